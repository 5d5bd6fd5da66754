"""PyTorch profiler (Kineto) Chrome-trace JSON, plain or ``.gz``: one file, or a folder
of per-rank files (one run).

Reading: the document is decoded with msgspec into a list of raw event slices, then in
batches into small typed records holding only the fields moetrace uses, and from there
into columns; the full JSON is never held as Python dicts. ``ts`` is kept as its decimal
text and converted to integer ns exactly (both conventions: integer absolute-epoch µs, or
fractional µs relative to ``baseTimeNanoseconds``).

Rank: ``distributedInfo.rank``, else the file name (``rank-3``, ``rank3_trace``,
``-TP-0-DP-1-PP-0-EP-5`` -> EP rank, ``-rank-N``), else the file's order in the folder
(said in ``runs.approximations``). Device and stream: a kernel's ``args.device`` /
``args.stream``, else its ``pid`` / ``tid``.
"""
from __future__ import annotations

import gzip
import json
import re
import sys
import time
import zlib
from decimal import Decimal, InvalidOperation
from pathlib import Path

import msgspec
import polars as pl

from ..errors import InputError
from ..store import sha256_files
from . import Collector, RunData, register
from ._profile import CPU_SCHEMA, GPU_SCHEMA, LAUNCH_SCHEMA, RankEvents, build, frame
from .classify import Classifier

MAX_DUR_NS = 3600 * 10**9          # an event longer than an hour is corrupt
BATCH = 20000                      # events decoded to records at a time
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
_CPU_CATS = {"user_annotation", "cpu_op", "operator", "gpu_user_annotation"}


class _Args(msgspec.Struct):
    correlation: int | None = None
    device: int | None = None
    stream: int | None = None
    collective: str | None = msgspec.field(default=None, name="Collective name")


class _Event(msgspec.Struct):
    ph: str | None = None
    cat: str | None = None
    name: str | int | float | None = None
    pid: int | str | None = None
    tid: int | str | None = None
    ts: msgspec.Raw = msgspec.Raw(b"")
    dur: float | int | None = None
    args: _Args | None = None


class _Dist(msgspec.Struct):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None


class _Top(msgspec.Struct):
    traceEvents: list[msgspec.Raw] | None = None
    distributedInfo: _Dist | None = None
    baseTimeNanoseconds: int | None = None
    schemaVersion: int | str | None = None
    deviceProperties: list[msgspec.Raw] | None = None


_EVENTS_DEC = msgspec.json.Decoder(list[_Event])
_TOP_DEC = msgspec.json.Decoder(_Top)
_LIST_DEC = msgspec.json.Decoder(list[msgspec.Raw])

_RANK_PATTERNS = [
    re.compile(r"-EP-(\d+)(?:\D|$)"),
    re.compile(r"(?:^|[^a-z])rank[-_]?(\d+)(?:\D|$)", re.I),
    re.compile(r"-TP-(\d+)(?:\D|$)"),
]


def rank_from_name(name: str) -> int | None:
    for pat in _RANK_PATTERNS:
        m = pat.search(name)
        if m:
            return int(m.group(1))
    return None


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip; bad gzip is an InputError."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(path, f"corrupt or truncated gzip: {e}") from None
    return raw


def ts_to_ns(texts: list[bytes], base_ns: int, path: Path, offset: int) -> list[int]:
    """Decimal µs text -> integer ns (+ base), exactly; rounds half away from zero past ns."""
    out = []
    for j, t in enumerate(texts):
        s = t.decode("ascii", "replace") if isinstance(t, (bytes, bytearray, memoryview)) else str(t)
        neg = s.startswith("-")
        body = s[1:] if neg else s
        ip, dot, fp = body.partition(".")
        if ip.isdigit() and (not fp or fp.isdigit()):
            v = int(ip) * 1000 + int((fp + "000")[:3] or 0)
            if len(fp) > 3 and fp[3] >= "5":
                v += 1
        else:
            try:
                d = Decimal(s.strip().strip('"'))
            except InvalidOperation:
                raise InputError(path, f"timestamp {s!r} is not a number", f"event {offset + j}") from None
            if not d.is_finite():
                raise InputError(path, f"timestamp {s!r} is not finite", f"event {offset + j}")
            neg = d < 0
            v = int((abs(d) * 1000).to_integral_value(rounding="ROUND_HALF_UP"))
        out.append(base_ns + (-v if neg else v))
    return out


