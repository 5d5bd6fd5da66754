"""Profiler-trace commands: ``moetrace kernels`` (what the classifier made of every kernel
name) and ``moetrace exposure`` (all-to-all exposure per rank, step, layer, kind)."""
from __future__ import annotations

import json

import click
import polars as pl

from ..output import emit, output_options
from ..store import Store


def _run_opt(f):
    return click.option("--run", "run_id", default=None, help="Run id (default: the store's only run).")(f)


def kernels_table(st: Store, run_id: str, kind: str | None = None, limit: int | None = None,
                  name_width: int | None = 110) -> pl.DataFrame:
    """Kernel names by kind with span count and total time (heaviest first within a kind);
    names cut to ``name_width`` characters (None: full names, for csv/json/files)."""
    where = "s.run_id = ?"
    params: list = [run_id]
    if kind:
        where += " AND s.kind = ?"
        params.append(kind)
    df = st.sql(f"""
        WITH k AS (
            SELECT s.kind, kn.name, count(*) AS spans, sum(s.end_ns - s.start_ns) AS total_ns,
                   count(DISTINCT s.rank) AS ranks, s.collective
            FROM spans s JOIN kernel_names kn ON kn.run_id = s.run_id AND kn.name_id = s.name_id
            WHERE {where}
            GROUP BY s.kind, kn.name, s.collective
        )
        SELECT kind, sum(total_ns) OVER (PARTITION BY kind) AS kind_total_ns, name, spans, ranks, collective,
               total_ns,
               total_ns / (SELECT sum(end_ns - start_ns) FROM spans WHERE run_id = ?) AS share_of_all
        FROM k
        ORDER BY kind_total_ns DESC, kind, total_ns DESC""", params + [run_id])
    if limit:
        df = df.with_columns(pl.int_range(pl.len()).over("kind").alias("_r")).filter(pl.col("_r") < limit).drop("_r")
    if name_width:
        df = df.with_columns(pl.col("name").str.slice(0, name_width))
    return df.with_columns((pl.col("total_ns") / 1e6).alias("total_ms")).select(
        "kind", "name", "spans", "ranks", "collective", "total_ms", "share_of_all")


@click.command("kernels")
@click.argument("store", type=click.Path(file_okay=False))
@_run_opt
@click.option("--kind", default=None, help="Only this kind (dispatch, combine, a2a_other, expert_gemm, attention, "
                                           "compute_other, memcpy, memset, comm_other).")
@click.option("--top", "limit", type=int, default=15, show_default=True,
              help="Names per kind (0 = all).")
@output_options
def kernels(store, run_id, kind, limit, fmt, output):
    """List kernel names by kind with total time, heaviest first.

    Heavy names under compute_other are where an unknown all-to-all would hide: add a
    rule for them with `moetrace ingest --kernel-rules FILE` (CSV kind,pattern,collective).

    Example:

        moetrace kernels st --kind compute_other --top 20
    """
    st = Store(store)
    rid = st.resolve_run(run_id)
    # full names where they are data (csv, json, a file): a user copies them into --kernel-rules
    df = kernels_table(st, rid, kind, limit or None, name_width=110 if fmt == "table" and not output else None)
    if df.height == 0:
        click.echo(f"run {rid}: no profiler spans (ingest a Kineto or Nsight trace)")
        return
    emit(df, fmt, output, max_rows=500)


def exposure_tables(st: Store, run_id: str) -> dict:
    """Everything the exposure command and report show, as frames (empty when no a2a)."""
    pres = st.sql("SELECT * FROM a2a_presence WHERE run_id = ?", [run_id])
    out = {"presence": pres.row(0, named=True) if pres.height else {"has_a2a": False, "spans": 0,
                                                                       "a2a_spans": 0, "other_comm_spans": 0}}
    if not out["presence"]["has_a2a"]:
        return out
    out["by_kind"] = st.sql("""
        SELECT kind, count(*) AS groups, sum(comm_ns) AS comm_ns, sum(overlapped_ns) AS overlapped_ns,
               sum(exposed_ns) AS exposed_ns, sum(exposed_ns) / nullif(sum(comm_ns), 0) AS exposed_share,
               bool_or(inferred) AS inferred
        FROM a2a_exposure WHERE run_id = ? GROUP BY kind ORDER BY kind""", [run_id])
    out["ranks"] = st.sql("SELECT * EXCLUDE (run_id) FROM a2a_rank_summary WHERE run_id = ? ORDER BY rank", [run_id])
    out["groups"] = st.sql("""SELECT * EXCLUDE (run_id) FROM a2a_exposure WHERE run_id = ?
                              ORDER BY rank, step, micro_batch NULLS FIRST, layer NULLS FIRST, kind""", [run_id])
    out["stragglers"] = st.sql("SELECT * EXCLUDE (run_id) FROM a2a_stragglers WHERE run_id = ? ORDER BY step",
                               [run_id])
    out["modes"] = st.sql("SELECT * EXCLUDE (run_id) FROM a2a_modes WHERE run_id = ? ORDER BY rank, device, stream",
                          [run_id])
    return out


def no_a2a_message(run_id: str, pres: dict) -> str:
    msg = (f"run {run_id}: no all-to-all found — none of its {pres.get('spans') or 0} profiler spans is a dispatch, "
           f"combine or all-to-all helper kernel, so there is no all-to-all exposure to report (not zero: absent).")
    if pres.get("other_comm_spans"):
        msg += f" It has {pres['other_comm_spans']} other collective kernels (all-reduce, all-gather, ...)."
    msg += " If the all-to-all kernels have unfamiliar names, `moetrace kernels STORE` shows them; add a rule " \
           "with --kernel-rules."
    return msg


def hook_mode_message(modes: pl.DataFrame) -> str | None:
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


@click.command("exposure")
@click.argument("store", type=click.Path(file_okay=False))
@_run_opt
@click.option("--by", type=click.Choice(["rank", "kind", "group", "straggler", "mode"]), default="rank",
              show_default=True, help="rank: per-rank summary; kind: totals per kind; group: every (rank, step, "
                                      "layer, micro-batch, kind); straggler: slowest rank per step; mode: stream use.")
@output_options
def exposure(store, run_id, by, fmt, output):
    """All-to-all exposure: how much dispatch/combine time no compute kernel hid.

    comm = union of the all-to-all kernel intervals; overlapped = the part of it during
    which a compute kernel ran on any stream of the same device; exposed = comm -
    overlapped. Also as SQL: a2a_exposure, a2a_rank_summary, a2a_stragglers, a2a_modes.

    Example:

        moetrace exposure st --by kind
    """
    st = Store(store)
    rid = st.resolve_run(run_id)
    t = exposure_tables(st, rid)
    if not t["presence"]["has_a2a"]:
        click.echo(no_a2a_message(rid, t["presence"]))
        return
    df = {"rank": t["ranks"], "kind": t["by_kind"], "group": t["groups"], "straggler": t["stragglers"],
          "mode": t["modes"]}[by]
    if by == "straggler" and df.height == 0:
        click.echo(f"run {rid}: stragglers need at least two ranks with combine spans in a step")
        return
    emit(df, fmt, output, max_rows=200)
    if fmt == "table" and not output:
        msg = hook_mode_message(t["modes"])
        if msg:
            click.echo("\n" + msg)
        approx = st.run(rid).get("approximations")
        if approx:
            for a in json.loads(approx):
                click.echo(f"note: {a}", err=True)


def register(cli):
    cli.add_command(kernels)
    cli.add_command(exposure)
