"""The metric views on Spark SQL, from the same definitions DuckDB runs.

The views in ``moetrace/storage/sql/*.sql`` are the product's definitions of every metric.
Spark does not get a second hand-written copy: each DuckDB statement is transpiled with
sqlglot (``read="duckdb", write="spark"``), then the few adaptations Spark needs are
applied, all of them listed in :data:`ADAPTATIONS` with the reason for each. The store's
tables are registered as Spark temp views straight from the hive-partitioned Parquet
folders (no export), with the schema taken from ``schemas/`` so that an absent table is an
empty view of the right types, as in DuckDB.

Local mode by default (``local[*]``); a cluster through the usual Spark settings: a
``--master`` URL (``spark://host:7077``, ``yarn``, ``k8s://...``) or Spark Connect
(``SPARK_REMOTE=sc://host:15002`` or ``remote=``). Needs ``pip install 'moetrace[spark]'``
and a Java runtime (17 or newer for Spark 4).

User text never reaches SQL here: the store path goes to ``DataFrameReader.parquet`` as a
path, table names come from the contract, and the query is the user's own SQL.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pyarrow as pa

from ..errors import StoreError
from . import schema

# Spark's types for the contract's column types.
_SPARK_TYPES = {"string": "string", "bool": "boolean", "int8": "tinyint", "int16": "smallint",
                "int32": "int", "int64": "bigint", "float32": "float", "float64": "double"}


@dataclass(frozen=True)
class Adaptation:
    """One hand-made change to sqlglot's Spark output: what it rewrites and why."""
    name: str
    reason: str


# Everything Spark needs beyond what sqlglot produces, applied on the syntax tree in
# :func:`_adapt`. Kept short on purpose: a view that needs more is better rewritten in
# portable SQL at its definition.
ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation("temporary views",
               "the views live in the Spark session next to the store's tables, not in a metastore"),
    Adaptation("ordered list aggregate",
               "DuckDB's list(x ORDER BY k) keeps the order; sqlglot writes COLLECT_LIST(x), which does "
               "not: sort_array over struct(k, x), then keep x"),
    Adaptation("list_sum", "aggregate(list, 0D, (a, v) -> a + v)"),
    Adaptation("list_inner_product", "aggregate(zip_with(a, b, (x, y) -> x * y), 0D, (s, v) -> s + v)"),
    Adaptation("materialized CTE", "WITH x AS MATERIALIZED (...) is a DuckDB planner hint; Spark has none: dropped"),
    Adaptation("quantile_cont", "sqlglot writes PERCENTILE_CONT(x, p), which Spark parses as an ordered-set "
               "aggregate; Spark's PERCENTILE(x, p) is the same exact, linearly interpolated quantile"),
    Adaptation("decimal literals", "DuckDB computes with a literal like 1.0 as a DOUBLE once it divides; Spark "
               "keeps DECIMAL and rounds quotients to 6 places: such literals become DOUBLE"),
    Adaptation("count(DISTINCT) OVER", "Spark has no DISTINCT window aggregates: size(collect_set(x) OVER w)"),
    Adaptation("unnest with its subscripts", "SELECT generate_subscripts(l, 1), unnest(l) FROM t (the dense "
               "expert_counts unnested) has two generators; Spark takes one: POSEXPLODE(l) AS (pos, val) "
               "in a subquery, the subscript is pos + 1"),
    Adaptation("cast of a generator", "CAST(unnest(l) AS T): Spark takes no generator inside an expression: "
               "EXPLODE(CAST(l AS ARRAY<T>))"),
    Adaptation("list_position", "same 1-based search: ARRAY_POSITION"),
    Adaptation("row_number type", "ROW_NUMBER() is BIGINT in DuckDB and INT in Spark; a recursive CTE that "
               "mixes it with BIGINT fails to merge types: CAST(... AS BIGINT)"),
    Adaptation("skew_by_batch: windows without recursion",
               "the view merges pairs of steps level by level in a recursive CTE (cheap in DuckDB); Spark's "
               "recursive CTEs take no aggregate over the recursive reference, so on Spark the CTE `merged` "
               "is one GROUP BY per window level w = 1, 2, 4, ... <= n_steps: the same sums"),
    Adaptation("len", "the views measure lists only (len(list)); Spark's LENGTH takes strings: SIZE(list)"),
    Adaptation("list_slice", "DuckDB list_slice(l, begin, end) is 1-based and inclusive: slice(l, begin, end - begin + 1)"),
    Adaptation("list index", "DuckDB's l[i] is 1-based and l[-1] is the last element; sqlglot shifts positive "
               "literal indexes only (and -1 to -2, which Spark reads as NULL): every list index becomes "
               "ELEMENT_AT(l, i), Spark's 1-based, negative-from-the-end form"),
    Adaptation("string_agg(DISTINCT x, sep ORDER BY x)", "sqlglot writes LISTAGG(DISTINCT x, sep) WITHIN GROUP "
               "(ORDER BY x), which Spark 4 fails to plan (ClassCastException in its sort handling): "
               "ARRAY_JOIN(SORT_ARRAY(COLLECT_SET(x)), sep), NULL when x has no value (as string_agg)"),
    Adaptation("unnest of several lists", "DuckDB's SELECT unnest(a) AS x, unnest(b) AS y zips the lists (NULL "
               "past the shorter); Spark allows one generator per SELECT (and a second would be a cross "
               "product): INLINE(ARRAYS_ZIP(a, b)) AS (x, y)"),
)


