"""Hostile store contents (family 5 of the round-3 audit): values and footers a reader
must not size anything by. Generated over every shape value of a ``runs`` row (0, -1, one
past 2^24, 2^31-1), the contradictions between them, the other numbers a reader
multiplies, a runs file of 0 or 2 rows, a footer past ``max_footer_bytes`` (lowered here:
the audit's was 300 MB), dense lists longer than the run's experts and more tiny files
than ``max_store_files`` (lowered). All cases run in one child process (each case its own
store): every reader exits 2 with one line naming the file, the child stays under 1 GiB,
nothing in the test folder changes, and ``check`` lists the file with exit 2."""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.domain.run_bounds import OTHER_RANGES, SHAPE_COLUMNS, SHAPE_MAX

from .test_hostile3_store import GIB, fresh, one_line, run_cli, seeded, the_file, tree_hash  # noqa: F401

LIMITS = {"MOETRACE_MAX_FOOTER_BYTES": str(64 << 10), "MOETRACE_MAX_STORE_FILES": "100"}


def _rewrite(f: Path, change) -> None:
    """Write ``f`` again as ``change(table)`` returns it, with the file's own schema metadata."""
    t = pq.read_table(f)
    meta = t.schema.metadata
    t = change(t)
    pq.write_table(t.replace_schema_metadata({**(meta or {}), **(t.schema.metadata or {})}), f)


def _set(col: str, value: int):
    def change(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index(col)
        return t.set_column(i, t.schema.field(i), pa.array([value] * t.num_rows, t.schema.field(i).type))
    return change


def runs_value(col: str, value: int):
    def damage(st: Path) -> Path:
        f = the_file(st, "runs")
        _rewrite(f, _set(col, value))
        return f
    damage.__name__ = f"runs_{col}_{value}"
    return damage


def runs_values(**values):
    def damage(st: Path) -> Path:
        f = the_file(st, "runs")
        for c, v in values.items():
            _rewrite(f, _set(c, v))
        return f
    damage.__name__ = "runs_" + "_".join(f"{c}_{v}" for c, v in values.items())
    return damage


def runs_rows(n: int):
    def damage(st: Path) -> Path:
        f = the_file(st, "runs")
        _rewrite(f, lambda t: pa.concat_tables([t] * n) if n else t.slice(0, 0))
        return f
    damage.__name__ = f"runs_file_of_{n}_rows"
    return damage


def big_footer(table: str):
    def damage(st: Path) -> Path:
        f = the_file(st, table)
        _rewrite(f, lambda t: t.replace_schema_metadata({b"junk": b"x" * (200 << 10)}))
        return f
    damage.__name__ = f"{table}_footer_of_200kb"
    return damage


def long_lists(n: int):
    def damage(st: Path) -> Path:
        f = the_file(st, "expert_counts")

        def change(t: pa.Table) -> pa.Table:
            for c in ("tokens", "tokens_desc"):
                i = t.schema.get_field_index(c)
                t = t.set_column(i, t.schema.field(i), pa.array([[1] * n] * t.num_rows, t.schema.field(i).type))
            return t
        _rewrite(f, change)
        return f
    damage.__name__ = f"expert_counts_lists_of_{n}"
    return damage


def tiny_files(st: Path) -> Path:
    f = the_file(st)
    for i in range(101):
        os.link(f, f.parent / f"part-{i:012x}.parquet")
    return st


BAD = ([runs_value(c, v) for c in SHAPE_COLUMNS for v in (0, -1, SHAPE_MAX + 1, 2**31 - 1)]
       + [runs_value(c, v) for c, (lo, hi) in OTHER_RANGES.items() for v in (lo - 1, hi + 1)
          if -(2**31) <= v < 2**31 or c in ("expert_bytes", "tokens_per_step")]
       + [runs_values(top_k=5), runs_values(num_ranks=2, ranks_per_node=4), runs_values(num_slots=3),
          runs_rows(0), runs_rows(2), big_footer("runs"), big_footer("expert_counts"), long_lists(5),
          long_lists(1000), tiny_files])


def test_hostile_contents_are_refused_before_they_size_anything(seeded, tmp_path):
    cases, cmds = [], []
    for i, damage in enumerate(BAD):
        d = tmp_path / f"c{i}"
        d.mkdir()
        st, b = fresh(seeded, d)
        bad = damage(st)
        needle = "max_store_files" if damage is tiny_files else str(bad)
        heavy = i in (0, len(BAD) - 1)   # the report on two cases (its start-up is the slowest)
        mine = [["runs", st], ["sql", st, "SELECT count(*) FROM expert_load"], ["skew", st], ["check", st]]
        mine += [["ingest", st, b], ["report", st, "--out-dir", d / "out" / "rep"]] if heavy else []
        cases.append((damage.__name__, needle, len(mine)))
        cmds += mine
    before = tree_hash(tmp_path)
    res, peak = run_cli(cmds, tmp_path, LIMITS, timeout=300)
    k = 0
    for name, needle, n in cases:
        for argv, r in zip(cmds[k:k + n], res[k:k + n]):
            if argv[0] == "check":
                assert r[0] == 2 and needle in r[2], (name, r)
            else:
                assert r[0] == 2, (name, argv, r)
                one_line(r, needle)
        k += n
    assert peak < GIB, f"peak RSS {peak / 2**20:.0f} MiB"
    assert tree_hash(tmp_path) == before   # no report folder either: refused before it is made


def test_values_at_their_bounds_are_read(seeded, tmp_path):
    """The edges of every range are accepted (the check refuses only what is past them)."""
    ok = [runs_values(num_experts=4, top_k=4, num_slots=4), runs_values(num_ranks=4, ranks_per_node=4),
          runs_values(hidden=SHAPE_MAX, dtype_bytes=64, expert_bytes=1 << 50, tokens_per_step=1 << 40)]
    cmds = []
    for i, damage in enumerate(ok):
        d = tmp_path / f"c{i}"
        d.mkdir()
        st, _ = fresh(seeded, d)
        damage(st)
        cmds += [["runs", st], ["check", st]]
    res, _ = run_cli(cmds, tmp_path)
    assert [r[0] for r in res] == [0] * len(cmds), res


@pytest.mark.slow
def test_a_runs_row_of_2_31_experts_does_not_reach_numpy(seeded, tmp_path):
    """The audit's case at full size through the report (16 GiB allocated before)."""
    st, b = fresh(seeded, tmp_path)
    f = runs_value("num_experts", 2**31 - 1)(st)
    res, peak = run_cli([["report", st, "--out-dir", tmp_path / "out" / "rep"]], tmp_path)
    one_line(res[0], str(f), "num_experts")
    assert peak < GIB