def _int(v) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return None
    return None


def parse_file(path: Path, progress: bool = False) -> tuple[dict, dict, dict, dict]:
    """Columns of one Kineto file: (info, gpu, launch, cpu)."""
    t0 = time.perf_counter()
    buf = read_bytes(path)
    if not buf.strip():
        raise InputError(path, "file is empty")
    try:
        if buf.lstrip()[:1] == b"[":  # bare array of events (Chrome trace array form)
            top = _Top(traceEvents=_LIST_DEC.decode(buf))
        else:
            top = _TOP_DEC.decode(buf)
    except msgspec.ValidationError as e:
        raise InputError(path, f"not a Kineto trace: {e}") from None
    except msgspec.DecodeError as e:
        msg = str(e)
        m = re.search(r"byte (\d+)", msg)
        raise InputError(path, f"invalid or truncated JSON: {msg}", f"byte {m.group(1)}" if m else None) from None
    if top.traceEvents is None:
        raise InputError(path, "no traceEvents: not a Kineto / Chrome trace")
    raws = top.traceEvents
    base = top.baseTimeNanoseconds
    info = {"n_events": len(raws), "base_ns": base, "rank": top.distributedInfo.rank if top.distributedInfo else None,
            "world_size": top.distributedInfo.world_size if top.distributedInfo else None,
            "bytes": len(buf)}
    del buf
    gpu = {k: [] for k in GPU_SCHEMA}
    gpu_ts: list = []
    launch = {"correlation": [], "pid": [], "tid": [], "ts_ns": []}
    launch_ts: list = []
    cpu = {k: [] for k in CPU_SCHEMA}
    cpu_ts: list = []
    cpu_dur: list = []
    gpu_dur: list = []
    gpu_idx: list = []
    cpu_idx: list = []
    stream_names: dict = {}
    last = time.perf_counter()
    for b0 in range(0, len(raws), BATCH):
        chunk = raws[b0:b0 + BATCH]
        try:
            evs = _EVENTS_DEC.decode(b"[" + b",".join(chunk) + b"]")
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # find the offending event for the message
            for j, r in enumerate(chunk):
                try:
                    msgspec.json.decode(r, type=_Event)
                except (msgspec.DecodeError, msgspec.ValidationError) as e2:
                    raise InputError(path, f"bad event: {e2}", f"event {b0 + j}") from None
            raise InputError(path, f"bad event: {e}", f"events {b0}..{b0 + len(chunk) - 1}") from None
        for j, e in enumerate(evs):
            ph = e.ph
            if ph != "X":
                if ph == "M" and e.name == "thread_name":
                    pass
                continue
            cat = e.cat
            lc = cat.lower() if cat else ""
            if lc in _GPU_CATS:
                a = e.args
                dev = a.device if a and a.device is not None else _int(e.pid)
                st = a.stream if a and a.stream is not None else _int(e.tid)
                gpu["name"].append(str(e.name))
                gpu["cat"].append(lc)
                gpu["device"].append(dev if dev is not None else 0)
                gpu["stream"].append(st if st is not None else 0)
                gpu["correlation"].append(a.correlation if a else None)
                gpu["coll_arg"].append(a.collective if a else None)
                gpu_ts.append(e.ts)
                gpu_dur.append(e.dur)
                gpu_idx.append(b0 + j)
            elif lc in _LAUNCH_CATS:
                a = e.args
                if a is None or a.correlation is None:
                    continue
                launch["correlation"].append(a.correlation)
                launch["pid"].append(_int(e.pid))
                launch["tid"].append(_int(e.tid))
                launch_ts.append(e.ts)
            elif lc in _CPU_CATS and lc != "gpu_user_annotation":
                cpu["name"].append(str(e.name))
                cpu["cat"].append(lc)
                cpu["pid"].append(_int(e.pid))
                cpu["tid"].append(_int(e.tid))
                cpu_ts.append(e.ts)
                cpu_dur.append(e.dur)
                cpu_idx.append(b0 + j)
        del evs
        if progress and time.perf_counter() - last > 2.0:
            last = time.perf_counter()
            print(f"  {path.name}: {min(b0 + BATCH, len(raws)):,}/{len(raws):,} events", file=sys.stderr, flush=True)
    del raws, top
    absolute = base is not None
    base_ns = int(base) if base is not None else 0
    for ts_list, dur_list, idx, cols, kind in ((gpu_ts, gpu_dur, gpu_idx, gpu, "gpu"),
                                               (cpu_ts, cpu_dur, cpu_idx, cpu, "cpu")):
        starts = _convert_ts(ts_list, idx, base_ns, path)
        durs = _convert_dur(dur_list, idx, path)
        cols["start_ns"] = starts
        cols["end_ns"] = [s + d for s, d in zip(starts, durs)]
    launch["ts_ns"] = _convert_ts(launch_ts, None, base_ns, path)
    if gpu["start_ns"] and not absolute:
        absolute = min(gpu["start_ns"]) > 10**18  # integer epoch µs -> ns > 2001-09
    elif cpu["start_ns"] and not absolute:
        absolute = min(cpu["start_ns"]) > 10**18
    info["time_base"] = "epoch" if absolute else "capture_start"
    if progress:
        dt = time.perf_counter() - t0
        print(f"kineto: {path.name}: {info['n_events']:,} events, {info['bytes'] / 1e6:.1f} MB in {dt:.1f} s",
              file=sys.stderr, flush=True)
    return info, gpu, launch, cpu


