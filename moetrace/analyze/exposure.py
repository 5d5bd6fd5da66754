"""All-to-all exposure and kernel names of one run, read from the views of
``sql/40_a2a_exposure.sql`` and ``sql/41_a2a_summary.sql`` (documented at
:meth:`moetrace.run.Run.exposure`). The ``exposure`` and ``kernels`` commands and the
report's exposure section print these."""
from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

_NO_SPANS = {"has_a2a": False, "spans": 0, "a2a_spans": 0, "other_comm_spans": 0}


@dataclass
class Exposure:
    """One run's all-to-all exposure. ``presence`` is the ``a2a_presence`` row (has_a2a,
    spans, a2a_spans, other_comm_spans); the frames are empty when ``has_a2a`` is False:

    - ``by_kind``: per kind (dispatch, combine, a2a_other) comm / overlapped / exposed ns
    - ``ranks``: ``a2a_rank_summary`` (exposed share of comm and of step time per rank)
    - ``groups``: ``a2a_exposure``, one row per (rank, step, micro-batch, layer, kind)
    - ``stragglers``: ``a2a_stragglers``, three straggler notions per step (last arrival at
      the combine, longest step, most tokens)
    - ``modes``: ``a2a_modes``, how each stream runs its all-to-all (DeepEP hook mode)
    """

    run_id: str
    presence: dict
    by_kind: pl.DataFrame = field(default_factory=pl.DataFrame)
    ranks: pl.DataFrame = field(default_factory=pl.DataFrame)
    groups: pl.DataFrame = field(default_factory=pl.DataFrame)
    stragglers: pl.DataFrame = field(default_factory=pl.DataFrame)
    modes: pl.DataFrame = field(default_factory=pl.DataFrame)
    #: (name_id, collective) of inferred dispatch/combine kernels whose name says no direction
    #: (the classifier gives plain 'a2a', e.g. an NCCL SendRecv): their label came from order
    undirected: frozenset = frozenset()

    @property
    def has_a2a(self) -> bool:
        return bool(self.presence.get("has_a2a"))

    def direction_inferred(self, spans: pl.DataFrame) -> bool:
        """Whether any of these spans (columns kind, inferred, name_id, collective) is a
        dispatch or combine whose direction was inferred from the order of all-to-alls."""
        a = spans.filter(pl.col("inferred") & pl.col("kind").is_in(["dispatch", "combine"]))
        return any(pair in self.undirected for pair in a.select("name_id", "collective").unique().iter_rows())

    def no_a2a_message(self) -> str:
        return no_a2a_message(self.run_id, self.presence)

    def hook_mode_message(self) -> str | None:
        return hook_mode_message(self.modes)


def exposure(store, run_id: str, sql=None) -> Exposure:
    """See :meth:`moetrace.run.Run.exposure`. ``sql(query, params)`` runs the view queries
    (default: the store's DuckDB; :class:`moetrace.storage.spark.SparkSQL` runs them on Spark)."""
    sql = sql or store.sql
    pres = sql("SELECT * FROM a2a_presence WHERE run_id = ?", [run_id])
    out = Exposure(run_id, pres.row(0, named=True) if pres.height else dict(_NO_SPANS))
    if not out.has_a2a:
        return out
    out.by_kind = sql("""
        SELECT kind, count(*) AS groups, sum(comm_ns) AS comm_ns, sum(overlapped_ns) AS overlapped_ns,
               sum(exposed_ns) AS exposed_ns, sum(exposed_ns) / nullif(sum(comm_ns), 0) AS exposed_share,
               bool_or(inferred) AS inferred
        FROM a2a_exposure WHERE run_id = ? GROUP BY kind ORDER BY kind""", [run_id])
    out.ranks = sql("SELECT * FROM a2a_rank_summary WHERE run_id = ? ORDER BY rank", [run_id]).drop("run_id")
    out.groups = sql("""SELECT * FROM a2a_exposure WHERE run_id = ?
                        ORDER BY rank, step, micro_batch NULLS FIRST, layer NULLS FIRST, kind""",
                     [run_id]).drop("run_id")
    out.stragglers = sql("SELECT * FROM a2a_stragglers WHERE run_id = ? ORDER BY step", [run_id]).drop("run_id")
    out.modes = sql("SELECT * FROM a2a_modes WHERE run_id = ? ORDER BY rank, device, stream",
                    [run_id]).drop("run_id")
    out.undirected = _undirected(sql, run_id)
    return out


