"""PyTorch Flight Recorder dumps (c10d ``FlightRecorder``, read by
``torch/distributed/flight_recorder/fr_trace.py``): one file per rank
(``TORCH_FR_DUMP_TEMP_FILE`` + rank, by default ``nccl_trace_rank_<rank>``), a folder of
them is one run.

A dump is a dict: ``version``, ``pg_config`` {group name: {name, desc, ranks}},
``pg_status`` {pg_id: {last_enqueued_collective, last_started_collective,
last_completed_collective}} and ``entries``, the ring buffer of the rank's recent c10d
operations: record_id, pg_id, process_group (name, desc), collective_seq_id, p2p_seq_id,
profiling_name (``nccl:all_reduce``, ``nccl:send 0->1``), input/output sizes and dtypes,
state (scheduled, started, completed), time_created_ns, time_discovered_started_ns,
time_discovered_completed_ns, duration_ms, is_p2p. The dump is a pickle (read with
:func:`moetrace.safety_pickle.load_plain`: plain containers and scalars only, anything that
would import or call is refused) or the JSON ``dump_json`` writes (same keys; a time not
yet discovered is 0 there, pg_status values are strings).

Tables: each entry is a ``collectives`` row, each (rank, group) a ``comm_groups`` row
(members from pg_config, last sequence ids from pg_status). The hang post-mortem over them
is :mod:`moetrace.analyze.hang` (``moetrace hang``). Flight Recorder times are the host's
discovery times, not kernel times: no spans are made from them.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from ..domain.kernels import normalize_collective
from ..errors import InputError
from ..safety import check_regular_file, excerpt, json_loads, limit, limit_error
from ..safety_pickle import is_pickle, load_plain
from . import Collector, RunData, register, source_label
from ._polars import Dtypes, pl

_U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_SIZE = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class _Entry(msgspec.Struct, kw_only=True):
    record_id: _U63
    process_group: tuple[str, str]
    collective_seq_id: _U63
    profiling_name: str
    state: Literal["scheduled", "started", "completed"]
    time_created_ns: _U63
    pg_id: _U63 | None = None
    p2p_seq_id: _U63 | None = None
    input_sizes: list[list[_SIZE]] = []
    output_sizes: list[list[_SIZE]] = []
    input_dtypes: list[str] = []
    output_dtypes: list[str] = []
    time_discovered_started_ns: _U63 | None = None
    time_discovered_completed_ns: _U63 | None = None
    duration_ms: float | None = None
    is_p2p: bool | None = None
    op_id: _U63 | None = None
    retired: bool | None = None
    timeout_ms: _SIZE | None = None


class _PgConfig(msgspec.Struct):
    name: str | None = None
    desc: str | None = None
    ranks: str | list[_U63] | None = None


class _Dump(msgspec.Struct):
    version: str | int | float
    entries: list[_Entry] = []
    pg_config: dict[str, _PgConfig] = {}
    pg_status: dict[str, dict[str, _SIZE | str]] = {}
    comm_lib_version: str | None = None


_RANK_AT_END = re.compile(r"(\d+)$")
_P2P_RE = re.compile(r"^(?:\w+:)?(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)$")


def op_of(profiling_name: str) -> str:
    """``nccl:all_reduce`` -> all_reduce, ``nccl:_allgather_base`` -> all_gather, ``nccl:send 0->1`` -> send."""
    base = profiling_name.split(":", 1)[-1].strip().split(" ")[0]
    return normalize_collective(base) or base.lower() or "unknown"


def _sniff(path: Path, head: bytes) -> bool:
    if is_pickle(head):
        return b"pg_config" in head or (b"entries" in head and b"profiling_name" in head)
    # dump_json sorts the keys (nlohmann::json): comm_lib_version, entries (each entry's keys
    # from collective_seq_id on), nccl_comm_state, pg_config, pg_status, version. version and
    # pg_config can lie past the head, so the entries' own keys identify the dump too.
    text = head.lstrip()
    if not text.startswith(b"{"):
        return False
    if b'"pg_config"' in head and (b'"version"' in head or b'"pg_status"' in head):
        return True
    return b'"entries"' in head and b'"collective_seq_id"' in head and (
        b'"profiling_name"' in head or b'"p2p_seq_id"' in head or b'"comm_lib_version"' in head)


def _load(path: Path) -> tuple[dict, bytes, str]:
    """(the dump as plain values, the file's bytes, 'pickle' or 'json')."""
    check_regular_file(path)
    cap = limit("max_pickle_bytes")
    try:
        size = path.stat().st_size
        if size > cap:
            raise limit_error(path, "max_pickle_bytes", f"a dump of {size} bytes")
        data = path.read_bytes()
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    if not data.strip():
        raise InputError(path, "file is empty")
    if data.lstrip()[:1] == b"{":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(path, "not UTF-8 text", f"byte {e.start}") from None
        obj, kind = json_loads(path, text), "json"
    else:   # anything else is read as a pickle (of any protocol), through the plain-values reader
        obj, kind = load_plain(path, data), "pickle"
    if not isinstance(obj, dict):
        raise InputError(path, f"not a Flight Recorder dump: the pickle holds a {type(obj).__name__}, not a dict")
    return obj, data, kind


def _members(path: Path, g: str, cfg: _PgConfig, notes: list[str]) -> list[int] | None:
    r = cfg.ranks
    if isinstance(r, list):
        return sorted(set(r))
    if isinstance(r, str) and len(r) <= 1 << 20:
        try:
            v = json.loads(r)
        except ValueError:
            v = None
        if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in v):
            return sorted(set(v))
    notes.append(f"{path.name}: pg_config ranks of group {excerpt(g, 40)} unreadable ({excerpt(str(r), 40)}): "
                 "members taken from the dumps")
    return None


