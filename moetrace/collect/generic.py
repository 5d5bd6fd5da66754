"""Generic collector: CSV, JSONL or Parquet in the canonical expert_load or routing columns.

expert_load needs ``step, layer, expert, tokens`` (optional ``slot, src_rank``); routing
needs ``step, layer, token, expert`` (optional ``choice, src_rank, slot, gate``; without
``choice`` the order of a token's rows gives it). Routing is also aggregated into
expert_load so every metric works on it. Each file is one run.

expert_load files stream (benchmarks/results/scale_log.md): Parquet and JSONL are read in batches of
:data:`._generic_read.BATCH_ROWS` rows, CSV in 8 MiB blocks (pyarrow's streaming reader). A first pass
checks every batch (integer columns, nulls, negative values, ids inside the shape given
and the contract's int32) and notes the shape; the rows are written in a second pass over the file,
batch by batch, so memory does not grow with the file. A file whose rows are complete
(step, layer) groups of experts 0..E-1 in order (no slot, no source rank) is stored in the
dense layout (``expert_counts``, one row per step and layer); any other file as long
``expert_load`` rows (``--set layout=long`` forces that). Duplicate rows are found by
DuckDB over the key columns (it spills), or ruled out by the dense order.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from ..domain.hashing import sha256_files
from ..errors import InputError
from ..streams import Rereadable, prefetched
from . import Collector, RunData, head, register
from ._compressed import is_gzip, plain_name
from ._generic_read import (
    _columns,
    _frames,
    _jsonl_batches,
    _parquet_batches,
    _row,
)
from .checks import MAX_COUNT

if TYPE_CHECKING:   # polars is imported where a path needs it (a command's start-up)
    import polars as pl

LOAD_REQ = ["step", "layer", "expert", "tokens"]
LOAD_OPT = ["slot", "src_rank"]
ROUTE_REQ = ["step", "layer", "token", "expert"]
ROUTE_OPT = ["choice", "src_rank", "slot", "gate"]
#: progress lines on stderr for files of more rows than this (or with ``--set progress=1``)
PROGRESS_ROWS = 8_000_000


def _kind_of(path: Path, head: bytes) -> str | None:
    name = path.name.lower()
    if is_gzip(path, head) and plain_name(path).endswith((".jsonl", ".ndjson")):
        return "jsonl"   # (a gzip JSONL, read inflated)
    if name.endswith(".parquet") and head[:4] == b"PAR1":
        return "parquet"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".csv"):
        # the generic collector is tried last: any CSV other collectors did not claim is
        # read here, so a CSV with missing columns gets the list of what is missing
        return "csv"
    return None


def _sniff(path: Path, head: bytes) -> bool:
    return _kind_of(path, head) is not None


#: the order the range checks of a batch run in (the first bad value of the first column
#: in this order is the one reported)
_RANGE_ORDER = ("layer", "expert", "slot", "step", "src_rank", "tokens")


def _upper(c: str, shape: dict) -> int | None:
    """The bound an expert_load column's values must stay below: the run's shape given
    (``shape``: layer, expert, slot, src_rank), the contract's int32, the largest count."""
    upper = shape.get(c)
    if c == "tokens":  # counts bounded so sums stay exact (checks.MAX_COUNT)
        upper = MAX_COUNT + 1
    if c in ("layer", "expert", "slot", "src_rank"):   # int32 in the contract (schemas/expert_load.json)
        upper = min(upper, 2 ** 31) if upper is not None else 2 ** 31
    return upper


def _negative(path: Path, c: str, value, row: int) -> InputError:
    return InputError(path, f"expert_load.{c} = {value} is negative", _row(path, row))


def _too_large(path: Path, c: str, value, upper: int, row: int) -> InputError:
    what = "does not fit the contract's int32" if upper == 2 ** 31 else f"is outside the run's shape (0..{upper - 1})"
    if c == "tokens":
        what = f"is beyond the largest count moetrace accepts (2^40 = {MAX_COUNT}; sums must stay exact)"
    return InputError(path, f"expert_load.{c} = {value} {what}", _row(path, row))


