"""Synthetic MoE traffic with known ground truth.

Each layer has a popularity vector over experts: log-normal with shape ``sigma``
(``p ∝ exp(sigma · N(0,1))``), or the normalized rows of a real count matrix
(``popularity_from``). With ``drift`` d the popularity at step t is
``(1 - d·t/(T-1)) · p0 + d·t/(T-1) · p1`` where p1 is p0 over a random permutation of the
experts (the hot experts move, the overall skew stays the same). Every token picks
``top_k`` distinct experts, sampled without replacement with probability proportional to
the popularity (successive sampling, :class:`TopKSampler`), so per (step, layer) the loads sum to exactly
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

from ..domain.hashing import sha256_text
from ..domain.model_shape import DEFAULT_HIDDEN, default_expert_bytes
from ..errors import InputError
from ..run import Store
from ..streams import Rereadable


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
    a draw from row g picks a bin ``i`` uniformly and keeps it with probability
    ``prob[g, i]``, else takes ``alias[g, i]``: exactly ∝ p[g]. A zero entry has prob 0 and
    is never drawn (nor is it anyone's alias)."""
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


class TopKSampler:
    """Top-k distinct experts per token, by successive sampling without replacement ∝ a
    popularity row: choice 1 is drawn ∝ p, choice j ∝ p among the experts not chosen yet.

    How (and why it is that law): a token's choices are the first k *distinct* values of an
    i.i.d. sequence of draws ∝ p — drawing again while a value repeats an earlier choice is
    drawing ∝ p conditioned on the not-yet-chosen set, i.e. ∝ p restricted to it, which is
    the successive-sampling (Plackett–Luce) law, the same as Gumbel-top-k. Each i.i.d. draw
    is one Walker alias draw from one 64-bit random word ``r``: the top ``b`` bits pick a bin
    of the table padded to ``2**b`` bins (padding has probability 0), and the bin is kept
    iff ``r < (bin << (64-b)) + floor(prob · 2**(64-b))`` — the low bits are the uniform
    coin; the acceptance probability is exact to 2**-(64-b) (well below float64 rounding
    of ``p`` itself). With a mixture (drift) a second word picks the row: row 2 when it is
    below ``share · 2**64``. Nothing is approximated in distribution; only the random
    stream differs from the earlier float alias sampler (tests/synth_oracle.py keeps it,
    and tests/test_synth_sampler.py compares the two laws).

    Vectorized over tokens, choice-major ``[k, n]`` small-integer arrays, one block of
    tokens at a time (the caller keeps blocks a few tens of thousands of tokens: cache-sized).
    """

    def __init__(self, p: np.ndarray):
        p = np.atleast_2d(np.asarray(p, np.float64))
        G, E = p.shape
        self.E = E
        self.b = b = max(1, int(E - 1).bit_length())
        Ep = 1 << b
        padded = np.zeros((G, Ep))
        padded[:, :E] = p
        prob, alias = alias_tables(padded)
        shift = 64 - b
        self.shift = np.uint64(shift)
        full = (1 << shift) - 1
        thr = np.minimum(np.floor(prob * float(1 << shift)), full).astype(np.uint64)
        thr[prob >= 1.0] = np.uint64(full)      # kept but for r's low bits all ones: alias = itself
        self.T = ((np.arange(Ep, dtype=np.uint64) << self.shift)[None, :] + thr).ravel()
        self.dtype = np.uint16 if Ep <= 1 << 16 else np.int32
        self.A = alias.astype(self.dtype).ravel()

    def row_offsets(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, np.uint64) << np.uint64(self.b)

    def _draw(self, goff, bitgen, mix):
        r = bitgen.random_raw(goff.size)
        if mix is not None:
            goff = np.where(bitgen.random_raw(goff.size) < mix[1], mix[0], goff)
        i = r >> self.shift
        e = i.astype(self.dtype)
        np.bitwise_or(i, goff, out=i)
        idx = i.view(np.int64)                  # < 2**63: the same numbers, and take() needs no cast
        return np.where(r < self.T.take(idx), e, self.A.take(idx))

    def draw(self, goff: np.ndarray, k: int, bitgen: np.random.BitGenerator,
             mix: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """``[k, n]`` expert ids (choice-major, in draw order) for n tokens whose rows are
        ``goff`` (:meth:`row_offsets`). ``mix = (goff2 [n], share [n] as uint64 thresholds
        share·2**64)``: each draw comes from row 2 with probability share."""
        n = goff.size
        out = np.empty((k, n), self.dtype)
        for j in range(k):
            e = out[j] = self._draw(goff, bitgen, mix)
            if not j:
                continue
            hit = out[0] == e
            for c in range(1, j):
                hit |= out[c] == e
            todo = np.flatnonzero(hit)
            while todo.size:
                sub = None if mix is None else (mix[0][todo], mix[1][todo])
                e = self._draw(goff[todo], bitgen, sub)
                out[j, todo] = e
                hit = out[0, todo] == e
                for c in range(1, j):
                    hit |= out[c, todo] == e
                todo = todo[hit]
        return out


def share_thresholds(share: np.ndarray) -> np.ndarray:
    """Mixture shares in [0, 1] as uint64 thresholds for :meth:`TopKSampler.draw`."""
    s = np.asarray(share, np.float64)
    out = np.floor(s * 2.0**64).clip(0, 2.0**64 - 2048).astype(np.uint64)
    out[s >= 1.0] = np.uint64(2**64 - 1)
    return out


def sample_topk(p: np.ndarray, n_tokens: int, k: int, rng: np.random.Generator, ordered: bool = True) -> np.ndarray:
    """[n_tokens, k] distinct expert ids per token, sampled without replacement ∝ p
    (successive sampling, :class:`TopKSampler`; ``rng``'s bit generator is advanced).
    Columns are in draw order (the router's order of choice); ``ordered`` is kept for
    callers and changes nothing."""
    s = TopKSampler(np.asarray(p, np.float64)[None])
    out = np.empty((n_tokens, k), np.int64)
    for a in range(0, n_tokens, BLOCK_TOKENS):
        b = min(n_tokens, a + BLOCK_TOKENS)
        out[a:b] = s.draw(np.zeros(b - a, np.uint64), k, rng.bit_generator).T
    return out


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


#: steps drawn together (one random stream per chunk of steps; a table chunk per chunk)
STEP_CHUNK = 16
#: tokens drawn at once (cache-sized working arrays; whole (step, layer) cells when they fit)
BLOCK_TOKENS = 32768


def _block_size(tokens_per_step: int) -> int:
    B = tokens_per_step
    return B * max(1, BLOCK_TOKENS // B) if B <= BLOCK_TOKENS else BLOCK_TOKENS


def generate(cfg: SynthConfig, dense: bool = False):
    """The run dict and the tables of a synthetic run. ``expert_load`` (and ``routing``)
    are re-readable streams of chunks of :data:`STEP_CHUNK` steps: every pass draws the
    same tokens again (each chunk of steps has its own random stream, keyed by the seed
    and the chunk's index), so nothing grows with the run's length. ``dense``: the counts
    come as ``expert_counts`` rows (the dense layout) instead of long ``expert_load``."""
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
    sampler = TopKSampler(np.concatenate([p0, p1]))     # rows 0..L-1: p0, rows L..2L-1: p1
    bs = _block_size(B)

    def blocks(t0: int, n: int):
        """(first token, [K, m] expert ids) per block of the chunk's n·L·B tokens, which
        are in (step, layer, token) order; draws in draw order."""
        bitgen = np.random.PCG64(np.random.SeedSequence(s_draw.entropy, spawn_key=(*s_draw.spawn_key, t0 // STEP_CHUNK)))
        N = n * L * B
        for a in range(0, N, bs):
            cell = np.arange(a, min(N, a + bs)) // B            # (step - t0) * L + layer
            goff = sampler.row_offsets(cell % L)
            mix = None
            if cfg.drift > 0 and T > 1:
                share = cfg.drift * (t0 + cell // L) / (T - 1)
                mix = (goff + sampler.row_offsets(np.full(cell.size, L)), share_thresholds(share))
            yield a, sampler.draw(goff, K, bitgen, mix)

    def counts(t0: int, n: int) -> np.ndarray:
        """int64 [n·L, E] tokens per (step, layer) cell and expert."""
        c = np.zeros((n * L, E), np.int64)
        for a, ch in blocks(t0, n):
            m = ch.shape[1]
            c0, c1 = a // B, (a + m - 1) // B + 1
            key = (((np.arange(a, a + m) // B) - c0) * E)[None, :] + ch
            c[c0:c1] += np.bincount(key.ravel(), minlength=(c1 - c0) * E).reshape(c1 - c0, E)
        return c

    def draws():
        """(first step, [n, L, B, K] expert ids) per chunk of steps, in draw order."""
        for t0 in range(0, T, STEP_CHUNK):
            n = min(STEP_CHUNK, T - t0)
            ch = np.empty((n * L * B, K), sampler.dtype)
            for a, blk in blocks(t0, n):
                ch[a:a + blk.shape[1]] = blk.T
            yield t0, ch.reshape(n, L, B, K)

    def dense_chunks():
        from ..storage.dense import dense_table

        for t0 in range(0, T, STEP_CHUNK):
            n = min(STEP_CHUNK, T - t0)
            yield dense_table(np.repeat(np.arange(t0, t0 + n, dtype=np.int64), L),
                              np.tile(np.arange(L, dtype=np.int32), n), counts(t0, n))

    def load_chunks():
        if cfg.by_src_rank:
            for t0, ch in draws():
                n = ch.shape[0]
                cell = (np.arange(n)[:, None] * L + np.arange(L)[None, :])[:, :, None, None]
                key = ((cell * R + src[t0:t0 + n, None, :, None]) * E + ch).ravel()
                c = np.bincount(key, minlength=n * L * R * E)
                nz = np.flatnonzero(c)
                cl, rest = np.divmod(nz, R * E)
                rr, ee = np.divmod(rest, E)
                tl, ll = np.divmod(cl, L)
                yield pa.table({"step": (t0 + tl).astype(np.int64), "layer": ll.astype(np.int32),
                                "expert": ee.astype(np.int32), "slot": pa.nulls(nz.size, pa.int32()),
                                "src_rank": rr.astype(np.int32), "tokens": c[nz].astype(np.int64)})
            return
        for t0 in range(0, T, STEP_CHUNK):
            n = min(STEP_CHUNK, T - t0)
            c = counts(t0, n)
            m = n * L * E
            yield pa.table({"step": np.repeat(np.arange(t0, t0 + n, dtype=np.int64), L * E),
                            "layer": np.tile(np.repeat(np.arange(L, dtype=np.int32), E), n),
                            "expert": np.tile(np.arange(E, dtype=np.int32), n * L),
                            "slot": pa.nulls(m, pa.int32()), "src_rank": pa.nulls(m, pa.int32()),
                            "tokens": c.ravel()})

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
    tables = {"steps": steps_tbl, "true_popularity": truth}
    if dense and not cfg.by_src_rank:
        tables["expert_counts"] = Rereadable(dense_chunks)
    else:
        tables["expert_load"] = Rereadable(load_chunks)
    if cfg.per_token:
        tables["routing"] = Rereadable(routing_chunks)
    return run, tables


def synth(store: Store, cfg: SynthConfig, run_id: str | None = None):
    """Generate a synthetic run into ``store``; returns the store's WriteResult."""
    run, tables = generate(cfg, dense=True)   # complete (step, layer) grids: the dense layout
    rid = run_id or f"synth-s{cfg.seed}"
    return store.write_run(run, tables, run_id=store.unique_run_id(rid) if run_id is None else run_id)
