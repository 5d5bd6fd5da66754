"""Shared by the profiler collectors (Kineto, Nsight): from per-rank device intervals,
kernel launches and CPU-side ranges to the canonical ``spans``, ``kernel_names`` and
``steps`` tables.

A collector hands one :class:`RankEvents` per rank (polars frames in ns) and this module
does the rest, the same way for every profiler:

* links each kernel to its launch (correlation id) and so to the CPU ranges around the
  launch: ``ProfilerStep#N`` (step), a collective op such as ``nccl:all_to_all`` (which
  collective a SendRecv kernel belongs to), a ``dispatch``/``combine`` annotation (the
  direction of a plain all-to-all), a layer annotation (``layer 3``, ``layers.3``) and a
  micro-batch annotation (``micro_batch 1``, DualPipe's ``(F)``/``(B)``/``(W)`` suffix) and
  the ``record_param_comms`` op naming a collective's process group (when the kernel's own
  args do not);
* classifies each kernel with the one classifier (:mod:`moetrace.domain.kernels`);
* fills in what no annotation gave, and says so (``spans.inferred``): the layer from the
  order of dispatches within (rank, step, micro-batch); the direction of an all-to-all
  from its order (dispatch, combine, dispatch, ...);
* on a trace with no device activity at all (a CPU-only run, e.g. gloo all-to-all),
  turns the host collective ops into spans on device -1 (``host``) and the top-level CPU
  ops into compute spans there, and says so in ``runs.approximations``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..domain.kernels import (
    COLLECTIVE_OP_RE,
    Classifier,
    demangle_all,
    normalize_collective,
    normalize_name,
)
from . import _launch_context as lctx
from . import source_label
from ._polars import Dtypes, pl

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
#: backend-level collective ops (innermost CPU op of a collective call)
COLL_OP_RE = COLLECTIVE_OP_RE
PHASE_RE = re.compile(r"(?i)(?:^|[^a-z])(dispatch|combine)(?:[^a-z]|$)")
LAYER_RE = re.compile(r"(?i)(?:^|[^a-z])(?:layers?|moe_layer|decoder_layer|block)[._\s#:\-\[]*(\d+)")
MB_RE = re.compile(r"(?i)(?:^|[^a-z])(?:micro_?batch|ubatch|mb|chunk)[._\s#:\-\[]*(\d+)")
DUALPIPE_RE = re.compile(r"\(([FBW])\)\s*$")
DUALPIPE_MB = {"F": 0, "B": 1, "W": 2}

GPU_SCHEMA = Dtypes(name="Utf8", cat="Utf8", device="Int32", stream="Int32", start_ns="Int64",
                    end_ns="Int64", correlation="Int64", coll_arg="Utf8")
LAUNCH_SCHEMA = Dtypes(correlation="Int64", pid="Int64", tid="Int64", ts_ns="Int64")
CPU_SCHEMA = Dtypes(name="Utf8", cat="Utf8", pid="Int64", tid="Int64", start_ns="Int64",
                    end_ns="Int64")


@dataclass
class RankEvents:
    rank: int
    gpu: pl.DataFrame          # GPU_SCHEMA: kernels, memcpy, memset
    launch: pl.DataFrame       # LAUNCH_SCHEMA: CPU launch of each correlation id
    cpu: pl.DataFrame          # CPU_SCHEMA: annotations and collective / top-level CPU ops
    source: str = ""
    rank_inferred: bool = False
    notes: list[str] = field(default_factory=list)
    part: dict | None = None   # rank_part() computed by the collector already (e.g. in a parsing process)


def frame(rows: dict, schema: dict) -> pl.DataFrame:
    return pl.DataFrame({k: rows.get(k, []) for k in schema}, schema=schema)


def _families(cpu: pl.DataFrame) -> dict[str, pl.DataFrame]:
    """Split CPU ranges into the families used for labels (each keyed by process)."""
    if cpu.height == 0:
        empty = cpu.with_columns(pl.lit(None, pl.Int64).alias("val"))
        return {k: empty for k in ("step", "coll", "phase", "layer", "mb")}
    names = cpu["name"].unique().to_list()
    step_v, coll_v, phase_v, layer_v, mb_v = {}, {}, {}, {}, {}
    for n in names:
        m = STEP_RE.match(n)
        if m:
            step_v[n] = int(m.group(1))
            continue
        if COLL_OP_RE.match(n):
            coll_v[n] = 1
            continue
        m = PHASE_RE.search(n)
        if m:
            phase_v[n] = 0 if m.group(1).lower() == "dispatch" else 1
        m = LAYER_RE.search(n)
        if m:
            layer_v[n] = int(m.group(1))
        m = MB_RE.search(n)
        if m:
            mb_v[n] = int(m.group(1))
        else:
            m = DUALPIPE_RE.search(n)
            if m:
                mb_v[n] = DUALPIPE_MB[m.group(1)]

    def fam(d: dict) -> pl.DataFrame:
        if not d:
            return cpu.clear().with_columns(pl.lit(None, pl.Int64).alias("val"))
        m = pl.DataFrame({"name": list(d), "val": list(d.values())}, schema={"name": pl.Utf8, "val": pl.Int64})
        return cpu.join(m, on="name", how="inner").sort("start_ns")

    return {"step": fam(step_v), "coll": fam(coll_v), "phase": fam(phase_v), "layer": fam(layer_v), "mb": fam(mb_v)}


def _enclosing(points: pl.DataFrame, ivals: pl.DataFrame, by: list[str], out: str, take: str = "val") -> pl.DataFrame:
    """For each point (column ``t``) the value of the latest-starting interval of the same
    ``by`` key that contains it (null when none)."""
    if ivals.height == 0:
        return points.with_columns(pl.lit(None, ivals.schema.get(take, pl.Int64)).alias(out))
    right = ivals.select([*by, pl.col("start_ns").alias("t"), pl.col("end_ns").alias("_end"),
                          pl.col(take).alias(out)]).sort("t")
    j = points.sort("t").join_asof(right, on="t", by=by, strategy="backward", check_sortedness=False)
    return j.with_columns(pl.when(pl.col("t") <= pl.col("_end")).then(pl.col(out)).otherwise(None).alias(out)
                          ).drop("_end")


def _host_events(ev: RankEvents) -> pl.DataFrame:
    """CPU-only trace: collective ops and top-level CPU ops as host spans (device -1)."""
    cpu = ev.cpu.filter(pl.col("end_ns") >= pl.col("start_ns"))
    ops = cpu.filter(pl.col("cat").str.to_lowercase().is_in(["cpu_op", "operator"]))
    # top level per thread: starts after every earlier op of the thread has ended
    ops = ops.sort(["pid", "tid", "start_ns", pl.col("end_ns")], descending=[False, False, False, True])
    ops = ops.with_columns(pl.col("end_ns").cum_max().shift(1).over(["pid", "tid"]).alias("_prev_end"))
    top = ops.filter(pl.col("_prev_end").is_null() | (pl.col("start_ns") >= pl.col("_prev_end")))
    top = top.filter(~pl.col("name").str.contains(r"(?i)^(?:record_param_comms|ProfilerStep)")
                     & ~pl.col("name").str.contains("(?i)" + COLL_OP_RE.pattern))
    coll = cpu.filter(pl.col("name").str.contains("(?i)" + COLL_OP_RE.pattern))
    # innermost backend op of each collective call: prefer gloo:/nccl:/mpi: over c10d::
    backend = coll.filter(~pl.col("name").str.to_lowercase().str.starts_with("c10d"))
    coll = backend if backend.height else coll
    out = pl.concat([
        coll.with_columns(pl.col("name").alias("coll_arg")),
        top.drop("_prev_end").with_columns(pl.lit(None, pl.Utf8).alias("coll_arg")),
    ])
    for col, dtype in (("pg_arg", pl.Utf8), ("gemm_n", pl.Int64)):
        if col not in out.columns:
            out = out.with_columns(pl.lit(None, dtype).alias(col))
    return out.select(
        "name", pl.lit("host_op").alias("cat"), pl.lit(-1, pl.Int32).alias("device"),
        pl.col("tid").cast(pl.Int32, strict=False).fill_null(-1).alias("stream"), "start_ns", "end_ns",
        pl.lit(None, pl.Int64).alias("correlation"), "coll_arg", "pg_arg", "gemm_n",
        pl.col("pid").alias("pid"), pl.col("tid").alias("tid"), pl.col("start_ns").alias("t"))


#: mangled -> demangled kernel names met so far in this process (one c++filt call per new batch)
_DEMANGLED: dict[str, str] = {}


def rank_part(ev: RankEvents, classifier: Classifier, host_mode: bool = False) -> dict:
    """The per-rank share of :func:`build` (the rank's spans, labeled and classified, and
    its steps), independent of the rank number; a collector may compute it in a parsing
    process (``RankEvents.part``) for :func:`build` to take as is."""
    all_cpu = ev.cpu
    if all_cpu.height and (all_cpu["cat"] == lctx.CONTEXT_CAT).any():   # (ops kept only as launch context)
        ev = RankEvents(rank=ev.rank, gpu=ev.gpu, launch=ev.launch, cpu=all_cpu.filter(pl.col("cat") != lctx.CONTEXT_CAT),
                        source=ev.source, rank_inferred=ev.rank_inferred, notes=ev.notes)
    fams = _families(ev.cpu)
    no_launch = 0
    if host_mode:
        pts = _host_events(ev).with_columns(pl.lit(True).alias("_launched"))
    else:
        g = ev.gpu.filter(pl.col("end_ns") >= pl.col("start_ns"))
        pts = g.join(ev.launch.unique("correlation", keep="first"), on="correlation", how="left")
        main_pid = None
        if fams["step"].height:
            main_pid = int(fams["step"]["pid"][0])
        elif ev.cpu.height:
            main_pid = int(ev.cpu["pid"].mode()[0])
        pts = pts.with_columns(pl.col("ts_ns").is_not_null().alias("_launched"))
        no_launch = int((~pts["_launched"]).sum())
        pts = pts.with_columns(
            pl.col("pid").fill_null(main_pid if main_pid is not None else -1),
            pl.col("tid").fill_null(-1),
            pl.coalesce("ts_ns", "start_ns").alias("t")).drop("ts_ns")
    if "pg_arg" not in pts.columns:   # (a collector that reads no process group)
        pts = pts.with_columns(pl.lit(None, pl.Utf8).alias("pg_arg"))
    pts = pts.with_row_index("_i")
    pts = _enclosing(pts, fams["step"], ["pid"], "step")
    coll_names = fams["coll"].with_columns(pl.col("name").alias("cname"))
    pts = _enclosing(pts, coll_names, ["pid", "tid"], "coll_op", take="cname")
    if "pg_arg" in ev.cpu.columns:   # a kernel without group args: the record_param_comms around its launch
        pg_ops = ev.cpu.filter((pl.col("name") == "record_param_comms") & pl.col("pg_arg").is_not_null())
        pts = _enclosing(pts, pg_ops.sort("start_ns"), ["pid", "tid"], "_pg_op", take="pg_arg")
        pts = pts.with_columns(pl.coalesce("pg_arg", "_pg_op").alias("pg_arg")).drop("_pg_op")
    pts = _enclosing(pts, fams["phase"], ["pid"], "phase")
    pts = _enclosing(pts, fams["layer"], ["pid"], "layer_a")
    pts = _enclosing(pts, fams["mb"], ["pid"], "mb")
    pts = pts.sort("_i").with_columns(pl.coalesce("coll_arg", "coll_op").alias("coll"))
    # the CPU ranges each kernel was launched under (none without a launch record)
    ranges = lctx.context_ranges(all_cpu, classifier.context_patterns)
    launch_pts = pts.select(pl.when(pl.col("_launched")).then(pl.col("pid")).alias("pid"),
                            pl.when(pl.col("_launched")).then(pl.col("tid")).alias("tid"), "t")
    ctx_ids, chains = lctx.launch_context(launch_pts, ranges)
    moe_names = lctx.moe_context_names(chains)
    pts = pts.with_columns(ctx_ids.alias("_ctx"),
                           ctx_ids.map_elements(lambda c: moe_names[c], return_dtype=pl.Utf8, skip_nulls=True)
                           .alias("moe_context") if chains else pl.lit(None, pl.Utf8).alias("moe_context"))
    if classifier.num_experts is not None:
        pts = _gemm_width(pts, all_cpu)
    # classify each distinct (name, category, collective, context[, stream][, GEMM width]) once
    key_cols = (["name", "cat", "coll", "_ctx"] + (["stream"] if classifier.uses_stream else [])
                + (["gemm_n"] if classifier.num_experts is not None else []))
    keys = pts.select(key_cols).unique()
    dem = _DEMANGLED
    todo = [n for n in keys["name"].to_list() if n.startswith("_Z") and n not in dem]
    if todo:
        dem.update({n: n for n in todo})
        dem.update(demangle_all(todo))
    si = key_cols.index("stream") if "stream" in key_cols else None
    ni = key_cols.index("gemm_n") if "gemm_n" in key_cols else None
    how = [classifier.classify_how(dem.get(r[0], r[0]), r[2], r[1], chains[r[3]] if r[3] is not None else (),
                                   None if si is None else r[si], None if ni is None else r[ni])
           for r in keys.iter_rows()]
    norm = [normalize_name(dem.get(n, n)) for n in keys["name"].to_list()]
    keys = keys.with_columns(pl.Series("kind", [h[0] for h in how], pl.Utf8),
                             pl.Series("classified_by", [h[1] for h in how], pl.Utf8),
                             pl.Series("norm", norm, pl.Utf8),
                             pl.col("coll").map_elements(normalize_collective, return_dtype=pl.Utf8)
                             .alias("collective"))
    pts = pts.join(keys, on=key_cols, how="left", nulls_equal=True).drop("_ctx", "_launched")
    if "gemm_n" in pts.columns:
        pts = pts.drop("gemm_n")
    has_steps = fams["step"].height > 0
    if not has_steps:
        pts = pts.with_columns(pl.lit(0, pl.Int64).alias("step"))
    pts = _resolve_a2a(pts)
    pts = pts.with_columns((pl.col("_inf") | pl.lit(not has_steps)).alias("inferred"))
    steps, host_steps, clipped = step_windows(fams["step"], pts, host_mode) if has_steps else ([], [], 0)
    if not has_steps and pts.height:
        steps.append((0, int(pts["start_ns"].min()), int(pts["end_ns"].max()), True))
    return {"pts": pts, "has_steps": has_steps, "steps": steps, "host_mode": host_mode, "host_steps": host_steps,
            "clipped_ns": clipped, "no_launch": no_launch}


def _gemm_width(pts: pl.DataFrame, all_cpu: pl.DataFrame) -> pl.DataFrame:
    """Column ``gemm_n``: the output width N of the GEMM-like op each point is (a host op)
    or was launched under (the innermost one on its thread), when the trace recorded
    shapes (column ``gemm_n`` of the CPU ops; :mod:`._gemm_shape`); else null."""
    if "gemm_n" in pts.columns:   # (host ops carry their own)
        return pts
    ops = all_cpu.filter(pl.col("gemm_n").is_not_null()) if "gemm_n" in all_cpu.columns else all_cpu.clear()
    if ops.height == 0:
        return pts.with_columns(pl.lit(None, pl.Int64).alias("gemm_n"))
    return _enclosing(pts, ops.sort("start_ns"), ["pid", "tid"], "gemm_n", take="gemm_n")


def step_windows(step_ranges: pl.DataFrame, pts: pl.DataFrame, host_mode: bool):
    """The steps of one rank from its ``ProfilerStep#N`` CPU ranges and its labeled spans.

    On a GPU trace a step is its GPU activity: from the first to the last kernel (memcpy,
    memset) launched inside ``ProfilerStep#N``. The CPU range is not the step: the GPU
    runs behind the host (often by more than a step), so "CPU start to last kernel end"
    windows overlap and their sum exceeds the trace. A step that launched nothing keeps
    its CPU range. Windows are then made disjoint in step order (a window never starts
    before the previous one ends; the clipped ns are returned), so summed step time never
    exceeds the span of the trace. On a CPU-only trace (``host_mode``) the CPU range is
    the step. Returns (steps [(step, start, end, inferred)], host_steps [(step, start,
    end, gpu_lag_ns)], clipped_ns)."""
    st = step_ranges.group_by("val").agg(pl.col("start_ns").min(), pl.col("end_ns").max()).sort("val")
    gpu = pts.filter(pl.col("device") >= 0) if not host_mode and "device" in pts.columns else pts.clear()
    win = gpu.group_by("step").agg(pl.col("start_ns").min().alias("gs"), pl.col("end_ns").max().alias("ge"))
    st = st.join(win, left_on="val", right_on="step", how="left").sort("val")
    steps, host, clipped, prev_end = [], [], 0, None
    for s_, a, b, gs, ge in st.iter_rows():
        host.append((s_, a, b, None if ge is None else ge - b))
        lo, hi = (a, b) if host_mode or gs is None else (gs, ge)
        if prev_end is not None and lo < prev_end:
            clipped += min(prev_end, hi) - lo
            lo = min(prev_end, hi)
        steps.append((s_, lo, hi, False))
        prev_end = hi
    return steps, host, clipped


def build(ranks: list[RankEvents], classifier: Classifier) -> tuple[dict[str, pl.DataFrame], list[str], dict]:
    """The canonical tables of one run from its ranks. Returns (tables, approximations, meta)."""
    approx: list[str] = []
    meta: dict = {"ranks": {}}
    parts, step_rows, host_rows, clipped = [], [], [], 0
    host_mode = all(r.gpu.height == 0 for r in ranks)
    if host_mode:
        approx.append("no GPU activity in the trace: host collective ops (e.g. gloo all_to_all) are the "
                      "all-to-all spans on device -1 (host), top-level CPU ops are the compute")
    any_step_annot = False
    no_launch: dict[int, int] = {}
    for ev in ranks:
        part = ev.part if ev.part is not None and ev.part["host_mode"] == host_mode else None
        if part is None:
            part = rank_part(ev, classifier, host_mode)
        any_step_annot |= part["has_steps"]
        pts = part["pts"].with_columns(pl.lit(ev.rank, pl.Int32).alias("rank"))
        pts = pts.select([*part["pts"].columns[:-1], "rank", "inferred"])  # (column order as before)
        parts.append(pts)
        step_rows.extend({"step": s_, "rank": ev.rank, "start_ns": a, "end_ns": b, "inferred": inf}
                         for s_, a, b, inf in part["steps"])
        host_rows.extend({"step": s_, "rank": ev.rank, "start_ns": a, "end_ns": b, "gpu_lag_ns": lag}
                         for s_, a, b, lag in part.get("host_steps", ()))
        clipped += part.get("clipped_ns", 0)
        if part.get("no_launch"):
            no_launch[ev.rank] = part["no_launch"]
        meta["ranks"][str(ev.rank)] = {"source": ev.source, "rank_inferred": ev.rank_inferred,
                                       "spans": pts.height}
        if ev.rank_inferred:
            approx.append(f"rank {ev.rank} of {ev.source} taken from the file name or order (no distributedInfo.rank)")
        approx.extend(ev.notes)
    if not any_step_annot and ranks:
        approx.append("no ProfilerStep#N annotations: the whole capture is step 0")
    tables_extra = {}
    if host_rows and not host_mode:
        host = pl.DataFrame(host_rows, schema={"step": pl.Int64, "rank": pl.Int32, "start_ns": pl.Int64,
                                               "end_ns": pl.Int64, "gpu_lag_ns": pl.Int64})
        tables_extra["host_steps"] = host
        lag = host["gpu_lag_ns"].drop_nulls()
        msg = ("steps are GPU windows: first to last kernel launched inside ProfilerStep#N (the CPU ranges are in "
               "host_steps)")
        if lag.len() and lag.max() > 0:
            msg += f"; the GPU ended up to {lag.max() / 1e6:.1f} ms after the CPU range of its step"
        if clipped:
            msg += (f"; {clipped / 1e6:.3f} ms where a step's kernels ran past the next step's first kernel are "
                    "counted in the earlier step only (windows kept disjoint)")
        approx.append(msg)
    if no_launch:
        approx.append(no_launch_note(no_launch, any_step_annot))
    allp = pl.concat(parts, how="diagonal_relaxed") if parts else pl.DataFrame()
    if allp.height == 0:
        names = pl.DataFrame(schema={"name_id": pl.Int32, "name": pl.Utf8, "kind": pl.Utf8, "classified_by": pl.Utf8})
        spans = pl.DataFrame(schema={"rank": pl.Int32})
    else:
        uniq = allp.select("norm").unique().sort("norm").with_row_index("name_id").with_columns(
            pl.col("name_id").cast(pl.Int32))
        allp = allp.join(uniq, on="norm", how="left")
        # a name's kind: the kind most of its spans got (SendRecv may be all-to-all or not)
        names = (allp.group_by(["name_id", "norm", "kind"]).len()
                 .sort(["name_id", "len", "kind"], descending=[False, True, False])
                 .group_by("name_id", maintain_order=True).first()
                 .select("name_id", pl.col("norm").alias("name"), "kind"))
        # how that kind was decided: the way most of the name's spans of that kind got it
        how = (allp.join(names.select("name_id", "kind"), on=["name_id", "kind"], how="inner")
               .group_by(["name_id", "classified_by"]).len()
               .sort(["name_id", "len", "classified_by"], descending=[False, True, False])
               .group_by("name_id", maintain_order=True).first().select("name_id", "classified_by"))
        names = names.join(how, on="name_id", how="left")
        spans = allp.select(
            "rank", pl.col("device").cast(pl.Int32), pl.col("stream").cast(pl.Int32), "kind", "name_id",
            "start_ns", "end_ns", pl.col("step").cast(pl.Int64), pl.col("layer").cast(pl.Int32),
            pl.col("mb").cast(pl.Int32).alias("micro_batch"), "inferred", "correlation", "collective",
            pl.when(pl.col("collective").is_not_null() | pl.col("kind").is_in(["dispatch", "combine", "a2a_other",
                                                                              "comm_other"]))
            .then(pl.col("pg_arg")).otherwise(None).alias("process_group"),
            "classified_by", "moe_context",
        ).sort(["rank", "start_ns", "device", "stream"])
    steps = pl.DataFrame(step_rows, schema={"step": pl.Int64, "rank": pl.Int32, "start_ns": pl.Int64,
                                            "end_ns": pl.Int64, "inferred": pl.Boolean})
    steps = steps.with_columns(pl.lit("unknown").alias("phase"), pl.lit(None, pl.Int64).alias("num_tokens"),
                               pl.lit(False).alias("is_dummy"))
    if spans.height and spans.filter(pl.col("kind").is_in(["dispatch", "combine"])).height:
        if spans.filter(pl.col("kind").is_in(["dispatch", "combine"]) & pl.col("inferred")).height:
            approx.append("all-to-all layer (and, for plain all-to-alls, direction) inferred from the order of "
                          "dispatches within each (rank, step, micro-batch) where no annotation gave it")
    return {"spans": spans, "kernel_names": names, "steps": steps, **tables_extra}, approx, meta


def no_launch_note(per_rank: dict[int, int], has_steps: bool) -> str:
    """The ``runs.approximations`` line for device activity with no launch record."""
    n = sum(per_rank.values())
    where = ", ".join(f"rank {r}: {c}" for r, c in sorted(per_rank.items())[:8]) + (
        ", ..." if len(per_rank) > 8 else "")
    return (f"{n} device event{'s' if n != 1 else ''} ({where}) have no launch record (no runtime call with their "
            f"correlation id): their " + ("step and " if has_steps else "")
            + "annotations were taken at their GPU start time, not at a launch, and they carry no launch context")


def _resolve_a2a(pts: pl.DataFrame) -> pl.DataFrame:
    """Direction of plain all-to-alls, and layers of all-to-all spans, from annotations
    or from order. Adds ``layer`` and ``_inf``; rewrites ``kind`` 'a2a'."""
    pts = pts.with_columns(pl.lit(False).alias("_inf"))
    is_a2a = pl.col("kind").is_in(["a2a", "dispatch", "combine", "a2a_other"])
    a2a = pts.filter(is_a2a)
    rest = pts.filter(~is_a2a).with_columns(pl.col("layer_a").alias("layer"))
    if a2a.height == 0:
        return rest.drop("layer_a")
    a2a = a2a.sort(["step", "mb", "start_ns"], nulls_last=True)
    kinds, layers, infs = [], [], []
    key_prev = object()
    layer = -1
    last_main = None
    toggle = 0
    pending: list[int] = []  # a2a_other rows waiting for the next main span's layer
    rows = a2a.select("step", "mb", "kind", "phase", "layer_a").iter_rows()
    for i, (step, mb, kind, phase, layer_a) in enumerate(rows):
        key = (step, mb)
        if key != key_prev:
            for p in pending:
                layers[p] = max(layer, 0)
            pending = []
            key_prev, layer, last_main, toggle = key, -1, None, 0
        inf = False
        if kind == "a2a":
            if phase is not None:
                kind = "dispatch" if phase == 0 else "combine"
            else:
                kind = "dispatch" if toggle % 2 == 0 else "combine"
                inf = True
            toggle += 1
        if kind == "dispatch":
            if last_main != "dispatch":
                layer += 1
            last_main = "dispatch"
        elif kind == "combine":
            if layer < 0:
                layer = 0
            last_main = "combine"
        kinds.append(kind)
        if layer_a is not None:
            layers.append(layer_a)
        elif kind == "a2a_other":
            layers.append(None)
            pending.append(i)
            inf = True
        else:
            layers.append(layer)
            inf = True
        if kind in ("dispatch", "combine") and layer_a is None:
            for p in pending:
                layers[p] = layer
            pending = []
        infs.append(inf)
    for p in pending:
        layers[p] = max(layer, 0)
    a2a = a2a.with_columns(pl.Series("kind", kinds, pl.Utf8), pl.Series("layer", layers, pl.Int64),
                           pl.Series("_inf", infs, pl.Boolean))
    return pl.concat([rest, a2a.select(rest.columns)], how="vertical_relaxed").drop("layer_a")


def run_data(paths, sha256: str, time_base: str, num_ranks: int, options: dict, approx: list[str], meta: dict,
             tables: dict):
    """The RunData of a profiler run (Kineto or Nsight): the runs row from the files and
    the user's shape options (layers, experts, top-k are not in a profiler trace)."""
    import json

    from . import RunData

    run = {
        "source": source_label(paths),
        "source_sha256": sha256,
        "time_base": time_base,
        "num_ranks": num_ranks,
        "ranks_per_node": options.get("ranks_per_node"),
        "num_layers": options.get("num_layers"),
        "num_experts": options.get("num_experts"),
        "top_k": options.get("top_k"),
        "approximations": json.dumps(approx) if approx else None,
        "meta_json": json.dumps(meta),
    }
    hint = paths[0].parent.name if len(paths) > 1 else paths[0].name.split(".")[0]
    return RunData(run=run, tables=tables, run_id_hint=hint, files=[str(p) for p in paths])