def _check_load_batch(df: pl.DataFrame, path: Path, offset: int, cols: set, shape: dict) -> pl.DataFrame:
    """One batch of expert_load rows: the contract's columns as Int64 (absent optional ones
    null), required ones non-null, counts and ids non-negative and inside ``shape``."""
    if set(df.columns) != cols:
        raise InputError(path, f"columns change within the file: {', '.join(df.columns)}", _row(path, offset + 1))
    df = _columns(df, path, LOAD_REQ, LOAD_OPT, offset)
    for c in _RANGE_ORDER:
        col = df[c]
        mn = col.min()
        if mn is not None and mn < 0:
            i = int((col < 0).fill_null(False).arg_max())
            raise _negative(path, c, col[i], offset + i + 1)
        upper = _upper(c, shape)
        mx = col.max()
        if upper is not None and mx is not None and mx >= upper:
            i = int((col >= upper).fill_null(False).arg_max())
            raise _too_large(path, c, col[i], upper, offset + i + 1)
    return df.select(["step", "layer", "expert", "slot", "src_rank", "tokens"])


def _cast_load_batch(df: pl.DataFrame, path: Path, offset: int, cols: set) -> pl.DataFrame:
    """A batch the first pass checked, cast as :func:`_check_load_batch` casts it."""
    if set(df.columns) != cols:
        raise InputError(path, f"columns change within the file: {', '.join(df.columns)}", _row(path, offset + 1))
    return _columns(df, path, LOAD_REQ, LOAD_OPT, offset).select(["step", "layer", "expert", "slot", "src_rank",
                                                                   "tokens"])


def _load_arrow(df: pl.DataFrame) -> pa.Table:
    t = df.to_arrow()
    return pa.table({"step": t.column("step"), "layer": t.column("layer").cast(pa.int32()),
                     "expert": t.column("expert").cast(pa.int32()), "slot": t.column("slot").cast(pa.int32()),
                     "src_rank": t.column("src_rank").cast(pa.int32()), "tokens": t.column("tokens")})


class _Progress:
    def __init__(self, path: Path, what: str, enabled: bool):
        self.path, self.what, self.enabled = path, what, enabled
        self.t0 = self.last = time.perf_counter()

    def __call__(self, rows: int, force: bool = False) -> None:
        now = time.perf_counter()
        if self.enabled and (force or now - self.last >= 5):
            self.last = now
            print(f"moetrace: {self.path.name}: {self.what} {rows:,} rows, {now - self.t0:.0f} s", file=sys.stderr,
                  flush=True)


def _first_duplicate(path: Path, cols: set, shape: dict) -> dict | None:
    """The first (step, layer, expert, slot, src_rank) key that repeats, found by DuckDB
    over the key columns of every batch (its aggregation spills to disk)."""
    import duckdb
    import polars as pl

    schema = pa.schema([(c, pa.int64()) for c in ("step", "layer", "expert", "slot", "src_rank", "rn")])

    def keys():
        off = 0
        for df in _frames(path):
            b = _check_load_batch(df, path, off, cols, shape)
            b = b.with_columns(pl.int_range(off + 1, off + 1 + b.height, dtype=pl.Int64).alias("rn"))
            off += df.height
            yield from b.select(schema.names).cast(pl.Int64).to_arrow().to_batches()

    con = duckdb.connect(":memory:")
    con.execute("SET preserve_insertion_order=false")
    reader = pa.RecordBatchReader.from_batches(schema, keys())
    con.register("_keys", reader)
    row = con.execute("SELECT step, layer, expert, count(*) AS n, min(rn), max(rn) FROM _keys GROUP BY step, layer, "
                      "expert, slot, src_rank HAVING count(*) > 1 ORDER BY step, layer, expert LIMIT 1").fetchone()
    con.close()
    return None if row is None else {"step": row[0], "layer": row[1], "expert": row[2], "len": row[3],
                                     "first": row[4], "last": row[5]}


# ----------------------------------------------------------------------------- one pass (dense Parquet)
#: Parquet column types the one pass reads as they are (every value fits int64)
_ONE_PASS_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


def _footer_ranges(path: Path) -> tuple[object, dict, dict] | None:
    """(metadata, min, max) of the four expert_load columns of a Parquet file from its
    footer's row-group statistics, or None when the file is not one the one pass reads
    (no footer, optional or odd columns, integer types other than :data:`_ONE_PASS_TYPES`,
    a row group without statistics, nulls)."""
    import pyarrow.parquet as pq

    from ..safety import arrow_path

    try:
        pf = pq.ParquetFile(arrow_path(path))
        md, arrow = pf.metadata, pf.schema_arrow
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        return None                          # the two passes say what is wrong with it
    names = arrow.names
    if len(set(names)) != len(names) or not set(LOAD_REQ) <= set(names) or set(LOAD_OPT) & set(names):
        return None
    if any(str(arrow.field(c).type) not in _ONE_PASS_TYPES for c in LOAD_REQ) or md.num_rows == 0:
        return None
    where = {md.schema.column(i).path: i for i in range(md.num_columns)}
    lo: dict = {}
    hi: dict = {}
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows == 0:
            continue
        for c in LOAD_REQ:
            st = rg.column(where[c]).statistics if c in where else None
            if st is None or not st.has_min_max or not st.has_null_count or st.null_count:
                return None
            lo[c] = min(lo.get(c, st.min), st.min)
            hi[c] = max(hi.get(c, st.max), st.max)
    return (md, lo, hi) if len(hi) == len(LOAD_REQ) else None


