"""Nsight Systems SQLite export (``nsys export --type sqlite``), plain or ``.gz``.

Kernels come from ``CUPTI_ACTIVITY_KIND_KERNEL`` (name through ``StringIds``:
``demangledName``, else ``shortName``), copies and memsets from
``CUPTI_ACTIVITY_KIND_MEMCPY`` / ``_MEMSET``, launches from ``CUPTI_ACTIVITY_KIND_RUNTIME``
(correlation id -> CPU thread and time) and ranges from ``NVTX_EVENTS`` (push/pop and
start/end ranges; text inline or through ``textId``). Times are ns from capture start;
with ``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` they become Unix-epoch ns.

Ranks: one file per rank (rank from the file name, else the file's order); a file holding
several processes with GPU work makes one rank per process (ordered by pid), a single
process driving several devices one rank per device. NVTX ranges named
``ProfilerStep#N`` give steps; ``dispatch``/``combine``/``layer N`` ranges label the
all-to-all, as for Kineto traces.
"""
from __future__ import annotations

import sqlite3
import sys
import tempfile
import zlib
from pathlib import Path

from ..domain.hashing import sha256_files
from ..domain.kernels import Classifier
from ..errors import InputError
from ..safety import (
    INT64,
    bounded_gunzip,
    check_regular_file,
    checked_int,
    limit,
    limit_error,
    sql_identifier,
    sqlite_ro_uri,
)
from . import Collector, RunData, register
from ._chrome_json import rank_from_name
from ._chrome_ts import MAX_DUR_NS
from ._polars import pl
from ._profile import CPU_SCHEMA, GPU_SCHEMA, LAUNCH_SCHEMA, RankEvents, build, run_data

SQLITE_MAGIC = b"SQLite format 3\x00"
NVTX_RANGE_TYPES = (59, 60, 70, 71)  # push/pop and start/end ranges (incl. domain variants)


def _sniff(path: Path, head: bytes) -> bool:
    name = path.name.lower()
    if head.startswith(SQLITE_MAGIC):
        return name.endswith((".sqlite", ".db", ".nsys.sqlite")) or "nsys" in name
    if head[:2] == b"\x1f\x8b" and name.endswith((".sqlite.gz", ".db.gz")):
        try:
            return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 64).startswith(SQLITE_MAGIC)
        except zlib.error:
            return False
    return False


def _open(path: Path, tmpdir: Path) -> sqlite3.Connection:
    """Open an export read-only and immutable through a percent-encoded URI: nothing is
    ever written next to the input (no -wal / -shm / journal, even for a WAL-mode export);
    a .gz is inflated (size-capped, safety.max_inflated) into a private temp folder."""
    check_regular_file(path)
    src = path
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        src = tmpdir / "export.sqlite"
        with open(src, "wb") as fo:
            bounded_gunzip(path, out=fo)
    try:
        con = sqlite3.connect(sqlite_ro_uri(src), uri=True)
        con.text_factory = lambda b: b.decode("utf-8", "replace")
        # no string or blob (a generated column's value included) longer than names may be
        con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max(1 << 16, 2 * limit("max_name_bytes")))
        con.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except (sqlite3.Error, UnicodeError) as e:
        raise InputError(path, f"not a readable SQLite database: {e}") from None
    return con


def _tables(con: sqlite3.Connection, path: Path) -> dict[str, set[str]]:
    """Tables of the export and their columns. Only real tables: a VIEW (which could be
    an endless recursive query) or a virtual table under an nsys table name is refused."""
    out = {}
    for t, typ, sql in con.execute("SELECT name, type, sql FROM sqlite_master WHERE type IN ('table', 'view')"):
        if not isinstance(t, str):
            continue
        wanted = t == "StringIds" or t == "NVTX_EVENTS" or t.startswith(("CUPTI_ACTIVITY_KIND_", "TARGET_INFO_"))
        if typ != "table" or (isinstance(sql, str) and sql.lstrip().upper().startswith("CREATE VIRTUAL")):
            if wanted:
                raise InputError(path, f"{t[:60]!r} is a {typ if typ != 'table' else 'virtual table'}, not a table; "
                                       "an Nsight export holds plain tables only")
            continue
        cols = con.execute(f"PRAGMA table_xinfo({sql_identifier(t)})").fetchall()
        gen = [c[1] for c in cols if c[6] in (2, 3)]   # hidden = 2/3: a generated column, computed when read
        if wanted and gen:
            raise InputError(path, f"table {t[:60]!r} has a generated column {str(gen[0])[:60]!r}; an Nsight export "
                                   "holds stored values only")
        out[t] = {c[1] for c in cols if c[6] not in (1,)}
    return out


