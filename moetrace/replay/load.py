"""A run's shape and its recorded expert load, read from the store for the replay: the
``run_shape`` view (the one the metrics use), dense per-step loads, routing blocks. Ranks
come from ``runs.num_ranks`` or the recorded placement, never guessed; values the run does
not record are unknown (``None``) and every answer that needs them says what it assumed."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from ..domain.model_shape import (
    DEFAULT_DTYPE_BYTES,
    DEFAULT_HIDDEN,
    DEFAULT_MOE_INTERMEDIATE,
    default_expert_bytes,
)
from ..domain.shape import Shape
from ..errors import InputError
from ..placement.planners import Plan
from .engine import Block
from .token_replay import replay_routing


# ----------------------------------------------------------------------------- shape
def read_shape(store, run_id: str) -> Shape:
    """The run's :class:`~moetrace.domain.shape.Shape` for a replay: the ``run_shape`` view,
    the steps and layers of the recorded load, and the values a replay cannot do without
    filled in where the run is silent (ranks per node from the recorded placement's nodes,
    else all ranks on one node; hidden size, bytes per element and per expert from
    :mod:`moetrace.domain.model_shape`), each assumption a line of ``shape.notes``."""
    run = store.run_row(run_id)
    notes = []
    # DuckDB's rows and Arrow columns, not polars frames (a command's start-up)
    sh = store.rows("SELECT * FROM run_shape WHERE run_id = ?", [run_id]).dicts()
    # step_layers / expert_load_long: the dense rows' steps and layers without unnesting them
    st = store.rows("""SELECT (SELECT min(step) FROM step_layers WHERE run_id = ?) lo,
                              (SELECT count(slot) FROM expert_load_long WHERE run_id = ?) ns""",
                    [run_id, run_id]).dicts()[0]
    if not sh or st["lo"] is None:
        raise InputError(None, f"run {run_id!r} has no expert_load rows to replay")
    sh = sh[0]
    steps = store.numpy("SELECT DISTINCT step FROM step_layers WHERE run_id = ? ORDER BY step",
                        [run_id])["step"]
    layers = store.numpy("SELECT DISTINCT layer FROM step_layers WHERE run_id = ? ORDER BY layer",
                         [run_id])["layer"]
    E, R, S = int(sh["num_experts"]), sh["num_ranks"], int(sh["num_slots"])
    if sh["experts_from"] != "runs":
        notes.append(f"runs.num_experts unknown: {E} ({sh['experts_from']})")
    rpn = run.get("ranks_per_node")
    if R is None:
        notes.append("expert-parallel rank count unknown (ingest with --ranks): give --ranks to plan or replay")
    elif not rpn:
        nodes = None
        if store.has_files("placement"):
            nodes = store.rows("SELECT max(node) + 1 AS n FROM placement WHERE run_id = ? AND plan_id = 'recorded'",
                               [run_id]).rows[0][0]
        if nodes and R % int(nodes) == 0:
            rpn = R // int(nodes)
            notes.append(f"runs.ranks_per_node unknown: {rpn} from the recorded placement ({R} ranks on "
                         f"{int(nodes)} nodes)")
        else:
            notes.append("ranks per node unknown (ingest with --ranks-per-node): all ranks taken as one node "
                         "(all-to-all and expert moves over NVLink only)")
    G = run.get("num_groups")
    k = sh["top_k"]
    hidden = run.get("hidden")
    if not hidden:
        hidden = DEFAULT_HIDDEN
        notes.append(f"runs.hidden unknown: {DEFAULT_HIDDEN} assumed for dispatch bytes")
    db = run.get("dtype_bytes")
    if not db:
        db = DEFAULT_DTYPE_BYTES
        notes.append(f"runs.dtype_bytes unknown: {DEFAULT_DTYPE_BYTES} bytes per element assumed for dispatch bytes")
    eb = run.get("expert_bytes") or default_expert_bytes(hidden)
    if not run.get("expert_bytes"):
        notes.append(f"runs.expert_bytes unknown: 3 x hidden x {DEFAULT_MOE_INTERMEDIATE} = {eb} bytes per expert assumed")
    has_routing = store.has_files("routing") and store.rows(
        "SELECT count(*) n FROM (SELECT 1 FROM routing WHERE run_id = ? LIMIT 1)", [run_id]).rows[0][0] > 0
    approx = json.loads(run.get("approximations") or "[]")
    aggregate = any("pseudo-step" in a for a in approx)
    passes = None
    if aggregate:
        try:
            passes = json.loads(run.get("meta_json") or "{}").get("num_passes")
        except ValueError:
            passes = None
    return Shape(num_experts=E, experts_from=sh["experts_from"], num_ranks=int(R) if R else None,
                 ranks_from=sh["ranks_from"], num_slots=S, top_k=int(k) if k else None,
                 num_layers=sh.get("num_layers", run.get("num_layers")), ranks_per_node=int(rpn) if rpn else None,
                 num_groups=int(G) if G else None, hidden=int(hidden), dtype_bytes=int(db), expert_bytes=int(eb),
                 layers=layers.astype(np.int64), steps=steps.astype(np.int64), has_slot=bool(st["ns"]),
                 has_routing=bool(has_routing), aggregate=aggregate, passes=int(passes) if passes else None,
                 notes=notes)


# ----------------------------------------------------------------------------- reading
#: steps x layers x experts of one piece the replay kernels take at a time (2 MiB of float64):
#: the kernels' temporaries then stay in cache instead of page-faulting fresh arrays of the
#: whole chunk (3-4x slower at fleet shape, measured: benchmarks/results/scale_log.md)
PIECE_ELEMENTS = 1 << 18


def piece_steps(shape: Shape, elements: int = PIECE_ELEMENTS) -> int:
    """Steps per piece for ``shape``: ``elements`` / (layers x max(experts, ranks)), at least 1."""
    width = max(shape.num_experts, shape.num_ranks or 0, shape.num_slots)
    return max(1, elements // max(1, shape.layers.size * width))


def _reads(store, run_id: str, shape: Shape, chunk_steps: int, with_slots: bool, ahead: bool):
    """:func:`_read_chunk` of every ``chunk_steps`` steps in order; with ``ahead`` the next
    chunk is read on a thread while the caller works on this one (Parquet decoding
    releases the GIL): two chunks in memory instead of one."""
    steps = shape.steps
    spans = [steps[i:i + chunk_steps] for i in range(0, steps.size, chunk_steps)]
    if not ahead or len(spans) < 2:
        for ids in spans:
            yield _read_chunk(store, run_id, shape, ids, with_slots)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="moetrace-read") as pool:
        fut = pool.submit(_read_chunk, store, run_id, shape, spans[0], with_slots)
        for nxt in spans[1:] + [None]:
            got = fut.result()
            fut = None if nxt is None else pool.submit(_read_chunk, store, run_id, shape, nxt, with_slots)
            yield got
            del got         # this chunk is done with before the one after next is read


def _group_pieces(store, run_id: str, shape: Shape, groups, spans, ahead: bool):
    """The pieces ``spans`` (step id arrays, in order) cut from the run's row groups read one
    at a time (the next one on a thread with ``ahead``): no read decodes a group twice or
    holds more than the groups a piece spans. A piece the groups do not give exactly (steps
    or layers missing, other experts) is read by :func:`_read_chunk`, as before."""
    from ..storage.dense import read_counts, read_grid_group, run_files

    L, E = shape.layers.size, shape.num_experts
    path = run_files(store, "expert_counts", run_id)[0]
    pf = []                                                  # the file, opened by the first read

    def read(g):
        if not pf:
            import pyarrow.parquet as pq

            pf.append(pq.ParquetFile(path))
        got = read_grid_group(pf[0], g, shape.layers, E)
        if got is not None:
            return got
        lo, hi = groups[g]
        got, got_layers, counts = read_counts(store, run_id, (lo, hi + 1))
        if np.array_equal(got_layers, shape.layers) and counts.ndim == 3 and counts.shape[1:] == (L, E):
            return got, counts
        return got[:0], np.zeros((0, L, E), np.int64)       # not a whole grid: its pieces are read as before

    starts = np.array([lo for lo, _ in groups])
    held: list[tuple[np.ndarray, np.ndarray]] = []          # groups read, in order
    # the first group that may hold the first piece's first step
    nxt = max(0, int(np.searchsorted(starts, spans[0][0], side="right")) - 1) if spans else 0
    pool = fut = None
    if ahead:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix="moetrace-read")
    try:
        for ids in spans:
            a, b = int(ids[0]), int(ids[-1])
            held = [h for h in held if h[0].size and h[0][-1] >= a]
            while nxt < len(groups) and groups[nxt][0] <= b:
                got = fut.result() if fut is not None else read(nxt)
                fut = None
                held.append(got)
                nxt += 1
                if pool is not None and nxt < len(groups):
                    fut = pool.submit(read, nxt)
            parts = []
            for s, c in held:
                i, j = np.searchsorted(s, a), np.searchsorted(s, b, side="right")
                if j > i:
                    parts.append((s[i:j], c[i:j]))
            got_ids = np.concatenate([p[0] for p in parts]) if parts else ids[:0]
            if not np.array_equal(got_ids, ids):
                _, load, _ = _read_chunk(store, run_id, shape, ids, False)
                yield ids, np.asarray(load, np.float64), None
                continue
            if len(parts) == 1:
                yield ids, np.asarray(parts[0][1], np.float64), None
            else:
                out = np.empty((ids.size, L, E))
                k = 0
                for _, c in parts:
                    out[k:k + c.shape[0]] = c
                    k += c.shape[0]
                yield ids, out, None
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def iter_load(store, run_id: str, shape: Shape, chunk_steps: int = 2000,
              with_slots: bool = False, piece: int | None = None, read_ahead: bool = False
              ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Yield (step ids [t], load [t, L, E] float64, slot_load [t, L, S] or None): the store is
    read ``chunk_steps`` steps at a time, each read yielded in pieces of ``piece`` steps
    (default :func:`piece_steps`, the whole read for runs with per-token routing; 0: the whole
    read). Memory: one read of int64 counts plus one piece, whatever the run's length (two
    reads with ``read_ahead``: the next one is read on a thread meanwhile).

    A run stored as one dense file (:func:`moetrace.storage.dense.grid_groups`) is read row group by row group
    instead, and the same pieces (the same steps, the same counts) are cut from the groups:
    a chunk of 500 steps over row groups of 200 decoded 3 or 4 groups, one of them again by
    the next chunk, into a fresh array of the whole chunk (measured: 2.4x the CPU of reading
    each group once, benchmarks/results/scale_log.md)."""
    if piece is None:   # runs with per-token routing replay each read with one routing query: whole
        piece = 0 if shape.has_routing else piece_steps(shape)
    if piece and not with_slots and not shape.has_routing and shape.steps.size:
        from ..storage.dense import grid_groups

        groups = grid_groups(store, run_id)
        if groups is not None:
            steps = shape.steps
            spans = [steps[a:min(i + chunk_steps, steps.size, a + piece)]
                     for i in range(0, steps.size, chunk_steps)
                     for a in range(i, min(i + chunk_steps, steps.size), piece)]
            yield from _group_pieces(store, run_id, shape, groups, spans, read_ahead)
            return
    for ids, load, slot_load in _reads(store, run_id, shape, chunk_steps, with_slots, read_ahead):
        n = ids.size
        step = piece or n
        for a in range(0, n, step):
            b = min(n, a + step)
            yield (ids[a:b], np.asarray(load[a:b], np.float64), None if slot_load is None else slot_load[a:b])
        del load, slot_load     # (with read_ahead: two chunks in memory, not three)