def _one_pass(path: Path, options: dict) -> RunData | None:
    """A Parquet expert_load file read once: every batch checked (the same checks and
    messages as :func:`_check_load_batch`) and turned into dense rows as it is read, the
    store writing each while the next is read (a second thread). Taken when the footer's
    statistics promise a file the dense layout holds (no slot or source rank, no nulls,
    values inside the shape); None otherwise (the two passes of :func:`_collect_load`).

    The rows are checked while the store writes them: a bad value raises InputError from
    inside the write, whose transaction leaves the store as it was. A file that breaks the
    footer's promise (rows not in dense order, statistics that disagree with them) raises
    :class:`~moetrace.collect.OnePassFailed` there, and the ingest writes the run again
    through ``RunData.two_pass`` (this file's :func:`_collect_load`)."""
    from . import OnePassFailed

    found = _footer_ranges(path)
    if found is None:
        return None
    md, lo, hi = found
    cols = set(md.schema.to_arrow_schema().names)
    L, E = options.get("num_layers"), options.get("num_experts")
    shape = {"layer": L, "expert": E, "slot": options.get("num_slots") or E, "src_rank": options.get("num_ranks")}
    if any(v < 0 for v in lo.values()) or any(hi[c] >= u for c in LOAD_REQ if (u := _upper(c, shape)) is not None):
        return None                          # a bad value: the two passes find and name its row
    E_run = E or hi["expert"] + 1
    if hi["expert"] + 1 != E_run or md.num_rows % E_run:
        return None                          # not the dense layout
    L_seen = hi["layer"] + 1
    big = bool(options.get("progress")) or md.num_rows > PROGRESS_ROWS

    def dense_rows() -> Iterator[pa.Table]:
        import numpy as np

        dense = _dense()
        d = dense.Densifier(E_run)
        p = _Progress(path, "written", big)
        off, top = 0, -1
        for b in _parquet_batches(path, LOAD_REQ):
            arrays = {}
            for c in LOAD_REQ:
                a = b.column(c)
                if a.null_count:             # the footer said none
                    i = next(j for j, v in enumerate(a.is_valid().to_pylist()) if not v)
                    raise InputError(path, f"column {c!r} is empty", _row(path, off + i + 1))
                arrays[c] = dense.numpy_ints(a).astype(np.int64, copy=False)
            for c in _RANGE_ORDER:
                v = arrays.get(c)
                if v is None:
                    continue
                if v.min() < 0:
                    i = int(np.argmax(v < 0))
                    raise _negative(path, c, v[i], off + i + 1)
                upper = _upper(c, shape)
                if upper is not None and v.max() >= upper:
                    i = int(np.argmax(v >= upper))
                    raise _too_large(path, c, v[i], upper, off + i + 1)
            top = max(top, int(arrays["layer"].max()))
            try:
                out = d.feed(pa.table({c: dense.arrow_ints(arrays[c]) for c in LOAD_REQ}))
            except dense.NotDense as e:
                raise OnePassFailed(f"{path}: {e}") from None
            off += b.num_rows
            if out is not None and out.num_rows:
                yield out
            p(off)
        try:
            d.finish()
        except dense.NotDense as e:
            raise OnePassFailed(f"{path}: {e}") from None
        if off != md.num_rows or (not L and top + 1 != L_seen):
            raise OnePassFailed(f"{path}: the footer's statistics disagree with the rows")
        p(off, force=big)

    approx = []
    if not L:
        approx.append("num_layers inferred from the highest layer id")
    if not E:
        approx.append("num_experts inferred from the highest expert id")
    run = _run_row(path, options, "expert_load", L_seen, E_run, None, approx)
    return RunData(run=run, tables={"expert_counts": Rereadable(lambda: prefetched(dense_rows))},
                   run_id_hint=path.name.split(".")[0], files=[str(path)],
                   two_pass=lambda: _collect_load(path, cols, options))


