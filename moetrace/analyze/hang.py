"""The hang post-mortem over a run's communication log (``collectives`` and
``comm_groups``, e.g. PyTorch Flight Recorder dumps): per process group, how far each rank
got, which collective the others wait in, which ranks never reached it, and where the
ranks disagree about an instance (op, sizes, dtypes). The one definition of each, used by
``moetrace hang`` and :meth:`moetrace.run.Run.hang`.

Over the Flight Recorder rows only (their seq counts every collective of a group; NCCL
Inspector's coll_sn counts per collective function and its log holds completed operations
only). Definitions (collectives only: point-to-point operations count p2p_seq, not seq):

* a rank's progress in a group: ``last_scheduled`` = the highest seq it recorded in any
  state, ``last_started`` = in state started or completed, ``last_completed`` = finished:
  in state completed, or a gloo entry (op_name ``gloo:...``) that is ``retired`` (gloo never
  marks an entry started or completed; it retires it when the work ends, while an NCCL
  entry retired but not completed timed out);
  where the dump keeps pg_status (``comm_groups.last_*_seq``), ``reached`` = the larger of
  last_scheduled and pg_status last_enqueued (pg_status outlives the ring buffer);
* a rank's ``done`` in a group: the larger of last_completed and pg_status
  last_completed (the collector puts gloo's pg_status, which counts every operation, into
  collective seq ids);
* the group's stuck collective: the lowest seq that some rank entered (recorded, or
  enqueued by pg_status) above its ``done`` (a group's collectives end in order on a
  rank: one finished means the ones before it ended too, whatever their entries say);
  none when every rank completed all it entered;
* waiting ranks: members that reached the stuck seq and did not complete it; ranks that
  never reached it: members with a dump whose ``reached`` is below it; members without a
  dump are listed apart (nothing can be said of them);
* a mismatch: one (group, seq) recorded by two or more ranks with different op names,
  dtypes, or (except for ops whose sizes may differ by design,
  :data:`VARIABLE_SIZE_OPS`) input sizes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import polars as pl

#: collectives whose input sizes may differ across ranks by design (uneven splits, roots)
VARIABLE_SIZE_OPS = ("all_to_all", "gather", "scatter", "all_gather_v", "reduce_scatter_v")


@dataclass
class HangResult:
    run_id: str
    progress: pl.DataFrame      # grp, rank, entries, last_scheduled, last_started, last_completed, status_* , reached
    groups: pl.DataFrame        # grp, group_desc, members, stuck_seq, op, waiting, never_reached, no_dump, completed
    mismatches: pl.DataFrame    # grp, seq, what, detail
    lines: list[str] = field(default_factory=list)

    @property
    def hung(self) -> bool:
        return self.groups.height > 0 and self.groups["stuck_seq"].is_not_null().any()

    def never_reached(self, grp: str) -> list[int]:
        g = self.groups.filter(pl.col("grp") == grp)
        return list(g["never_reached"][0]) if g.height else []


def _ranks(xs) -> str:
    xs = sorted(xs)
    return ("rank " if len(xs) == 1 else "ranks ") + ", ".join(str(x) for x in xs)


def hang_result(store, run_id: str) -> HangResult:
    """The run's hang post-mortem (see the module docstring)."""
    coll = store.sql("""SELECT rank, grp, group_desc, op, op_name, seq, state, input_sizes, input_dtypes,
                               state = 'completed' OR (coalesce(retired, false) AND op_name LIKE 'gloo:%')
                                 AS finished
                        FROM collectives WHERE run_id = ? AND source = 'flight_recorder' AND NOT is_p2p
                          AND seq IS NOT NULL""", [run_id])
    cg = store.sql("""SELECT rank, grp, group_desc, members, last_enqueued_seq, last_started_seq, last_completed_seq
                      FROM comm_groups WHERE run_id = ? AND source = 'flight_recorder'""", [run_id])
    dumps = set(coll["rank"].to_list()) | set(cg["rank"].to_list())
    prog = (coll.group_by("grp", "rank").agg(
        pl.len().alias("entries"), pl.col("seq").max().alias("last_scheduled"),
        pl.col("seq").filter(pl.col("state") != "scheduled").max().alias("last_started"),
        pl.col("seq").filter(pl.col("finished")).max().alias("last_completed")))
    st = cg.select("grp", "rank", pl.col("last_enqueued_seq").alias("status_enqueued"),
                   pl.col("last_started_seq").alias("status_started"),
                   pl.col("last_completed_seq").alias("status_completed"))
    prog = prog.join(st, on=["grp", "rank"], how="full", coalesce=True).with_columns(
        pl.col("entries").fill_null(0),
        pl.max_horizontal("last_scheduled", "status_enqueued").alias("reached"),
        pl.max_horizontal("last_completed", "status_completed").alias("done")).sort("grp", "rank")
    descs = {g: d for g, d in pl.concat([coll.select("grp", "group_desc"), cg.select("grp", "group_desc")])
             .drop_nulls().unique(keep="first").iter_rows()}
    members: dict[str, set[int]] = {}
    for g, m in cg.select("grp", "members").iter_rows():
        if m:
            members.setdefault(g, set()).update(json.loads(m))
    for g, r in prog.select("grp", "rank").iter_rows():
        members.setdefault(g, set()).add(r)
    rows, lines = [], []
    for g in sorted(members):
        p = prog.filter(pl.col("grp") == g)
        # an unfinished entry is open unless its rank finished a later collective of the group
        # or pg_status says it completed: a group's collectives end in order on a rank, and
        # the backend records an end some time after it (gloo: from its worker threads)
        cand = (coll.filter((pl.col("grp") == g) & ~pl.col("finished"))
                .join(p.select("rank", "done"), on="rank", how="left")
                .filter(pl.col("done").is_null() | (pl.col("seq") > pl.col("done")))["seq"].to_list())
        for reached, done in p.select("status_enqueued", "done").iter_rows():
            if reached is not None and (done is None or reached > done):
                cand.append((done if done is not None else -1) + 1)
        mem = sorted(members[g])
        stuck = min(cand) if cand else None
        name = f"group {g}" + (f" ({descs[g]})" if descs.get(g) else "")
        if stuck is None:
            rows.append({"grp": g, "group_desc": descs.get(g), "members": mem, "stuck_seq": None, "op": None,
                         "waiting": [], "never_reached": [], "no_dump": [r for r in mem if r not in dumps],
                         "completed": []})
            continue
        by = {r: (reached, done) for r, reached, done in p.select("rank", "reached", "done").iter_rows()}
        waiting = [r for r in mem if r in by and by[r][0] is not None and by[r][0] >= stuck
                   and (by[r][1] is None or by[r][1] < stuck)]
        completed = [r for r in mem if r in by and by[r][1] is not None and by[r][1] >= stuck]
        never = [r for r in mem if r in dumps and (r not in by or by[r][0] is None or by[r][0] < stuck)]
        no_dump = [r for r in mem if r not in dumps]
        at = coll.filter((pl.col("grp") == g) & (pl.col("seq") == stuck))
        ops = at["op_name"].unique().sort().to_list()
        op = ops[0] if len(ops) == 1 else (" / ".join(ops) if ops else None)
        rows.append({"grp": g, "group_desc": descs.get(g), "members": mem, "stuck_seq": stuck, "op": op,
                     "waiting": waiting, "never_reached": never, "no_dump": no_dump, "completed": completed})
        states = {s: sorted(at.filter(pl.col("state") == s)["rank"].to_list()) for s in ("started", "scheduled")}
        how = "; ".join(f"{s} on {', '.join(map(str, rs))}" for s, rs in states.items() if rs)
        msg = f"{name}: {_ranks(waiting) if waiting else 'no rank'} wait in {op or 'collective'} #{stuck}"
        msg += f" ({how})" if how else ""
        if never:
            got = []
            for r in never:
                reached, done = by.get(r, (None, None))
                if reached is None:
                    got.append(f"rank {r} recorded none in the group")
                else:
                    state = "completed" if done is not None and done >= reached else "not completed"
                    got.append(f"rank {r} got to #{reached}, {state}")
            msg += f"; {_ranks(never)} never reached it ({'; '.join(got)})"
        if no_dump:
            msg += f"; no dump from {_ranks(no_dump)}"
        lines.append(msg + ".")
    groups = pl.DataFrame(rows, schema={"grp": pl.Utf8, "group_desc": pl.Utf8, "members": pl.List(pl.Int64),
                                        "stuck_seq": pl.Int64, "op": pl.Utf8, "waiting": pl.List(pl.Int64),
                                        "never_reached": pl.List(pl.Int64), "no_dump": pl.List(pl.Int64),
                                        "completed": pl.List(pl.Int64)})
    mism = _mismatches(coll)
    if not lines:
        lines.append(f"run {run_id}: no collective left incomplete in any group: the log shows no hang."
                     if coll.height or cg.height else f"run {run_id}: no Flight Recorder log in this run (the hang post-mortem reads "
                     "Flight Recorder dumps).")
    for g, seq, what, detail in mism.iter_rows():
        lines.append(f"group {g} #{seq}: {what} differ across ranks: {detail}.")
    return HangResult(run_id, prog.drop("done"), groups, mism, lines)


def _mismatches(coll: pl.DataFrame) -> pl.DataFrame:
    out = []
    multi = coll.group_by("grp", "seq").agg(pl.col("rank").n_unique().alias("n")).filter(pl.col("n") > 1)
    c = coll.join(multi.select("grp", "seq"), on=["grp", "seq"], how="semi").sort("grp", "seq", "rank")
    for (g, seq), d in c.group_by(["grp", "seq"], maintain_order=True):
        checks = [("ops", "op_name"), ("dtypes", "input_dtypes")]
        if not any(d["op"].is_in(list(VARIABLE_SIZE_OPS))):
            checks.insert(1, ("input sizes", "input_sizes"))
        for what, col in checks:
            if d[col].n_unique() > 1:
                detail = "; ".join(f"rank {r}: {v}" for r, v in d.select("rank", col).iter_rows())
                out.append({"grp": g, "seq": seq, "what": what, "detail": detail})
    return pl.DataFrame(out, schema={"grp": pl.Utf8, "seq": pl.Int64, "what": pl.Utf8, "detail": pl.Utf8})