def _read_chunk(store, run_id: str, shape: Shape, ids: np.ndarray, with_slots: bool):
    """(ids, counts [t, L, E] (int64 or float64), slot_load or None) of steps ``ids``."""
    layers, E, S = shape.layers, shape.num_experts, shape.num_slots
    want_slots = with_slots and shape.has_slot
    cols = "step, layer, expert, tokens" + (", slot" if want_slots else "")
    if not want_slots:      # counts per logical expert: the dense reader (no SQL for dense runs)
        from ..storage.dense import read_counts

        got, got_layers, counts = read_counts(store, run_id, ids)
        if counts.shape[2] > E:
            raise InputError(None, f"run {run_id!r}: expert_load holds expert {counts.shape[2] - 1} but the run "
                                   f"has {E} experts")
        if np.array_equal(got, ids) and np.array_equal(got_layers, layers) and counts.shape[2] == E:
            load = counts           # the whole grid: converted to float64 piece by piece
        else:
            load = np.zeros((ids.size, layers.size, E))
            load[np.ix_(np.searchsorted(ids, got), np.searchsorted(layers, got_layers),
                        np.arange(counts.shape[2]))] = counts
        return ids, load, None
    tbl = store.arrow(f"SELECT {cols} FROM expert_load WHERE run_id = ? AND step BETWEEN ? AND ?",
                      [run_id, int(ids[0]), int(ids[-1])])
    ti = np.searchsorted(ids, tbl.column("step").to_numpy())
    keep = (ti < ids.size) & (ids[np.minimum(ti, ids.size - 1)] == tbl.column("step").to_numpy())
    li = np.searchsorted(layers, tbl.column("layer").to_numpy())
    cell = (ti * layers.size + li)[keep]
    tok = tbl.column("tokens").to_numpy().astype(np.float64)[keep]
    n = ids.size * layers.size
    ex = tbl.column("expert").to_numpy()[keep]
    if ex.size and (ex.min() < 0 or ex.max() >= E):
        raise InputError(None, f"run {run_id!r}: expert_load holds expert {int(ex.max())} but the run has {E} experts")
    # bincount sums rows that repeat a (step, layer, expert): per slot, per source rank
    load = np.bincount(cell * E + ex, weights=tok, minlength=n * E).reshape(ids.size, layers.size, E)
    slot_load = None
    if want_slots:
        sl = tbl.column("slot").to_numpy(zero_copy_only=False).astype(np.float64)[keep]
        ok = ~np.isnan(sl)
        if ok.any() and (sl[ok].min() < 0 or sl[ok].max() >= S):
            raise InputError(None, f"run {run_id!r}: expert_load holds slot {int(sl[ok].max())} but the run has {S} slots")
        slot_load = np.bincount(cell[ok] * S + sl[ok].astype(np.int64), weights=tok[ok],
                                minlength=n * S).reshape(ids.size, layers.size, S)
    return ids, load, slot_load