def _collect_load(path: Path, cols: set, options: dict) -> RunData:
    """The streamed expert_load path: check every batch (first pass), then hand the store
    a re-readable stream of dense or long rows (second pass, when written)."""
    L, E = options.get("num_layers"), options.get("num_experts")
    shape = {"layer": L, "expert": E, "slot": options.get("num_slots") or E, "src_rank": options.get("num_ranks")}
    rows = 0
    mx = {"layer": -1, "expert": -1, "slot": -1, "src_rank": -1}
    dens = None if options.get("layout") == "long" else "?"       # "?": dense so far
    densifier = None
    prog = None
    for df in _frames(path):
        b = _check_load_batch(df, path, rows, cols, shape)
        for c in mx:
            v = b[c].max()
            if v is not None:
                mx[c] = max(mx[c], int(v))
        if dens is not None:
            try:
                if densifier is None:       # group size = rows of the first (step, layer)
                    st, la = b["step"].to_numpy(), b["layer"].to_numpy()
                    brk = (st != st[0]) | (la != la[0])
                    if not brk.any():
                        raise _NotDense()
                    densifier = _dense().Densifier(int(brk.argmax()), build=False)
                densifier.feed(b.select(["step", "layer", "expert", "slot", "src_rank", "tokens"]).to_arrow())
            except (_NotDense, _dense().NotDense):
                dens = None
        rows += b.height
        if prog is None:
            prog = _Progress(path, "checked", bool(options.get("progress")) or path.stat().st_size > 64 << 20)
        prog(rows)
    if rows == 0:
        raise InputError(path, "file holds no rows")
    E_run = E or mx["expert"] + 1
    if dens is not None:
        try:
            densifier.finish()
            if densifier.E != E_run:
                dens = None
        except _dense().NotDense:
            dens = None
    # slot and src_rank bounds that depend on an inferred E: checked once E is known
    late = {"slot": options.get("num_slots") or E_run, "src_rank": options.get("num_ranks")}
    for c, upper in late.items():
        if upper is not None and mx[c] >= upper:
            _locate(path, cols, c, upper)
    if dens is None:
        dup = _first_duplicate(path, cols, shape)
        if dup:
            raise InputError(path, f"duplicate expert_load row for step={dup['step']}, layer={dup['layer']}, "
                                   f"expert={dup['expert']} ({dup['len']} rows; first {_row(path, dup['first'])}, "
                                   f"last {_row(path, dup['last'])})", _row(path, dup["last"]))
    big = bool(options.get("progress")) or rows > PROGRESS_ROWS

    parquet = path.name.lower().endswith(".parquet")

    def stream() -> Iterator[pa.Table]:
        p = _Progress(path, "written", big)
        off = 0
        if dens is not None and parquet:
            # dense Parquet: the first pass checked every row and the (step, layer, expert)
            # order, so this pass reads step, layer and tokens only and checks nothing again
            d = _dense().Densifier(E_run, check=False)
            batches = (pa.Table.from_batches([b]) for b in _parquet_batches(path, ["step", "layer", "tokens"]))
            for b in batches:
                b = pa.table({"step": b.column("step").cast(pa.int64()), "layer": b.column("layer").cast(pa.int32()),
                              "tokens": b.column("tokens").cast(pa.int64())})
                off += b.num_rows
                out = d.feed(b)
                if out is not None and out.num_rows:
                    yield out
                p(off)
            d.finish()
            p(off, force=big)
            return
        d = _dense().Densifier(E_run) if dens is not None else None
        for df in _frames(path):       # checked in the first pass: only the casts again
            b = _load_arrow(_cast_load_batch(df, path, off, cols))
            off += b.num_rows
            out = d.feed(b) if d is not None else b
            if out is not None and out.num_rows:
                yield out
            p(off)
        if d is not None:
            d.finish()
        p(off, force=big)

    table = "expert_counts" if dens is not None else "expert_load"
    approx = []
    if not L:
        approx.append("num_layers inferred from the highest layer id")
    if not E:
        approx.append("num_experts inferred from the highest expert id")
    run = _run_row(path, options, "expert_load", mx["layer"] + 1, E_run, None, approx)
    return RunData(run=run, tables={table: Rereadable(stream)}, run_id_hint=path.name.split(".")[0],
                   files=[str(path)])


class _NotDense(Exception):
    pass


def _shown_columns(names) -> str:
    """The header, only when it looks like one: a secret file's first line is never echoed into an error message."""
    from ..safety import plausible_header

    return ', '.join(names) if plausible_header(names) else 'a first line that is not a CSV header, not shown'


def _dense():
    from ..storage import dense
    return dense


