"""Live capture of router decisions from a Hugging Face transformers MoE model.

::

    from moetrace.produce.capture import capture
    with capture(model) as cap:
        model.generate(**inputs, max_new_tokens=8)     # or model(**inputs)
    cap.write(Store("st", create=True))               # routing, expert_load, steps, runs

Forward hooks go on every router module (transformers 5.x: ``*TopKRouter`` /
``*TopkRouter`` modules, the ``gate`` of each sparse MoE block, which return
``(router_logits, top_k_weights, top_k_index)``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V2/V3, GLM-4-MoE, Phi-MoE, GPT-OSS, ...). Each forward call of the model is one
step; tokens are numbered in batch-major order within a step (padding included: a
padded position is routed like any token). The decisions and gate weights are the
router's own outputs, not a recomputation. A router that returns only logits (an
``nn.Linear`` gate of older transformers) gets a softmax top-k recomputation, and the run
says so. torch and transformers are optional (``pip install 'moetrace[capture]'``).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import InputError, MissingExtra

_ROUTER_CLS = re.compile(r"Router$")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


def find_routers(model) -> list[tuple[int, str, object]]:
    """(layer, module name, module) of every MoE router in ``model``, by layer."""
    out = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        is_router = bool(_ROUTER_CLS.search(cls)) and hasattr(mod, "weight")
        if not is_router and name.endswith(".gate") and hasattr(mod, "weight"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
            is_router = parent is not None and hasattr(parent, "experts")
        if not is_router:
            continue
        m = _LAYER.search("." + name)
        if m is None:
            continue
        out.append((int(m.group(1)), name, mod))
    out.sort(key=lambda t: t[0])
    return out


def _cfg(model, *names, default=None):
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


class Capture:
    """Collects per-token router decisions while active; see :func:`capture`."""

    def __init__(self, model, layers: list[int] | None = None):
        self.model = model
        routers = find_routers(model)
        if layers is not None:
            routers = [r for r in routers if r[0] in set(layers)]
        if not routers:
            raise InputError(None, f"no MoE router found in {type(model).__name__} (looked for *TopKRouter modules and "
                                   "the 'gate' of blocks with 'experts')")
        self.routers = routers
        self.step = -1
        self._parts: list[tuple] = []
        self._steps: list[tuple] = []
        self._handles = []
        self._shape: tuple[int, int] | None = None
        self._t0 = 0
        self.recomputed = False
        self.num_experts = int(getattr(routers[0][2], "num_experts", 0) or routers[0][2].weight.shape[0])
        self.top_k = int(getattr(routers[0][2], "top_k", 0) or _cfg(model, "num_experts_per_tok", "top_k", default=0))

    # hooks ------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        self.step += 1
        self._t0 = time.time_ns()
        x = kwargs.get("input_ids")
        if x is None and args:
            x = args[0]
        if x is None:
            x = kwargs.get("inputs_embeds")
        self._shape = (int(x.shape[0]), int(x.shape[1])) if x is not None and x.dim() >= 2 else None

    def _post(self, module, args, kwargs, output):
        b, s = self._shape or (None, None)
        n = b * s if b is not None else None
        phase = "prefill" if s and s > 1 else "decode"
        self._steps.append((self.step, n, phase, self._t0, time.time_ns()))

    def _router_hook(self, layer: int):
        def hook(module, args, output):
            import torch

            if isinstance(output, (tuple, list)) and len(output) >= 3:
                logits, weights, idx = output[0], output[1], output[2]
            elif isinstance(output, torch.Tensor):
                logits = output.reshape(-1, output.shape[-1])
                probs = torch.softmax(logits.float(), dim=-1)
                weights, idx = torch.topk(probs, self.top_k, dim=-1)
                weights = weights / weights.sum(dim=-1, keepdim=True)
                self.recomputed = True
            else:
                return
            idx = idx.detach().reshape(-1, idx.shape[-1]).to("cpu").numpy()
            w = weights.detach().reshape(-1, weights.shape[-1]).float().to("cpu").numpy()
            self._parts.append((max(self.step, 0), layer, idx, w))
        return hook

    def __enter__(self):
        self._handles.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post, with_kwargs=True))
        for layer, _name, mod in self.routers:
            self._handles.append(mod.register_forward_hook(self._router_hook(layer)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    # results ----------------------------------------------------------------
    def routing(self) -> pa.Table:
        cols = {k: [] for k in ("step", "layer", "token", "choice", "expert", "gate")}
        for step, layer, idx, w in self._parts:
            T, K = idx.shape
            cols["step"].append(np.full(T * K, step, np.int64))
            cols["layer"].append(np.full(T * K, layer, np.int32))
            cols["token"].append(np.repeat(np.arange(T, dtype=np.int64), K))
            cols["choice"].append(np.tile(np.arange(K, dtype=np.int8), T))
            cols["expert"].append(idx.ravel().astype(np.int32))
            cols["gate"].append(w.ravel().astype(np.float32))
        if not self._parts:
            raise InputError(None, "capture saw no router call (run the model inside the `with` block)")
        t = {k: np.concatenate(v) for k, v in cols.items()}
        n = len(t["step"])
        return pa.table({"step": t["step"], "layer": t["layer"], "token": t["token"],
                         "src_rank": pa.nulls(n, pa.int32()), "choice": t["choice"], "expert": t["expert"],
                         "slot": pa.nulls(n, pa.int32()), "gate": t["gate"]})

    def expert_load(self) -> pa.Table:
        rows = []
        E = self.num_experts
        for step, layer, idx, _w in self._parts:
            c = np.bincount(idx.ravel(), minlength=E)
            rows.append((np.full(E, step), np.full(E, layer), np.arange(E), c))
        cat = (lambda i, dt: np.concatenate([r[i] for r in rows]).astype(dt))
        # several calls of one router in one step (e.g. a model run twice without the root hook) add up
        t = pa.table({"step": cat(0, np.int64), "layer": cat(1, np.int32), "expert": cat(2, np.int32),
                      "tokens": cat(3, np.int64)})
        import polars as pl
        df = (pl.from_arrow(t).group_by(["step", "layer", "expert"]).agg(pl.col("tokens").sum())
              .sort(["step", "layer", "expert"]))
        return pa.table({"step": df["step"].to_numpy(), "layer": df["layer"].to_numpy(),
                         "expert": df["expert"].to_numpy(), "slot": pa.nulls(df.height, pa.int32()),
                         "src_rank": pa.nulls(df.height, pa.int32()), "tokens": df["tokens"].to_numpy()})

    def steps(self) -> pa.Table:
        s = self._steps
        return pa.table({"step": pa.array([x[0] for x in s], pa.int64()), "rank": pa.array([0] * len(s), pa.int32()),
                         "phase": [x[2] for x in s], "num_tokens": pa.array([x[1] for x in s], pa.int64()),
                         "is_dummy": [x[1] == 0 for x in s], "start_ns": pa.array([x[3] for x in s], pa.int64()),
                         "end_ns": pa.array([x[4] for x in s], pa.int64()), "inferred": [False] * len(s)})

    def run_row(self, source: str | None = None) -> dict:
        from ..domain.hashing import sha256_text

        m = self.model
        hidden = _cfg(m, "hidden_size", "d_model")
        ffn = _cfg(m, "moe_intermediate_size", "intermediate_size", "ffn_dim")
        p = next(iter(m.parameters()), None)
        dtype_bytes = p.element_size() if p is not None else None
        groups = _cfg(m, "n_group", "num_expert_group", default=1)
        L = _cfg(m, "num_hidden_layers", "num_layers", default=max(r[0] for r in self.routers) + 1)
        name = _cfg(m, "_name_or_path", default="") or type(m).__name__
        approx = ["single process capture: one rank, no expert parallelism (num_ranks = 1)"]
        if self.recomputed:
            approx.append("the router returned only logits: top-k recomputed as softmax top-k with renormalized "
                          "weights, which may differ from the model's own routing rule")
        moe_layers = sorted({r[0] for r in self.routers})
        if len(moe_layers) < L:
            approx.append(f"MoE layers {moe_layers[0]}..{moe_layers[-1]} ({len(moe_layers)} of {L}); the others are dense")
        digest = sha256_text(json.dumps([name, self.step, time.time_ns(), len(self._parts)]))
        meta = {"format": "transformers_capture", "model_class": type(m).__name__, "model": name,
                "routers": [r[1] for r in self.routers], "router_class": type(self.routers[0][2]).__name__,
                "moe_layers": moe_layers}
        try:
            import transformers
            meta["transformers"] = transformers.__version__
        except ImportError:
            pass
        return {
            "source": source or f"capture:{name}", "source_sha256": digest, "collector": "capture",
            "time_base": "epoch", "num_layers": int(L), "num_experts": self.num_experts, "top_k": self.top_k,
            "hidden": int(hidden) if hidden else None, "num_groups": int(groups or 1),
            "expert_bytes": int(3 * hidden * ffn * dtype_bytes) if hidden and ffn and dtype_bytes else None,
            "num_ranks": 1, "ranks_per_node": 1, "num_slots": self.num_experts, "dtype_bytes": dtype_bytes,
            "approximations": json.dumps(approx), "meta_json": json.dumps(meta),
        }

    def tables(self) -> dict:
        return {"routing": self.routing(), "expert_load": self.expert_load(), "steps": self.steps()}

    def write(self, store, run_id: str | None = None, source: str | None = None):
        """Validate and write the captured run to ``store``; returns the WriteResult."""
        from ..collect import RunData
        from ..collect.checks import validate_run

        rd = validate_run(RunData(run=self.run_row(source), tables=self.tables(), run_id_hint="capture"), {})
        rid = run_id or store.unique_run_id(f"capture-{type(self.model).__name__}")
        return store.write_run(rd.run, rd.tables, run_id=rid)


def capture(model, layers: list[int] | None = None) -> Capture:
    """Context manager recording every router decision of ``model`` while active."""
    return Capture(model, layers)


def load_model(model_path: str, download: bool = False):
    """A transformers causal LM and its tokenizer (left padding) from ``model_path``; from
    the Hugging Face hub only with ``download``."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise MissingExtra("loading a model for capture", "capture", "transformers") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=not download)
        tok = AutoTokenizer.from_pretrained(model_path, local_files_only=not download)
    except (OSError, ValueError) as e:
        raise InputError(model_path, f"cannot load model: {str(e).splitlines()[0]}") from None
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok


