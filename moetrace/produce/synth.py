"""Synthetic MoE traffic with known ground truth.

Each layer has a popularity vector over experts: log-normal with shape ``sigma``
(``p ∝ exp(sigma · N(0,1))``), or the normalized rows of a real count matrix
(``popularity_from``). With ``drift`` d the popularity at step t is
``(1 - d·t/(T-1)) · p0 + d·t/(T-1) · p1`` where p1 is p0 over a random permutation of the
experts (the hot experts move, the overall skew stays the same). Every token picks
``top_k`` distinct experts, sampled without replacement with probability proportional to
the popularity (Gumbel top-k), so per (step, layer) the loads sum to exactly
tokens_per_step · top_k. Tokens belong to DP ranks (``src_rank``); a ``dummy_share`` of
(step, rank) pairs run with no tokens (the step's tokens go to the other ranks).

The truth (p0 and the popularity at the last step) goes into ``true_popularity``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import InputError
from ..store import Store, sha256_text


@dataclass
class SynthConfig:
    layers: int = 4
    experts: int = 256
    top_k: int = 8
    ranks: int = 32
    ranks_per_node: int = 8
    steps: int = 50
    tokens_per_step: int = 4096
    sigma: float = 0.6
    drift: float = 0.0
    popularity_from: str | None = None
    per_token: bool = False
    dummy_share: float = 0.0
    seed: int = 0
    hidden: int = 7168
    num_groups: int | None = None
    expert_bytes: int | None = None
    dtype_bytes: int = 2
    by_src_rank: bool = False

    def validate(self) -> None:
        def bad(opt, msg):
            raise InputError(None, f"--{opt.replace('_', '-')}: {msg}")
        for k in ("layers", "experts", "top_k", "ranks", "ranks_per_node", "steps", "tokens_per_step"):
            if getattr(self, k) < 1:
                bad(k, "must be at least 1")
        if self.top_k > self.experts:
            bad("top_k", f"{self.top_k} is more than --experts {self.experts}")
        if self.experts % self.ranks:
            bad("experts", f"{self.experts} experts do not divide evenly over {self.ranks} ranks")
        if self.ranks % self.ranks_per_node:
            bad("ranks_per_node", f"{self.ranks} ranks are not a multiple of {self.ranks_per_node}")
        if self.sigma < 0:
            bad("sigma", "must be >= 0")
        if not 0 <= self.drift <= 1:
            bad("drift", "must be within [0, 1]")
        if not 0 <= self.dummy_share < 1:
            bad("dummy_share", "must be within [0, 1)")


def load_popularity_file(path: str | Path, layers: int | None, experts: int) -> np.ndarray:
    """Rows of a real count matrix (SGLang ``{"logical_count": [L][E]}`` or ``[N][L][E]``,
    or a bare nested list) as popularity vectors; all-zero rows (dense layers) are skipped."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(path, f"cannot read popularity JSON: {e}") from None
    data = doc.get("logical_count") if isinstance(doc, dict) else doc
    if data is None:
        raise InputError(path, "expected a JSON object with 'logical_count' or a nested list")
    try:
        arr = np.asarray(data, dtype=np.float64)
    except (ValueError, TypeError):
        raise InputError(path, "logical_count is not a rectangular numeric array") from None
    if arr.ndim == 3:
        arr = arr.sum(axis=0)
    if arr.ndim != 2:
        raise InputError(path, f"logical_count must be [layers, experts] or [N, layers, experts], got shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise InputError(path, "logical_count holds negative or non-finite values")
    if arr.shape[1] != experts:
        raise InputError(path, f"logical_count has {arr.shape[1]} experts per layer but --experts is {experts}")
    rows = arr[arr.sum(axis=1) > 0]
    if rows.shape[0] == 0:
        raise InputError(path, "every layer of logical_count is zero")
    if layers is not None:
        rows = rows[np.arange(layers) % rows.shape[0]]
    return rows / rows.sum(axis=1, keepdims=True)


def popularity(cfg: SynthConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(p0, p1): popularity at the first step, and the vector the drift mixes toward."""
    if cfg.popularity_from:
        p0 = load_popularity_file(cfg.popularity_from, cfg.layers, cfg.experts)
    else:
        w = np.exp(cfg.sigma * rng.standard_normal((cfg.layers, cfg.experts)))
        p0 = w / w.sum(axis=1, keepdims=True)
    perm = np.stack([rng.permutation(cfg.experts) for _ in range(cfg.layers)])
    p1 = np.take_along_axis(p0, perm, axis=1)
    return p0, p1


def sample_topk(p: np.ndarray, n_tokens: int, k: int, rng: np.random.Generator, ordered: bool = True) -> np.ndarray:
    """[n_tokens, k] distinct expert ids per token, sampled without replacement ∝ p.

    Exponential race (equivalent to Gumbel top-k): each expert draws Exp(1)/p and the k
    smallest win, which is exactly successive sampling without replacement. With
    ``ordered`` a row lists the winners in draw order (the router's order of choice).
    """
    inv = (1.0 / np.maximum(p, 1e-30)).astype(np.float32)
    keys = rng.standard_exponential(size=(n_tokens, p.shape[0]), dtype=np.float32)
    keys *= inv
    idx = np.argpartition(keys, k - 1, axis=1)[:, :k]
    if ordered:
        order = np.argsort(np.take_along_axis(keys, idx, axis=1), axis=1)
        idx = np.take_along_axis(idx, order, axis=1)
    return idx


def _token_ranks(rng, cfg: SynthConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per step: bool[ranks] dummy mask and the src_rank of each token."""
    R, B = cfg.ranks, cfg.tokens_per_step
    dummy = rng.random(R) < cfg.dummy_share
    if dummy.all():
        dummy[rng.integers(R)] = False
    active = np.flatnonzero(~dummy)
    # tokens split as evenly as possible over the active ranks, in rank order
    src = active[(np.arange(B) * len(active)) // B]
    return dummy, src


def generate(cfg: SynthConfig):
    """Yield the run dict and the tables of a synthetic run (expert_load streamed)."""
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    p0, p1 = popularity(cfg, rng)
    L, E, K, T, B, R = cfg.layers, cfg.experts, cfg.top_k, cfg.steps, cfg.tokens_per_step, cfg.ranks
    groups = cfg.num_groups or (8 if E % 8 == 0 and E >= 64 else 1)
    expert_bytes = cfg.expert_bytes or 3 * cfg.hidden * 2048  # 3 FP8 matrices hidden x 2048
    steps_rows = {"step": [], "rank": [], "phase": [], "num_tokens": [], "is_dummy": [], "start_ns": [],
                  "end_ns": [], "inferred": []}
    load_chunks: list[pa.Table] = []
    routing_chunks: list[pa.Table] = []
    for t in range(T):
        a = t / (T - 1) if T > 1 else 0.0
        pt = (1 - cfg.drift * a) * p0 + cfg.drift * a * p1
        dummy, src = _token_ranks(rng, cfg)
        counts_rank = np.bincount(src, minlength=R)
        steps_rows["step"].extend([t] * R)
        steps_rows["rank"].extend(range(R))
        steps_rows["phase"].extend(["idle" if d else "decode" for d in dummy])
        steps_rows["num_tokens"].extend(counts_rank.tolist())
        steps_rows["is_dummy"].extend(dummy.tolist())
        steps_rows["start_ns"].extend([None] * R)
        steps_rows["end_ns"].extend([None] * R)
        steps_rows["inferred"].extend([False] * R)
        for layer in range(L):
            choice = sample_topk(pt[layer], B, K, rng, ordered=cfg.per_token)
            if cfg.by_src_rank:
                key = np.repeat(src, K) * E + choice.ravel()
                c = np.bincount(key, minlength=R * E).reshape(R, E)
                rr, ee = np.nonzero(c)
                load_chunks.append(pa.table({
                    "step": np.full(len(ee), t, np.int64), "layer": np.full(len(ee), layer, np.int32),
                    "expert": ee.astype(np.int32), "slot": pa.nulls(len(ee), pa.int32()),
                    "src_rank": rr.astype(np.int32), "tokens": c[rr, ee].astype(np.int64)}))
            else:
                c = np.bincount(choice.ravel(), minlength=E)
                load_chunks.append(pa.table({
                    "step": np.full(E, t, np.int64), "layer": np.full(E, layer, np.int32),
                    "expert": np.arange(E, dtype=np.int32), "slot": pa.nulls(E, pa.int32()),
                    "src_rank": pa.nulls(E, pa.int32()), "tokens": c.astype(np.int64)}))
            if cfg.per_token:
                n = B * K
                routing_chunks.append(pa.table({
                    "step": np.full(n, t, np.int64), "layer": np.full(n, layer, np.int32),
                    "token": np.repeat(np.arange(B, dtype=np.int64), K),
                    "src_rank": np.repeat(src, K).astype(np.int32),
                    "choice": np.tile(np.arange(K, dtype=np.int8), B),
                    "expert": choice.ravel().astype(np.int32), "slot": pa.nulls(n, pa.int32()),
                    "gate": np.full(n, 1.0 / K, np.float32)}))
    p_end = (1 - cfg.drift) * p0 + cfg.drift * p1
    truth = pa.table({
        "layer": np.repeat(np.arange(L, dtype=np.int32), E),
        "expert": np.tile(np.arange(E, dtype=np.int32), L),
        "p_start": p0.ravel(), "p_end": p_end.ravel()})
    params = asdict(cfg)
    run = {
        "source": "synth",
        "source_sha256": sha256_text(json.dumps(params, sort_keys=True)),
        "collector": "synth",
        "time_base": "none",
        "num_layers": L, "num_experts": E, "top_k": K, "hidden": cfg.hidden, "num_groups": groups,
        "expert_bytes": expert_bytes, "num_ranks": R, "ranks_per_node": cfg.ranks_per_node,
        "num_slots": E, "tokens_per_step": B, "dtype_bytes": cfg.dtype_bytes,
        "approximations": json.dumps(["synthetic run: no placement recorded, contiguous placement assumed"]),
        "meta_json": json.dumps({"synth": params}),
    }
    tables = {"expert_load": load_chunks, "steps": pa.table(steps_rows), "true_popularity": truth}
    if cfg.per_token:
        tables["routing"] = routing_chunks
    return run, tables


def synth(store: Store, cfg: SynthConfig, run_id: str | None = None):
    """Generate a synthetic run into ``store``; returns the store's WriteResult."""
    run, tables = generate(cfg)
    rid = run_id or f"synth-s{cfg.seed}"
    return store.write_run(run, tables, run_id=store.unique_run_id(rid) if run_id is None else run_id)
