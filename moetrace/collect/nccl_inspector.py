"""NCCL Inspector JSON lines (NVIDIA/nccl ``plugins/profiler/inspector/``): one file per
process (``<hostname>-pid<pid>.log``), one JSON object per completed collective (or P2P
operation) per communicator; a folder of per-rank files is one run.

Each line: ``header`` {id (the communicator's hash), comm_name, rank (in the
communicator), n_ranks, nnodes}, ``metadata`` {inspector_output_format_version,
dump_timestamp_us, hostname, pid, ...} and ``coll_perf`` {coll, coll_sn,
coll_msg_size_bytes, coll_exec_time_us, coll_timing_source, coll_algobw_gbs,
coll_busbw_gbs, and with ``NCCL_INSPECTOR_DUMP_VERBOSE=1`` ``event_trace_ts`` with the
kernel channels' start / stop times} or ``p2p_perf`` {p2p, p2p_sn, p2p_peer, ...}.

Tables: every record is a ``collectives`` row; every (rank, communicator) a
``comm_groups`` row. In verbose mode each collective instance recorded on every rank of
its communicator is also a span (kind comm_other, a2a_other for All2All; process group =
the communicator), so the waits views (``moetrace waits``) pair the instances across
ranks; coll_sn is counted per communicator and collective function, the same on every
rank, and the spans kept are exactly those whose order per (rank, communicator,
collective) is their coll_sn order, so the views' order matching is matching by
(communicator, collective, coll_sn). Field meanings and assumptions: docs/engines.md.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated

import msgspec

from ..domain.kernels import normalize_collective
from ..errors import InputError
from ..safety import check_regular_file, excerpt, limit, limit_error
from . import Collector, RunData, register, source_label
from ._polars import pl

_U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
#: a timestamp in µs whose ns value fits int64
_TS_US = Annotated[int, msgspec.Meta(ge=0, le=(2**63 - 1) // 1000)]
_I32 = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
_NRANKS = Annotated[int, msgspec.Meta(ge=1, lt=2**31)]


class _Header(msgspec.Struct):
    id: str
    rank: _I32
    n_ranks: _NRANKS
    nnodes: _U63 | None = None
    comm_name: str | None = None


class _Meta(msgspec.Struct):
    inspector_output_format_version: str | None = None
    dump_timestamp_us: _TS_US | None = None
    hostname: str | None = None
    pid: _U63 | None = None


class _Kernel(msgspec.Struct):
    channel_id: _I32 | None = None
    kernel_start_ts: _TS_US | None = None
    kernel_stop_ts: _TS_US | None = None


class _TraceTs(msgspec.Struct):
    coll_start_ts: _TS_US | None = None
    coll_stop_ts: _TS_US | None = None
    p2p_start_ts: _TS_US | None = None
    p2p_stop_ts: _TS_US | None = None
    kernel_events: list[_Kernel] = []


class _Coll(msgspec.Struct):
    coll: str
    coll_sn: _U63
    coll_msg_size_bytes: _U63
    coll_exec_time_us: _TS_US
    coll_timing_source: str | None = None
    coll_algobw_gbs: float | None = None
    coll_busbw_gbs: float | None = None
    event_trace_ts: _TraceTs | None = None


class _P2p(msgspec.Struct):
    p2p: str
    p2p_sn: _U63
    p2p_msg_size_bytes: _U63
    p2p_exec_time_us: _TS_US
    p2p_peer: Annotated[int, msgspec.Meta(ge=-1, lt=2**31)] | None = None
    p2p_timing_source: str | None = None
    p2p_algobw_gbs: float | None = None
    p2p_busbw_gbs: float | None = None
    event_trace_ts: _TraceTs | None = None


class _Record(msgspec.Struct):
    header: _Header
    metadata: _Meta | None = None
    coll_perf: _Coll | None = None
    p2p_perf: _P2p | None = None


# lax decoding: the writer prints its doubles with "%lf" and a NaN as the string "nan"
# (plugins/profiler/inspector/json.cc jsonDouble), and a whole-number count may come as a
# float (5663.0) from builds that format through a double; a fraction is still refused
_DEC = msgspec.json.Decoder(_Record, strict=False)

#: NCCL's function names (ncclFuncToString) in moetrace's spelling (one per function: coll_sn
#: is counted per function, so AllGather and AllGatherV must stay apart)
_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "AllGatherV": "all_gather_v",
        "ReduceScatter": "reduce_scatter", "Broadcast": "broadcast", "Reduce": "reduce", "All2All": "all_to_all",
        "SendRecv": "sendrecv", "Send": "send", "Recv": "recv"}
_KNOWN_SOURCES = ("kernel_gpu", "kernel_cpu", "collective_cpu")


def op_of(name: str) -> str:
    """An NCCL function name (AllReduce, All2All, ...) in moetrace's spelling."""
    return _OPS.get(name) or normalize_collective(name) or name.lower()