def capture_prompts(model, texts: list[str], tokenizer=None, max_new_tokens: int = 8,
                    batch_size: int = 8, progress=None) -> Capture:
    """Run ``texts`` through ``model`` in batches (greedy ``generate`` of ``max_new_tokens``,
    or one forward pass with 0) while recording its routers. Without a ``tokenizer`` the
    prompts are encoded as bytes (:func:`byte_tokens`, for tiny random models). Returns the
    :class:`Capture` (``.write(store)`` stores it). ``progress(line)`` gets a line per batch."""
    import torch

    vocab = model.config.vocab_size
    with capture(model) as cap, torch.no_grad():
        for i in range(0, len(texts), batch_size):
            chunk = texts[i:i + batch_size]
            if tokenizer is not None:
                enc = tokenizer(chunk, return_tensors="pt", padding=True)
                ids, mask = enc["input_ids"], enc["attention_mask"]
            else:
                seqs = byte_tokens(chunk, vocab)
                n = max(len(s) for s in seqs)
                ids = torch.tensor([[0] * (n - len(s)) + s for s in seqs])
                mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs])
            if max_new_tokens > 0:
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=model.config.pad_token_id or 0)
            else:
                model(input_ids=ids, attention_mask=mask)
            if progress is not None:
                progress(f"capture: {min(i + batch_size, len(texts))} of {len(texts)} prompts, "
                         f"{cap.step + 1} forward passes recorded")
    return cap


