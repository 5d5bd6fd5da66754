"""The whole-run parts of the stored analysis, fed from each step batch's rows read once.

:func:`moetrace.analyze.materialize.materialize_layer_skew` reads a batch of steps of the
run's ``expert_counts`` once (a TEMP table shadowing the table for the batch's queries);
the per-(step, layer) views take their rows from it with list functions, and so do the
objects of this module, with numpy, instead of unnesting the lists again in SQL:

* :class:`DenseExperts`: the dense rows' part of ``expert_token_hist`` (pairs per token
  count) and ``expert_step_bins`` (tokens of each expert summed per bin of steps),
  accumulated over the batches in arrays of the run's shape (layers x bins x experts);
* :func:`rank_windows`: the batch's rank rows (``rank_tokens_by_step``: both layouts) as a
  (layer, step, rank) array, from which ``skew_by_batch``'s windows of 1, 2, 4, ... steps
  inside the batch, the batch's rank totals and the suffix buckets are summed exactly as
  the SQL of ``25_skew_by_batch.sql`` merges them (pairs added level by level).

Each returns Arrow tables that the caller inserts into its TEMP accumulators; the SQL that
finishes the views from them is materialize.py's. Sums of integers are exact; sums of the
replicas' fractional rank loads may differ from DuckDB's in the last bit (order of
addition), as the batched views already did.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

#: the report's heatmap bins per layer (sql/22_expert_distribution.sql: least(steps, 300))
MAX_BINS = 300


def _flat(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if isinstance(arr, pa.ChunkedArray):      # combine_chunks of a list column may stay chunked
        arr = pa.concat_arrays(arr.chunks) if arr.num_chunks else pa.array([], arr.type)
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


class DenseExperts:
    """The dense rows' (step, layer, expert) tokens of a run, batch by batch, summed into
    ``expert_step_bins`` per (layer, bin, expert) and counted into ``expert_token_hist``
    per (layer, tokens)."""

    def __init__(self):
        self.layers: dict[int, int] = {}          # layer -> row of the accumulators
        self.bins: np.ndarray | None = None       # [layers, MAX_BINS, experts] tokens
        self.hit: np.ndarray | None = None        # same shape: a row was there

    def _grow(self, layers: np.ndarray, width: int) -> None:
        for x in layers.tolist():
            self.layers.setdefault(int(x), len(self.layers))
        L = len(self.layers)
        if self.bins is None or self.bins.shape[0] < L or self.bins.shape[2] < width:
            E = max(width, 0 if self.bins is None else self.bins.shape[2])
            bins = np.zeros((L, MAX_BINS, E), np.int64)
            hit = np.zeros((L, MAX_BINS, E), bool)
            if self.bins is not None:
                lo, _, e = self.bins.shape
                bins[:lo, :, :e] = self.bins
                hit[:lo, :, :e] = self.hit
            self.bins, self.hit = bins, hit

    def add(self, batch: pa.Table) -> pa.Table:
        """Add a batch of dense rows (``layer``, ``bin``, ``tokens`` list) to the bins;
        returns the batch's histogram rows (layer, tokens, pairs)."""
        if batch.num_rows == 0:
            return pa.table({"layer": pa.array([], pa.int32()), "tokens": pa.array([], pa.int64()),
                             "pairs": pa.array([], pa.int64())})
        values, offsets = _flat(batch.column("tokens"))
        values = values.astype(np.int64, copy=False)
        lengths = np.diff(offsets)
        layer = batch.column("layer").to_numpy()
        self._grow(np.unique(layer), int(lengths.max()) if len(lengths) else 0)
        li = np.fromiter((self.layers[int(x)] for x in layer), np.int64, len(layer))
        b = batch.column("bin").to_numpy().astype(np.int64)
        assert self.bins is not None and self.hit is not None
        _, nb, E = self.bins.shape
        if (lengths == E).all():   # every list of the run's length: a row-major [rows, E] block
            block = values.reshape(-1, E)
            key = li * nb + b
            order = np.argsort(key, kind="stable")
            k_sorted = key[order]
            starts = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]])
            sums = np.add.reduceat(block[order], starts, axis=0)
            flat_bins = self.bins.reshape(-1, E)
            flat_bins[k_sorted[starts]] += sums
            self.hit.reshape(-1, E)[k_sorted[starts]] = True
        else:                      # lists of other lengths: one (row, expert) at a time
            row = np.repeat(np.arange(len(lengths)), lengths)
            expert = np.arange(len(values)) - offsets[:-1][row]
            cell = (li[row] * nb + b[row]) * E + expert
            np.add.at(self.bins.reshape(-1), cell, values)
            self.hit.reshape(-1)[cell] = True
        # histogram: (layer, tokens) pairs counted
        li_v = np.repeat(li, lengths)
        lo, hi = (int(values.min()), int(values.max())) if len(values) else (0, 0)
        span = hi - lo + 1
        if lo >= 0 and len(self.layers) * span <= 1 << 24:
            counts = np.bincount(li_v * span + (values - lo), minlength=len(self.layers) * span)
            nz = np.flatnonzero(counts)
            keys, pairs = nz, counts[nz]
        else:
            keys, pairs = np.unique(li_v * span + (values - lo), return_counts=True)
        rev = np.array(list(self.layers), np.int64)
        return pa.table({"layer": pa.array(rev[keys // span], pa.int32()),
                         "tokens": pa.array(keys % span + lo, pa.int64()),
                         "pairs": pa.array(pairs, pa.int64())})

    def add_long(self, rows: pa.Table) -> None:
        """Add long rows (``layer``, ``bin``, ``expert``, ``tokens``: one per (step, expert))."""
        if rows.num_rows == 0:
            return
        layer = rows.column("layer").to_numpy()
        expert = rows.column("expert").to_numpy().astype(np.int64)
        self._grow(np.unique(layer), int(expert.max()) + 1)
        assert self.bins is not None and self.hit is not None
        _, nb, E = self.bins.shape
        li = np.fromiter((self.layers[int(x)] for x in layer), np.int64, len(layer))
        cell = (li * nb + rows.column("bin").to_numpy().astype(np.int64)) * E + expert
        np.add.at(self.bins.reshape(-1), cell, rows.column("tokens").to_numpy().astype(np.int64))
        self.hit.reshape(-1)[cell] = True

    def bin_rows(self, steps_of: dict[int, int]) -> pa.Table:
        """``expert_step_bins`` of the run but its run_id: every (layer, bin, expert) that
        had a row, with the layer's bins and steps (``steps_of``: the layer's steps with rows)."""
        if self.bins is None:
            li = b = e = np.zeros(0, np.int64)
            tokens = np.zeros(0, np.int64)
        else:
            assert self.hit is not None
            li, b, e = np.nonzero(self.hit)
            tokens = self.bins[li, b, e]
        rev = np.array(list(self.layers), np.int64)
        layer = rev[li] if len(li) else np.zeros(0, np.int64)
        steps = np.array([steps_of[int(x)] for x in rev], np.int64)[li] if len(li) else np.zeros(0, np.int64)
        return pa.table({"layer": pa.array(layer, pa.int32()),
                         "bin": pa.array(b, pa.int64()), "expert": pa.array(e, pa.int32()),
                         "tokens": pa.array(tokens, pa.int64()), "bins": pa.array(np.minimum(steps, MAX_BINS), pa.int64()),
                         "steps": pa.array(steps, pa.int64())})


def rank_windows(rows: pa.Table, kc: int, batch_ord0: int, n: int, top_level: int,
                 chunk: int) -> tuple[pa.Table, pa.Table, pa.Table]:
    """One batch's rank rows (``layer``, ``ord``: the step's place in the run, ``ranks``,
    ``tokens``) as the three accumulators of ``skew_by_batch``:

    * windows (layer, w, batch, mx, total) of w = 1, 2, ... ``top_level`` steps, window
      ``batch`` covering the run's steps ``batch*w .. batch*w + w - 1`` (only
      ``batch < n // w``), each merged from the two halves below it;
    * the batch's rank totals (chunk, layer, rank, tokens);
    * the suffix buckets (layer, rank, k, tokens): tokens of the steps whose distance from
      the run's end ``n - ord`` has ``ceil(log2(.)) = k``.

    A (layer, window) or (layer, rank) without any rank row yields no row, as in SQL.
    The batch's ``kc`` steps are the run's steps ``batch_ord0 ..``."""
    layer = rows.column("layer").to_numpy().astype(np.int64)
    o = rows.column("ord").to_numpy().astype(np.int64) - batch_ord0
    rk, off = _flat(rows.column("ranks"))
    tk, _ = _flat(rows.column("tokens"))
    lengths = np.diff(off)
    uniq, li = np.unique(layer, return_inverse=True)
    L = len(uniq)
    R = int(rk.max()) + 1 if len(rk) else 1
    X = np.zeros((L, kc, R))
    P = np.zeros((L, kc), bool)                # (layer, step) has a rank row
    RP = np.zeros((L, kc, R), bool)            # ... for that rank
    V = np.zeros((L, kc, R), bool)             # ... with tokens (a rank of a list too short is NULL)
    li_v, o_v = np.repeat(li, lengths), np.repeat(o, lengths)
    tk = tk.astype(np.float64, copy=False)
    ok = ~np.isnan(tk)
    X[li_v, o_v, rk] = np.where(ok, tk, 0.0)
    RP[li_v, o_v, rk] = True
    V[li_v, o_v, rk] = ok
    P[li, o] = True
    # windows, level by level (a window's ranks are the sum of its halves' ranks)
    out_l, out_w, out_b, out_mx, out_tot = [], [], [], [], []
    Vw: np.ndarray = np.asarray(V.any(axis=2))
    w, Xw, Pw = 1, X, P   # SQL's max and sum skip NULL: a window of NULLs is NULL
    while True:
        first = batch_ord0 // w
        idx = np.arange(Xw.shape[1])
        keep = (first + idx) < n // w
        lw, bw = np.nonzero(Pw & keep[None, :])
        if len(lw):
            sel = Xw[lw, bw]
            out_l.append(uniq[lw])
            out_w.append(np.full(len(lw), w))
            out_b.append(first + bw)
            valid = Vw[lw, bw]
            out_mx.append(np.where(valid, sel.max(axis=1), np.nan))
            out_tot.append(np.where(valid, sel.sum(axis=1), np.nan))
        if w * 2 > top_level:
            break
        if Xw.shape[1] % 2:
            Xw = np.concatenate([Xw, np.zeros((L, 1, R))], axis=1)
            Pw = np.concatenate([Pw, np.zeros((L, 1), bool)], axis=1)
            Vw = np.concatenate([Vw, np.zeros((L, 1), bool)], axis=1)
        Xw = Xw[:, 0::2] + Xw[:, 1::2]
        Pw = Pw[:, 0::2] | Pw[:, 1::2]
        Vw = Vw[:, 0::2] | Vw[:, 1::2]
        w *= 2
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
    nullable = (lambda x: pa.array(x, pa.float64(), mask=np.isnan(x)))
    windows = pa.table({"layer": pa.array(cat(out_l, np.int32)), "w": pa.array(cat(out_w, np.int64)),
                        "batch": pa.array(cat(out_b, np.int64)), "mx": nullable(cat(out_mx, np.float64)),
                        "total": nullable(cat(out_tot, np.float64))})
    # the batch's rank totals
    present = RP.any(axis=1)
    tl, tr = np.nonzero(present)
    tsum = np.asarray(np.where(V.any(axis=1), X.sum(axis=1), np.nan))[tl, tr]
    totals = pa.table({"chunk": pa.array(np.full(len(tl), chunk), pa.int64()), "layer": pa.array(uniq[tl], pa.int32()),
                       "rank": pa.array(tr, pa.int64()), "tokens": nullable(tsum)})
    # suffix buckets: k = ceil(log2(n - ord)) is non-increasing in ord: runs of equal k
    dist = n - (batch_ord0 + np.arange(kc))
    k = np.array([int(d - 1).bit_length() for d in dist.tolist()], np.int64)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if kc else np.zeros(0, np.int64)
    sums = np.add.reduceat(X, starts, axis=1) if kc else np.zeros((L, 0, R))
    hits = np.logical_or.reduceat(RP, starts, axis=1) if kc else np.zeros((L, 0, R), bool)
    vals = np.logical_or.reduceat(V, starts, axis=1) if kc else np.zeros((L, 0, R), bool)
    sl, sg, sr = np.nonzero(hits)
    suffix = pa.table({"layer": pa.array(uniq[sl], pa.int32()), "rank": pa.array(sr, pa.int64()),
                       "k": pa.array(k[starts][sg], pa.int64()),
                       "tokens": nullable(np.asarray(np.where(vals, sums, np.nan))[sl, sg, sr])})
    return windows, totals, suffix