def _convert_ts(ts_list: list, idx: list | None, base_ns: int, path: Path) -> list[int]:
    texts = []
    for j, t in enumerate(ts_list):
        if not len(t):
            raise InputError(path, "complete event without ts", f"event {idx[j] if idx else j}")
        texts.append(bytes(t))
    try:
        return ts_to_ns(texts, base_ns, path, 0)
    except InputError as e:
        if idx is not None and e.position and e.position.startswith("event "):
            k = int(e.position.split()[1])
            raise InputError(path, e.message, f"event {idx[k]}") from None
        raise


def _convert_dur(dur_list: list, idx: list, path: Path) -> list[int]:
    out = []
    for j, d in enumerate(dur_list):
        if d is None:
            out.append(0)
            continue
        v = int(round(d * 1000)) if isinstance(d, float) else int(d) * 1000
        if v < 0:
            raise InputError(path, f"event has a negative duration ({d} µs)", f"event {idx[j]}")
        if v > MAX_DUR_NS:
            raise InputError(path, f"event lasts {d / 1e6:.0f} s (over an hour): corrupt trace", f"event {idx[j]}")
        out.append(v)
    return out


def _is_kineto(path: Path, head: bytes) -> bool:
    name = path.name.lower()
    if not (name.endswith(".json") or name.endswith(".json.gz") or name.endswith(".pt.trace.json")
            or name.endswith(".trace.json.gz")):
        return False
    if head[:2] == b"\x1f\x8b":
        try:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            head = d.decompress(head, 8192)
        except zlib.error:
            return name.endswith((".trace.json.gz", ".pt.trace.json.gz"))
    text = head.decode("utf-8", "replace")
    return ("traceEvents" in text or "schemaVersion" in text or "deviceProperties" in text
            or ('"ph"' in text and '"ts"' in text))


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    """Files of one folder are the ranks of one run when their ranks differ (from
    ``distributedInfo.rank`` or the file name); otherwise every file is its own run."""
    total = sum(p.stat().st_size for p in paths)
    progress = bool(options.get("progress")) or total > 64 * 2**20
    parsed = []
    for p in sorted(paths):
        info, gpu, launch, cpu = parse_file(p, progress=progress)
        parsed.append((p, info, RankEvents(rank=-1, gpu=frame(gpu, GPU_SCHEMA), launch=frame(launch, LAUNCH_SCHEMA),
                                           cpu=frame(cpu, CPU_SCHEMA), source=p.name)))
        del gpu, launch, cpu
    groups: dict[Path, list] = {}
    for item in parsed:
        groups.setdefault(item[0].parent, []).append(item)
    runs = []
    for _, items in sorted(groups.items()):
        if len(items) > 1 and not _one_run(items):
            runs.extend([it] for it in items)
        else:
            runs.append(items)
    return [_collect_run(items, options) for items in runs]


