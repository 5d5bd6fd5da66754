"""Replay recorded routing against a plan: per-rank tokens, slots touched, dispatch bytes
and predicted layer time for every (step, layer), vectorized over steps and layers.

A pure numeric kernel: arrays in, arrays out (the store is read and written by
:mod:`.load`). Inputs are dense arrays ``load [T, L, E]`` (tokens per logical expert),
optionally ``slot_load [T, L, S]`` when the
engine counted per physical slot (replaying the recorded plan then uses those counts, so
it reproduces the recorded per-rank loads exactly), or per-token routing (exact dispatch
bytes). Splits of an expert's tokens over its replicas:

- ``even``: an equal share to every copy (fractional tokens);
- ``hash``: vLLM's per-token choice; per token ``replica = hash(token) mod copies`` with
  per-token data, else the integer split it converges to (floor, remainder to the first
  copies);
- ``local``: SGLang's static dispatch, a copy on the token's own rank, else on its node,
  else the hash choice. Needs per-token routing (source ranks); without it ``even``.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import numpy as np

from ..costmodel.step_cost import CostModel
from ..domain.balance import imbalance
from ..errors import InputError
from ..placement.planners import Plan
from .accumulate import Summary, SummaryAccumulator

SPLITS = ("even", "hash", "local")



#: glibc's malloc gives a freed block back to the system once more than 128 KiB sit free at
#: the top of the heap (or unmaps it, above its mmap threshold), so every [steps, layers,
#: ranks] temporary of a replay piece (2 MiB) was page-faulted in afresh: at fleet shape
#: 126,000 page faults per 700 steps, a third of the kernels' CPU (measured, benchmarks/results/scale_log.md)
_MALLOC = {"depth": 0, "lib": None, "lock": threading.Lock()}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@contextlib.contextmanager
def reuse_freed_memory(mmap_above: int = 32 << 20, keep: int = 128 << 20):
    """Inside: blocks up to ``mmap_above`` bytes come from the heap and up to ``keep``
    freed bytes stay there for the next piece's temporaries; on leaving the outermost one,
    glibc's default thresholds are set back and the free memory is given back
    (``malloc_trim``). Peak memory is unchanged: the freed blocks are the next ones used.
    A no-op where the C library has no ``mallopt`` (not glibc)."""
    if _MALLOC["lib"] is None:
        try:
            import ctypes

            lib = ctypes.CDLL(None)
            _MALLOC["lib"] = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _MALLOC["lib"] = False
    lib = _MALLOC["lib"]
    with _MALLOC["lock"]:       # replays may run in threads (a Dask worker's): one count for all
        if lib and _MALLOC["depth"] == 0:
            lib.mallopt(_M_MMAP_THRESHOLD, int(mmap_above))
            lib.mallopt(_M_TRIM_THRESHOLD, int(keep))
        _MALLOC["depth"] += 1
    try:
        yield
    finally:
        with _MALLOC["lock"]:
            _MALLOC["depth"] -= 1
            if lib and _MALLOC["depth"] == 0:
                lib.mallopt(_M_MMAP_THRESHOLD, 128 << 10)
                lib.mallopt(_M_TRIM_THRESHOLD, 128 << 10)
                lib.malloc_trim(0)


# ----------------------------------------------------------------------------- replay core
@dataclass
class Block:
    """Replay of t steps: everything [t, L, R] unless said otherwise."""
    tokens: np.ndarray
    touched: np.ndarray
    bytes_intra: np.ndarray
    bytes_inter: np.ndarray
    exact_bytes: bool
    nodes_per_token_max: int | None = None
    nodes_per_token_mean: float | None = None
    #: dispatch bytes summed over the block, source rank x destination rank [R, R] (exact
    #: per-token replays only; the diagonal is 0: a token's own rank costs nothing)
    traffic: np.ndarray | None = None
    #: estimated bytes (:func:`_estimate_dispatch`): the tokens each rank receives [t, L, R]
    #: and the bytes per received token inside / between nodes, so that
    #: ``bytes_intra = received * per_token[0]`` and ``bytes_inter = received * per_token[1]``
    #: (the cost model then times the all-to-all in one pass: :meth:`CostModel.comm_received_ns`)
    received: np.ndarray | None = None
    per_token: tuple[float, float] | None = None


def _slot_replica_index(plan: Plan) -> np.ndarray:
    """Replica number of every slot among the slots of its expert, [L, S]."""
    L, S = plan.phy2log.shape
    out = np.zeros((L, S), np.int64)
    for li in range(L):
        order = np.argsort(plan.phy2log[li], kind="stable")
        sorted_e = plan.phy2log[li][order]
        first = np.searchsorted(sorted_e, sorted_e)
        out[li, order] = np.arange(S) - first
    return out


def _slot_gather(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(index of every slot's (layer, expert) into ``load.reshape(T, L * E)`` [L * S],
    copies of every slot's expert [L * S]): the sparse form of :meth:`Plan.copies`, one
    entry per slot instead of a dense [L, E, R] matrix that is almost all zeros."""
    L, S = plan.phy2log.shape
    E = plan.num_experts
    # each rank's slots in expert order: a rank's sum then does not depend on the order of
    # its slots (a relabeled plan replays to the same float32 bytes, as the dense product did)
    order = np.argsort(plan.slot_rank[None, :] * E + plan.phy2log, axis=1, kind="stable")
    p2l = np.take_along_axis(plan.phy2log, order, axis=1)
    flat = (np.arange(L, dtype=np.int64)[:, None] * E + p2l).ravel()
    cnt = np.take_along_axis(plan.logcnt(), p2l, axis=1).ravel()
    return flat, cnt