def _parse(path: Path, rank: int, notes: list[str]) -> tuple[list[dict], list[dict], dict]:
    obj, data, kind = _load(path)
    if kind == "json":   # dump_json: 0 for a time not yet discovered; pg_status values as text
        for e in obj.get("entries") or []:
            if isinstance(e, dict):
                for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                    if e.get(k) == 0:
                        e[k] = None
    try:
        d = msgspec.convert(obj, _Dump, strict=False) if kind == "json" else msgspec.convert(obj, _Dump)
    except msgspec.ValidationError as e:
        m = re.search(r"\$\.entries\[(\d+)\]", str(e))
        raise InputError(path, f"not a Flight Recorder dump: {excerpt(str(e), 160)}",
                         f"entry {m.group(1)}" if m else None) from None
    members: dict[str, list[int] | None] = {}
    descs: dict[str, str | None] = {}
    cfg_ranks: dict[str, object] = {}
    for g, cfg in d.pg_config.items():
        name = cfg.name or g
        cfg_ranks[name] = cfg.ranks
        members[name] = _members(path, name, cfg, notes)
        descs[name] = cfg.desc
    rows = []
    pg_names: dict[int, str] = {}
    seen: dict[int, int] = {}
    used: set[str] = set()
    op_seq: dict[str, dict[int, int]] = {}   # gloo group -> {op_id: collective_seq_id}
    for i, e in enumerate(d.entries):
        if e.record_id in seen:
            raise InputError(path, f"record_id {e.record_id} appears twice (entries {seen[e.record_id]} and {i})",
                             f"entry {i}")
        seen[e.record_id] = i
        g, desc = e.process_group
        used.add(g)
        if e.pg_id is not None:
            pg_names.setdefault(e.pg_id, g)
        if e.profiling_name.startswith("gloo:") and e.op_id is not None and not e.is_p2p:
            op_seq.setdefault(g, {})[e.op_id] = e.collective_seq_id
        if e.duration_ms is not None and not (0 <= e.duration_ms < 1e9):
            raise InputError(path, f"duration_ms {e.duration_ms!r} is negative, not finite or over 11 days",
                             f"entry {i}")
        a, b = e.time_discovered_started_ns, e.time_discovered_completed_ns
        if a is not None and b is not None and b < a:
            raise InputError(path, f"time_discovered_completed_ns {b} is before time_discovered_started_ns {a}",
                             f"entry {i}")
        mem = members.get(g)
        p2p = bool(e.is_p2p) if e.is_p2p is not None else op_of(e.profiling_name) in ("send", "recv")
        peer = None
        m = _P2P_RE.match(e.profiling_name.strip())
        if m:
            peer = int(m.group(4))   # send a->b: b; recv a<-b: b (group ranks)
            peer = peer if peer < 2**31 else None
        rows.append({
            "rank": rank, "source": "flight_recorder", "entry": i, "grp": g, "group_desc": desc,
            "group_rank": mem.index(rank) if mem and rank in mem else None,
            "group_size": len(mem) if mem else None, "op": op_of(e.profiling_name), "op_name": e.profiling_name,
            "is_p2p": p2p, "seq": e.collective_seq_id, "p2p_seq": e.p2p_seq_id, "record_id": e.record_id,
            "peer": peer, "msg_bytes": None,
            "input_sizes": json.dumps(e.input_sizes), "output_sizes": json.dumps(e.output_sizes),
            "input_dtypes": json.dumps(e.input_dtypes), "output_dtypes": json.dumps(e.output_dtypes),
            "state": e.state, "retired": e.retired, "created_ns": e.time_created_ns, "started_ns": a, "completed_ns": b,
            "duration_ns": round(e.duration_ms * 1e6) if e.duration_ms is not None else None,
            "timing_source": "cuda_event" if e.duration_ms is not None else None,
            "algo_bw_gbps": None, "bus_bw_gbps": None,
        })
        descs.setdefault(g, desc)
        members.setdefault(g, None)
    status: dict[str, dict] = {}
    unmapped = 0
    for pg_id, st in d.pg_status.items():
        try:
            g = pg_names.get(int(pg_id))
        except ValueError:
            g = None
        if g is None:
            unmapped += 1
            continue
        vals = {}
        for key in ("last_enqueued_collective", "last_started_collective", "last_completed_collective"):
            v = st.get(key)
            if isinstance(v, str):
                try:
                    v = int(v)
                except ValueError:
                    raise InputError(path, f"pg_status {excerpt(pg_id, 20)}.{key} = {excerpt(v, 30)!r} is not a "
                                           "whole number") from None
            if v is not None and not (-1 <= v < 2**63):
                raise InputError(path, f"pg_status {excerpt(pg_id, 20)}.{key} = {v} is out of range")
            # -1: nothing yet (and always for last_started without TORCH_NCCL_ENABLE_TIMING)
            vals[key] = v if v is None or v >= 0 else None
        if g in op_seq:
            status[g] = _gloo_status(vals, op_seq[g])
        else:
            status[g] = _p2p_status(vals, [r for r in rows if r["grp"] == g])
            if status[g] != vals:
                notes.append(f"{path.name}: pg_status of group {excerpt(g, 40)} names a point-to-point operation "
                             "(NCCL counts those apart, p2p_seq): read as the last collective before it")
    if unmapped:
        notes.append(f"{path.name}: pg_status of {unmapped} group id(s) with no entry left in the buffer (their "
                     "names are unknown): not kept")
    if op_seq:
        notes.append(f"{path.name}: gloo pg_status counts every operation of a group (op_id, point-to-point "
                     "included); translated to collective sequence ids through the entries' op_id")
    for g in [g for g in members if g == "" and g not in used]:
        # gloo registers a group's ranks before it has a name, all under "": such an entry
        # names no group the entries use
        notes.append(f"{path.name}: pg_config lists ranks {excerpt(str(cfg_ranks.get(g)), 40)} under an empty group "
                     "name no entry uses (gloo registers groups before naming them): members taken from the dumps")
        del members[g]
    groups = []
    for g in sorted(members):
        mem, st = members[g], status.get(g, {})
        groups.append({"rank": rank, "source": "flight_recorder", "grp": g, "group_desc": descs.get(g),
                       "group_rank": mem.index(rank) if mem and rank in mem else None,
                       "group_size": len(mem) if mem else None, "members": json.dumps(mem) if mem else None,
                       "last_enqueued_seq": st.get("last_enqueued_collective"),
                       "last_started_seq": st.get("last_started_collective"),
                       "last_completed_seq": st.get("last_completed_collective")})
    info = {"version": str(d.version), "kind": kind, "sha256": hashlib.sha256(data).hexdigest(),
            "comm_lib_version": d.comm_lib_version}
    return rows, groups, info