def _rank_of(p: Path, info: dict) -> int | None:
    return info["rank"] if info["rank"] is not None else rank_from_name(p.name)


def _one_run(items: list) -> bool:
    ranks = [_rank_of(p, info) for p, info, _ in items]
    worlds = {info["world_size"] for _, info, _ in items if info["world_size"]}
    if any(w == 1 for w in worlds) or len(worlds) > 1:
        return False
    if all(r is None for r in ranks):
        return True  # no rank anywhere: a folder of per-rank files, numbered by order
    return None not in ranks and len(set(ranks)) == len(ranks)


def _collect_run(items: list, options: dict) -> RunData:
    paths = [p for p, _, _ in items]
    classifier = Classifier(options.get("kernel_rules"))
    ranks: list[RankEvents] = []
    bases, time_bases, world = set(), set(), set()
    seen: dict[int, str] = {}
    for i, (p, info, ev) in enumerate(items):
        rank, inferred = info["rank"], False
        if rank is None:
            fr = rank_from_name(p.name)
            rank, inferred = (fr, True) if fr is not None else (i, True)
        if rank in seen:
            raise InputError(p, f"rank {rank} appears twice (also in {seen[rank]})")
        seen[rank] = p.name
        time_bases.add(info["time_base"])
        bases.add(info["base_ns"])
        if info["world_size"]:
            world.add(info["world_size"])
        ev.rank, ev.rank_inferred = rank, inferred
        ranks.append(ev)
    if len(time_bases) > 1:
        raise InputError(paths[0], "files mix absolute (epoch) and relative timestamps; they cannot form one run")
    tables, approx, meta = build(ranks, classifier)
    meta.update({"format": "kineto", "world_size": sorted(world), "files": [p.name for p in paths]})
    n_ranks = options.get("num_ranks") or len(ranks)
    run = {
        "source": ",".join(p.name for p in paths) if len(paths) <= 4 else f"{paths[0].parent.name}/ ({len(paths)} files)",
        "source_sha256": sha256_files(paths),
        "time_base": time_bases.pop() if time_bases else "none",
        "num_ranks": n_ranks,
        "ranks_per_node": options.get("ranks_per_node"),
        "num_layers": options.get("num_layers"),
        "num_experts": options.get("num_experts"),
        "top_k": options.get("top_k"),
        "approximations": json.dumps(approx) if approx else None,
        "meta_json": json.dumps(meta),
    }
    hint = paths[0].parent.name if len(paths) > 1 else paths[0].name.split(".")[0]
    return RunData(run=run, tables=tables, run_id_hint=hint, files=[str(p) for p in paths])


register(Collector("kineto", "PyTorch profiler (Kineto) Chrome-trace JSON, plain or .gz; a folder of per-rank files "
                             "is one run", _is_kineto, _collect, priority=20))