@dataclass
class _PlanArrays:
    """What the kernels take from a plan at every piece: :func:`_slot_gather`'s (index,
    copies) per slot, each slot's share of its expert's tokens (1 / copies, float64) and the
    copies of each expert [L, E] in float32."""
    flat: np.ndarray
    cnt: np.ndarray
    share: np.ndarray
    logcnt32: np.ndarray


#: the last few plans' arrays: a replay asks for the same two plans (the candidate and the
#: recorded one) at every piece, and the argsort behind them took 6% of the kernels' time
_PLAN_CACHE: list = []
_PLAN_CACHE_SIZE = 4


def _plan_arrays(plan: Plan) -> _PlanArrays:
    """:class:`_PlanArrays` of ``plan``, computed once while the plan is unchanged (its
    slots, experts and ranks are compared at every call, so a plan edited in place is
    computed afresh)."""
    key = (plan.num_experts, plan.num_ranks)
    for p, k, p2l, arrays in list(_PLAN_CACHE):
        if p is plan and k == key and np.array_equal(p2l, plan.phy2log):
            return arrays
    flat, cnt = _slot_gather(plan)
    arrays = _PlanArrays(flat, cnt, 1.0 / cnt.astype(np.float64), plan.logcnt().astype(np.float32))
    _PLAN_CACHE.append((plan, key, plan.phy2log.copy(), arrays))
    del _PLAN_CACHE[:-_PLAN_CACHE_SIZE]
    return arrays


def _rank_sum(per_slot: np.ndarray, T: int, L: int, R: int, spr: int, dtype=None) -> np.ndarray:
    """[T, L * S] per-slot values summed over each rank's slots (slot order): [T, L, R]."""
    v = per_slot.reshape(T, L, R, spr)
    if spr == 1:
        return v[..., 0] if dtype is None else v[..., 0].astype(dtype)
    return v.sum(axis=3, dtype=dtype)


def received_cap(load: np.ndarray, top_k: int, dtype=np.float64) -> np.ndarray:
    """The step's tokens B = assignments / top_k per (step, layer) [t, L]: no rank receives
    more (counts of real routing never give one copy more; synthetic ones may)."""
    return load.sum(axis=2, dtype=dtype) / dtype(max(top_k, 1))


