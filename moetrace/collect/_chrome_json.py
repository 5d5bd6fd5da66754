"""Kineto's Chrome-trace JSON reader: the document decoded with msgspec into raw event
slices, then in batches into small typed records holding only the fields moetrace uses,
and from there into columns (the full JSON is never held as Python dicts). ``ts`` is kept
as its decimal text and converted to integer ns exactly (integer absolute-epoch µs, or
fractional µs relative to ``baseTimeNanoseconds``)."""
from __future__ import annotations

import gc
import gzip
import hashlib
import mmap
import os
import re
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from ..domain.kernels import COLLECTIVE_OP_PREFIXES
from ..errors import InputError
from ..safety import (
    INT64,
    SHAPE_MAX,
    bounded_gunzip,
    check_regular_file,
    checked_int,
    max_inflated,
)
from ._chrome_ts import TsTexts as _TsTexts
from ._chrome_ts import dur_column, int_or_none, ts_column
from ._gemm_shape import GEMM_OPS, gemm_out_n
from ._launch_context import CONTEXT_CAT, keep_cpu_op
from ._profile import CPU_SCHEMA, GPU_SCHEMA

BATCH = 4000                       # events decoded to records at a time (cache-sized)
# ids must fit their columns (device, stream: int32; correlation: int64): a value beyond
# is a ValidationError naming the event, never an overflow later
_I32 = Annotated[int, msgspec.Meta(ge=-(2**31), lt=2**31)]
_I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class _Args(msgspec.Struct, gc=False):
    correlation: _I64 | None = None
    device: _I32 | None = None
    stream: _I32 | None = None
    collective: str | None = msgspec.field(default=None, name="Collective name")
    # process group of a collective (PyTorch puts it on NCCL kernels and record_param_comms ops)
    pg_name: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Process Group Name")
    pg_ranks: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Process Group Ranks")
    # the op's input shapes (record_shapes=True): read only for GEMM-like ops (_gemm_shape)
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input Dims")


class _Event(msgspec.Struct, gc=False):
    ph: str | None = None
    cat: str | None = None
    name: str | int | float | None = None
    pid: _I64 | str | None = None
    tid: _I64 | str | None = None
    ts: msgspec.Raw = msgspec.Raw(b"")
    dur: float | int | None = None
    args: _Args | None = None


class _PgConfig(msgspec.Struct):
    pg_name: msgspec.Raw = msgspec.Raw(b"")


class _Dist(msgspec.Struct):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    pg_config: msgspec.Raw = msgspec.Raw(b"")   # read leniently (_pg_names): never a reason to refuse


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


def rank_from_name(name: str, path=None) -> int | None:
    for pat in _RANK_PATTERNS:
        m = pat.search(name)
        if m:   # a rank in a file name is range-checked like one in the trace
            return checked_int(m.group(1), 0, SHAPE_MAX - 1, path or name, "rank in the file name")
    return None


def parse_file(path: Path, progress: bool = False) -> tuple[dict, dict, dict, dict]:
    """Columns of one Kineto file: (info, gpu, launch, cpu)."""
    was = gc.isenabled()
    gc.disable()  # millions of short-lived records: the cyclic collector only costs time here
    try:
        out = _parse_file(path, progress)
        if not len(out[1]["name"]) and not out[0]["all_cpu_ops"]:
            out = _parse_file(path, progress, all_cpu_ops=True)  # no GPU event after all: keep every CPU op
        return out
    except RecursionError:
        raise InputError(path, "JSON nested too deeply to parse (a crafted or corrupt trace)") from None
    finally:
        if was:
            gc.enable()


class _Digest(threading.Thread):
    """sha256 of a buffer, taken in a thread while the caller decodes it (hashlib
    releases the GIL on large buffers: the digest costs no wall time on a second CPU)."""

    def __init__(self, data):
        super().__init__(daemon=True)
        self.data, self.hex = data, None
        self.start()

    def run(self):
        self.hex = hashlib.sha256(self.data).hexdigest()
        self.data = None

    def result(self) -> str:
        self.join()
        return self.hex