def _check_row_counts(con: sqlite3.Connection, tabs: dict, path: Path, size: int) -> None:
    """Row counts of the tables read, against what the file's bytes can hold (a row takes
    at least a few bytes of a page): a crafted count is refused before any row is read."""
    for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
              "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS", "StringIds"):
        if t in tabs:
            n = con.execute(f"SELECT count(*) FROM {sql_identifier(t)}").fetchone()[0]
            if n > size // 2 + 1000:
                raise InputError(path, f"table {t} claims {n} rows, more than a {size}-byte file can hold")
    if "StringIds" in tabs and "id" in tabs["StringIds"]:
        dup = con.execute("SELECT id FROM StringIds GROUP BY id HAVING count(*) > 1 LIMIT 1").fetchone()
        if dup is not None:
            raise InputError(path, f"StringIds holds the id {dup[0]!r} twice (a join on it would multiply rows)")


def _df(con, sql: str, schema: dict, path: Path) -> pl.DataFrame:
    try:
        rows = con.execute(sql).fetchall()
    except sqlite3.DataError as e:   # SQLITE_LIMIT_LENGTH: a string longer than any name may be
        raise limit_error(path, "max_name_bytes", f"a value ({e})") from None
    except sqlite3.DatabaseError as e:
        raise InputError(path, f"cannot read the nsys export: {e}") from None
    cap = limit("max_name_bytes")
    for i, row in enumerate(rows):
        for v in row:
            if isinstance(v, str) and len(v) > cap // 4 and len(v.encode("utf-8", "replace")) > cap:
                raise limit_error(path, "max_name_bytes", f"a name of {len(v.encode('utf-8', 'replace'))} bytes",
                                  f"row {i + 1}")
    try:
        return pl.DataFrame(rows, schema=schema, orient="row")
    except Exception as e:  # noqa: BLE001 - a text / real / out-of-range value in an integer column
        raise InputError(path, f"a column holds a value that is not a {', '.join(sorted({str(t) for t in schema.values()}))} "
                               f"({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None


def _check_times(path: Path, off: int, *cols) -> None:
    """Timestamps are >= 0 and stay within int64 nanoseconds after the session's epoch
    offset is added (polars would wrap them silently)."""
    checked_int(off, 0, INT64[1], path, "TARGET_INFO_SESSION_START_TIME.utcEpochNs")
    for c in cols:
        c = c.drop_nulls()
        if not c.len():
            continue
        lo, hi = int(c.min()), int(c.max())
        if lo < 0:
            raise InputError(path, f"a timestamp is negative ({lo} ns)")
        if hi + off > INT64[1]:
            raise InputError(path, f"timestamp {hi} ns + session start {off} ns is outside int64 nanoseconds "
                                   f"(-2^63..2^63-1)")


def read_export(path: Path, tmpdir: Path) -> tuple[list[dict], int | None]:
    """Per-rank frames of one export: list of {gpu, launch, cpu, key}, and the epoch offset."""
    con = _open(path, tmpdir)
    try:
        tabs = _tables(con, path)
        if "StringIds" not in tabs or not any(t.startswith("CUPTI_ACTIVITY_KIND_") or t == "NVTX_EVENTS" for t in tabs):
            raise InputError(path, "SQLite file is not an Nsight Systems export (no StringIds / CUPTI_ACTIVITY_KIND_* "
                                   "tables)")
        inflated = tmpdir / "export.sqlite"
        _check_row_counts(con, tabs, path, (inflated if inflated.exists() else path).stat().st_size)
        epoch = None
        if "TARGET_INFO_SESSION_START_TIME" in tabs and "utcEpochNs" in tabs["TARGET_INFO_SESSION_START_TIME"]:
            r = con.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME LIMIT 1").fetchone()
            epoch = checked_int(r[0], 0, INT64[1], path, "TARGET_INFO_SESSION_START_TIME.utcEpochNs") \
                if r and r[0] is not None else None
        gschema = {"name": pl.Utf8, "cat": pl.Utf8, "device": pl.Int32, "stream": pl.Int32, "start_ns": pl.Int64,
                   "end_ns": pl.Int64, "correlation": pl.Int64, "gpid": pl.Int64}
        parts = []
        k = tabs.get("CUPTI_ACTIVITY_KIND_KERNEL")
        if k:
            name_col = "demangledName" if "demangledName" in k else "shortName"
            parts.append(_df(con, f"""
                SELECT coalesce(s.value, s2.value, '<unknown kernel>'), 'kernel', k.deviceId, k.streamId, k.start, k.end,
                       k.correlationId, k.globalPid
                FROM CUPTI_ACTIVITY_KIND_KERNEL k
                LEFT JOIN StringIds s ON s.id = k.{name_col}
                LEFT JOIN StringIds s2 ON s2.id = k.shortName""", gschema, path))
        for tab, cat, label in (("CUPTI_ACTIVITY_KIND_MEMCPY", "gpu_memcpy", "Memcpy"),
                                ("CUPTI_ACTIVITY_KIND_MEMSET", "gpu_memset", "Memset")):
            if tab in tabs:
                nm = f"'{label}'"
                if "copyKind" in tabs[tab]:
                    nm = ("CASE copyKind WHEN 1 THEN 'Memcpy HtoD' WHEN 2 THEN 'Memcpy DtoH' WHEN 8 THEN 'Memcpy DtoD' "
                          "WHEN 10 THEN 'Memcpy PtoP' ELSE 'Memcpy' END")
                parts.append(_df(con, f"""SELECT {nm}, '{cat}', deviceId, streamId, start, end, correlationId,
                                          globalPid FROM {tab}""", gschema, path))
        gpu = pl.concat(parts) if parts else pl.DataFrame(schema=gschema)
        bad = gpu.filter((pl.col("end_ns") < pl.col("start_ns")) | ((pl.col("end_ns") - pl.col("start_ns")) > MAX_DUR_NS))
        if bad.height:
            r = bad.row(0, named=True)
            raise InputError(path, f"{r['cat']} {r['name'][:60]!r} has an absurd duration "
                                   f"({(r['end_ns'] - r['start_ns']) / 1e9:.3f} s)", f"start={r['start_ns']}")
        lschema = {"correlation": pl.Int64, "gtid": pl.Int64, "ts_ns": pl.Int64}
        launch = (_df(con, "SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME", lschema, path)
                  if "CUPTI_ACTIVITY_KIND_RUNTIME" in tabs else pl.DataFrame(schema=lschema))
        cschema = {"name": pl.Utf8, "gtid": pl.Int64, "start_ns": pl.Int64, "end_ns": pl.Int64}
        nv = tabs.get("NVTX_EVENTS")
        if nv:
            text = "coalesce(n.text, s.value)" if "textId" in nv else "n.text"
            join = "LEFT JOIN StringIds s ON s.id = n.textId" if "textId" in nv else ""
            types = ",".join(map(str, NVTX_RANGE_TYPES))
            cpu = _df(con, f"""SELECT {text}, n.globalTid, n.start, n.end FROM NVTX_EVENTS n {join}
                               WHERE n.eventType IN ({types}) AND n.end IS NOT NULL""", cschema, path)
            cpu = cpu.filter(pl.col("name").is_not_null())
        else:
            cpu = pl.DataFrame(schema=cschema)
    finally:
        con.close()
        (tmpdir / "export.sqlite").unlink(missing_ok=True)
    # globalTid / globalPid: pid in bits 24..47, tid in the low 24 bits
    launch = launch.with_columns((pl.col("gtid") // (1 << 24) % (1 << 24)).alias("pid"),
                                 (pl.col("gtid") % (1 << 24)).alias("tid"))
    cpu = cpu.with_columns((pl.col("gtid") // (1 << 24) % (1 << 24)).alias("pid"),
                           (pl.col("gtid") % (1 << 24)).alias("tid"), pl.lit("user_annotation").alias("cat"))
    gpu = gpu.with_columns((pl.col("gpid") // (1 << 24) % (1 << 24)).alias("pid"))
    off = epoch or 0
    _check_times(path, off, gpu["start_ns"], gpu["end_ns"], launch["ts_ns"], cpu["start_ns"], cpu["end_ns"])
    if off:
        gpu = gpu.with_columns(pl.col("start_ns") + off, pl.col("end_ns") + off)
        launch = launch.with_columns(pl.col("ts_ns") + off)
        cpu = cpu.with_columns(pl.col("start_ns") + off, pl.col("end_ns") + off)
    # split into ranks: one per process with GPU work, else one per device
    pids = sorted(gpu["pid"].unique().drop_nulls().to_list())
    devices = sorted(gpu["device"].unique().drop_nulls().to_list())
    out = []
    if len(pids) > 1:
        for p in pids:
            out.append({"key": ("pid", p), "gpu": gpu.filter(pl.col("pid") == p),
                        "launch": launch.filter(pl.col("pid") == p), "cpu": cpu.filter(pl.col("pid") == p)})
    elif len(devices) > 1:
        for d in devices:
            out.append({"key": ("device", d), "gpu": gpu.filter(pl.col("device") == d), "launch": launch, "cpu": cpu})
    else:
        out.append({"key": None, "gpu": gpu, "launch": launch, "cpu": cpu})
    for o in out:
        o["gpu"] = o["gpu"].select(*[pl.col(c) for c in ("name", "cat", "device", "stream", "start_ns", "end_ns",
                                                          "correlation")],
                                   pl.lit(None, pl.Utf8).alias("coll_arg")).cast(GPU_SCHEMA)
        o["launch"] = o["launch"].select(list(LAUNCH_SCHEMA)).cast(LAUNCH_SCHEMA)
        o["cpu"] = o["cpu"].select(list(CPU_SCHEMA)).cast(CPU_SCHEMA)
    return out, epoch


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    groups: dict[Path, list[Path]] = {}
    for p in paths:
        groups.setdefault(p.parent, []).append(p)
    return [_collect_run(sorted(g), options) for _, g in sorted(groups.items())]


def _collect_run(paths: list[Path], options: dict) -> RunData:
    classifier = Classifier(options.get("kernel_rules"), options.get("num_experts"))
    ranks: list[RankEvents] = []
    epochs = set()
    with tempfile.TemporaryDirectory(prefix="moetrace-nsys-") as td:
        next_rank = 0
        for _i, p in enumerate(paths):
            if len(paths) > 1 or p.stat().st_size > 64 * 2**20:
                print(f"nsys: reading {p.name}", file=sys.stderr, flush=True)
            try:
                per, epoch = read_export(p, Path(td))
            except InputError:
                raise
            except (sqlite3.Error, UnicodeError, ValueError, OverflowError, TypeError, pl.exceptions.PolarsError) as e:
                msg = str(e).encode("utf-8", "replace").decode("utf-8", "replace")[:200]
                raise InputError(p, f"corrupt or unreadable Nsight export ({type(e).__name__}: {msg})") from None
            epochs.add(epoch is not None)
            file_rank = rank_from_name(p.name, p)
            for _j, part in enumerate(per):
                if len(per) == 1 and file_rank is not None:
                    rank, inferred = file_rank, False
                else:
                    rank, inferred = next_rank, True
                next_rank = max(next_rank, rank) + 1
                note = []
                if part["key"] is not None:
                    note.append(f"{p.name}: rank {rank} is {part['key'][0]} {part['key'][1]} (ranks of one export "
                                f"numbered by {part['key'][0]} order)")
                ranks.append(RankEvents(rank=rank, gpu=part["gpu"], launch=part["launch"], cpu=part["cpu"],
                                        source=p.name, rank_inferred=inferred and len(paths) > 1 and not note,
                                        notes=note))
    if len({r.rank for r in ranks}) != len(ranks):
        raise InputError(paths[0], "two exports claim the same rank (name files rank-N.sqlite)")
    tables, approx, meta = build(ranks, classifier)
    meta.update({"format": "nsys-sqlite", "files": [p.name for p in paths]})
    time_base = "epoch" if all(epochs) else "capture_start"
    if len(epochs) > 1:
        approx.append("some exports lack TARGET_INFO_SESSION_START_TIME: times are from each capture's start")
    return run_data(paths, sha256_files(paths), time_base, options.get("num_ranks") or len(ranks), options, approx,
                    meta, tables)


register(Collector("nsys", "Nsight Systems SQLite export (nsys export --type sqlite), plain or .gz", _sniff, _collect,
                   priority=20))