def _estimate_dispatch(load, plan, top_k, bytes_per_token, arrays: _PlanArrays | None = None, even_tokens=None):
    """Bytes each rank receives in the dispatch, without per-token data: (intra bytes, inter
    bytes, tokens received or None, (intra, inter) bytes per received token). A token
    reaches rank r unless it misses every copy there, each copy taking load/copies of the
    step's B tokens independently, P = 1 - prod(1 - x/B); source ranks uniform over ranks
    (the token's own rank costs nothing, its node's other ranks are intra-node). Without
    ``top_k`` the tokens per step are unknown: no bytes (zeros; the caller says so).
    float32 throughout (a probability per rank; the bytes are an estimate), except with one
    slot per rank, where P = x/B exactly: the rank receives its own tokens (at most B), in
    the load's precision. ``even_tokens``: the plan's per-rank tokens under the even split,
    when the caller has them (one slot per rank: they are the tokens received)."""
    T, L, E = load.shape
    if not top_k:
        z = np.zeros((T, L, plan.num_ranks))
        return z, z, None, None
    R, rpn = plan.num_ranks, plan.ranks_per_node
    arrays = arrays or _plan_arrays(plan)
    per_token = ((rpn - 1) / R * bytes_per_token, (R - rpn) / R * bytes_per_token)
    if plan.slots_per_rank == 1:
        # one copy on the rank: P = x / B, so the tokens received are the copy's even share
        # of its expert's tokens (top-k experts are distinct: a token reaches a copy once),
        # the rank's tokens themselves (at most the step's B tokens), with no float32
        # log/exp round trip
        dt = np.float64 if load.dtype == np.float64 else np.float32
        s = even_tokens if even_tokens is not None else _even_slot_tokens(load, arrays).reshape(T, L, R)
        s = np.minimum(s, received_cap(load, top_k, dt)[..., None])
    else:
        B = load.sum(axis=2, keepdims=True, dtype=np.float32) / np.float32(max(top_k, 1))
        inv = np.float32(1.0) / (arrays.logcnt32[None] * np.maximum(B, np.float32(1e-30)))
        x = np.multiply(load, inv, dtype=np.float32)
        np.clip(x, 0.0, 1.0 - 1e-7, out=x)
        np.negative(x, out=x)
        np.log1p(x, out=x)                 # log(1 - x), x = copy load / tokens per step
        # sum of log(1 - x) over the rank's copies: one value per slot, summed per rank
        s = _rank_sum(np.take(x.reshape(T, L * E), arrays.flat, axis=1), T, L, R, plan.slots_per_rank)
        np.exp(s, out=s)
        np.subtract(np.float32(1.0), s, out=s)
        s *= B                             # tokens received
    intra = s * ((rpn - 1) / R)
    intra *= bytes_per_token
    inter = s * ((R - rpn) / R)
    inter *= bytes_per_token
    return intra, inter, s, per_token


#: elements of one [steps, L, R] block the kernels work on at a time (2 MiB of float64):
#: the temporaries stay in cache, and big fresh arrays are not page-faulted in per operation
#: (a 500-step chunk of the fleet shape in one piece ran 3-4x slower, measured)
BLOCK_ELEMENTS = 1 << 18


