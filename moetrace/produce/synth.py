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
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import InputError
from ..run import Store
from ..domain.hashing import sha256_text
from ..streams import Rereadable
from ..domain.model_shape import DEFAULT_HIDDEN, default_expert_bytes


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
    hidden: int = DEFAULT_HIDDEN
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
        if not math.isfinite(self.sigma) or self.sigma < 0:  # nan would store a NaN truth
            bad("sigma", f"must be a finite number >= 0, got {self.sigma}")
        if not 0 <= self.seed < 2**63:
            bad("seed", f"must be within 0..2^63-1, got {self.seed}")
        if not 0 <= self.drift <= 1:
            bad("drift", "must be within [0, 1]")
        if not 0 <= self.dummy_share < 1:
            bad("dummy_share", "must be within [0, 1)")
        # the run is built in memory: its (step, layer, expert) and (step, rank) cells, before any is allocated
        from ..safety import LIMITS, limit

        need = self.steps * (self.layers * self.experts * 24 + self.ranks * 40 + self.tokens_per_step * 8)
        if need > limit("max_replay_bytes"):
            bad("steps", f"{self.steps} steps x ({self.layers} layers x {self.experts} experts + "
                         f"{self.tokens_per_step} tokens) need about "
                         f"{need / 2**30:.1f} GiB, over the limit max_replay_bytes={limit('max_replay_bytes')}; "
                         f"give fewer steps, or raise it with {LIMITS['max_replay_bytes'].env}=N")


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