def read_bytes(path: Path) -> tuple[bytes | mmap.mmap, _Digest]:
    """(the file's bytes, gunzipped when it is gzip; the sha256 of the bytes on disk, being
    taken in a thread). A plain file is memory-mapped, not copied: the caller closes it.
    Bad gzip is an InputError."""
    check_regular_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            if head == b"\x1f\x8b" or os.fstat(f.fileno()).st_size == 0:  # (size 0: empty, or a pipe)
                raw = head + f.read()
            else:
                try:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    return mm, _Digest(mm)
                except (OSError, ValueError):  # a file that cannot be mapped is read
                    raw = head + f.read()
    except (OSError, ValueError) as e:
        raise InputError(path, f"cannot read: {getattr(e, 'strerror', None) or e}") from None
    digest = _Digest(raw)
    if raw[:2] == b"\x1f\x8b":
        try:
            return _gunzip(raw, path), digest
        except InputError:
            digest.join()
            raise
        except (OSError, EOFError, zlib.error) as e:
            digest.join()
            raise InputError(path, f"corrupt or truncated gzip: {e}") from None
    return raw, digest


try:  # optional (pip install 'moetrace[fast]'): ISA-L inflates about 2.5x faster than zlib
    from isal import isal_zlib as _isal_zlib
except ImportError:  # pragma: no cover - depends on the environment
    _isal_zlib = None


def _gunzip(raw: bytes, path: Path | None = None) -> bytes:
    """Inflate, never beyond safety.max_inflated (a multiple of the compressed size, and
    the memory available): through ISA-L when it is installed and the file is one whole
    gzip member (the usual case); anything else (several members, damage, a bomb) goes to
    safety.bounded_gunzip, which reads every member and words the error."""
    cap = max_inflated(path, len(raw)) if path is not None else None
    if _isal_zlib is not None and cap is not None:
        try:
            d = _isal_zlib.decompressobj(wbits=31)
            out = d.decompress(raw, cap + 1)
            if d.eof and not d.unused_data and len(out) <= cap:
                return out
            del out
        except Exception:  # noqa: BLE001 - bounded_gunzip below says what is wrong
            pass
    if path is None:
        return gzip.decompress(raw)
    return bounded_gunzip(path, raw)


_EVENT_AT = re.compile(r"\$\[(\d+)\]")
_KEY_AT = re.compile(rb'"traceEvents"[ \t\r\n]*:[ \t\r\n]*\[')
_BETWEEN = re.compile(rb'\}[ \t\r\n]*,[ \t\r\n]*\{')
#: bytes of the document decoded at a time (cache-sized: faster than larger slices)
SLICE_BYTES = 256 * 2**10


class _EventsAt(msgspec.Struct):
    traceEvents: msgspec.Raw = msgspec.Raw(b"")


_EVENTS_AT_DEC = msgspec.json.Decoder(_EventsAt)


def _address(b) -> int:
    return np.frombuffer(b, np.uint8).ctypes.data if len(b) else -1