def _sniff(path: Path, head: bytes) -> bool:
    text = head.lstrip()
    return text.startswith(b"{") and b'"header"' in text and (b'"coll_perf"' in text or b'"p2p_perf"' in text)


def _kernel_window(tr: _TraceTs | None) -> tuple[int | None, int | None]:
    """(earliest kernel start, latest kernel stop) in µs over the channels that have both."""
    if tr is None:
        return None, None
    ks = [(k.kernel_start_ts, k.kernel_stop_ts) for k in tr.kernel_events
          if k.kernel_start_ts and k.kernel_stop_ts]
    if not ks:
        return None, None
    return min(a for a, _ in ks), max(b for _, b in ks)


def _parse(path: Path) -> tuple[list[dict], dict]:
    """The records of one file (as collectives rows without rank) and what it says about
    itself (hostnames, pids, versions, verbose)."""
    check_regular_file(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    cap = limit("max_line_bytes") * 16
    rows: list[dict] = []
    info = {"hosts": set(), "pids": set(), "versions": set(), "sources": set(), "verbose": 0, "no_kernel_ts": 0,
            "other": 0, "nan_bw": 0}
    seen: dict[tuple, int] = {}
    for ln, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        if len(line) > cap:
            raise limit_error(path, "max_line_bytes", f"a line of {len(line)} bytes (16 x max_line_bytes accepted "
                                                      "for NCCL Inspector records)", f"line {ln}")
        try:
            rec = _DEC.decode(line)
        except msgspec.ValidationError as e:
            raise InputError(path, f"not an NCCL Inspector record: {excerpt(str(e), 160)}", f"line {ln}") from None
        except msgspec.DecodeError as e:
            raise InputError(path, f"invalid JSON: {excerpt(str(e), 120)}", f"line {ln}") from None
        h, m = rec.header, rec.metadata
        if rec.coll_perf is not None and rec.p2p_perf is not None:
            raise InputError(path, "a record holds both coll_perf and p2p_perf", f"line {ln}")
        if rec.coll_perf is None and rec.p2p_perf is None:
            # a record of another kind (statistics of the dump itself, a future record type):
            # neither a collective nor a P2P operation; counted and said, never a row
            info["other"] += 1
            continue
        if h.rank >= h.n_ranks:
            raise InputError(path, f"header.rank {h.rank} is not below header.n_ranks {h.n_ranks}", f"line {ln}")
        if not h.id or len(h.id) > 64:
            raise InputError(path, "header.id (the communicator) is empty or longer than 64 characters", f"line {ln}")
        if m is not None:
            if m.hostname:
                info["hosts"].add(m.hostname)
            if m.pid is not None:
                info["pids"].add(m.pid)
            if m.inspector_output_format_version:
                info["versions"].add(m.inspector_output_format_version)
        base = {"entry": ln, "grp": h.id, "group_desc": h.comm_name, "group_rank": h.rank, "group_size": h.n_ranks,
                "record_id": None, "input_sizes": None, "output_sizes": None, "input_dtypes": None,
                "output_dtypes": None, "state": "completed", "_nnodes": h.nnodes}
        if rec.coll_perf is not None:
            c = rec.coll_perf
            key = ("coll", h.id, h.rank, c.coll, c.coll_sn)
            tr = c.event_trace_ts
            row = {**base, "op": op_of(c.coll), "op_name": c.coll, "is_p2p": False, "seq": c.coll_sn, "p2p_seq": None,
                   "peer": None, "msg_bytes": c.coll_msg_size_bytes, "duration_ns": c.coll_exec_time_us * 1000,
                   "timing_source": c.coll_timing_source, "algo_bw_gbps": c.coll_algobw_gbs,
                   "bus_bw_gbps": c.coll_busbw_gbs,
                   "created_ns": tr.coll_start_ts * 1000 if tr is not None and tr.coll_start_ts else None}
        else:
            c = rec.p2p_perf
            key = ("p2p", h.id, h.rank, c.p2p, c.p2p_sn)
            tr = c.event_trace_ts
            row = {**base, "op": op_of(c.p2p), "op_name": c.p2p, "is_p2p": True, "seq": None, "p2p_seq": c.p2p_sn,
                   "peer": c.p2p_peer if c.p2p_peer is not None and c.p2p_peer >= 0 else None,
                   "msg_bytes": c.p2p_msg_size_bytes, "duration_ns": c.p2p_exec_time_us * 1000,
                   "timing_source": c.p2p_timing_source, "algo_bw_gbps": c.p2p_algobw_gbs,
                   "bus_bw_gbps": c.p2p_busbw_gbs,
                   "created_ns": tr.p2p_start_ts * 1000 if tr is not None and tr.p2p_start_ts else None}
        if key in seen:
            raise InputError(path, f"{key[3]} #{key[4]} of communicator {excerpt(h.id, 24)} (rank {h.rank}) appears "
                                   f"twice (lines {seen[key]} and {ln})", f"line {ln}")
        seen[key] = ln
        for k in ("algo_bw_gbps", "bus_bw_gbps"):
            v = row[k]
            if v is not None and v != v:   # "nan": the writer's bandwidth of a zero-time operation
                row[k] = None
                info["nan_bw"] += 1
            elif v is not None and abs(v) == float("inf"):
                raise InputError(path, "bandwidth is not a finite number", f"line {ln}")
        if row["timing_source"]:
            info["sources"].add(row["timing_source"])
        if tr is not None:
            info["verbose"] += 1
            a, b = _kernel_window(tr)
            if a is None:
                info["no_kernel_ts"] += 1
            elif b < a:
                raise InputError(path, f"kernel_stop_ts {b} is before kernel_start_ts {a}", f"line {ln}")
            row["started_ns"] = a * 1000 if a is not None else None
            row["completed_ns"] = b * 1000 if b is not None else None
        else:
            row["started_ns"] = row["completed_ns"] = None
        rows.append(row)
    if not rows:
        raise InputError(path, "no NCCL Inspector collective or P2P records (the file holds only blank lines"
                               + (f" and {info['other']} record(s) of another kind)" if info["other"] else ")"))
    return rows, info


def _global_ranks(paths: list[Path], per_file: list[list[dict]], approx: list[str]) -> list[int | None]:
    """Each file's global rank: its rank in the communicator the files share (the one
    recorded in the most files, then the largest, then by id), else the file's order.
    None for a file that drove several ranks of that communicator (one process, several
    GPUs): its rows keep their rank in the communicator."""
    cover: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    for i, rows in enumerate(per_file):
        for r in rows:
            cover.setdefault(r["grp"], set()).add(i)
            size[r["grp"]] = r["group_size"]
    ref = max(cover, key=lambda g: (len(cover[g]), size[g], g))
    out: list[int | None] = []
    owner: dict[int, str] = {}
    unplaced = []
    for i, rows in enumerate(per_file):
        mine = sorted({r["group_rank"] for r in rows if r["grp"] == ref})
        if len(mine) > 1:
            other = sorted({r["grp"] for r in rows if r["grp"] != ref})
            if other:
                raise InputError(paths[i], f"the file holds ranks {mine[0]} and {mine[1]} of communicator "
                                           f"{excerpt(ref, 24)} and also records of other communicators: one process "
                                           "drove several GPUs and moetrace cannot tell which GPU ran which record")
            out.append(None)
            for g in mine:
                if g in owner:
                    raise InputError(paths[i], f"rank {g} of communicator {excerpt(ref, 24)} is also in {owner[g]}")
                owner[g] = paths[i].name
            continue
        if not mine:
            out.append(-1)
            unplaced.append(i)
            continue
        g = mine[0]
        if g in owner:
            raise InputError(paths[i], f"rank {g} of communicator {excerpt(ref, 24)} is also in {owner[g]}")
        owner[g] = paths[i].name
        out.append(g)
    nxt = max(owner, default=-1) + 1
    for i in unplaced:
        out[i] = nxt
        approx.append(f"{paths[i].name} holds no record of communicator {ref}, which the other files share: its "
                      f"process is given rank {nxt} (file order)")
        nxt += 1
    return out


def _instances_for_spans(coll: pl.DataFrame, approx: list[str]) -> pl.DataFrame:
    """The collective records that become spans: instances (communicator, collective,
    coll_sn) with a kernel window on every rank of the communicator, and, on every rank,
    in the same order by start as by coll_sn (so order matching is coll_sn matching)."""
    timed = coll.filter(pl.col("started_ns").is_not_null() & pl.col("completed_ns").is_not_null())
    if timed.height == 0:
        return timed
    total = coll.select("grp", "op", "seq").unique().height
    full = (timed.group_by("grp", "op", "seq").agg(pl.col("rank").n_unique().alias("_n"),
                                                   pl.col("group_size").first().alias("_size"))
            .filter(pl.col("_n") == pl.col("_size")).select("grp", "op", "seq"))
    kept = timed.join(full, on=["grp", "op", "seq"], how="semi")
    dropped_incomplete = total - full.height
    dropped_order = 0
    while kept.height:
        s = kept.sort("rank", "grp", "op", "seq")
        s = s.with_columns(pl.col("started_ns").shift(1).over("rank", "grp", "op").alias("_ps"),
                           pl.col("completed_ns").shift(1).over("rank", "grp", "op").alias("_pe"))
        bad = s.filter(pl.col("_ps").is_not_null()
                       & ((pl.col("started_ns") < pl.col("_ps"))
                          | ((pl.col("started_ns") == pl.col("_ps")) & (pl.col("completed_ns") <= pl.col("_pe")))))
        if bad.height == 0:
            break
        drop = bad.select("grp", "op", "seq").unique()
        dropped_order += drop.height
        kept = kept.join(drop, on=["grp", "op", "seq"], how="anti")
    if dropped_incomplete:
        approx.append(f"{dropped_incomplete} of {total} collective instances were not recorded with kernel times on "
                      "every rank of their communicator (a rank's file missing or cut short, sizes below "
                      "NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES, records without GPU timing discarded, the ring buffer "
                      "overrun): they are in the collectives table but not in spans or the waits views")
    if dropped_order:
        approx.append(f"{dropped_order} collective instances started, on some rank, before an earlier coll_sn of "
                      "the same communicator and collective (host clock stepped?): left out of spans and the waits "
                      "views, which pair instances by their order")
    return kept


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    paths = sorted(paths)
    per_file, infos = [], []
    for p in paths:
        rows, info = _parse(p)
        per_file.append(rows)
        infos.append(info)
    approx: list[str] = []
    granks = _global_ranks(paths, per_file, approx)
    rows = []
    for i, (_p, fr) in enumerate(zip(paths, per_file)):
        for r in fr:
            rows.append({**r, "rank": granks[i] if granks[i] is not None else r["group_rank"], "source": "nccl_inspector"})
    if any(g is None for g in granks):
        approx.append("a file holds several ranks of one communicator (one process drove several GPUs): those "
                      "ranks are numbered by their rank in that communicator")
    verbose = sum(i["verbose"] for i in infos)
    cols = ["rank", "source", "entry", "grp", "group_desc", "group_rank", "group_size", "op", "op_name", "is_p2p",
            "seq", "p2p_seq", "record_id", "peer", "msg_bytes", "input_sizes", "output_sizes", "input_dtypes",
            "output_dtypes", "state", "retired", "created_ns", "started_ns", "completed_ns", "duration_ns", "timing_source",
            "algo_bw_gbps", "bus_bw_gbps"]
    schema = {"rank": pl.Int32, "source": pl.Utf8, "entry": pl.Int64, "grp": pl.Utf8, "group_desc": pl.Utf8,
              "group_rank": pl.Int32, "group_size": pl.Int32, "op": pl.Utf8, "op_name": pl.Utf8,
              "is_p2p": pl.Boolean, "seq": pl.Int64, "p2p_seq": pl.Int64, "record_id": pl.Int64, "peer": pl.Int32,
              "msg_bytes": pl.Int64, "input_sizes": pl.Utf8, "output_sizes": pl.Utf8, "input_dtypes": pl.Utf8,
              "output_dtypes": pl.Utf8, "state": pl.Utf8, "retired": pl.Boolean, "created_ns": pl.Int64, "started_ns": pl.Int64,
              "completed_ns": pl.Int64, "duration_ns": pl.Int64, "timing_source": pl.Utf8,
              "algo_bw_gbps": pl.Float64, "bus_bw_gbps": pl.Float64}
    coll = pl.DataFrame([{c: r.get(c) for c in cols} for r in rows], schema=schema, orient="row")
    # a communicator's size must agree wherever it is recorded
    sizes = coll.group_by("grp").agg(pl.col("group_size").n_unique().alias("n"), pl.col("group_size").min().alias("a"),
                                     pl.col("group_size").max().alias("b")).filter(pl.col("n") > 1)
    if sizes.height:
        g = sizes.row(0, named=True)
        raise InputError(paths[0].parent if len(paths) > 1 else paths[0],
                         f"communicator {excerpt(g['grp'], 24)} has n_ranks {g['a']} in one record and {g['b']} in "
                         "another")
    groups = (coll.group_by("rank", "grp").agg(pl.col("group_desc").drop_nulls().first(),
                                               pl.col("group_rank").first(), pl.col("group_size").first())
              .sort("rank", "grp"))
    members = coll.group_by("grp").agg(pl.col("rank").unique().sort().alias("m"), pl.col("group_size").first().alias("s"))
    members = members.with_columns(
        pl.when(pl.col("m").list.len() == pl.col("s"))
        .then(pl.col("m").map_elements(lambda m: json.dumps(list(m)), return_dtype=pl.Utf8))
        .otherwise(None).alias("members")).select("grp", "members")
    groups = groups.join(members, on="grp", how="left").with_columns(
        pl.lit("nccl_inspector").alias("source"), pl.lit(None, pl.Int64).alias("last_enqueued_seq"),
        pl.lit(None, pl.Int64).alias("last_started_seq"), pl.lit(None, pl.Int64).alias("last_completed_seq"))
    tables: dict = {"collectives": coll, "comm_groups": groups}
    srcs = sorted(set().union(*(i["sources"] for i in infos)))
    if verbose == 0:
        approx.append("no event_trace_ts in the records (NCCL_INSPECTOR_DUMP_VERBOSE=0): per-rank collective "
                      "durations only (coll_exec_time_us); the records are not placed in time, so there are no "
                      "spans and no cross-rank waits")
    else:
        spans_src = _instances_for_spans(coll.filter(~pl.col("is_p2p")), approx)
        if spans_src.height:
            approx.append("verbose records: a collective's span runs from the first kernel channel's kernel_start_ts "
                          "to the last channel's kernel_stop_ts, times the host took with gettimeofday when NCCL's "
                          "profiler events reached the plugin (µs; ranks on different hosts compared on their wall "
                          "clocks, no clock correction); arrival = that first kernel start")
            tables.update(_spans(spans_src))
        if coll.filter(pl.col("is_p2p")).height:
            approx.append("P2P records (p2p_perf) are kept in the collectives table only: p2p_sn counts one rank's "
                          "operations on a communicator and does not pair a send with its receive across ranks")
    if any(s not in _KNOWN_SOURCES for s in srcs):
        approx.append(f"timing sources {srcs} include values this moetrace does not know")
    elif "kernel_gpu" not in srcs or len(srcs) > 1:
        approx.append(f"coll_exec_time_us timing sources: {', '.join(srcs)} (kernel_gpu = GPU globaltimer; kernel_cpu "
                      "and collective_cpu = host times, which include launch and queueing)")
    versions = sorted(set().union(*(i["versions"] for i in infos)))
    if any(not v.startswith("v4.") for v in versions):
        approx.append(f"inspector_output_format_version {', '.join(versions)}: moetrace reads the v4.0 layout "
                      "(NVIDIA/nccl 5067397); fields may have moved")
    if any(v != "v4.0" and v.startswith("v4.") for v in versions):
        approx.append(f"inspector_output_format_version {', '.join(versions)}: read with the v4.0 fields "
                      "(NVIDIA/nccl 5067397 writes v4.0 only); fields it does not know are ignored")
    other = sum(i["other"] for i in infos)
    if other:
        approx.append(f"{other} record(s) with neither coll_perf nor p2p_perf (e.g. statistics of the dump "
                      "itself) are not operations: counted here, not stored")
    nan_bw = sum(i["nan_bw"] for i in infos)
    if nan_bw:
        approx.append(f"{nan_bw} bandwidth value(s) written as \"nan\" (an operation timed at 0 us) are NULL")
    h = hashlib.sha256()
    for p in paths:
        h.update(hashlib.sha256(p.read_bytes()).hexdigest().encode())
    R = len(set(coll["rank"].to_list()))
    meta = {"format": "nccl_inspector", "inspector_output_format_version": versions, "files": [p.name for p in paths],
            "hostnames": sorted(set().union(*(i["hosts"] for i in infos))), "verbose_records": verbose,
            "records": coll.height, "timing_sources": srcs, "other_records": other}
    run = {"source": source_label(paths),
           "source_sha256": h.hexdigest(), "time_base": "epoch" if verbose else "none",
           "num_ranks": options.get("num_ranks") or R, "ranks_per_node": options.get("ranks_per_node"),
           "approximations": json.dumps(approx) if approx else None, "meta_json": json.dumps(meta)}
    hint = paths[0].parent.name if len(paths) > 1 else paths[0].name.split(".")[0]
    return [RunData(run=run, tables=tables, run_id_hint=hint, files=[str(p) for p in paths])]


def _spans(c: pl.DataFrame) -> dict:
    """spans + kernel_names of the collective records kept for the timeline."""
    names = c.select("op_name", "op").unique().sort("op_name").with_row_index("name_id")
    names = names.with_columns(pl.col("name_id").cast(pl.Int32),
                               pl.when(pl.col("op") == "all_to_all").then(pl.lit("a2a_other"))
                               .otherwise(pl.lit("comm_other")).alias("kind"),
                               (pl.lit("NCCL ") + pl.col("op_name") + pl.lit(" (NCCL Inspector)")).alias("name"))
    s = c.join(names.select("op_name", "name_id", "kind"), on="op_name", how="left")
    spans = s.select(
        "rank", pl.lit(0, pl.Int32).alias("device"), pl.lit(0, pl.Int32).alias("stream"), "kind", "name_id",
        "started_ns", "completed_ns", pl.lit(None, pl.Int64).alias("step"), pl.lit(None, pl.Int32).alias("layer"),
        pl.lit(None, pl.Int32).alias("micro_batch"), pl.lit(False).alias("inferred"),
        pl.lit(None, pl.Int64).alias("correlation"), pl.col("op").alias("collective"),
        pl.col("grp").alias("process_group"),
        # the kind follows the record's collective, not the kernel rules; no CPU ranges
        pl.lit(None, pl.Utf8).alias("classified_by"), pl.lit(None, pl.Utf8).alias("moe_context"),
    ).rename({"started_ns": "start_ns", "completed_ns": "end_ns"}).sort("rank", "start_ns")
    return {"spans": spans, "kernel_names": names.select("name_id", "name", "kind",
                                                         pl.lit(None, pl.Utf8).alias("classified_by"))}


register(Collector("nccl_inspector", "NCCL Inspector JSON lines (plugins/profiler/inspector): one file per process, "
                                     "a folder of them is one run; verbose records feed the waits views",
                   _sniff, _collect, priority=12))
