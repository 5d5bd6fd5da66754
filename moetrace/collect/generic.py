"""Generic collector: CSV, JSONL or Parquet in the canonical expert_load or routing columns.

expert_load needs ``step, layer, expert, tokens`` (optional ``slot, src_rank``); routing
needs ``step, layer, token, expert`` (optional ``choice, src_rank, slot, gate``; without
``choice`` the order of a token's rows gives it). Routing is also aggregated into
expert_load so every metric works on it. Each file is one run.
"""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from ..errors import InputError
from ..store import sha256_files
from . import Collector, RunData, register

LOAD_REQ = ["step", "layer", "expert", "tokens"]
LOAD_OPT = ["slot", "src_rank"]
ROUTE_REQ = ["step", "layer", "token", "expert"]
ROUTE_OPT = ["choice", "src_rank", "slot", "gate"]
_INT_COLS = {"step", "layer", "expert", "tokens", "slot", "src_rank", "token", "choice"}


def _kind_of(path: Path, head: bytes) -> str | None:
    name = path.name.lower()
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


def _read(path: Path) -> pl.DataFrame:
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            return pl.read_parquet(path)
        if name.endswith((".jsonl", ".ndjson")):
            return _read_jsonl(path)
        return pl.read_csv(path, infer_schema_length=10000)
    except InputError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # polars/arrow parse errors; polars panics on some corrupt Parquet
        # (pyo3 PanicException derives from BaseException, not Exception)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(path, f"cannot parse: {msg}") from None


def _read_jsonl(path: Path) -> pl.DataFrame:
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(path, f"invalid JSON: {e.msg}", f"line {i}") from None
            if not isinstance(obj, dict):
                raise InputError(path, f"expected a JSON object per line, got {type(obj).__name__}", f"line {i}")
            for k in _INT_COLS.intersection(obj):
                if isinstance(obj[k], bool):  # JSON true/false would silently become 1/0
                    raise InputError(path, f"column {k!r} must be an integer, got {json.dumps(obj[k])}", f"line {i}")
            rows.append(obj)
    if not rows:
        raise InputError(path, "file holds no rows")
    try:
        return pl.DataFrame(rows, infer_schema_length=None)
    except Exception as e:
        raise InputError(path, f"inconsistent column types: {e}") from None


def _ints(df: pl.DataFrame, path: Path) -> pl.DataFrame:
    for c in df.columns:
        if c not in _INT_COLS:
            continue
        s = df[c]
        if s.dtype.is_float():
            bad = s.is_nan() | (s != s.round(0))
            if bad.any():
                i = int(bad.arg_max())
                raise InputError(path, f"column {c!r} holds a non-integer value {s[i]!r}", f"row {i + 1}")
        elif not s.dtype.is_integer() and s.dtype != pl.Null:
            try:
                df = df.with_columns(pl.col(c).cast(pl.Int64, strict=True))
                continue
            except Exception:
                raise InputError(path, f"column {c!r} must be integer, got {s.dtype}") from None
        try:
            df = df.with_columns(pl.col(c).cast(pl.Int64))
        except Exception:  # e.g. a 128-bit integer polars read from a huge literal
            raise InputError(path, f"column {c!r} holds a value outside the 64-bit integer range") from None
    return df


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    out = []
    for path in paths:
        df = _read(path)
        if df.height == 0:
            raise InputError(path, "file holds no rows")
        cols = set(df.columns)
        if set(LOAD_REQ) <= cols:
            kind, req, opt = "expert_load", LOAD_REQ, LOAD_OPT
        elif set(ROUTE_REQ) <= cols:
            kind, req, opt = "routing", ROUTE_REQ, ROUTE_OPT
        else:
            miss_l = [c for c in LOAD_REQ if c not in cols]
            miss_r = [c for c in ROUTE_REQ if c not in cols]
            raise InputError(path, f"missing columns: expert_load needs {', '.join(miss_l)}; "
                                   f"routing needs {', '.join(miss_r)} (found: {', '.join(df.columns)})")
        df = _ints(df.select([c for c in req + opt if c in cols]), path)
        for c in req:
            if df[c].null_count():
                i = int(df[c].is_null().arg_max())
                raise InputError(path, f"column {c!r} is empty", f"row {i + 1}")
        for c in opt:
            if c not in df.columns:
                df = df.with_columns(pl.lit(None, dtype=pl.Int64 if c != "gate" else pl.Float32).alias(c))
        approx = []
        if kind == "routing":
            if "choice" not in cols:
                df = df.with_columns(pl.int_range(pl.len()).over(["step", "layer", "token"]).alias("choice"))
                approx.append("routing.choice inferred from row order within each token")
            neg = df.filter(pl.col("expert") < 0)
            if neg.height:
                raise InputError(path, f"expert id {neg['expert'][0]} is negative")
            routing = df.select(["step", "layer", "token", "src_rank", "choice", "expert", "slot", "gate"])
            load = (routing.group_by(["step", "layer", "expert"])
                    .agg(pl.len().cast(pl.Int64).alias("tokens"))
                    .with_columns(pl.lit(None, pl.Int64).alias("slot"), pl.lit(None, pl.Int64).alias("src_rank"))
                    .select(["step", "layer", "expert", "slot", "src_rank", "tokens"])
                    .sort(["step", "layer", "expert"]))
            tables = {"routing": routing, "expert_load": load}
            top_k_seen = int(routing["choice"].max()) + 1
        else:
            load = df.select(["step", "layer", "expert", "slot", "src_rank", "tokens"])
            dup = load.group_by(["step", "layer", "expert", "slot", "src_rank"]).len().filter(pl.col("len") > 1)
            if dup.height:
                r = dup.row(0, named=True)
                raise InputError(path, f"duplicate expert_load row for step={r['step']}, layer={r['layer']}, "
                                       f"expert={r['expert']} ({r['len']} rows)")
            tables = {"expert_load": load}
            top_k_seen = None
        L = options.get("num_layers") or (int(df["layer"].max()) + 1)
        E = options.get("num_experts") or (int(df["expert"].max()) + 1)
        if not options.get("num_layers"):
            approx.append("num_layers inferred from the highest layer id")
        if not options.get("num_experts"):
            approx.append("num_experts inferred from the highest expert id")
        run = {
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
            "meta_json": json.dumps({"table": kind, "format": _kind_of(path, path.read_bytes()[:4096])}),
        }
        out.append(RunData(run=run, tables=tables, run_id_hint=path.name.split(".")[0], files=[str(path)]))
    return out


register(Collector("generic", "CSV, JSONL or Parquet in the canonical expert_load or routing columns",
                   _sniff, _collect, priority=90))