def _adapt(tree):
    """Apply :data:`ADAPTATIONS` (but the first, done on the text) to a sqlglot tree."""
    from sqlglot import exp, parse_one

    def sql(node):
        return _adapt(node.copy()).sql(dialect="spark")

    def rewrite(node):
        if isinstance(node, exp.Bracket) and len(node.expressions) == 1 and not (
                isinstance(node.expressions[0], exp.Literal) and node.expressions[0].is_string):
            i = node.expressions[0]  # as written in DuckDB (parsed by _duckdb_dialect: no shift)
            lit = isinstance(i, exp.Literal) or (isinstance(i, exp.Neg) and isinstance(i.this, exp.Literal))
            idx = sql(i) if lit else f"CAST({sql(i)} AS INT)"  # Spark's ELEMENT_AT takes an INT
            return parse_one(f"ELEMENT_AT({sql(node.this)}, {idx})", read="spark")
        if isinstance(node, exp.Select):
            gens = [k for k, p in enumerate(node.expressions)
                    if isinstance(p, exp.Alias) and isinstance(p.this, exp.Explode)]
            if len(gens) > 1 and not any(str(a.this).upper() == "GENERATE_SUBSCRIPTS"
                                         for a in node.find_all(exp.Anonymous)):
                if gens != list(range(gens[0], gens[0] + len(gens))):
                    raise ValueError("unnest of several lists must be adjacent in the SELECT list")
                node = node.copy()
                projs = list(node.expressions)
                lists = ", ".join(sql(projs[k].this.this) for k in gens)
                names = ", ".join(projs[k].alias for k in gens)
                inline = parse_one(f"SELECT INLINE(ARRAYS_ZIP({lists})) AS ({names})",
                                   read="spark").expressions[0]
                projs[gens[0]:gens[-1] + 1] = [inline]
                node.set("expressions", projs)
                return node
            subs = [a for a in node.find_all(exp.Anonymous) if str(a.this).upper() == "GENERATE_SUBSCRIPTS"]
            explodes = list(node.find_all(exp.Explode))
            if subs and len(explodes) == 1 and all(sql(a.expressions[0]) == sql(explodes[0].this) for a in subs):
                node = node.copy()
                lst = sql(node.find(exp.Explode).this)
                src = node.args["from_"].this.sql(dialect="spark")
                for a in list(node.find_all(exp.Anonymous)):
                    if str(a.this).upper() == "GENERATE_SUBSCRIPTS":
                        a.replace(parse_one("(__pos + 1)", read="spark"))
                node.find(exp.Explode).replace(exp.column("__val"))
                node.set("from_", parse_one(f"SELECT 1 FROM (SELECT *, POSEXPLODE({lst}) AS (__pos, __val) "
                                            f"FROM {src}) AS __px", read="spark").args["from_"])
                return node
        if isinstance(node, exp.Window) and isinstance(node.this, exp.RowNumber) and not isinstance(node.parent, exp.Cast):
            return exp.Cast(this=node.copy(), to=exp.DataType.build("BIGINT"))
        if isinstance(node, exp.Cast) and isinstance(node.this, exp.Explode):
            to = node.to.sql(dialect="spark")
            return parse_one(f"EXPLODE(CAST({sql(node.this.this)} AS ARRAY<{to}>))", read="spark")
        if (isinstance(node, exp.GroupConcat) and isinstance(node.this, exp.Order)
                and isinstance(node.this.this, exp.Distinct) and len(node.this.this.expressions) == 1
                and len(node.this.expressions) == 1):
            x, key = node.this.this.expressions[0], node.this.expressions[0]
            if sql(key.this) == sql(x):
                arg, sep = sql(x), sql(node.args["separator"]) if node.args.get("separator") else "','"
                order = "FALSE" if key.args.get("desc") else "TRUE"
                return parse_one(f"CASE WHEN COUNT({arg}) > 0 THEN ARRAY_JOIN(SORT_ARRAY(COLLECT_SET({arg}), "
                                 f"{order}), {sep}) END", read="spark")
        if isinstance(node, exp.ArrayAgg) and isinstance(node.this, exp.Order):
            keys = node.this.expressions
            desc = {bool(k.args.get("desc")) for k in keys}
            if len(desc) != 1:
                raise ValueError("ordered list aggregate with mixed ASC/DESC keys has no Spark form here")
            fields = ", ".join(f"{sql(k.this)} AS k{i}" for i, k in enumerate(keys))
            asc = "FALSE" if desc.pop() else "TRUE"
            return parse_one(f"TRANSFORM(SORT_ARRAY(COLLECT_LIST(STRUCT({fields}, {sql(node.this.this)} AS v)), "
                             f"{asc}), s -> s.v)", read="spark")
        if isinstance(node, exp.CTE) and node.args.get("materialized"):
            node = node.copy()
            node.set("materialized", None)
            return node
        if isinstance(node, exp.PercentileCont) and node.args.get("expression") is not None:
            return parse_one(f"PERCENTILE({sql(node.this)}, {sql(node.expression)})", read="spark")
        if isinstance(node, exp.Literal) and not node.is_string and "." in node.this:
            return parse_one(f"CAST({node.this} AS DOUBLE)", read="spark")
        if (isinstance(node, exp.Window) and isinstance(node.this, exp.Count)
                and isinstance(node.this.this, exp.Distinct)):
            win = node.copy()
            arg = sql(node.this.this.expressions[0])
            win.set("this", parse_one(f"COLLECT_SET({arg})", read="spark"))
            return parse_one("SIZE(x)", read="spark").transform(
                lambda n: win if isinstance(n, exp.Column) and n.name == "x" else n)
        if isinstance(node, exp.Length):
            return parse_one(f"SIZE({sql(node.this)})", read="spark")
        if isinstance(node, exp.Anonymous):
            name, args = str(node.this).upper(), [sql(a) for a in node.expressions]
            if name == "LIST_SUM" and len(args) == 1:
                return parse_one(f"AGGREGATE({args[0]}, 0D, (acc, v) -> acc + v)", read="spark")
            if name == "LIST_INNER_PRODUCT" and len(args) == 2:
                return parse_one(f"AGGREGATE(ZIP_WITH({args[0]}, {args[1]}, (x, y) -> x * y), 0D, "
                                 f"(acc, v) -> acc + v)", read="spark")
            if name == "LIST_POSITION" and len(args) == 2:
                return parse_one(f"ARRAY_POSITION({args[0]}, {args[1]})", read="spark")
            if name == "LIST_SLICE" and len(args) == 3:
                return parse_one(f"SLICE({args[0]}, {args[1]}, ({args[2]}) - ({args[1]}) + 1)", read="spark")
        return node

    return tree.transform(rewrite)