def alias_tables(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker/Vose alias tables of the rows of ``p [G, E]``: ``(prob [G, E], alias [G, E])``;
    a draw from row g is ``i = floor(u·E)``, kept when ``frac(u·E) < prob[g, i]``, else
    ``alias[g, i]``: exactly ∝ p[g] with one uniform per draw."""
    p = np.atleast_2d(np.asarray(p, np.float64))
    G, E = p.shape
    prob = np.ones((G, E))
    alias = np.tile(np.arange(E), (G, 1))
    for g in range(G):
        q = p[g] * (E / p[g].sum())
        small = [i for i in range(E) if q[i] < 1.0]
        large = [i for i in range(E) if q[i] >= 1.0]
        while small and large:
            s_, l_ = small.pop(), large.pop()
            prob[g, s_], alias[g, s_] = q[s_], l_
            q[l_] -= 1.0 - q[s_]
            (small if q[l_] < 1.0 else large).append(l_)
        for i in small + large:                 # what is left is 1 up to rounding
            prob[g, i] = 1.0
    return prob, alias


def draw_topk(prob: np.ndarray, alias: np.ndarray, table: np.ndarray, k: int, rng: np.random.Generator,
              mix: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[n, k] distinct expert ids for n tokens: successive sampling without replacement,
    each choice drawn ∝ the token's popularity row (``table[n]`` indexes the alias tables)
    and drawn again while it repeats an earlier choice of the token (which is exactly
    drawing ∝ p among the experts not chosen yet). Columns are in draw order. With
    ``mix = (table2 [n], share [n])`` a draw comes from row ``table2`` with probability
    ``share`` (the popularity is the mixture ``(1 - share)·p[table] + share·p[table2]``)."""
    n, E = table.size, prob.shape[1]
    pflat, aflat = prob.ravel(), alias.ravel()
    table = np.asarray(table, np.int64)

    def draw(idx):
        g = table if idx is None else table[idx]
        m = g.shape[0] if idx is None else idx.size
        if mix is not None:
            t2, share = (mix[0], mix[1]) if idx is None else (mix[0][idx], mix[1][idx])
            g = np.where(rng.random(m) < share, t2, g)
        u = rng.random(m) * E
        i = np.minimum(u.astype(np.int64), E - 1)
        gi = g * E + i
        return np.where(u - i < pflat[gi], i, aflat[gi])

    out = np.empty((k, n), np.int64)         # choice-major: each choice's column contiguous
    for j in range(k):       # choice j: drawn for every token, drawn again where it repeats
        e = out[j] = draw(None)
        if not j:
            continue
        hit = out[0] == e
        for c in range(1, j):
            hit |= out[c] == e
        todo = np.flatnonzero(hit)
        while todo.size:
            e = draw(todo)
            out[j, todo] = e
            hit = out[0, todo] == e
            for c in range(1, j):
                hit |= out[c, todo] == e
            todo = todo[hit]
    return np.ascontiguousarray(out.T)


def sample_topk(p: np.ndarray, n_tokens: int, k: int, rng: np.random.Generator, ordered: bool = True) -> np.ndarray:
    """[n_tokens, k] distinct expert ids per token, sampled without replacement ∝ p
    (successive sampling, :func:`draw_topk`). Columns are in draw order (the router's
    order of choice); ``ordered`` is kept for callers and changes nothing."""
    prob, alias = alias_tables(np.asarray(p, np.float64)[None])
    return draw_topk(prob, alias, np.zeros(n_tokens, np.int64), k, rng)


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


#: steps drawn together (memory: STEP_CHUNK x layers x tokens_per_step x top_k ids)
STEP_CHUNK = 16


def generate(cfg: SynthConfig):
    """The run dict and the tables of a synthetic run. ``expert_load`` (and ``routing``)
    are re-readable streams of chunks of :data:`STEP_CHUNK` steps: every pass draws the
    same tokens again (its own random stream), so nothing grows with the run's length."""
    cfg.validate()
    s_pop, s_steps, s_draw = np.random.SeedSequence(cfg.seed).spawn(3)
    p0, p1 = popularity(cfg, np.random.default_rng(s_pop))
    L, E, K, T, B, R = cfg.layers, cfg.experts, cfg.top_k, cfg.steps, cfg.tokens_per_step, cfg.ranks
    groups = cfg.num_groups or (8 if E % 8 == 0 and E >= 64 else 1)
    expert_bytes = cfg.expert_bytes or default_expert_bytes(cfg.hidden)
    rng_steps = np.random.default_rng(s_steps)
    dummy = np.zeros((T, R), bool)
    src = np.zeros((T, B), np.int32)
    for t in range(T):
        dummy[t], src[t] = _token_ranks(rng_steps, cfg)
    counts_rank = np.stack([np.bincount(src[t], minlength=R) for t in range(T)]) if T else np.zeros((0, R), int)
    steps_tbl = pa.table({
        "step": np.repeat(np.arange(T, dtype=np.int64), R), "rank": np.tile(np.arange(R, dtype=np.int32), T),
        "phase": np.where(dummy.ravel(), "idle", "decode"), "num_tokens": counts_rank.ravel().astype(np.int64),
        "is_dummy": dummy.ravel(), "start_ns": pa.nulls(T * R, pa.int64()), "end_ns": pa.nulls(T * R, pa.int64()),
        "inferred": np.zeros(T * R, bool)})
    prob, alias = alias_tables(np.concatenate([p0, p1]))     # rows 0..L-1: p0, rows L..2L-1: p1

    def draws():
        """(first step, [n, L, B, K] expert ids) per chunk of steps, in draw order."""
        rng = np.random.default_rng(s_draw)
        for t0 in range(0, T, STEP_CHUNK):
            n = min(STEP_CHUNK, T - t0)
            table = np.tile(np.repeat(np.arange(L), B), n)
            mix = None
            if cfg.drift > 0 and T > 1:
                share = np.repeat(cfg.drift * np.arange(t0, t0 + n) / (T - 1), L * B)
                mix = (table + L, share)
            yield t0, draw_topk(prob, alias, table, K, rng, mix).reshape(n, L, B, K)

    def load_chunks():
        for t0, ch in draws():
            n = ch.shape[0]
            cell = (np.arange(n)[:, None] * L + np.arange(L)[None, :])[:, :, None, None]
            if cfg.by_src_rank:
                key = ((cell * R + src[t0:t0 + n, None, :, None]) * E + ch).ravel()
                c = np.bincount(key, minlength=n * L * R * E)
                nz = np.flatnonzero(c)
                cl, rest = np.divmod(nz, R * E)
                rr, ee = np.divmod(rest, E)
                tl, ll = np.divmod(cl, L)
                yield pa.table({"step": (t0 + tl).astype(np.int64), "layer": ll.astype(np.int32),
                                "expert": ee.astype(np.int32), "slot": pa.nulls(nz.size, pa.int32()),
                                "src_rank": rr.astype(np.int32), "tokens": c[nz].astype(np.int64)})
            else:
                c = np.bincount((cell * E + ch).ravel(), minlength=n * L * E)
                m = n * L * E
                yield pa.table({"step": np.repeat(np.arange(t0, t0 + n, dtype=np.int64), L * E),
                                "layer": np.tile(np.repeat(np.arange(L, dtype=np.int32), E), n),
                                "expert": np.tile(np.arange(E, dtype=np.int32), n * L),
                                "slot": pa.nulls(m, pa.int32()), "src_rank": pa.nulls(m, pa.int32()),
                                "tokens": c.astype(np.int64)})

    def routing_chunks():
        for t0, ch in draws():
            n = ch.shape[0]
            for dt in range(n):
                for layer in range(L):
                    m = B * K
                    yield pa.table({
                        "step": np.full(m, t0 + dt, np.int64), "layer": np.full(m, layer, np.int32),
                        "token": np.repeat(np.arange(B, dtype=np.int64), K),
                        "src_rank": np.repeat(src[t0 + dt], K).astype(np.int32),
                        "choice": np.tile(np.arange(K, dtype=np.int8), B),
                        "expert": ch[dt, layer].ravel().astype(np.int32), "slot": pa.nulls(m, pa.int32()),
                        "gate": np.full(m, 1.0 / K, np.float32)})

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
    tables = {"expert_load": Rereadable(load_chunks), "steps": steps_tbl, "true_popularity": truth}
    if cfg.per_token:
        tables["routing"] = Rereadable(routing_chunks)
    return run, tables


def synth(store: Store, cfg: SynthConfig, run_id: str | None = None):
    """Generate a synthetic run into ``store``; returns the store's WriteResult."""
    run, tables = generate(cfg)
    if not cfg.by_src_rank:             # complete (step, layer) grids: the dense layout
        from ..storage.dense import dense_chunks

        load = tables.pop("expert_load")
        tables["expert_counts"] = Rereadable(lambda: dense_chunks(load, cfg.experts))
    rid = run_id or f"synth-s{cfg.seed}"
    return store.write_run(run, tables, run_id=store.unique_run_id(rid) if run_id is None else run_id)