def _gloo_status(vals: dict, op_seq: dict[int, int]) -> dict:
    """pg_status of a gloo group in collective sequence ids. gloo's pg_status holds the
    work's sequence number, which counts every operation of the group (the entries' op_id;
    ProcessGroupGloo::enqueue), while the entries' collective_seq_id counts collectives only:
    the value becomes the seq of the last collective at or before that op_id (a send or recv
    has no entry). Below the oldest op_id left in the buffer nothing says: NULL."""
    ids = sorted(op_seq)
    out = {}
    for k, v in vals.items():
        at = [i for i in ids if v is not None and i <= v]
        out[k] = op_seq[at[-1]] if at else None
    return out


def _p2p_status(vals: dict, ents: list[dict]) -> dict:
    """pg_status of an NCCL group in collective sequence ids. ProcessGroupNCCL numbers a
    work by ``seqCollective_`` or, for a send / recv, by ``seqP2P_`` (``initWork``), and
    ``workEnqueue`` / the watchdog store that number whatever the work was, so a value can
    be a point-to-point id. The entries say which: when the group's last enqueued entry (by
    record_id) is a point-to-point one with that p2p_seq_id, the last collective enqueued
    is the collective_seq_id that entry recorded (seqCollective_ at its enqueue; 0: none
    yet); when the last started / finished entry is a point-to-point one with that
    p2p_seq_id, pg_status says nothing of collectives there (the entries' own states do):
    NULL. A value that is no such id but the seq of a collective entry in that state stays
    (a writer counting collectives only); any other value after a point-to-point entry is
    not trusted: NULL."""
    if not any(e["is_p2p"] for e in ents):
        return vals
    order = sorted(ents, key=lambda e: e["record_id"])
    started = [e for e in order if e["state"] in ("started", "completed") or e["retired"]]
    finished = [e for e in order if e["state"] == "completed" or e["retired"]]
    out = dict(vals)
    for key, pool in (("last_enqueued_collective", order), ("last_started_collective", started),
                      ("last_completed_collective", finished)):
        v = vals.get(key)
        if v is None or not pool or not pool[-1]["is_p2p"]:
            continue
        last = pool[-1]
        if last["p2p_seq"] == v:
            out[key] = (last["seq"] or None) if key == "last_enqueued_collective" else None
        elif not any(not e["is_p2p"] and e["seq"] == v for e in pool):
            out[key] = None
    return out