def _undirected(sql, run_id: str) -> frozenset:
    from ..domain.kernels import classify

    kn = sql("""SELECT DISTINCT s.name_id, s.collective, kn.name FROM spans s
                LEFT JOIN kernel_names kn ON kn.run_id = s.run_id AND kn.name_id = s.name_id
                WHERE s.run_id = ? AND s.inferred AND s.kind IN ('dispatch', 'combine')""", [run_id])
    return frozenset((n, c) for n, c, name in kn.iter_rows() if classify(name or "", c) == "a2a")


def no_a2a_message(run_id: str, pres: dict) -> str:
    msg = (f"run {run_id}: no all-to-all found — none of its {pres.get('spans') or 0} profiler spans is a dispatch, "
           f"combine or all-to-all helper kernel, so there is no all-to-all exposure to report (not zero: absent).")
    if pres.get("other_comm_spans"):
        msg += f" It has {pres['other_comm_spans']} other collective kernels (all-reduce, all-gather, ...)."
    msg += " If the all-to-all kernels have unfamiliar names, `moetrace kernels STORE` shows them; add a rule " \
           "with --kernel-rules."
    return msg


def hook_mode_message(modes: pl.DataFrame | None) -> str | None:
    if modes is None or modes.height == 0:
        return None
    hook = modes.filter(pl.col("mode") == "deepep_ll_hook")
    if hook.height == 0:
        return None
    ranks = sorted(set(hook["rank"].to_list()))
    return (f"DeepEP low-latency hook mode detected on rank(s) {', '.join(map(str, ranks))}: the send and receive "
            "kernels run on the compute stream and the transfer happens between them with no kernel running, so "
            "interval overlap cannot see it. comm_ns there counts the send/receive kernels only; the real transfer "
            "is hidden by construction (or stalls the receive kernel, which then shows up as exposed).")


def kernels_table(store, run_id: str, kind: str | None = None, limit: int | None = None,
                  name_width: int | None = 110) -> pl.DataFrame:
    """Kernel names by kind with span count and total time (heaviest first within a kind)
    and how the kind was decided (``classified_by``: user, name, context, stream,
    category, default; NULL in older stores); names cut to ``name_width`` characters
    (None: full names, for csv/json/files)."""
    where = "s.run_id = ?"
    params: list = [run_id]
    if kind:
        where += " AND s.kind = ?"
        params.append(kind)
    df = store.sql(f"""
        WITH k AS (
            SELECT s.kind, kn.name, count(*) AS spans, sum(s.end_ns - s.start_ns) AS total_ns,
                   count(DISTINCT s.rank) AS ranks, s.collective, s.classified_by
            FROM spans s JOIN kernel_names kn ON kn.run_id = s.run_id AND kn.name_id = s.name_id
            WHERE {where}
            GROUP BY s.kind, kn.name, s.collective, s.classified_by
        )
        SELECT kind, sum(total_ns) OVER (PARTITION BY kind) AS kind_total_ns, name, spans, ranks, collective,
               classified_by, total_ns,
               total_ns / (SELECT sum(end_ns - start_ns) FROM spans WHERE run_id = ?) AS share_of_all
        FROM k
        ORDER BY kind_total_ns DESC, kind, total_ns DESC, name, classified_by""", params + [run_id])
    if limit:
        df = df.with_columns(pl.int_range(pl.len()).over("kind").alias("_r")).filter(pl.col("_r") < limit).drop("_r")
    if name_width:
        df = df.with_columns(pl.col("name").str.slice(0, name_width))
    return df.with_columns((pl.col("total_ns") / 1e6).alias("total_ms")).select(
        "kind", "name", "spans", "ranks", "collective", "classified_by", "total_ms", "share_of_all")
