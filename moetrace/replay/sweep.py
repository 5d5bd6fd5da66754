"""The operator's decision table: replica budgets x re-plan intervals x windows
(``moetrace sweep``), as cells a pool of workers can run."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from ..costmodel import step_cost as costmod
from ..domain.budget import check_sweep_cells
from ..domain.shape import ClusterSpec, Shape
from ..errors import InputError
from ..notebook import NotebookView
from ..placement.plan_store import recorded_plan
from ..placement.planners import PlanShape, check_shape, make_plan
from ..placement.relabel import relabel
from .cost_fit import _cost
from .judge import _in_memory, _InMemory, _too_short
from .move_schedule import scheduled_changes
from .results import (
    ReplayOptions,
    ReplayResult,
    _layer_table,
    _runs_row,
    _time_note,
    load_answer,
    new_replay_id,
)
from .strategies import Fixed, Judged, Replan, judge


# ----------------------------------------------------------------------------- sweep
@dataclass
class SweepRow:
    """One cell of the operator's decision table."""
    what: str
    replicas: int
    replan_every: int | None
    window: int
    judged_steps: int
    extra_mem_gib_per_rank: float
    #: the exact half (no time model): straggler tokens, mean over the judged steps and layers
    recorded_straggler_tokens: float | None
    straggler_tokens: float | None
    load_verdict: str
    mean_imbalance: float | None
    recorded_ms: float | None
    gross_ms: float | None
    net_ms: float | None
    vs_recorded_pct: float | None
    moved_experts: int
    moved_gib: float
    moved_gib_per_hour: float | None
    median_break_even_steps: float | None
    verdict: str
    why: str
    skipped: str | None = None
    #: with --layers-per-step N: N, and the median break-even when each change moves N layers a step
    layers_per_step: int | None = None
    scheduled_break_even_steps: float | None = None


@dataclass
class SweepResult(NotebookView):
    rows: list[SweepRow]
    notes: list[str]
    #: the stored sweep's id (its cells are ``replay_runs`` rows ``<sweep_id>-<cell>``); None: not stored
    sweep_id: str | None = None
    run_id: str | None = None

    def _notebook_view(self):
        """In a notebook: the answer in words and a short table (moetrace.notebook)."""
        from ..notebook import sweep_view

        return sweep_view(self)

    def frame(self, brief: bool = False):
        """The decision table as a polars frame (one row per cell, skipped cells say why);
        ``brief`` keeps the columns a terminal table shows (the verdicts' reasons are notes)."""
        import polars as pl

        df = pl.DataFrame([asdict(r) for r in self.rows], schema_overrides={"skipped": pl.Utf8, "replan_every": pl.Int64})
        if df["skipped"].null_count() == df.height:
            df = df.drop("skipped")
        if brief:
            df = df.drop("what", "why", "judged_steps", "moved_experts", "gross_ms").rename(
                {"extra_mem_gib_per_rank": "extra_GiB_per_rank", "vs_recorded_pct": "net_vs_rec_%",
                 "moved_gib": "moved_GiB", "moved_gib_per_hour": "replan_GiB_per_h",
                 "median_break_even_steps": "break_even_steps", "mean_imbalance": "imbalance",
                 "recorded_straggler_tokens": "rec_straggler_tok", "straggler_tokens": "straggler_tok",
                 "load_verdict": "load (exact)", "verdict": "time verdict"})
        return df


@dataclass
class SweepCell:
    """One independent task of a sweep: a replica budget, a re-plan interval (None = the
    static plan) and a fit window, with the plan shape it plans for. ``replay_id`` is set
    when the sweep stores its results (the rows go under that id)."""
    run_id: str
    index: int
    replicas: int
    every: int | None
    window: int
    plan_shape: PlanShape
    replay_id: str | None = None


@dataclass
class SweepCellResult:
    """What a cell sends back: its row, the judged strategy and (when stored) its
    ``replay_layer`` tables. Nothing is written where a cell runs."""
    index: int
    row: SweepRow
    judged: Judged
    layer_tables: list


@dataclass
class SweepJob:
    """A sweep planned on the client: the cells to judge (in row order, budgets that cannot
    be planned as skipped rows) and what the notes and the stored rows need. Reading the
    counts and judging the cells happen in :func:`run_sweep_cells` (here, or on a cluster
    worker: :mod:`moetrace.replay.distributed`); :func:`finish_sweep` assembles and writes."""
    run_id: str
    shape: Shape
    policy: str
    opts: ReplayOptions
    windows: list[int]
    first: int
    items: list                 # SweepCell | SweepRow (skipped), in row order
    described: list[str]
    recorded_policy: str
    sweep_id: str | None
    params: dict

    @property
    def cells(self) -> list[SweepCell]:
        return [c for c in self.items if isinstance(c, SweepCell)]