def _sub_blocks(T: int, per_step: int):
    nb = max(1, BLOCK_ELEMENTS // max(per_step, 1))
    return [(a, min(T, a + nb)) for a in range(0, T, nb)]


def replay_load(load: np.ndarray, plan: Plan, split: str = "even", slot_load: np.ndarray | None = None,
                top_k: int | None = None, bytes_per_token: int = 0) -> Block:
    """Replay aggregated load [t, L, E] (or per-slot counts of this very plan) against ``plan``,
    a few steps at a time (:data:`BLOCK_ELEMENTS`); the answer does not depend on the split."""
    T, L, E = load.shape
    arrays = _plan_arrays(plan)
    parts = _sub_blocks(T, L * max(plan.num_ranks, E))
    if len(parts) == 1:
        return _replay_load(load, plan, split, slot_load, top_k, bytes_per_token, arrays)
    out = None
    for a, b in parts:
        blk = _replay_load(load[a:b], plan, split, None if slot_load is None else slot_load[a:b], top_k,
                           bytes_per_token, arrays)
        if out is None:
            out = Block(*(np.empty((T,) + x.shape[1:], x.dtype) for x in
                          (blk.tokens, blk.touched, blk.bytes_intra, blk.bytes_inter)), exact_bytes=False,
                        received=None if blk.received is None else np.empty((T,) + blk.received.shape[1:],
                                                                             blk.received.dtype),
                        per_token=blk.per_token)
        out.tokens[a:b], out.touched[a:b] = blk.tokens, blk.touched
        out.bytes_intra[a:b], out.bytes_inter[a:b] = blk.bytes_intra, blk.bytes_inter
        if out.received is not None:
            out.received[a:b] = blk.received
    return out


def _even_slot_tokens(load: np.ndarray, arrays: _PlanArrays) -> np.ndarray:
    """Every slot's equal share of its expert's tokens [t, L * S] (a gather per slot, no
    dense [E, R] product). float64 counts (the store's) split in float64, as the SQL views
    do: the recorded plan's replay then equals skew_summary; float32 arrays stay float32."""
    T, L, E = load.shape
    dt = np.float64 if load.dtype == np.float64 else np.float32
    l2 = load.reshape(T, L * E)
    g = np.take(l2 if l2.dtype == dt else l2.astype(dt), arrays.flat, axis=1)
    g *= arrays.share if dt == np.float64 else arrays.share.astype(dt)    # = Plan.share() at each slot
    return g


def _replay_load(load, plan, split, slot_load, top_k, bytes_per_token, arrays: _PlanArrays) -> Block:
    T, L, E = load.shape
    R, spr = plan.num_ranks, plan.slots_per_rank
    even = None                 # the even split's per-rank tokens
    if slot_load is not None:
        if slot_load.shape[2] != plan.num_slots:
            raise InputError(None, f"per-slot load has {slot_load.shape[2]} slots, plan has {plan.num_slots}")
        st = slot_load.reshape(T, L, R, spr)
        tokens = st.sum(axis=3, dtype=np.float64)
        touched = (st > 0).sum(axis=3, dtype=np.int32)
    elif split == "hash":
        cnt = plan.logcnt()
        rep = _slot_replica_index(plan)
        g = np.take_along_axis(load, np.broadcast_to(plan.phy2log[None], (T, L, plan.num_slots)), axis=2)
        c = np.take_along_axis(cnt, plan.phy2log, axis=1)[None].astype(np.float32)
        st = np.floor(g / c) + (rep[None] < np.mod(g, c))
        st = st.reshape(T, L, R, spr)
        tokens = st.sum(axis=3, dtype=np.float64)
        touched = (st > 0).sum(axis=3, dtype=np.int32)
    else:
        # an equal share of the expert's tokens to every copy, summed over the rank's slots
        g = _even_slot_tokens(load, arrays)
        touched = _rank_sum(g > 0, T, L, R, spr, dtype=np.int32)     # the slot's expert routed tokens
        tokens = _rank_sum(g, T, L, R, spr)
        even = tokens
    intra, inter, received, per_token = _estimate_dispatch(load, plan, top_k, bytes_per_token, arrays,
                                                           even)
    return Block(tokens, touched, intra, inter, exact_bytes=False, received=received, per_token=per_token)


# ----------------------------------------------------------------------------- two plans, one pass
class _GatheredBlock(Block):
    """A :class:`Block` of a plan with one slot per rank from :func:`replay_pair`: its
    tokens gathered from per-(layer, expert, copies) columns; the slots touched (1 where a
    rank has tokens), the tokens received (its tokens, at most the step's: one copy on the rank) and the
    dispatch bytes derived on first use (a replay that writes no rank rows never asks for
    them). The same values as :func:`replay_load`'s block."""

    def __init__(self, tokens, received, T, L, R, per_token, rpn, bytes_per_token):
        self.tokens, self.exact_bytes, self.per_token = tokens, False, per_token
        self.nodes_per_token_max = self.nodes_per_token_mean = self.traffic = None
        self._shape, self._rpn, self._bpt = (T, L, R), rpn, bytes_per_token
        self._cache = {"received": received}

    def _get(self, name):
        got = self._cache.get(name)
        if got is None:
            R = self._shape[2]
            if name in ("bytes_intra", "bytes_inter"):
                s = self.received
                got = s * (((self._rpn - 1) if name == "bytes_intra" else (R - self._rpn)) / R)
                got *= self._bpt
            else:   # touched
                got = np.greater(self.tokens, 0, out=np.empty(self.tokens.shape, np.int32), casting="unsafe")
            self._cache[name] = got
        return got

    touched = property(lambda self: self._get("touched"), lambda self, v: self._cache.__setitem__("touched", v))
    received = property(lambda self: self._get("received"), lambda self, v: self._cache.__setitem__("received", v))
    bytes_intra = property(lambda self: self._get("bytes_intra"),
                           lambda self, v: self._cache.__setitem__("bytes_intra", v))
    bytes_inter = property(lambda self: self._get("bytes_inter"),
                           lambda self, v: self._cache.__setitem__("bytes_inter", v))


#: the union columns of the last few plan pairs (:func:`pair_columns`)
_PAIR_CACHE: list = []


def pair_columns(plans: tuple[Plan, ...]):
    """(layer * E + expert [U], 1 / copies (float64) [U], columns per layer [L], per plan the
    column of each of its slots [L * R]): the distinct (layer, expert, copies) of the plans' slots, in that order.
    With one slot per rank everything a rank gets is a function of its slot's column, so
    the columns are computed once for every plan."""
    arrs = [_plan_arrays(p) for p in plans]
    for ps, keys, got in list(_PAIR_CACHE):
        if len(ps) == len(plans) and all(a is b for a, b in zip(ps, plans)) and \
                all(np.array_equal(k, a.flat * (1 << 20) + a.cnt) for k, a in zip(keys, arrs)):
            return got
    keys = [a.flat * (1 << 20) + a.cnt for a in arrs]          # copies < 2^20 (slots per layer)
    u = np.unique(np.concatenate(keys))
    flat, cnt = u >> 20, u & ((1 << 20) - 1)
    L, E = plans[0].num_layers, plans[0].num_experts
    got = (flat, 1.0 / cnt.astype(np.float64), np.bincount(flat // E, minlength=L), [np.searchsorted(u, k) for k in keys])
    _PAIR_CACHE.append((tuple(plans), keys, got))
    del _PAIR_CACHE[:-_PLAN_CACHE_SIZE]
    return got


def pair_applies(plans, split: str, top_k, cost: CostModel) -> bool:
    """Whether :func:`replay_pair` replays ``plans`` (else :func:`replay_load` one by one):
    one slot per rank, the even split over replicas, a known top_k and a cost model whose
    rank time is a function of the rank's own values (no contention term)."""
    p0 = plans[0]
    return (split != "hash" and bool(top_k) and cost.fused_comm and not cost.contention
            and all(p.slots_per_rank == 1 and p.num_experts == p0.num_experts and p.num_layers == p0.num_layers
                    for p in plans))


def replay_pair(load: np.ndarray, plans: tuple[Plan, ...], top_k: int, bytes_per_token: int, cost: CostModel,
                columns=None) -> list[tuple[Block, LayerMetrics]]:
    """(block, metrics) of each of ``plans`` on ``load [t, L, E]`` (float64), equal bit for
    bit to ``layer_metrics(replay_load(load, plan, "even", None, top_k, bytes_per_token),
    cost)`` plan by plan (:func:`pair_applies` says when it applies). With one slot per rank
    a rank's tokens, slots touched, received tokens and time are a function of its slot's
    (layer, expert, copies): those are computed once over the distinct columns of all the
    plans (the candidate and the recorded placement share all but a few percent), and each
    plan gathers its ranks' values and takes its maxima. ``columns``: ``pair_columns(plans)``
    when the caller holds it (a replay's plans do not change from piece to piece)."""
    T, L, E = load.shape
    flatU, shareU, per_layer, pos = columns if columns is not None else pair_columns(plans)
    tokU = np.take(load.reshape(T, L * E), flatU, axis=1)              # [t, U] float64
    tokU *= shareU                      # = the per-slot share: a rank's tokens, and (one copy on
    # the rank) the tokens it receives in the dispatch, at most the step's B (_estimate_dispatch)
    cap = received_cap(load, top_k)
    recU = tokU if (load.max(axis=2) <= cap).all() else np.minimum(tokU, np.repeat(cap, per_layer, axis=1))
    rank_nsU: dict = {}       # the rank time of every column, per (intra, inter) bytes per token
    res = []
    for p, pp in zip(plans, pos):
        R, rpn = p.num_ranks, p.ranks_per_node
        per_token = ((rpn - 1) / R * bytes_per_token, (R - rpn) / R * bytes_per_token)
        if per_token not in rank_nsU:       # compute + all-to-all: elementwise without contention
            r = cost.compute_ns(tokU, None)     # one slot per rank: touched where it has tokens
            r += cost.comm_received_ns(recU, per_token)
            rank_nsU[per_token] = r
        tok = np.take(tokU, pp, axis=1).reshape(T, L, R)
        rank_ns = np.take(rank_nsU[per_token], pp, axis=1).reshape(T, L, R)
        rec = tok if recU is tokU else np.take(recU, pp, axis=1).reshape(T, L, R)
        blk = _GatheredBlock(tok, rec, T, L, R, per_token, rpn, bytes_per_token)
        res.append((blk, _metrics_from(tok, rank_ns)))
    return res


#: threads that replay pieces side by side (:func:`ordered_map`); numpy releases the GIL in
#: the kernels, so two pieces run on two cores. 1: in the calling thread
REPLAY_THREADS = max(1, min(2, os.cpu_count() or 1))


def ordered_map(fn, items, threads: int | None = None, ahead: int | None = None):
    """``fn(item)`` of every item, yielded in the items' order, computed on ``threads``
    threads (default :data:`REPLAY_THREADS`) with at most ``ahead`` results pending
    (default twice the threads). The results are those of a plain loop: each call is
    independent, only the order of the calls in time differs."""
    threads = REPLAY_THREADS if threads is None else threads
    if threads <= 1:
        for it in items:
            yield fn(it)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    ahead = ahead or 2 * threads
    pending: deque = deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="moetrace-replay") as pool:
        try:
            for it in items:
                pending.append(pool.submit(fn, it))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def _metrics_from(tok, rank_ns) -> LayerMetrics:
    """:func:`_layer_metrics`'s results from a block's tokens and rank times (the maxima
    read at the argmax: the same element, one pass less)."""
    load_strag = np.argmax(tok, axis=2)
    mx = np.take_along_axis(tok, load_strag[..., None], axis=2)[..., 0]     # = tok.max(axis=2)
    mean = tok.mean(axis=2)
    imb = imbalance(tok, mx=mx, mean=mean)
    undefined = np.isnan(imb)
    strag = np.argmax(rank_ns, axis=2)
    layer_ns = np.take_along_axis(rank_ns, strag[..., None], axis=2)[..., 0]
    strag[undefined] = -1
    load_strag[undefined] = -1
    return LayerMetrics(mx, mean, imb, strag, layer_ns, None, None, rank_ns, load_strag, rank_ns.mean(axis=2))


# ----------------------------------------------------------------------------- metrics
@dataclass
class LayerMetrics:
    """Per (step, layer) results, [t, L] each; rank times [t, L, R]. A (step, layer) that
    routed no tokens has no imbalance: NaN there, straggler -1 (as NULL in ``layer_skew``)."""
    max_tokens: np.ndarray
    mean_tokens: np.ndarray
    imbalance: np.ndarray
    straggler: np.ndarray
    layer_ns: np.ndarray
    dispatch_ns: np.ndarray
    compute_ns: np.ndarray
    rank_ns: np.ndarray
    #: the rank holding the most tokens (the load straggler, no time model), -1 where no
    #: tokens were routed; ``straggler`` is the slowest rank under the cost model
    load_straggler: np.ndarray | None = None
    #: ``rank_ns.mean(axis=2)`` when the kernel computed it (on its thread: :func:`replay_pair`)
    rank_ns_mean: np.ndarray | None = None
    # dispatch_ns / compute_ns are None when the all-to-all was timed in one pass from the
    # received tokens (:func:`layer_metrics`); :func:`rank_parts` gives them


def layer_metrics(block: Block, cost: CostModel) -> LayerMetrics:
    """Per (step, layer) results of a replayed block, a few steps at a time (same answer).
    With estimated bytes and a GPU cost model the all-to-all is timed from the received
    tokens in one pass (:meth:`CostModel.comm_received_ns`) and ``dispatch_ns`` /
    ``compute_ns`` are not kept (None: :func:`rank_parts` gives them when asked)."""
    tok = block.tokens
    T, L, R = tok.shape
    rec = block.received if block.per_token is not None and cost.fused_comm else None
    parts = _sub_blocks(T, L * R)

    def one(a, b):
        return _layer_metrics(tok[a:b], block.touched[a:b], block.bytes_intra[a:b], block.bytes_inter[a:b], cost,
                              None if rec is None else rec[a:b], block.per_token)

    if len(parts) == 1:
        return one(0, T)
    out = None
    keys = ("max_tokens", "mean_tokens", "imbalance", "straggler", "layer_ns", "dispatch_ns", "compute_ns",
            "rank_ns", "load_straggler")
    for a, b in parts:
        m = one(a, b)
        if out is None:
            out = LayerMetrics(*(None if getattr(m, k) is None else np.empty((T,) + getattr(m, k).shape[1:],
                                                                             getattr(m, k).dtype) for k in keys))
        for k in keys:
            if getattr(m, k) is not None:
                getattr(out, k)[a:b] = getattr(m, k)
    return out


def rank_parts(block: Block, cost: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dispatch, compute, combine) ns per rank [t, L, R] of a block (the trace's lanes)."""
    return cost.rank_ns(block.tokens, block.touched, block.bytes_intra, block.bytes_inter)


def _layer_metrics(tok, touched, intra, inter, cost: CostModel, received=None, per_token=None) -> LayerMetrics:
    mx = tok.max(axis=2)
    mean = tok.mean(axis=2)
    imb = imbalance(tok, mx=mx, mean=mean)
    if received is not None:
        rank_ns = cost.compute_ns(tok, touched)
        rank_ns += cost.comm_received_ns(received, per_token)
        disp = comp = None
    else:
        disp, comp, comb = cost.rank_ns(tok, touched, intra, inter)
        rank_ns = disp + comp
        rank_ns += comb
    undefined = np.isnan(imb)
    strag = np.argmax(rank_ns, axis=2)
    layer_ns = np.take_along_axis(rank_ns, strag[..., None], axis=2)[..., 0]     # = rank_ns.max(axis=2)
    strag[undefined] = -1
    load_strag = np.argmax(tok, axis=2)
    load_strag[undefined] = -1
    return LayerMetrics(mx, mean, imb, strag, layer_ns, disp, comp, rank_ns, load_strag)


def summarize(imbalance: np.ndarray, layer_ns: np.ndarray, rank_ns_mean: np.ndarray | None = None) -> Summary:
    """The :class:`Summary` of [steps, L] arrays (one block of
    :class:`.accumulate.SummaryAccumulator`, which a streamed replay feeds block by block)."""
    acc = SummaryAccumulator()
    imb = np.asarray(imbalance, np.float64)
    lns = np.asarray(layer_ns)
    acc.add(imb.reshape(lns.shape) if lns.ndim == 2 and imb.size == lns.size else imb, lns, rank_ns_mean)
    return acc.summary()


def approximation_notes(block: Block, split: str, used_slots: bool, has_routing: bool,
                        top_k_known: bool = True) -> list[str]:
    notes = []
    if used_slots:
        notes.append("per-rank tokens from the recorded per-slot counts (exact)")
    if not top_k_known and not block.exact_bytes:
        notes.append("top_k unknown (ingest with --top-k): tokens per step unknown, so no all-to-all bytes or time "
                     "are predicted (expert compute only)")
    elif not block.exact_bytes:
        notes.append("no per-token routing: dispatch bytes estimated (a token reaches a rank with probability "
                     "1 - prod over the rank's copies of (1 - copy load / tokens per step), source ranks uniform)")
    if split == "local" and not has_routing:
        notes.append("--split local needs per-token source ranks: even split used")
    if split == "hash" and not has_routing and not used_slots:
        notes.append("--split hash without per-token data: integer split (floor, remainder to the first copies)")
    return notes