# The Spark form of skew_by_batch's recursive CTE `merged` (see ADAPTATIONS): level w holds,
# for each batch = ord DIV w, the tokens of the steps ord in [batch*w, (batch+1)*w).
_MERGED_BY_LEVEL = """
SELECT r.run_id, r.layer, lv.w, st.ord DIV lv.w AS batch, r.rank, SUM(r.tokens) AS tokens,
       MAX(st.n_steps) AS n_steps
FROM rank_load_sparse AS r JOIN st ON st.run_id = r.run_id AND st.step = r.step
JOIN (SELECT CAST(POW(2, e) AS BIGINT) AS w FROM (SELECT EXPLODE(SEQUENCE(0, 62)) AS e)) AS lv
  ON lv.w <= st.n_steps
GROUP BY r.run_id, r.layer, lv.w, st.ord DIV lv.w, r.rank
"""


def _unrecurse_skew_by_batch(tree):
    from sqlglot import exp, parse_one

    w = tree.find(exp.With)
    if w is None or not w.args.get("recursive"):
        return tree
    for cte in w.expressions:
        if cte.alias_or_name == "merged":
            cte.set("this", parse_one(_MERGED_BY_LEVEL, read="spark"))
            alias = cte.args.get("alias")
            if alias is not None:
                alias.set("columns", None)
            w.set("recursive", False)
    return tree