def plan_sweep(store, run_id: str, shape: Shape, policy: str, replicas: list[int], intervals: list[int],
               windows: list[int] | None, opts: ReplayOptions, cluster: ClusterSpec | None = None, *,
               write: bool = False, sweep_id: str | None = None) -> SweepJob:
    """The cells of a sweep, checked before anything is read or run: replica budgets x
    (static, re-plan intervals) x fit windows, on ``cluster`` (its ``replicas`` is replaced
    by each budget). The cost model is fixed here (every cell, wherever it runs, uses the
    same one). The one sweep entry point is :func:`moetrace.run.sweep_runs`."""
    cluster = cluster or ClusterSpec()
    opts = replace(opts, cost=_cost(store, run_id, shape, opts))
    T = shape.steps.size
    windows = sorted(set(windows or [max(intervals) if intervals else max(1, T // 2)]))
    J = max(windows)
    if T <= J:
        raise InputError(None, _too_short(shape, T, f"--window {J}", " (give a smaller --window)"))
    sid = (sweep_id or new_replay_id("s")) if write else None
    items, described = [], []
    for rep in replicas:
        try:
            ps = shape.plan_shape(replace(cluster, replicas=rep))
            check_shape(ps, shape.num_experts, policy)
            if not described:
                described.append(
                    f"plans: {policy} on {ps.num_ranks} ranks ({ps.nodes()} nodes x {ps.ranks_per_node} ranks per "
                    f"node), {shape.num_experts} experts + replicas slots, " + (
                        f"{ps.num_groups} expert groups" if policy == "eplb" else "expert groups not used"))
        except InputError as e:
            items.append(SweepRow(f"replicas {rep}", rep, None, 0, 0, 0.0, None, None, "", None, None, None, None, None,
                                  0, 0.0, None, None, "", "", skipped=e.message))
            continue
        for every in [None] + list(intervals):
            for w in windows:
                i = len(items)
                items.append(SweepCell(run_id, i, rep, every, w, ps, f"{sid}-{i}" if sid else None))
    check_sweep_cells(sum(isinstance(c, SweepCell) for c in items))
    if items and not any(isinstance(c, SweepCell) for c in items):
        raise InputError(None, "no replica budget can be planned: " + items[0].skipped)
    params = {"policy": policy, "replicas": list(replicas), "replan_every": list(intervals), "windows": windows,
              "ranks": cluster.ranks, "groups": cluster.groups, "nodes": cluster.nodes,
              "ranks_per_node": cluster.ranks_per_node, "split": opts.split,
              "passes": opts.passes, "move": asdict(opts.move)}
    return SweepJob(run_id, shape, policy, opts, windows, J, items, described,
                    recorded_plan(store, run_id, shape).policy, sid, params)


def sweep_context(store, job: SweepJob) -> _InMemory:
    """The run's counts in memory for judging the job's cells (read from the store's Parquet)."""
    return _in_memory(store, job.run_id, job.shape, job.opts.split, job.opts.cost, job.opts.passes)


def sweep_cell(m: _InMemory, job: SweepJob, cell: SweepCell) -> SweepCellResult:
    """Judge one cell on the steps after the largest window, against the recorded placement,
    net of moves. The one per-cell function: the single-process sweep and the cluster
    workers both call it."""
    shape, J, w, every, rep = job.shape, job.first, cell.window, cell.every, cell.replicas
    ids, load, timing = m.ids, m.load, m.timing
    if every is None:
        fitted = make_plan(job.policy, load[J - w:J].sum(axis=0), cell.plan_shape, layers=shape.layers,
                           plan_id=f"{job.policy}+{rep}")
        fitted, _ = relabel(m.recorded, fitted)
        strat = Fixed(fitted, kind="static")
    else:
        strat = Replan(job.policy, cell.plan_shape, every, w, J, shape.layers)
    layer_tbls: list = []

    def on_block(bids, plan, blk, lm):
        if cell.replay_id is not None:
            ages = np.arange(1, bids.size + 1) if every is not None else None
            layer_tbls.append(_layer_table(bids, plan.layers, lm, cell.replay_id, plan.plan_id, ages))

    j = judge(ids, load, m.slot_load, J, strat, m.recorded, m.fn, m.cost, shape.expert_bytes, job.opts.move,
              timing=timing, on_block=on_block)
    mem = rep * shape.expert_bytes * shape.layers.size / cell.plan_shape.num_ranks / 2**30
    hours = (j.steps.size * (j.net_step_ns or 0) * (timing.per_pass or 1)) / 3.6e12
    be = [c.break_even_steps for c in j.changes if c.break_even_steps is not None]
    la = load_answer(j)
    row = SweepRow(
        f"+{rep} replicas, " + ("static" if every is None else f"re-plan every {every}") + f", window {w}",
        rep, every, w, int(j.steps.size), mem, la.recorded_straggler_tokens, la.straggler_tokens, la.verdict,
        j.summary.mean_imbalance,
        None if j.recorded_step_ns is None else j.recorded_step_ns / 1e6,
        None if j.gross_step_ns is None else j.gross_step_ns / 1e6,
        None if j.net_step_ns is None else j.net_step_ns / 1e6,
        None if j.net_step_ns is None else (j.net_step_ns / j.recorded_step_ns - 1) * 100,
        j.moved_experts, j.moved_bytes / 2**30,
        sum(c.bytes for c in j.changes[1:]) / 2**30 / hours if hours > 0 else None,
        float(np.median(be)) if be else None, j.verdict,
        # a row of --format csv/json stands alone: its reason carries the band's source (the
        # terminal table says it once, in the notes)
        j.verdict_reason + (f" ({costmod.error_band(m.cost)[1]})" if "band" in j.verdict_reason else ""))
    mc = job.opts.move
    if mc.layers_per_step:
        sb = [c.break_even_steps for c in scheduled_changes(j.changes, shape.layers.size, mc.stall_ns,
                                                             mc.layers_per_step, mc.overlap)
              if c.break_even_steps is not None]
        row.layers_per_step = mc.layers_per_step
        row.scheduled_break_even_steps = float(np.median(sb)) if sb else None
    return SweepCellResult(cell.index, row, j, layer_tbls)


def run_sweep_cells(store, job: SweepJob, cells: list[SweepCell] | None = None, done=None) -> list[SweepCellResult]:
    """Judge ``cells`` (default all of the job's) in this process; ``done()`` is called
    after each cell (a progress bar)."""
    m = sweep_context(store, job)
    out = []
    for c in (job.cells if cells is None else cells):
        out.append(sweep_cell(m, job, c))
        if done is not None:
            done()
    return out


def finish_sweep(store, job: SweepJob, results: list[SweepCellResult]) -> SweepResult:
    """The decision table in row order with its notes; with a stored sweep, one
    ``replay_runs`` row (kind ``sweep``) and the ``replay_layer`` rows per cell, written
    in one transaction here (never where the cells ran)."""
    got = {r.index: r for r in results}
    missing = [c.index for c in job.cells if c.index not in got]
    if missing:
        raise ValueError(f"sweep of run {job.run_id!r}: no result for cells {missing}")
    rows = [got[c.index].row if isinstance(c, SweepCell) else c for c in job.items]
    shape, J, cost, opts = job.shape, job.first, job.opts.cost, job.opts
    T, timing = shape.steps.size, shape.timing(opts.passes)
    band = costmod.error_band(cost)
    notes = list(shape.notes) + _time_note(shape, timing) + job.described + list(cost.notes) + [
        f"every row judged on the same {T - J} steps (from step {int(shape.steps[J])}), after the largest fit window "
        f"{J}; static plans fitted on the `window` steps before them, re-plans on the trailing `window` steps",
        f"baseline: the recorded placement ({job.recorded_policy}) on those steps, same cost model "
        f"({cost.source.split(':')[0]})",
        "net = predicted MoE time per step + the cost of moving experts (bytes over NVLink / NIC from the cost "
        "model, " + opts.move.describe() + "), spread over the judged steps; the first plan is charged its moves "
        "from the recorded placement",
        "straggler_tok / rec_straggler_tok: the most tokens on one rank under the plan / the recorded placement, "
        "mean over the judged steps and layers: counted from the recorded routing, exact (no time model, no band); "
        "load (exact) says whether the plan cuts it",
        f"time verdict: pays off / does not pay off beyond the model's ±{band[0]:.0%} error ({band[1]}); fewer than "
        "10 judged steps: not enough evidence",
        "replan GiB per hour: weights moved by re-plans after the first plan, per hour of predicted (net) time, "
        "not wall-clock time; the first plan's moves (from the recorded placement) are in moved GiB"]
    if job.sweep_id is not None:
        runs, layers = [], []
        for c in job.cells:
            r = got[c.index]
            res = ReplayResult(c.replay_id, job.run_id, r.judged, r.judged.plan.describe(), opts.split, False, cost,
                               f"{T - J} steps after the largest fit window {J}", notes, band, opts.move, timing,
                               f"{job.policy} {r.row.what}")      # the report tells the cells apart by it
            runs.append(_runs_row(res, "sweep", {**job.params, "sweep_id": job.sweep_id, "cell": r.row.what,
                                                 "cell_replicas": c.replicas, "cell_replan_every": c.every,
                                                 "cell_window": c.window}))
            layers += r.layer_tables
        store.append(job.run_id, {"replay_layer": layers, "replay_runs": runs})
    return SweepResult(rows, notes, job.sweep_id, job.run_id)
