"""Checks every ingested run passes before it is written: contract types (via
schema.conform), non-negative counts, ids inside the run's shape, conservation."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from ..domain.run_bounds import OTHER_RANGES, range_problem, relation_problem
from ..errors import InputError, UsageError
from ..safety import SHAPE_MAX
from ..storage import schema


def _first_bad(mask: pa.ChunkedArray) -> int:
    return pc.index(mask, True).as_py()


def _check_range(rd, table: str, tbl: pa.Table, column: str, upper: int | None) -> None:
    if column not in tbl.column_names or tbl.num_rows == 0:
        return
    arr = tbl.column(column)
    mn = pc.min(arr).as_py()
    if mn is not None and mn < 0:
        i = _first_bad(pc.fill_null(pc.less(arr, 0), False))
        raise InputError(_file(rd), f"{table}.{column} = {arr[i].as_py()} is negative", f"row {i + 1}")
    if upper is not None:
        mx = pc.max(arr).as_py()
        if mx is not None and mx >= upper:
            i = _first_bad(pc.fill_null(pc.greater_equal(arr, upper), False))
            raise InputError(_file(rd), f"{table}.{column} = {arr[i].as_py()} is outside the run's shape (0..{upper - 1})",
                             f"row {i + 1}")


def _check_count(rd, table: str, tbl: pa.Table, column: str) -> None:
    if column not in tbl.column_names or tbl.num_rows == 0:
        return
    arr = tbl.column(column)
    mx = pc.max(arr).as_py()
    if mx is not None and mx > MAX_COUNT:
        i = _first_bad(pc.fill_null(pc.greater(arr, MAX_COUNT), False))
        raise InputError(_file(rd), f"{table}.{column} = {arr[i].as_py()} is beyond the largest count moetrace accepts "
                                    f"(2^40 = {MAX_COUNT}; sums must stay exact)", f"row {i + 1}")


def _file(rd) -> str:
    return ", ".join(rd.files) if rd.files else rd.run.get("source", "<input>")


#: Largest token count of one row (2^40, about 1.1e12): sums over up to 2^13 rows stay
#: below 2^53, exact in float64 and far from int64 overflow in skew and replay.
MAX_COUNT = 2**40
#: shape values (runs columns and the matching ingest options) and their physical range
_SHAPE = {"num_layers": "--layers", "num_experts": "--experts", "top_k": "--top-k", "num_ranks": "--ranks",
          "ranks_per_node": "--ranks-per-node", "num_slots": "num_slots", "num_groups": "num_groups",
          "dp_size": "--dp-size"}


def _err(file, msg: str):
    """An InputError naming the file, or a UsageError for an option (no file)."""
    return InputError(file, msg) if file is not None else UsageError(msg)


def check_shape(values: dict, file=None, source: str = "option") -> None:
    """Shape values must be whole numbers in 1..2^24 and consistent (top_k <= experts,
    ranks_per_node <= ranks, ranks <= slots); else one line naming the value."""
    got = {}
    for k, flag in _SHAPE.items():
        v = values.get(k)
        if v is None or v is False:
            continue
        name = flag if source == "option" else k
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise _err(file, f"{name} = {v!r} is not a whole number")
        try:
            n = int(v)
            if isinstance(v, float) and v != n:
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise _err(file, f"{name} = {str(v)[:30]!r} is not a whole number") from None
        if not 1 <= n <= SHAPE_MAX:
            raise _err(file, f"{name} = {n} is out of range (1..{SHAPE_MAX})")
        got[k] = n
    why = relation_problem(got)   # the rule readers apply to a runs row too (domain/run_bounds.py)
    for k in OTHER_RANGES if source == "run" and not why else ():
        v = values.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            why = range_problem(k, v)
            if why:
                break
    if why:
        raise _err(file, why)


def validate_run(rd, options: dict):
    """Conform every table of ``rd`` (non-streamed ones) and check ids and counts."""
    run = rd.run
    check_shape(options, _file(rd), "option")
    check_shape(run, _file(rd), "run")
    conformed = {}
    for name, data in rd.tables.items():
        if isinstance(data, (pa.Table, dict)) or hasattr(data, "to_arrow"):
            try:
                t = data if isinstance(data, pa.Table) else (pa.table(data) if isinstance(data, dict) else data.to_arrow())
                if "run_id" not in t.column_names:
                    t = t.append_column("run_id", pa.array(["_"] * t.num_rows, pa.string()))
                t = schema.conform(name, t, file=_file(rd))
                conformed[name] = t.drop_columns(["run_id"])
            except InputError:
                raise
        else:
            conformed[name] = data  # streamed: conformed chunk by chunk when written
    rd.tables = conformed
    L, E = run.get("num_layers"), run.get("num_experts")
    slots = run.get("num_slots")
    R = run.get("num_ranks")
    for name in ("expert_load", "routing"):
        t = rd.tables.get(name)
        if isinstance(t, pa.Table):
            _check_range(rd, name, t, "layer", L)
            _check_range(rd, name, t, "expert", E)
            _check_range(rd, name, t, "slot", slots)
            _check_range(rd, name, t, "step", None)
            _check_range(rd, name, t, "src_rank", R)
    t = rd.tables.get("expert_load")
    if isinstance(t, pa.Table):
        _check_range(rd, "expert_load", t, "tokens", None)
        _check_count(rd, "expert_load", t, "tokens")
    t = rd.tables.get("steps")
    if isinstance(t, pa.Table):
        _check_count(rd, "steps", t, "num_tokens")
    t = rd.tables.get("placement")
    if isinstance(t, pa.Table):
        _check_range(rd, "placement", t, "expert", E)
        _check_range(rd, "placement", t, "layer", L)
    t = rd.tables.get("spans")
    # with --allow-inconsistent, conservation.check flags backwards spans instead of refusing
    if isinstance(t, pa.Table) and t.num_rows and not options.get("allow_inconsistent"):
        bad = pc.less(t.column("end_ns"), t.column("start_ns"))
        if pc.any(bad).as_py():
            i = _first_bad(bad)
            raise InputError(_file(rd), f"span ends before it starts (start_ns={t.column('start_ns')[i].as_py()}, "
                                        f"end_ns={t.column('end_ns')[i].as_py()})", f"span row {i + 1}")
    try:
        from . import conservation  # added by the hardening work, optional
    except ImportError:
        conservation = None
    if conservation is not None:
        conservation.check(rd, options)
    return rd