def _locate(path: Path, cols: set, column: str, upper: int) -> None:
    """Raise for the first row whose ``column`` is >= ``upper`` (second look at the file)."""
    off = 0
    for df in _frames(path):
        b = _check_load_batch(df, path, off, cols, {column: upper})
        off += b.height
    raise AssertionError("unreachable: a value out of range was seen")


def _run_row(path: Path, options: dict, kind: str, L_seen: int, E: int, top_k_seen, approx: list) -> dict:
    L = options.get("num_layers") or L_seen
    return {
        "source": path.name,
        "source_sha256": sha256_files([path]),
        "time_base": "none",
        "num_layers": L,
        "num_experts": E,
        "top_k": options.get("top_k") or top_k_seen,
        "num_ranks": options.get("num_ranks"),
        "ranks_per_node": options.get("ranks_per_node"),
        "num_slots": options.get("num_slots") or E,
        "num_groups": options.get("num_groups"),
        "approximations": json.dumps(approx) if approx else None,
        "meta_json": json.dumps({"table": kind, "format": _kind_of(path, head(path))}),
    }


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    out = []
    from ._jsonl_meta import keep_meta

    for path in paths:
        if path.name.lower().endswith(".parquet") and options.get("layout") != "long":
            rd = _one_pass(path, options)
            if rd is not None:
                out.append(rd)
                continue
        import polars as pl

        meta: list = []
        frames = _frames(path, meta)
        first = next(frames, None)
        if first is None:
            raise InputError(path, "file holds no rows" + (f" (only {len(meta)} metadata records)" if meta else ""))
        cols = set(first.columns)
        if set(LOAD_REQ) <= cols:
            frames.close()
            if plain_name(path).endswith((".jsonl", ".ndjson")):   # every metadata line, not only the first batch's
                meta = []
                for _ in _jsonl_batches(path, meta=meta):
                    pass
            out.append(keep_meta(_collect_load(path, cols, options), path, meta))
            continue
        # routing (or missing columns): read whole, as before (aggregated into expert_load)
        df = pl.concat([first, *frames], how="vertical_relaxed")
        if set(ROUTE_REQ) <= cols:
            req, opt = ROUTE_REQ, ROUTE_OPT
        else:
            from ._jsonl_meta import routing_formats_matching
            from .routing_wide import EXPERT_COLS

            miss_l = [c for c in LOAD_REQ if c not in cols]
            miss_r = [c for c in ROUTE_REQ if c not in cols]
            hint = routing_formats_matching(cols, EXPERT_COLS)
            raise InputError(path, f"missing columns: expert_load needs {', '.join(miss_l)}; "
                                   f"routing needs {', '.join(miss_r)} (found: {_shown_columns(df.columns)})"
                                   + (f"; the columns match {hint}" if hint else ""))
        df = _columns(df, path, req, opt)
        approx = []
        if "choice" not in cols:
            df = df.with_columns(pl.int_range(pl.len()).over(["step", "layer", "token"]).alias("choice"))
            approx.append("routing.choice inferred from row order within each token")
        neg = (df["expert"] < 0)
        if neg.any():
            i = int(neg.arg_max())
            raise InputError(path, f"expert id {df['expert'][i]} is negative", _row(path, i + 1))
        routing = df.select(["step", "layer", "token", "src_rank", "choice", "expert", "slot", "gate"])
        load = (routing.group_by(["step", "layer", "expert"])
                .agg(pl.len().cast(pl.Int64).alias("tokens"))
                .with_columns(pl.lit(None, pl.Int64).alias("slot"), pl.lit(None, pl.Int64).alias("src_rank"))
                .select(["step", "layer", "expert", "slot", "src_rank", "tokens"])
                .sort(["step", "layer", "expert"]))
        top_k_seen = int(routing["choice"].max()) + 1
        E = options.get("num_experts") or (int(df["expert"].max()) + 1)
        if not options.get("num_layers"):
            approx.append("num_layers inferred from the highest layer id")
        if not options.get("num_experts"):
            approx.append("num_experts inferred from the highest expert id")
        run = _run_row(path, options, "routing", int(df["layer"].max()) + 1, E, top_k_seen, approx)
        out.append(keep_meta(RunData(run=run, tables={"routing": routing, "expert_load": load},
                                     run_id_hint=path.name.split(".")[0], files=[str(path)]), path, meta))
    return out


register(Collector("generic", "CSV, JSONL or Parquet in the canonical expert_load or routing columns",
                   _sniff, _collect, priority=90,
                   options=("layout",)))   # --set layout=long: keep long expert_load rows (no dense layout)