def read_load(store, run_id: str, shape: Shape, step_range: tuple[int, int] | None = None,
              max_steps: int | None = None, with_slots: bool = False):
    """(step ids, load [T, L, E], slot_load or None) for all steps (or lo <= step < hi; at most max_steps)."""
    steps = shape.steps
    if step_range:
        steps = steps[(steps >= step_range[0]) & (steps < step_range[1])]
    if max_steps is not None:
        steps = steps[:max_steps]
    if steps.size == 0:
        return steps, np.zeros((0, shape.layers.size, shape.num_experts)), None
    parts = list(iter_load(store, run_id, replace(shape, steps=steps), with_slots=with_slots, piece=0))
    sl = None if parts[0][2] is None else np.concatenate([p[2] for p in parts])
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), sl


def read_load_total(store, run_id: str, shape: Shape, step_range: tuple[int, int] | None = None,
                    chunk_steps: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """(step ids, load summed over those steps [L, E] float64): what a planner is fitted on,
    without holding the steps' loads (a 1,000-step window of the fleet shape is 119 MB in
    float64). The counts are integers, summed exactly (int64, or float64 below 2^53), so the
    total equals ``read_load(...)[1].sum(axis=0)``."""
    steps = shape.steps
    if step_range:
        steps = steps[(steps >= step_range[0]) & (steps < step_range[1])]
    total = np.zeros((shape.layers.size, shape.num_experts))
    got = []
    # pieces of a dense file's row groups (integer counts: the sums are exact in any order)
    for ids, load, _ in iter_load(store, run_id, replace(shape, steps=steps), chunk_steps,
                                  piece=piece_steps(shape), read_ahead=True):
        total += load.sum(axis=0)
        got.append(ids)
    return (np.concatenate(got) if got else steps), total


def routing_has_slots(store, run_id) -> bool:
    """True when every per-token routing row records its physical slot."""
    r = store.sql("SELECT count(*) AS n, count(slot) AS s FROM routing WHERE run_id = ?", [run_id]).row(0)
    return r[0] > 0 and r[0] == r[1]


def routing_block(store, run_id, shape: Shape, plan: Plan, split: str, ids: np.ndarray,
                  use_recorded_slot: bool = False) -> Block:
    """Exact replay of the run's per-token routing rows of steps ``ids`` against ``plan``."""
    tbl = store.arrow("""SELECT step, layer, token, src_rank, expert, slot FROM routing
                         WHERE run_id = ? AND step BETWEEN ? AND ?""", [run_id, int(ids[0]), int(ids[-1])])
    steps = tbl.column("step").to_numpy()
    ti = np.searchsorted(ids, steps)
    keep = (ti < ids.size) & (ids[np.minimum(ti, ids.size - 1)] == steps)
    li = np.searchsorted(plan.layers, tbl.column("layer").to_numpy())
    src = tbl.column("src_rank").to_numpy(zero_copy_only=False).astype(np.float64)
    tok = tbl.column("token").to_numpy()
    src = np.where(np.isnan(src), tok % plan.num_ranks, src).astype(np.int64)
    rs = tbl.column("slot").to_numpy(zero_copy_only=False)[keep] if use_recorded_slot else None
    return replay_routing(ti[keep], li[keep], tok[keep], src[keep], tbl.column("expert").to_numpy()[keep], ids.size,
                          plan, split, shape.bytes_per_token, recorded_slot=rs)