_COLL_SCHEMA = Dtypes(rank="Int32", source="Utf8", entry="Int64", grp="Utf8", group_desc="Utf8",
                      group_rank="Int32", group_size="Int32", op="Utf8", op_name="Utf8",
                      is_p2p="Boolean", seq="Int64", p2p_seq="Int64", record_id="Int64",
                      peer="Int32", msg_bytes="Int64", input_sizes="Utf8", output_sizes="Utf8",
                      input_dtypes="Utf8", output_dtypes="Utf8", state="Utf8", retired="Boolean",
                      created_ns="Int64",
                      started_ns="Int64", completed_ns="Int64", duration_ns="Int64",
                      timing_source="Utf8", algo_bw_gbps="Float64", bus_bw_gbps="Float64")
_GROUP_SCHEMA = Dtypes(rank="Int32", source="Utf8", grp="Utf8", group_desc="Utf8", group_rank="Int32",
                       group_size="Int32", members="Utf8", last_enqueued_seq="Int64",
                       last_started_seq="Int64", last_completed_seq="Int64")


def _ranks(paths: list[Path], approx: list[str]) -> list[int]:
    """Each dump's rank: the digits its name ends with (fr_trace's rule, after an
    extension such as .json or .pkl), else the file's order (said)."""
    out, seen = [], {}
    named = []
    for p in paths:
        stem = p.name[: -len(p.suffix)] if p.suffix in (".json", ".pkl", ".pickle") else p.name
        m = _RANK_AT_END.search(stem)
        named.append(int(m.group(1)) if m and len(m.group(1)) < 10 else None)
    if None in named:
        approx.append("a dump's name does not end with its rank: ranks taken from the files' order ("
                      + ", ".join(f"{p.name} = {i}" for i, p in enumerate(paths[:8])) + ")")
        return list(range(len(paths)))
    for p, r in zip(paths, named):
        if r in seen:
            raise InputError(p, f"rank {r} (from the file name) is also {seen[r]}")
        seen[r] = p.name
        out.append(r)
    return out


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    paths = sorted(paths)
    approx: list[str] = []
    ranks = _ranks(paths, approx)
    rows, groups, infos = [], [], []
    for p, r in zip(paths, ranks):
        cr, gr, info = _parse(p, r, approx)
        rows.extend(cr)
        groups.extend(gr)
        infos.append(info)
    coll = pl.DataFrame(rows, schema=_COLL_SCHEMA, orient="row") if rows else pl.DataFrame(schema=_COLL_SCHEMA)
    grp = pl.DataFrame(groups, schema=_GROUP_SCHEMA, orient="row") if groups else pl.DataFrame(schema=_GROUP_SCHEMA)
    if coll.height == 0 and grp.height == 0:
        raise InputError(paths[0].parent if len(paths) > 1 else paths[0],
                         "the dump(s) hold no entries and no pg_config: nothing to read")
    versions = sorted({i["version"] for i in infos})
    if any(not v.startswith("2.") for v in versions):
        approx.append(f"Flight Recorder dump version {', '.join(versions)}: moetrace reads the 2.x layout; fields "
                      "may have moved")
    approx.append("Flight Recorder times are when the host's watchdog found an operation created, started or "
                  "completed (time_created_ns, time_discovered_*), not kernel times: no spans are made from them")
    h = hashlib.sha256("".join(i["sha256"] for i in infos).encode()).hexdigest() if len(infos) > 1 \
        else infos[0]["sha256"]
    meta = {"format": "flight_recorder", "version": versions, "encoding": sorted({i["kind"] for i in infos}),
            "comm_lib_version": sorted({i["comm_lib_version"] for i in infos if i["comm_lib_version"]}),
            "files": [p.name for p in paths], "ranks": ranks}
    run = {"source": source_label(paths),
           "source_sha256": h, "time_base": "epoch", "num_ranks": options.get("num_ranks") or len(set(ranks)),
           "ranks_per_node": options.get("ranks_per_node"), "approximations": json.dumps(approx),
           "meta_json": json.dumps(meta)}
    hint = paths[0].parent.name if len(paths) > 1 else paths[0].name.split(".")[0]
    return [RunData(run=run, tables={"collectives": coll, "comm_groups": grp}, run_id_hint=hint,
                    files=[str(p) for p in paths])]


register(Collector("flight_recorder", "PyTorch Flight Recorder dumps (pickle or JSON, one per rank: "
                                      "nccl_trace_rank_N); read without running any pickle code",
                   _sniff, _collect, priority=12))
