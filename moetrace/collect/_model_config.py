"""The model's shape from its Hugging Face ``config.json`` (what SGLang and vLLM load): the
runs columns a collector cannot see in an expert-load dump. ``ingest --model-config FILE``.

Keys read (the first present wins): experts ``n_routed_experts`` / ``num_experts`` /
``num_local_experts`` / ``moe_num_experts``; top-k ``num_experts_per_tok`` /
``moe_topk``; groups ``n_group`` / ``num_expert_group`` (DeepSeek-V2/V3/R1: 8 in V3/R1;
a model without groups: 1); hidden ``hidden_size``; expert weight bytes ``3 x hidden x
moe_intermediate_size`` (``intermediate_size`` for Mixtral-style models) x bytes per
weight (1 for FP8 ``quantization_config``, else 2 for bf16/fp16, 4 for float32). Nothing
is guessed: a key the file does not hold stays unknown.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

_FIRST = {
    "num_experts": ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk", "num_selected_experts"),
    "num_groups": ("n_group", "num_expert_group"),
    "hidden": ("hidden_size",),
}


def _first(cfg: dict, keys):
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return k, v
    return None, None


def read_model_config(path) -> tuple[dict, list[str]]:
    """(runs columns, what each came from) of a Hugging Face model ``config.json``."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(p, f"cannot read the model config: {e}") from None
    except ValueError as e:
        raise InputError(p, f"model config is not JSON: {e}") from None
    if isinstance(cfg.get("text_config"), dict):      # multimodal wrappers keep the LM config inside
        cfg = {**cfg, **cfg["text_config"]}
    if not isinstance(cfg, dict):
        raise InputError(p, "model config: expected a JSON object")
    out, said = {}, []
    for col, keys in _FIRST.items():
        k, v = _first(cfg, keys)
        if k:
            out[col] = v
            said.append(f"{col} {v} ({k})")
    if "num_experts" in out and "num_groups" not in out:
        out["num_groups"] = 1
        said.append("num_groups 1 (no n_group in the config: experts not grouped)")
    _, inter = _first(cfg, ("moe_intermediate_size",) if "moe_intermediate_size" in cfg else ("intermediate_size",))
    if inter and out.get("hidden"):
        q = cfg.get("quantization_config") or {}
        fp8 = isinstance(q, dict) and "fp8" in str(q.get("quant_method", "")).lower()
        per = 1 if fp8 else {"float32": 4}.get(str(cfg.get("torch_dtype", "")), 2)
        out["expert_bytes"] = 3 * out["hidden"] * inter * per
        said.append(f"expert_bytes {out['expert_bytes']} (3 x hidden x {inter} x {per} bytes per weight)")
    if not out:
        raise InputError(p, "model config holds none of n_routed_experts / num_experts / num_experts_per_tok / "
                            "n_group / hidden_size: not a MoE model config")
    return out, said
