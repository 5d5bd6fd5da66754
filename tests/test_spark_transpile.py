"""The DuckDB → Spark SQL adaptations of ``moetrace.storage.spark``, checked on the text (sqlglot
only, no Java): each one is what the Spark semantics need for DuckDB's meaning. The
row-for-row comparison of every view on both engines is tests/test_spark_views.py."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("sqlglot", reason="pip install 'moetrace[spark]'")

from moetrace.storage.spark import ADAPTATIONS, transpile  # noqa: E402


def _one_line(s: str) -> str:
    return re.sub(r"\s+", " ", s)


def test_list_indexes_stay_one_based():
    """DuckDB l[1] is the first element and l[-1] the last; Spark's ELEMENT_AT is 1-based
    and counts negative indexes from the end, so the index is kept as written."""
    out = _one_line(transpile("SELECT a[1] AS f, a[-1] AS l, a[n // 2 + 1] AS m, s['k'] AS k FROM t"))
    assert "ELEMENT_AT(a, 1) AS f" in out
    assert "ELEMENT_AT(a, -1) AS l" in out
    assert "ELEMENT_AT(a, CAST(n DIV 2 + 1 AS INT)) AS m" in out
    assert "s['k'] AS k" in out  # a struct field is not a list index


def test_index_inside_a_lambda():
    out = _one_line(transpile("SELECT list_transform(m, lambda x: tokens[x.i] / x.c) AS r FROM t"))
    assert "ELEMENT_AT(tokens, CAST(x.i AS INT))" in out


def test_several_unnests_are_zipped_not_crossed():
    """DuckDB zips unnest(a), unnest(b) in one SELECT; two EXPLODEs on Spark would be a
    cross product (or refused)."""
    out = _one_line(transpile("SELECT run_id, unnest(ranks) AS rank, unnest(tokens) AS tokens FROM x"))
    assert "INLINE(ARRAYS_ZIP(ranks, tokens)) AS (rank, tokens)" in out
    assert "EXPLODE" not in out


def test_unnest_with_subscripts_is_posexplode():
    out = _one_line(transpile("SELECT generate_subscripts(l, 1) - 1 AS i, unnest(l) AS v FROM x"))
    assert "POSEXPLODE(l) AS (__pos, __val)" in out and "(__pos + 1) - 1 AS i" in out


def test_every_adaptation_has_a_reason():
    names = [a.name for a in ADAPTATIONS]
    assert len(names) == len(set(names))
    assert all(len(a.reason) > 20 for a in ADAPTATIONS)
    assert {"list index", "unnest of several lists"} <= set(names)


def test_distinct_string_agg_is_a_sorted_set():
    """string_agg(DISTINCT x, ',' ORDER BY x): Spark 4 fails to plan sqlglot's LISTAGG ...
    WITHIN GROUP form; a sorted set joined, NULL without values, is the same text."""
    out = _one_line(transpile("SELECT string_agg(DISTINCT s.p, ',' ORDER BY s.p) AS ps FROM t AS s"))
    assert "ARRAY_JOIN(SORT_ARRAY(COLLECT_SET(s.p)), ',')" in out
    assert "CASE WHEN COUNT(s.p) > 0" in out and "LISTAGG" not in out
