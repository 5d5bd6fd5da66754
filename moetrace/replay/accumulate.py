"""Streaming accumulators of a replay's per-(step, layer) results: the memory they hold does
not grow with the number of judged steps (an hour and a week of a fleet need the same).

The replay judges a plan block by block (:func:`moetrace.replay.strategies.judge_stream`);
each block's [steps, layers] metrics are folded in here and dropped:

- means and maxima are exact running sums, counts and maxima (float64 sums: equal to a
  mean over the concatenated arrays up to float rounding, ~1e-15 relative; integer-valued
  quantities such as token counts sum exactly);
- the straggler rank of each layer is an exact count per (layer, rank);
- percentiles (:class:`Quantiles`) follow ``np.percentile``'s default definition (linear
  interpolation between the order statistics at ``(n - 1) q / 100``, reproduced bit for
  bit): exact from a histogram of the distinct values while they number at most
  ``max_entries`` (integer token counts: one entry per distinct count, however many
  steps), else from log-spaced buckets whose relative error is at most ``rel_error``
  (a DDSketch: every value within ``rel_error`` of its bucket's representative, so the
  interpolated percentile too). :attr:`Quantiles.rel_error` says which (0.0: exact), and
  every answer that prints such a percentile says so.

Memory: a :class:`Quantiles` holds at most two buffers of ``max_entries`` (value, count)
pairs and fewer than 65,536 pending values (plus one block) in its exact form, or
``log(max / min) / log((1 + a) / (1 - a))`` buckets per group as a sketch (the replay's
imbalance lies in [1, ranks]: about 29,000 buckets at a = 1e-4 and 320 ranks), whatever
the number of steps. ``nbytes`` adds up the arrays an accumulator holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: the percentile every replay answer reports
P99 = 99.0
#: relative error of a sketched percentile (0.01%)
SKETCH_REL_ERROR = 1e-4
#: distinct values kept exactly before a :class:`Quantiles` turns into a sketch (per accumulator)
MAX_EXACT_ENTRIES = 1 << 19
_MIN_MERGE = 1 << 16


def rel_error_text(rel: float) -> str:
    """'' when exact, else ' (within 0.01%)': what a printed percentile says about itself."""
    return "" if not rel else f" (within {rel * 100:.2g}%)"


def _lerp(a: float, b: float, t: float) -> float:
    """``numpy.lib._function_base_impl._lerp`` on scalars (the same float operations)."""
    d = b - a
    return float(b - d * (1 - t)) if t >= 0.5 else float(a + d * t)


def percentile_index(n: int, q: float = P99) -> tuple[int, int, float]:
    """(previous, next, gamma) of ``np.percentile(x, q)`` (method 'linear') on n values:
    the result is ``lerp(sorted[previous], sorted[next], gamma)``."""
    v = (n - 1) * np.true_divide(q, 100)
    if v >= n - 1:
        return n - 1, n - 1, float(v - math.floor(v))
    lo = int(math.floor(v))
    return lo, lo + 1, float(v - lo)


def percentile_from_counts(values: np.ndarray, counts: np.ndarray, q: float = P99) -> float:
    """``np.percentile(np.repeat(values, counts), q)`` (bit for bit) from sorted distinct
    ``values`` and their ``counts``, without the repeated array."""
    cum = np.cumsum(counts)
    n = int(cum[-1])
    lo, hi, g = percentile_index(n, q)
    a, b = np.searchsorted(cum, [lo, hi], side="right")
    return _lerp(float(values[a]), float(values[b]), g)


class Quantiles:
    """Percentiles of values in ``groups`` groups, fed block by block, in bounded memory.

    Exact (a histogram of the distinct (group, value) pairs, sorted, with their counts) until
    more than ``max_entries`` distinct pairs are seen, then a log-bucket sketch of relative
    error ``rel_error`` (values must be >= 0; zeros are counted apart). With ``value_range``
    (lo, hi), known bounds of the values, the sketch's buckets cover that range from the
    start (a fixed size; a value outside it counts in the edge bucket), else they grow with
    the range of the values seen. Which one answers depends only on the values seen (their
    number of distinct pairs), not on the blocks they came in: the sketch's buckets are a
    function of each value.

    The histogram lives in two buffers (the sorted pairs and the next merge's output); new
    values wait in blocks of at most ``_MIN_MERGE`` and are merged in sorted (an insertion
    that moves the held pairs once, without sorting them again). ``capacity``: the most
    distinct pairs expected (e.g. the cells a replay will judge): the buffers are allocated
    at ``min(capacity, max_entries)`` from the start and written once, so a long replay's
    memory does not grow with them (nor fragment the heap with ever larger temporaries);
    without it they double as needed."""

    def __init__(self, groups: int, rel_error: float = SKETCH_REL_ERROR, max_entries: int = MAX_EXACT_ENTRIES,
                 value_range: tuple[float, float] | None = None, capacity: int | None = None):
        self.groups = int(groups)
        self.value_range = value_range
        self.alpha = float(rel_error)
        self.max_entries = int(max_entries)
        self._n = 0                                  # distinct pairs held
        self._cap = 0
        self._bufs: tuple | None = None             # (values, counts, groups or None) of capacity _cap
        self._spare: tuple | None = None            # the same, the next merge's output
        self._mask: np.ndarray | None = None
        self._pending: list[tuple[np.ndarray | None, np.ndarray]] = []
        self._npending = 0
        self._sketch: np.ndarray | None = None      # [groups, span] bucket counts
        self._lo = 0                                 # bucket index of column 0
        self._zeros = np.zeros(self.groups, np.int64)
        self._lng = math.log((1 + self.alpha) / (1 - self.alpha))
        if capacity:
            self._grow(min(int(capacity), self.max_entries), touch=True)

    def _alloc(self, cap: int, touch: bool) -> tuple:
        bufs = (np.empty(cap, np.float64), np.empty(cap, np.int64),
                np.empty(cap, np.int64) if self.groups > 1 else None)
        if touch:       # pages counted now, not as the histogram fills
            for b in bufs:
                if b is not None:
                    b.fill(0)
        return bufs

    def _grow(self, cap: int, touch: bool = False) -> None:
        """Buffers of ``cap`` pairs (the held pairs copied over)."""
        bufs, spare = self._alloc(cap, touch), self._alloc(cap, touch)
        if self._bufs is not None:
            for new, old in zip(bufs, self._bufs):
                if new is not None:
                    new[:self._n] = old[:self._n]
        self._bufs, self._spare, self._cap = bufs, spare, cap
        self._mask = np.ones(cap, bool)

    @property
    def _v(self) -> np.ndarray:
        return np.zeros(0) if self._bufs is None else self._bufs[0][:self._n]

    @property
    def _c(self) -> np.ndarray:
        return np.zeros(0, np.int64) if self._bufs is None else self._bufs[1][:self._n]

    @property
    def _g(self) -> np.ndarray:
        if self._bufs is None:
            return np.zeros(0, np.int64)
        return self._bufs[2][:self._n] if self.groups > 1 else np.zeros(self._n, np.int64)

    @property
    def rel_error(self) -> float:
        """0.0 while exact, else the sketch's relative error bound."""
        return 0.0 if self._sketch is None else self.alpha

    @property
    def nbytes(self) -> int:
        n = self._zeros.nbytes + sum(b.nbytes for bs in (self._bufs, self._spare) if bs for b in bs if b is not None)
        n += 0 if self._mask is None else self._mask.nbytes
        n += sum(v.nbytes + (0 if g is None else g.nbytes) for g, v in self._pending)
        return n + (0 if self._sketch is None else self._sketch.nbytes)

    def add(self, group: np.ndarray, values: np.ndarray) -> None:
        """Fold in ``values`` (finite), ``group[i]`` the group of ``values[i]``."""
        v = np.asarray(values, np.float64).ravel()
        if not v.size:
            return
        if self._sketch is not None:
            g = np.broadcast_to(np.asarray(group, np.int64), v.shape).ravel()
            self._to_sketch(g, v, None)
            return
        g = None if self.groups == 1 else np.broadcast_to(np.asarray(group, np.int64), v.shape).ravel().copy()
        self._pending.append((g, v.copy()))
        self._npending += v.size
        if self._npending >= _MIN_MERGE:
            self._compact()

    def _compact(self) -> None:
        """Merge the pending values into the sorted histogram (or, past ``max_entries``
        distinct pairs, everything into the sketch)."""
        if not self._pending:
            return
        v = np.concatenate([p[1] for p in self._pending])
        g = None if self.groups == 1 else np.concatenate([p[0] for p in self._pending])
        self._pending, self._npending = [], 0
        if g is None:
            v.sort()
            new = np.empty(v.size, bool)
            new[0] = True
            np.not_equal(v[1:], v[:-1], out=new[1:])
        else:
            order = np.lexsort((v, g))
            g, v = g[order], v[order]
            new = np.empty(v.size, bool)
            new[0] = True
            new[1:] = (g[1:] != g[:-1]) | (v[1:] != v[:-1])
        starts = np.flatnonzero(new)
        uc = np.diff(np.append(starts, v.size))
        uv = v[starts]
        ug = None if g is None else g[starts]
        n = self._n
        if n:
            hv, hc, hg = (b[:n] if b is not None else None for b in self._bufs)
            if ug is None:
                pos = np.searchsorted(hv, uv)
            else:      # position among the pairs sorted by (group, value): a group's block, then its values
                off = np.searchsorted(hg, np.arange(self.groups + 1))
                ub = np.searchsorted(ug, np.arange(self.groups + 1))
                pos = np.empty(uv.size, np.int64)
                for k in np.flatnonzero(ub[1:] > ub[:-1]):
                    a, b, lo = ub[k], ub[k + 1], off[k]
                    pos[a:b] = lo + np.searchsorted(hv[lo:off[k + 1]], uv[a:b])
            at = np.minimum(pos, n - 1)
            hit = (pos < n) & (hv[at] == uv)
            if ug is not None:
                hit &= hg[at] == ug
            if hit.any():
                hc[pos[hit]] += uc[hit]
                miss = ~hit
                pos, uv, uc = pos[miss], uv[miss], uc[miss]
                ug = None if ug is None else ug[miss]
        else:
            pos = np.zeros(uv.size, np.int64)
        m = n + uv.size
        if m > self.max_entries:       # too many distinct values: a sketch from here on
            held = (self._g, self._v, self._c)
            self._bufs = self._spare = self._mask = None
            self._n = self._cap = 0
            self._sketch = np.zeros((self.groups, 0), np.int64)
            if self.value_range is not None:
                lo, hi = (int(math.ceil(math.log(x) / self._lng)) for x in self.value_range)
                self._sketch, self._lo = np.zeros((self.groups, hi - lo + 1), np.int64), lo
            self._to_sketch(*held)
            self._to_sketch(np.zeros(uv.size, np.int64) if ug is None else ug, uv, uc)
            return
        if not uv.size:
            return
        if m > self._cap:
            self._grow(min(max(m, 2 * self._cap, 4096), self.max_entries))
        dest = pos + np.arange(uv.size)            # the new pairs' places; the held ones fill the rest, in order
        mask = self._mask[:m]
        mask[dest] = False
        for out, held, add in zip(self._spare, self._bufs, (uv, uc, ug)):
            if out is not None:
                o = out[:m]
                o[mask] = held[:n]
                o[dest] = add
        mask[dest] = True
        self._bufs, self._spare, self._n = self._spare, self._bufs, m

    def _to_sketch(self, g: np.ndarray, v: np.ndarray, c: np.ndarray | None) -> None:
        if (v < 0).any():
            raise ValueError("a sketched percentile needs values >= 0")
        zero = v == 0
        if zero.any():
            np.add.at(self._zeros, g[zero], 1 if c is None else c[zero])
            keep = ~zero
            g, v, c = g[keep], v[keep], None if c is None else c[keep]
        if not v.size:
            return
        idx = np.ceil(np.log(v) / self._lng).astype(np.int64)
        if self.value_range is not None:
            np.clip(idx, self._lo, self._lo + self._sketch.shape[1] - 1, out=idx)
        lo, hi = int(idx.min()), int(idx.max())
        span = self._sketch.shape[1]
        if span == 0:
            self._lo, span = lo, 0
        if lo < self._lo or hi >= self._lo + span:
            nlo, nhi = min(lo, self._lo), max(hi, self._lo + span - 1)
            grown = np.zeros((self.groups, nhi - nlo + 1), np.int64)
            grown[:, self._lo - nlo:self._lo - nlo + span] = self._sketch
            self._sketch, self._lo = grown, nlo
        flat = g * self._sketch.shape[1] + (idx - self._lo)
        self._sketch += np.bincount(flat, weights=c, minlength=self._sketch.size).astype(np.int64).reshape(
            self._sketch.shape)

    def count(self) -> np.ndarray:
        """Values seen per group [groups]."""
        self._compact()
        if self._sketch is not None:
            return self._sketch.sum(axis=1) + self._zeros
        return np.bincount(self._g, weights=self._c, minlength=self.groups).astype(np.int64)

    def percentile(self, q: float = P99) -> np.ndarray:
        """``np.percentile`` of each group's values [groups] (NaN for a group without values);
        exact while :attr:`rel_error` is 0."""
        self._compact()
        out = np.full(self.groups, np.nan)
        if self._sketch is None:
            bounds = [0, self._n] if self.groups == 1 else np.searchsorted(self._g, np.arange(self.groups + 1))
            for k in range(self.groups):
                a, b = bounds[k], bounds[k + 1]
                if b > a:
                    out[k] = percentile_from_counts(self._v[a:b], self._c[a:b], q)
            return out
        gam = (1 + self.alpha) / (1 - self.alpha)
        # bucket i holds (gamma^(i-1), gamma^i]; its representative is within alpha of all of them
        rep = np.concatenate([[0.0], 2 * gam ** (np.arange(self._sketch.shape[1]) + self._lo) / (gam + 1)])
        for k in range(self.groups):
            counts = np.concatenate([[self._zeros[k]], self._sketch[k]])
            if counts.sum():
                out[k] = percentile_from_counts(rep, counts, q)
        return out


@dataclass
class Summary:
    """Summary over (step, layer) cells. Undefined cells (no tokens) are counted, not
    averaged in; ``predicted_step_ns`` is the mean over steps of the summed layer times.
    ``p99_imbalance`` is ``np.percentile(.., 99)`` of the defined cells, exact when
    ``p99_imbalance_rel_error`` is 0, else within that relative error (a long replay's
    bounded-memory sketch: :mod:`.accumulate`)."""
    mean_imbalance: float | None
    p99_imbalance: float | None
    max_imbalance: float | None
    undefined_cells: int
    cells: int
    predicted_step_ns: int | None
    mean_efficiency: float | None
    p99_imbalance_rel_error: float = 0.0

    def p99_text(self, fmt: str = ".3f") -> str:
        """The p99 imbalance as printed, with its error when it is sketched ('1.807 (within 0.01%)')."""
        return "n/a" if self.p99_imbalance is None else (
            f"{self.p99_imbalance:{fmt}}{rel_error_text(self.p99_imbalance_rel_error)}")


@dataclass
class LoadTotals:
    """The exact load of one placement per layer over the judged steps, [L] each: cells with
    tokens ``n``, the load straggler's counts per rank ``rank_counts [L, R]``, sums of the
    straggler's tokens, the mean rank tokens and their ratio, and the p99 of the straggler's
    tokens (``p99_rel_error`` 0.0: exact)."""
    n: np.ndarray
    rank_counts: np.ndarray
    sum_max: np.ndarray
    sum_mean: np.ndarray
    sum_ratio: np.ndarray
    p99_max: np.ndarray
    p99_rel_error: float


class LoadAccumulator:
    """Folds blocks of (max tokens, load straggler, mean tokens) [t, L] into :class:`LoadTotals`."""

    def __init__(self, max_entries: int = MAX_EXACT_ENTRIES):
        self.max_entries = max_entries
        self.L = self.R = None

    def _init(self, L: int, R: int) -> None:
        self.L, self.R = L, R
        self.rank_counts = np.zeros((L, R), np.int64)
        self.n = np.zeros(L, np.int64)
        self.sum_max = np.zeros(L)
        self.sum_mean = np.zeros(L)
        self.sum_ratio = np.zeros(L)
        self.q = Quantiles(L, max_entries=self.max_entries)

    @property
    def nbytes(self) -> int:
        if self.L is None:
            return 0
        return sum(a.nbytes for a in (self.rank_counts, self.n, self.sum_max, self.sum_mean, self.sum_ratio)) \
            + self.q.nbytes

    def add(self, max_tokens: np.ndarray, straggler: np.ndarray, mean_tokens: np.ndarray, num_ranks: int) -> None:
        t, L = max_tokens.shape
        if self.L is None:
            self._init(L, int(num_ranks))
        ok = straggler >= 0                          # -1: no tokens routed in that (step, layer)
        layer = np.broadcast_to(np.arange(L), (t, L))[ok]
        mx, mn = max_tokens[ok].astype(np.float64), mean_tokens[ok].astype(np.float64)
        self.rank_counts += np.bincount(layer * self.R + straggler[ok].astype(np.int64),
                                        minlength=L * self.R).reshape(L, self.R)
        self.n += np.bincount(layer, minlength=L)
        self.sum_max += np.bincount(layer, weights=mx, minlength=L)
        self.sum_mean += np.bincount(layer, weights=mn, minlength=L)
        self.sum_ratio += np.bincount(layer, weights=mx / mn, minlength=L)
        self.q.add(layer, mx)

    def totals(self) -> LoadTotals | None:
        if self.L is None:
            return None
        return LoadTotals(self.n.copy(), self.rank_counts.copy(), self.sum_max.copy(), self.sum_mean.copy(),
                          self.sum_ratio.copy(), self.q.percentile(P99), self.q.rel_error)


class SummaryAccumulator:
    """Folds blocks of (imbalance, layer ns, mean rank ns) [t, L] into the numbers of a
    :class:`moetrace.replay.engine.Summary`: defined / undefined cells, the sum, max and
    p99 of the imbalance, the summed layer time and the efficiency's sum and count. The
    imbalance (max / mean over R ranks) lies in [1, R]: its sketch has a fixed size once
    the first block says R."""

    def __init__(self, max_entries: int = MAX_EXACT_ENTRIES, expect_cells: int | None = None):
        self.expect_cells = expect_cells
        self.cells = 0
        self.undefined = 0
        self.steps = 0
        self.sum_imb = 0.0
        self.max_imb = -math.inf
        self.sum_layer_ns = 0.0
        self.sum_eff = 0.0
        self.n_eff = 0
        self.has_eff = False
        self.max_entries = max_entries
        self.q = None

    @property
    def nbytes(self) -> int:
        return 0 if self.q is None else self.q.nbytes

    def add(self, imbalance: np.ndarray, layer_ns: np.ndarray, rank_ns_mean: np.ndarray | None = None,
            num_ranks: int | None = None) -> None:
        """``num_ranks``: the ranks the imbalance is over (bounds it; None: unbounded sketch)."""
        if self.q is None:
            self.q = Quantiles(1, max_entries=self.max_entries,
                               value_range=(1.0, float(max(num_ranks, 1))) if num_ranks else None,
                               capacity=self.expect_cells)
        imb = np.asarray(imbalance, np.float64)
        lns = np.asarray(layer_ns)
        defined = ~np.isnan(imb)
        ok = imb[defined]
        self.cells += imb.size
        self.undefined += imb.size - ok.size
        self.steps += lns.shape[0] if lns.ndim else 0
        if ok.size:
            self.sum_imb += float(ok.sum())
            self.max_imb = max(self.max_imb, float(ok.max()))
            self.q.add(0, ok)
        if lns.size:
            self.sum_layer_ns += float(lns.sum(dtype=np.float64))
        if rank_ns_mean is not None and lns.size:
            self.has_eff = True
            pos = defined & (lns > 0)
            e = np.asarray(rank_ns_mean)[pos] / lns[pos]
            e = e[~np.isnan(e)]
            self.sum_eff += float(e.sum(dtype=np.float64))
            self.n_eff += e.size

    def summary(self) -> Summary:
        n_ok = self.cells - self.undefined
        return Summary(mean_imbalance=self.sum_imb / n_ok if n_ok else None,
                       p99_imbalance=float(self.q.percentile(P99)[0]) if n_ok else None,
                       max_imbalance=self.max_imb if n_ok else None,
                       undefined_cells=int(self.undefined), cells=int(self.cells),
                       predicted_step_ns=int(round(self.sum_layer_ns / self.steps)) if self.steps and self.cells else None,
                       mean_efficiency=self.sum_eff / self.n_eff if self.has_eff and self.n_eff else None,
                       p99_imbalance_rel_error=self.q.rel_error if self.q is not None else 0.0)