def _decode_in_slices(path: Path, buf: bytes, all_cpu_ops: bool, progress: bool):
    """Fast path: decode ``traceEvents`` straight from slices of the document, cut between
    two events (``}`` ``,`` ``{``) every :data:`SLICE_BYTES`, without a first pass over
    the whole document. Returns (top, columns, n_events), or None when a cut does not
    hold (a slice is not a list of whole events, or the array the cuts are in is not
    the document's ``traceEvents``): the caller then takes the slow path, which also
    words the error. Exact: every slice decodes as a non-empty array of values, so each
    cut lies between two elements of the array opened at the ``traceEvents`` key; the
    rest of the document (head, last slice, tail) decodes as a whole, and its
    ``traceEvents`` value is checked to start at that very byte."""
    key = _KEY_AT.search(buf)
    if key is None:
        return None
    first = key.end()  # just after the '['
    cuts = []
    pos = first + SLICE_BYTES
    while True:
        m = _BETWEEN.search(buf, pos)
        if m is None:
            break
        cuts.append((m.start() + 1, m.end() - 1))  # end of one slice (after '}'), start of the next ('{')
        pos = m.end() + SLICE_BYTES
    if not cuts:
        return None
    mv = memoryview(buf)
    acc = _Acc()
    n = 0
    last = time.perf_counter()
    start = first
    try:
        for end, nxt in cuts:
            evs = _EVENTS_DEC.decode(b"".join((b"[", mv[start:end], b"]")))
            if not evs:
                return None
            _take(evs, n, acc, all_cpu_ops)
            acc.compact()
            n += len(evs)
            del evs
            start = nxt
            if progress and time.perf_counter() - last > 2.0:
                last = time.perf_counter()
                print(f"  {path.name}: {n:,} events, {100 * start / len(buf):.0f}% of {len(buf) / 1e6:.0f} MB",
                      file=sys.stderr, flush=True)
        rest = b"".join((mv[:first], mv[start:]))
        at = _EVENTS_AT_DEC.decode(rest).traceEvents
        if _address(at) != _address(rest) + first - 1:
            return None
        top = _TOP_DEC.decode(rest)
        evs = _EVENTS_DEC.decode(b"[" + b",".join(top.traceEvents) + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    finally:
        mv.release()
    _take(evs, n, acc, all_cpu_ops)
    acc.compact()
    return top, acc, n + len(evs)


def _decode_in_batches(path: Path, buf: bytes, all_cpu_ops: bool, progress: bool):
    """Slow path (any valid document): decode into raw event slices, then BATCH events at a
    time; the error, if any, names the event."""
    if buf.isspace():
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
    acc = _Acc()
    last = time.perf_counter()
    for b0 in range(0, len(raws), BATCH):
        chunk = raws[b0:b0 + BATCH]
        try:
            evs = _EVENTS_DEC.decode(b"[" + b",".join(chunk) + b"]")
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # the offending event, by its index in traceEvents
            m = _EVENT_AT.search(str(e)) if isinstance(e, msgspec.ValidationError) else None
            if m:
                i = b0 + int(m.group(1))
                raise InputError(path, "bad event: " + _EVENT_AT.sub(f"$.traceEvents[{i}]", str(e), count=1),
                                 f"event {i}") from None
            raise InputError(path, f"bad event: {e}", f"events {b0}..{b0 + len(chunk) - 1}") from None
        _take(evs, b0, acc, all_cpu_ops)
        acc.compact()
        del evs
        if progress and time.perf_counter() - last > 2.0:
            last = time.perf_counter()
            print(f"  {path.name}: {min(b0 + BATCH, len(raws)):,}/{len(raws):,} events", file=sys.stderr, flush=True)
    top.traceEvents = None
    return top, acc, len(raws)


def _parse_file(path: Path, progress: bool, all_cpu_ops: bool = False) -> tuple[dict, dict, dict, dict]:
    t0 = time.perf_counter()
    buf, digest = read_bytes(path)
    try:
        if not len(buf):
            raise InputError(path, "file is empty")
        # CPU ops matter only in a CPU-only trace (host spans); a quick byte search tells
        all_cpu_ops = all_cpu_ops or all(buf.find(m) < 0 for m in _GPU_MARKERS)
        got = _decode_in_slices(path, buf, all_cpu_ops, progress)
        if got is None:
            # (the raw event slices of this path point into the buffer: a copy, not the map)
            got = _decode_in_batches(path, bytes(buf) if isinstance(buf, mmap.mmap) else buf, all_cpu_ops,
                                     progress)
        n_bytes = len(buf)
    finally:
        digest.join()  # (on error: no stray thread) the digest is wanted only at the end anyway
        if isinstance(buf, mmap.mmap):
            buf.close()
    top, acc, n_events = got
    base = top.baseTimeNanoseconds
    if base is not None:
        base = checked_int(base, 0, INT64[1], path, "baseTimeNanoseconds")
    dist = top.distributedInfo
    if dist is not None and dist.rank is not None:
        checked_int(dist.rank, 0, SHAPE_MAX - 1, path, "distributedInfo.rank")
    if dist is not None and dist.world_size is not None:
        checked_int(dist.world_size, 1, SHAPE_MAX, path, "distributedInfo.world_size")
    info = {"n_events": n_events, "base_ns": base, "sha256": None, "rank": dist.rank if dist else None,
            "world_size": dist.world_size if dist else None, "bytes": n_bytes, "all_cpu_ops": all_cpu_ops,
            "pg_names": _pg_names(dist.pg_config) if dist else []}
    del buf, top
    absolute = base is not None
    base_ns = int(base) if base is not None else 0
    gpu, launch, cpu = acc.gpu, acc.launch, acc.cpu
    gpu["pg_arg"], cpu["pg_arg"] = acc.gpu_pg, acc.cpu_pg
    cpu["gemm_n"] = acc.cpu_n
    for ts_list, dur_list, idx, cols in ((acc.ts["gpu"], acc.gpu_dur, acc.gpu_idx, gpu),
                                         (acc.ts["cpu"], acc.cpu_dur, acc.cpu_idx, cpu)):
        starts = ts_column(ts_list, idx, base_ns, path)
        durs = dur_column(dur_list, idx, path)
        if len(starts) and starts.min() < 0:
            j = int(starts.arg_min())
            raise InputError(path, f"event starts at a negative time ({starts[j]} ns since the epoch"
                                   f"{'' if absolute else ', no baseTimeNanoseconds'})", f"event {idx[j]}")
        cols["start_ns"] = starts
        cols["end_ns"] = starts + durs
    launch["ts_ns"] = ts_column(acc.ts["launch"], acc.launch_idx, base_ns, path)
    if not absolute:
        firsts = [int(c["start_ns"].min()) for c in (gpu, cpu) if len(c["start_ns"])]
        absolute = bool(firsts) and min(firsts) > 10**18  # integer epoch µs -> ns after 2001-09
    info["time_base"] = "epoch" if absolute else "capture_start"
    info["sha256"] = digest.result()
    if progress:
        dt = time.perf_counter() - t0
        print(f"kineto: {path.name}: {info['n_events']:,} events, {info['bytes'] / 1e6:.1f} MB in {dt:.1f} s",
              file=sys.stderr, flush=True)
    return info, gpu, launch, cpu


_GPU_CATS = frozenset({"kernel", "Kernel", "gpu_memcpy", "gpu_memset", "Memcpy", "Memset", "memcpy", "memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "Driver", "runtime", "driver"})
_CPU_CATS = frozenset({"user_annotation", "cpu_op", "Operator", "operator", "User Annotation"})
_CAT_CANON = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset", "memcpy": "gpu_memcpy",
              "memset": "gpu_memset", "Operator": "cpu_op", "operator": "cpu_op", "User Annotation": "user_annotation"}
_OP_CATS = frozenset({"cpu_op", "Operator", "operator"})
#: 0 device activity, 1 launch, 2 annotation (always kept), 3 CPU op (kept when a collective or CPU-only)
_CAT_CODE = {**{c: 0 for c in _GPU_CATS}, **{c: 1 for c in _LAUNCH_CATS}, **{c: 2 for c in _CPU_CATS - _OP_CATS},
             **{c: 3 for c in _OP_CATS}}
_CAT_CODE_ALL = {c: 2 if k == 3 else k for c, k in _CAT_CODE.items()}  # every CPU op kept (CPU-only trace)
_COLL_PREFIXES = COLLECTIVE_OP_PREFIXES
_COLL_FIRST = frozenset(p[0] for p in _COLL_PREFIXES)
_GPU_MARKERS = (b'"kernel"', b'"Kernel"', b'"gpu_memcpy"', b'"gpu_memset"', b'"Memcpy"', b'"Memset"')


class _Acc:
    """Column lists of the kept events of one file, filled batch by batch."""

    def __init__(self):
        self.gpu = {k: [] for k in GPU_SCHEMA}
        self.gpu_pg: list = []   # process group of each kept device event (None: not in the trace)
        self.cpu_pg: list = []
        self.cpu_n: list = []    # output width N of a kept GEMM-like CPU op (None: not one, or no shapes)
        self.launch = {"correlation": [], "pid": [], "tid": []}
        self.cpu = {k: [] for k in CPU_SCHEMA}
        self.gpu_ts, self.gpu_dur, self.gpu_idx = [], [], []
        self.launch_ts, self.launch_idx = [], []
        self.cpu_ts, self.cpu_dur, self.cpu_idx = [], [], []
        self.ts = {"gpu": _TsTexts(), "launch": _TsTexts(), "cpu": _TsTexts()}

    def compact(self) -> None:
        """Move the batch's ``ts`` slices (which keep the whole decoded batch alive) into
        compact texts."""
        for k, col in self.ts.items():
            raws = getattr(self, k + "_ts")
            if raws:
                col.add(raws)
                raws.clear()


def _take(evs: list, b0: int, acc: _Acc, all_cpu_ops: bool = True) -> None:
    """Columns of one decoded batch (comprehensions: the per-event cost is what matters)."""
    gpu, gpu_ts, gpu_dur, gpu_idx = acc.gpu, acc.gpu_ts, acc.gpu_dur, acc.gpu_idx
    launch, launch_ts = acc.launch, acc.launch_ts
    cpu, cpu_ts, cpu_dur, cpu_idx = acc.cpu, acc.cpu_ts, acc.cpu_dur, acc.cpu_idx
    g, lr, c = [], [], []
    ga, la, ca = g.append, lr.append, c.append
    code = (_CAT_CODE_ALL if all_cpu_ops else _CAT_CODE).get
    first = _COLL_FIRST
    keep_ctx, ctx_at, gemm_ops = keep_cpu_op, set(), GEMM_OPS
    for i, e in enumerate(evs):  # one pass: most events are dropped on their category
        k = code(e.cat)
        if k is None:
            continue
        if k == 3:  # a CPU op: kept when a collective (or the record_param_comms naming its process group)
            n = e.name
            if type(n) is str and e.ph == "X" and (
                    (n[:1] in first and n.startswith(_COLL_PREFIXES))
                    or (n == "record_param_comms" and e.args is not None
                        and (len(e.args.pg_name) or len(e.args.pg_ranks)))):
                ca((i, e))
            elif e.ph == "X" and (keep_ctx(n) or (n in gemm_ops and e.args is not None and len(e.args.input_dims))):
                ca((i, e))   # or as launch context (vllm::moe_forward, ...; a GEMM op with its shapes)
                ctx_at.add(i)
        elif k == 1:
            la((i, e))
        elif e.ph == "X":
            if k == 0:
                ga((i, e))
            else:
                ca((i, e))
    if g:
        gpu["name"].extend([str(e.name) for _, e in g])
        gpu["cat"].extend([_CAT_CANON.get(e.cat, e.cat) for _, e in g])
        gpu["device"].extend([e.args.device if e.args is not None and e.args.device is not None
                              else ((e.pid if type(e.pid) is int else int_or_none(e.pid)) or 0) for _, e in g])
        gpu["stream"].extend([e.args.stream if e.args is not None and e.args.stream is not None
                              else ((e.tid if type(e.tid) is int else int_or_none(e.tid)) or 0) for _, e in g])
        gpu["correlation"].extend([e.args.correlation if e.args is not None else None for _, e in g])
        gpu["coll_arg"].extend([e.args.collective if e.args is not None else None for _, e in g])
        acc.gpu_pg.extend([_pg_of(e.args) for _, e in g])
        gpu_ts.extend([e.ts for _, e in g])
        gpu_dur.extend([e.dur for _, e in g])
        gpu_idx.extend([b0 + i for i, _ in g])
    lr = [(i, e) for i, e in lr if e.args is not None and e.args.correlation is not None]
    if lr:
        launch["correlation"].extend([e.args.correlation for _, e in lr])
        launch["pid"].extend([(e.pid if type(e.pid) is int else int_or_none(e.pid)) for _, e in lr])
        launch["tid"].extend([(e.tid if type(e.tid) is int else int_or_none(e.tid)) for _, e in lr])
        launch_ts.extend([e.ts for _, e in lr])
        acc.launch_idx.extend([b0 + i for i, _ in lr])
    if c:
        cpu["name"].extend([str(e.name) for _, e in c])
        cpu["cat"].extend([CONTEXT_CAT if i in ctx_at else _CAT_CANON.get(e.cat, e.cat) for i, e in c])
        cpu["pid"].extend([(e.pid if type(e.pid) is int else int_or_none(e.pid)) for _, e in c])
        cpu["tid"].extend([(e.tid if type(e.tid) is int else int_or_none(e.tid)) for _, e in c])
        cpu_ts.extend([e.ts for _, e in c])
        cpu_dur.extend([e.dur for _, e in c])
        cpu_idx.extend([b0 + i for i, _ in c])
        acc.cpu_pg.extend([_pg_of(e.args) for _, e in c])
        acc.cpu_n.extend([gemm_out_n(e.name, bytes(e.args.input_dims)) if e.name in gemm_ops and e.args is not None
                          else None for _, e in c])


def _pg_of(args) -> str | None:
    """A collective's process group from its event args: the group's name, else its ranks
    (``ranks [0,1]``); None when the event does not say."""
    if args is None or (not len(args.pg_name) and not len(args.pg_ranks)):   # (most events: no group args)
        return None
    name = _plain(args.pg_name)
    if name:
        return name
    txt = _plain(args.pg_ranks).replace(" ", "")
    return f"ranks {txt}" if _RANKS_RE.fullmatch(txt) else None


_RANKS_RE = re.compile(r"\[\d+(?:,\d+)*\]")


def _pg_names(raw: msgspec.Raw) -> list[str]:
    """The group names of ``distributedInfo.pg_config`` ([] when absent or malformed)."""
    try:
        groups = msgspec.json.decode(bytes(raw), type=list[_PgConfig]) if bytes(raw).strip() else []
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []
    return [n for n in (_plain(g.pg_name) for g in groups) if n]


def _plain(raw: msgspec.Raw) -> str:
    """A string or number arg as text ('' for null, absent or anything else): a group arg
    of an unexpected type is not read, never a reason to refuse the trace."""
    b = bytes(raw).strip()
    if b[:1] == b'"':
        try:
            return msgspec.json.decode(b, type=str)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return ""
    if b[:1] == b"[":   # a list of ranks
        try:
            return "[" + ",".join(str(r) for r in msgspec.json.decode(b, type=list[int])) + "]"
        except (msgspec.DecodeError, msgspec.ValidationError):
            return ""
    return b.decode("ascii", "replace") if b and re.fullmatch(rb"-?\d+", b) else ""