_VIEW_ADAPTATIONS = {"skew_by_batch": _unrecurse_skew_by_batch}


def _view_name(stmt: str) -> str:
    m = re.match(r'\s*CREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP(?:ORARY)?\s+)?VIEW\s+"?([A-Za-z_][A-Za-z0-9_]*)"?',
                 stmt, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a CREATE VIEW statement: {stmt[:60]!r}")
    return m.group(1)


@lru_cache(maxsize=None)
def _duckdb_dialect():
    """DuckDB as sqlglot reads it, but list indexes kept as written (1-based): sqlglot
    would shift them to 0-based for the Spark text, literals only and -1 wrongly; the
    "list index" adaptation turns each into ELEMENT_AT, which is 1-based like DuckDB."""
    from sqlglot.dialects.duckdb import DuckDB

    class DuckDBListIndex(DuckDB):
        INDEX_OFFSET = 0

    return DuckDBListIndex


def transpile(duckdb_sql: str) -> str:
    """One DuckDB statement as Spark SQL: sqlglot, then :data:`ADAPTATIONS`."""
    import sqlglot

    trees = sqlglot.parse(duckdb_sql, read=_duckdb_dialect())
    if len(trees) != 1:
        raise ValueError(f"expected one statement, got {len(trees)}")
    tree = trees[0]
    fix = _VIEW_ADAPTATIONS.get(_view_name(duckdb_sql)) if re.match(r"\s*CREATE", duckdb_sql, re.I) else None
    if fix is not None:
        tree = fix(tree)
    text = _adapt(tree).sql(dialect="spark")
    return re.sub(r"^\s*CREATE\s+OR\s+REPLACE\s+VIEW\s+", "CREATE OR REPLACE TEMPORARY VIEW ", text,
                  flags=re.IGNORECASE)


@lru_cache(maxsize=None)
def spark_view_statement(name: str) -> str:
    """The Spark SQL of the metric view ``name``, transpiled when first asked for (all of
    them cost ~0.8 s of sqlglot; a command needs a few)."""
    from .views import view_graph

    return transpile(view_graph()[name][1])


@lru_cache(maxsize=None)
def spark_view_statements() -> tuple[tuple[str, str], ...]:
    """(view name, Spark SQL) for every metric view, in definition order."""
    from .views import view_graph

    return tuple((name, spark_view_statement(name)) for name in view_graph())


def _spark_type(t: str) -> str:
    """A contract type as Spark DDL; ``int64[]`` (a list) is ``array<bigint>``."""
    m = re.fullmatch(r"(\w+)\[\d*\]", t)
    return f"array<{_SPARK_TYPES[m.group(1)]}>" if m else _SPARK_TYPES[t]


def spark_schema(table: str):
    """The contract of ``table`` as a pyspark StructType (run_id included)."""
    from pyspark.sql.types import _parse_datatype_string

    ts = schema.get(table)
    ddl = ", ".join(f"`{c.name}` {_spark_type(c.type)}" for c in ts.columns)
    return _parse_datatype_string(ddl)


#: a session this process keeps for every caller (:func:`keep_session`), or None
_kept = None


def keep_session(spark) -> None:
    """Hand ``spark`` to every later :func:`session` call (and keep :class:`SparkSQL` and
    :func:`sql` from stopping it) until ``keep_session(None)``: one JVM and one
    SparkContext for a whole process that runs many Spark commands (the test suite)."""
    global _kept, _registered
    _kept = spark
    _registered = None     # a registration belongs to the session it was made on


def session(master: str | None = None, remote: str | None = None, app_name: str = "moetrace",
            conf: dict[str, str] | None = None):
    """A SparkSession: Spark Connect when ``remote`` (or ``SPARK_REMOTE``) is set, else
    classic Spark on ``master`` (default ``local[*]``, or ``spark.master`` from the
    environment's Spark configuration when ``MASTER`` is set); the kept session
    (:func:`keep_session`) when there is one."""
    if _kept is not None:
        return _kept
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        from .errors import MissingExtra

        raise MissingExtra("--engine spark", "spark", "pyspark", hint="(and a Java runtime)") from None
    remote = remote or os.environ.get("SPARK_REMOTE")
    b = SparkSession.builder.appName(app_name)
    if remote:
        b = b.remote(remote)
    else:
        b = b.master(master or os.environ.get("MASTER") or "local[*]")
        # local mode runs the tasks in the driver: Spark's 1g default is too small for the
        # plans of the nested views (skew_by_batch holds layer_skew twice); only read when
        # this call starts the JVM. MOETRACE_SPARK_DRIVER_MEMORY or conf= to change it.
        b = b.config("spark.driver.memory", os.environ.get("MOETRACE_SPARK_DRIVER_MEMORY", "4g"))
        b = (b.config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
             # many small joins over views: broadcasting each one costs more than it saves
             .config("spark.sql.autoBroadcastJoinThreshold", "-1")
             # DuckDB gives NULL for a list index out of range and for x / 0; so does
             # Spark outside ANSI mode (ANSI raises)
             .config("spark.sql.ansi.enabled", "false")
             .config("spark.log.structuredLogging.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             # the driver keeps every finished query's plan for the UI (1,000 by default):
             # with plans this large that alone fills the heap over a few dozen queries
             .config("spark.sql.ui.retainedExecutions", "5").config("spark.ui.retainedJobs", "20")
             .config("spark.ui.retainedStages", "20").config("spark.ui.retainedTasks", "200")
             # the views nest deeply (layer_skew under skew_by_batch, twice): inferring
             # constraints over such plans costs minutes in the optimizer; results are the same
             .config("spark.sql.constraintPropagation.enabled", "false")
             # a temp view keeps its analyzed plan instead of its SQL text: a query over
             # layer_skew (a dozen views deep) is not parsed and analysed again view by view
             # at every reference (analysis of such a query: ~5 s -> ~1 s on local[2]); so
             # when the store changes its tables are registered again and each metric view
             # is made again over them before a query reads it (_tables, SparkSQL)
             .config("spark.sql.legacy.storeAnalyzedPlanForView", "true"))
    # run_id is a string whatever it looks like (a run called 2024 stays '2024')
    b = b.config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
    # DuckDB's integer division and casts follow ANSI rules; so does Spark 4 by default
    b = b.config("spark.sql.session.timeZone", "UTC")
    for k, v in (conf or {}).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    try:   # a refused query is raised to the caller (one line); pyspark's JSON log of it is noise
        from pyspark.logger import PySparkLogger

        for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
            PySparkLogger.getLogger(name).disabled = True
    except ImportError:   # pyspark < 4 has no such logger
        pass
    if not remote:
        # a failed analysis is raised to the caller; the JVM's copy of it is noise
        spark.sparkContext.setLogLevel("FATAL")
    return spark


def _table_frame(spark, root: Path, table: str, committed):
    """The store's files of ``table`` (committed runs only, as the DuckDB views show), or
    an empty frame of the contract's types."""
    st = spark_schema(table)
    d = root / table
    if d.is_dir() and any(d.glob("run_id=*/*.parquet")):
        df = spark.read.schema(st).option("basePath", str(d)).parquet(str(d))
        df = df.select(*[f"`{c}`" for c in st.fieldNames()])
        if committed is not None:
            df = df.join(committed, on="run_id", how="left_semi")
        return df
    return spark.createDataFrame([], st)


class _Registration:
    """What is registered on a session for one store: its tables (``key``: the store's
    fingerprint when they were registered, on the kept session; None elsewhere) and the
    metric views made over those tables so far."""

    def __init__(self, key, tables):
        self.key = key
        self.tables: tuple[str, ...] = tuple(tables)
        self.views: set[str] = set()     # metric views made over these tables
        self.failed: set[str] = set()    # left out by strict=False: Spark refused it, or a view it reads


#: the registration on the kept session (:func:`keep_session`), or None
_registered: _Registration | None = None


def _store_fingerprint(root: Path) -> tuple:
    """What the tables registered from ``root`` depend on: every file of the store (path,
    size, mtime). Equal fingerprints mean the same tables would be registered again."""
    files = []
    for dirpath, _dirs, fnames in os.walk(root):
        for f in fnames:
            try:
                st = os.stat(os.path.join(dirpath, f))
            except OSError:
                continue
            files.append((os.path.relpath(os.path.join(dirpath, f), root), st.st_size, st.st_mtime_ns))
    return (str(root.resolve()), tuple(sorted(files)))


def forget_registration() -> None:
    """Make the next registration on the kept session register the tables (and, as they
    are named, the metric views) again: call it after replacing one of its temp views by
    hand."""
    global _registered
    _registered = None


def _register_tables(spark, root: Path) -> list[str]:
    """Every contract table of the store at ``root`` as a temp view (empty with the
    contract's types when the store has no files for it), and the store's own
    ``expert_load`` view over the long rows and the dense ``expert_counts``."""
    from .dense import expert_load_views

    runs = _table_frame(spark, root, "runs", None)
    committed = runs.select("run_id")
    names = []
    for table in schema.load_all():
        df = runs if table == "runs" else _table_frame(spark, root, table, committed)
        if table == "expert_counts":  # a store written before tokens_desc: sorted on read, as DuckDB does
            from pyspark.sql import functions as F

            df = df.withColumn("tokens_desc", F.coalesce(F.col("tokens_desc"), F.sort_array("tokens", asc=False)))
        # expert_load: its long rows under another name, then the store's own view over
        # them and the dense expert_counts (the same statement DuckDB runs, transpiled)
        df.createOrReplaceTempView("expert_load_long" if table == "expert_load" else table)
        names.append(table)
    for stmt in expert_load_views('CREATE OR REPLACE VIEW "expert_load" AS SELECT 1')[1:]:
        spark.sql(transpile(stmt))
    return names


def _tables(spark, store_path: str | os.PathLike) -> _Registration:
    """The store's tables registered on ``spark``. On the kept session, a store registered
    last and unchanged since (the same files, sizes and mtimes) keeps its registration,
    with the metric views made over it (no Spark statement); else the tables are
    registered now and no metric view counts as made over them: a temp view keeps the
    plan it was analysed with (``spark.sql.legacy.storeAnalyzedPlanForView``), so each is
    made again, over the new tables, when next needed."""
    global _registered
    root = Path(store_path)
    kept = spark is not None and spark is _kept
    key = _store_fingerprint(root) if kept else None
    if kept and _registered is not None and _registered.key == key:
        return _registered
    if kept:
        _registered = None
    reg = _Registration(key, _register_tables(spark, root))
    if kept:
        _registered = reg
    return reg


def _register_views(spark, reg: _Registration, names, strict: bool = True) -> None:
    """Make the metric views ``names`` (in definition order: each after the views it
    reads) that are not made over ``reg``'s tables yet. A view Spark cannot take raises
    :class:`StoreError` naming it; with ``strict=False`` it is left out, and so are the
    views that read it."""
    from .views import view_graph

    graph = view_graph()
    for name in names:
        if name in reg.views or (not strict and name in reg.failed):
            continue
        if not strict and graph[name][2] & reg.failed:
            reg.failed.add(name)       # reads a view left out: not made over a stale copy of it
            continue
        stmt = spark_view_statement(name)
        try:
            spark.sql(stmt)
        except Exception as e:  # a view Spark cannot take is a bug in ADAPTATIONS: name it
            if not strict:
                reg.failed.add(name)
                continue
            first = " ".join(str(e).strip().split("\n")[:2])[:400]
            raise StoreError(f"metric view {name!r} does not run on Spark: {first}") from None
        reg.views.add(name)
        reg.failed.discard(name)


def register_store(spark, store_path: str | os.PathLike, strict: bool = True, views: bool = True) -> list[str]:
    """Every contract table of the store as a temp view (empty with the contract's types
    when the store has no files for it), then every metric view. Returns the names
    registered: the tables, then the metric views in definition order. A metric view Spark
    cannot take raises :class:`StoreError` naming it; with ``strict=False`` it is left out
    (and the views built on it), so the rest still run. ``views=False``: the tables and
    the store's own ``expert_load`` view only (:class:`SparkSQL` makes the metric views a
    query names when it runs it; a caller can make them from :func:`spark_view_statements`).

    On the kept session (:func:`keep_session`) a store registered last, unchanged since
    (the same files, sizes and mtimes), is not registered again: its tables and the
    metric views already made over them are still there, and only the views not made yet
    are (each costs Spark an analysis: all ~50 take ~15 s of JVM CPU on a warm local[2]
    session, more in a fresh one). After the store changed, the tables are registered
    again and every metric view is made again."""
    from .views import view_graph

    reg = _tables(spark, store_path)
    if not views:
        return list(reg.tables)
    order = list(view_graph())
    _register_views(spark, reg, order, strict)
    return [*reg.tables, *(n for n in order if n in reg.views)]


def to_arrow(df) -> pa.Table:
    """A Spark DataFrame as an Arrow table (through pandas-free Arrow when available)."""
    if hasattr(df, "toArrow"):
        return df.toArrow()
    import pandas as pd  # noqa: F401  (pyspark's toPandas needs it)

    return pa.Table.from_pandas(df.toPandas(), preserve_index=False)


def sql(store_path: str | os.PathLike, query: str, master: str | None = None, remote: str | None = None,
        spark=None) -> pa.Table:
    """Run ``query`` over the store's tables and metric views on Spark; an Arrow table."""
    own = spark is None and _kept is None
    spark = spark or session(master=master, remote=remote)
    try:
        register_store(spark, store_path)
        return to_arrow(spark.sql(query))
    finally:
        if own:
            spark.stop()


class SparkSQL:
    """The store's tables and metric views on a Spark session, queried like
    :meth:`moetrace.storage.store.Store.sql`: ``sql(query, params)`` returns a polars DataFrame.

    The tables are registered when it is made; a metric view is made when a query first
    names it, with the views it reads (:func:`moetrace.storage.views.views_closure`, as
    DuckDB's store does): Spark analyses each view it makes, and a command reads a few
    of the ~50. On the kept session (:func:`keep_session`) an unchanged store keeps the
    tables and views made for it before.

    The library's readers write DuckDB SQL; ``dialect="duckdb"`` (the default) transpiles
    such a query with the same rules as the views; ``dialect="spark"`` runs the text as
    written (a user's own Spark SQL). ``?`` parameters are bound by Spark, never pasted
    into the text. A query Spark refuses is a :class:`StoreError` with its first line; so
    is a metric view it names that Spark cannot take (naming the view)."""

    def __init__(self, store_path: str | os.PathLike, master: str | None = None, remote: str | None = None,
                 spark=None):
        self._own = spark is None and _kept is None
        self.spark = spark or session(master=master, remote=remote)
        self._path = store_path
        try:
            self._reg = _tables(self.spark, store_path)
        except BaseException:
            self.close()
            raise

    def _views(self, query: str) -> None:
        """Make the metric views ``query`` names that are not made yet, with the views they
        read. Spark folds the case of names: the words are matched in lower case."""
        from .views import views_closure

        if self.spark is _kept and _registered is not self._reg:
            # another store (or this one, changed) was registered on the kept session since
            self._reg = _tables(self.spark, self._path)
        need = views_closure(query.lower(), self._reg.views)
        if need:
            _register_views(self.spark, self._reg, need)

    def sql(self, query: str, params=None, dialect: str = "duckdb"):
        import polars as pl

        self._views(query)
        text = transpile(query) if dialect == "duckdb" else query
        try:
            df = self.spark.sql(text, args=list(params)) if params else self.spark.sql(text)
            tbl = to_arrow(df)
        except Exception as e:
            if type(e).__module__.split(".")[0] not in ("pyspark", "py4j"):
                raise
            first = " ".join(str(e).strip().split("\n")[:1])[:400]
            raise StoreError(f"Spark SQL error: {first}") from None
        return pl.from_arrow(tbl) if tbl.num_columns else pl.DataFrame()

    def close(self) -> None:
        if self._own and self.spark is not None:
            self.spark.stop()
        self.spark = None

    def __enter__(self) -> "SparkSQL":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