# ----------------------------------------------------------------------------- tiny models
TINY = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def tiny_model(arch: str, seed: int = 0, layers: int = 2, experts: int = 8, top_k: int = 2, hidden: int = 32):
    """A tiny randomly initialized MoE causal LM of a transformers architecture (no download)."""
    import torch
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=top_k,
                  bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=2 * hidden, num_local_experts=experts, **common)
        cls = tf.MixtralForCausalLM
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden, num_experts=experts,
                                shared_expert_intermediate_size=hidden, decoder_sparse_step=1, **common)
        cls = tf.Qwen2MoeForCausalLM
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden, num_experts=experts,
                                decoder_sparse_step=1, head_dim=hidden // 4, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=hidden, num_experts=experts, **common)
        cls = tf.OlmoeForCausalLM
    elif arch == "deepseek_v3":
        common["num_key_value_heads"] = 4
        cfg = tf.DeepseekV3Config(intermediate_size=2 * hidden, moe_intermediate_size=hidden, n_routed_experts=experts,
                                  n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
                                  kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=8, **common)
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise InputError(None, f"unknown tiny architecture {arch!r} (known: {', '.join(TINY)})")
    torch.manual_seed(seed)
    model = cls(cfg)
    # default init leaves routers (near) zero, so every token would tie: give them unit-scale logits
    with torch.no_grad():
        for _layer, _name, mod in find_routers(model):
            mod.weight.normal_(0.0, 1.0 / hidden ** 0.5)
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0.0, 0.05)
    model.eval()
    return model


def byte_tokens(texts: list[str], vocab: int) -> list[list[int]]:
    """A tokenizer-free encoding (UTF-8 bytes modulo the vocabulary) for tiny random models."""
    return [[b % vocab for b in t.encode("utf-8")] or [0] for t in texts]


def read_prompts(path: str | Path) -> list[str]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(p, f"cannot read prompts: {e}") from None
    if p.suffix.lower() in (".jsonl", ".ndjson"):
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(p, f"invalid JSON: {e}", f"line {i}") from None
            v = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else obj
            if not isinstance(v, str):
                raise InputError(p, "expected a string or an object with 'prompt'", f"line {i}")
            out.append(v)
    else:
        out = [line for line in text.splitlines() if line.strip()]
    if not out:
        raise InputError(p, "no prompts in the file")
    return out
