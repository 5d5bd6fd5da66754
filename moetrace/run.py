"""One run of a store, and everything moetrace can say about it: the ``Run`` facade.

This module is the documented entry point of the Python API, in the spirit of
HolisticTraceAnalysis's ``TraceAnalysis``: open a store, take one run, ask it questions::

    import moetrace

    run = moetrace.open_store("moetrace-demo/store").run("dsv3")   # run_id=None: the only run
    run.shape                      # Shape(num_experts=256, num_ranks=32, ..., ranks_from='runs')
    run.skew()                     # polars: per-layer imbalance distribution (skew_summary)
    run.skew(by="step")            # every (step, layer): imbalance, straggler, gini, ...
    run.tokens_per_expert()        # per (step, layer): experts hit vs expected, per-expert spread
    run.dummy_steps()              # per rank: steps run with no tokens, and their time
    run.exposure()                 # Exposure: all-to-all time no compute kernel hid
    run.kernels()                  # kernel names by kind with total time
    run.waits()                    # WaitResult: who waited for whom across ranks (wait matrix)
    run.whatif(domains=(8, 16, 72))  # two micro-batches, attention/FFN disaggregation, NVLink domain size
    run.plan("eplb", cluster=ClusterSpec(replicas=32))  # a placement plan fitted on the run's load
    run.replay(policy="eplb", cluster=ClusterSpec(replicas=32))  # predicted loads and step time under it
    run.drift("eplb", every=10)    # static vs re-planned vs oracle placement over time
    run.sweep("eplb", replicas=[0, 16, 32])  # the operator's decision table
    run.calibrate(judge=["rb"])    # fit the cost model on measured spans, judge on another run

    from moetrace.report.build import build_report
    build_report(run.store, run.id, "out/")   # report.html, report.md and PNGs

Every method reads the store through the same SQL views ``moetrace sql`` shows (one
definition of each quantity, in ``moetrace/storage/sql``) or delegates to the replay
package; the CLI commands and the report are thin callers of these methods. Frames are
polars DataFrames with the columns of the view they come from (``moetrace tables VIEW``
documents them); results that are not tables are dataclasses.

The shape (:class:`Shape`) is read from the ``run_shape`` view, the one every rank metric
uses, so SQL and replay agree on the number of ranks and experts: where a number was not
recorded it says where it came from (``ranks_from``: ``runs`` or ``recorded placement``)
or is None, never a silent default.
"""
from __future__ import annotations

import json
from functools import cached_property
from typing import TYPE_CHECKING

from .domain.shape import ClusterSpec, Shape
from .errors import InputError
from .notebook import NotebookView
from .storage.store import Store, open_store, register_facade

if TYPE_CHECKING:  # imported for annotations only: run.py stays light to import
    import polars as pl

    from .analyze.cache import CacheState
    from .analyze.exposure import Exposure
    from .analyze.waits import WaitResult
    from .output import Rows

#: the ways :meth:`Run.skew` groups the per-(step, layer) imbalance
SKEW_BY = ("layer", "run", "step")


class Run(NotebookView):
    """One run of a store: its shape, its metrics, and what-ifs over it.

    Get one with ``moetrace.open_store(path).run(run_id)`` (``run_id=None``: the store's
    only run). ``run.id`` is the run id, ``run.row`` the ``runs`` row (a dict),
    ``run.shape`` a :class:`Shape`, ``run.approximations`` what the collector inferred.
    Methods return polars DataFrames (one row per what they describe) or dataclasses.
    """

    def __init__(self, store, run_id: str):
        self.store = store
        self.id = run_id

    def __repr__(self) -> str:
        return f"Run({self.id!r} in {str(self.store.path)!r})"

    def _notebook_view(self):
        """In a notebook: the source, the shape and what it leaves unknown (moetrace.notebook)."""
        from .notebook import run_view

        return run_view(self)

    # ------------------------------------------------------------------ what the run is
    @cached_property
    def row(self) -> dict:
        """The ``runs`` row: source, collector, shape columns, approximations, ..."""
        return self.store.run_row(self.id)

    @cached_property
    def shape(self) -> Shape:
        """The shape every metric uses (view ``run_shape``), see :class:`Shape`."""
        df = self.store.sql("SELECT * FROM run_shape WHERE run_id = ?", [self.id])
        return Shape.from_rows(df.row(0, named=True) if df.height else {}, self.row)

    @property
    def approximations(self) -> list[str]:
        """What had to be inferred when the run was collected (``runs.approximations``)."""
        text = self.row.get("approximations")
        return list(json.loads(text)) if text else []

    def sql(self, query: str, params=None) -> "pl.DataFrame":
        """SQL over the store's views (as ``Store.sql``); filter on ``run_id`` yourself."""
        return self.store.sql(query, params)

    # ------------------------------------------------------------------ measured metrics
    def skew(self, by: str = "layer", *, batch_steps: int | None = None, memory_limit: str | None = None,
             progress=None, sql=None) -> "pl.DataFrame":
        """Imbalance (max/mean rank tokens: time lost at the combine barrier), efficiency,
        Gini, top-5% share, hottest expert and straggler rank.

        ``by="layer"``: the distribution over steps per layer (view ``skew_summary``, most
        skewed layer first); ``"run"``: one row (``run_skew_summary``); ``"step"``: every
        (step, layer) (``layer_skew``). Steps without tokens have an undefined imbalance:
        NULL in ``"step"``, counted in ``steps_undefined`` and left out of the means; so do
        steps with tokens when num_ranks is unknown, counted in ``steps_no_ranks``.
        The per-(step, layer) view is computed once, in batches of ``batch_steps`` steps,
        DuckDB capped at ``memory_limit``; ``progress(line)`` gets progress lines. With
        ``sql`` (a :class:`moetrace.storage.spark.SparkSQL`'s ``sql``), the views run on that engine
        as they are, unbatched."""
        from .analyze.frames import skew, skew_frame

        if sql is not None:
            return skew_frame(sql, self.id, by)
        return skew(self.store, self.id, by, batch_steps=batch_steps, memory_limit=memory_limit, progress=progress)

    def skew_rows(self, by: str = "layer", *, batch_steps: int | None = None, memory_limit: str | None = None,
                  progress=None) -> "Rows":
        """:meth:`skew` as :class:`moetrace.output.Rows`: the same rows as DuckDB returns
        them, without polars or Arrow (what ``moetrace skew`` prints; a command's start-up)."""
        from .analyze.frames import skew_rows

        return skew_rows(self.store, self.id, by, batch_steps=batch_steps, memory_limit=memory_limit,
                         progress=progress)

    def skew_to_parquet(self, by: str, path, *, batch_steps: int | None = None, memory_limit: str | None = None,
                        progress=None) -> int:
        """:meth:`skew`'s rows written to the Parquet file ``path`` by DuckDB itself (no polars,
        no Arrow: ``moetrace skew -o x.parquet``); returns the rows written."""
        from .analyze.frames import skew_to_parquet

        return skew_to_parquet(self.store, self.id, by, path, batch_steps=batch_steps, memory_limit=memory_limit,
                               progress=progress)

    def materialize(self, *, force: bool = False, batch_steps: int | None = None, memory_limit: str | None = None,
                    progress=None, compute=None) -> "tuple[CacheState, CacheState]":
        """Compute the run's per-(step, layer) analysis views once and store them in the store
        (:mod:`moetrace.analyze.cache`), unless a fresh copy is stored (``force``: anyway);
        the report, :meth:`skew` and :meth:`tokens_per_expert` then read the stored rows.
        Returns the cache's state before and after. ``compute``: another engine computes
        them (:func:`moetrace.analyze.on_engine.compute_with`: Spark)."""
        from .analyze.cache import store_run
        from .analyze.materialize import configure

        configure(self.store.con, memory_limit)
        return store_run(self.store, self.id, batch_steps, force=force, progress=progress, compute=compute)

    def cache_state(self) -> "CacheState":
        """The run's stored analysis against its key now: fresh, stale (and why) or absent."""
        from .analyze.cache import state

        return state(self.store, self.id)

    def clear_cache(self) -> dict[str, int]:
        """Remove the run's stored analysis ({table: files removed})."""
        from .analyze.cache import clear

        return clear(self.store, self.id)

    def tokens_per_expert(self) -> "pl.DataFrame":
        """Per (step, layer): tokens, experts hit and the expected number ``E·(1−(1−k/E)^B)``,
        per-expert min / median / mean / max (view ``tokens_per_expert``)."""
        from .analyze.frames import tokens_per_expert

        return tokens_per_expert(self.store, self.id)

    def dp_balance_line(self) -> str | None:
        """The run's attention data-parallel balance in one line (view ``dp_balance_summary``:
        mean/max tokens per DP rank and the tokens-proportional barrier cost), None when no
        step had tokens on a rank. No polars: ``moetrace skew`` prints it."""
        from .domain.dp_balance import summary_line

        rows = self.store.rows("SELECT * FROM dp_balance_summary WHERE run_id = ?", [self.id]).dicts()
        return summary_line(rows[0]) if rows else None

    def dummy_steps(self, by: str = "rank") -> "pl.DataFrame":
        """Steps a rank ran with no tokens (to keep collectives aligned): ``by="rank"`` per
        rank with their time share (view ``dummy_steps``), ``"step"`` per step
        (``dummy_by_step``)."""
        from .analyze.frames import dummy_steps

        return dummy_steps(self.store, self.id, by)

    def exposure(self, sql=None) -> "Exposure":
        """All-to-all exposure from profiler spans: how much dispatch/combine time no
        compute kernel on the same device hid, per kind, rank, group, straggler and
        stream mode (:class:`moetrace.analyze.exposure.Exposure`; ``has_a2a`` False when
        the run has no all-to-all kernel at all). ``sql``: run the view queries elsewhere
        (a :class:`moetrace.storage.spark.SparkSQL`'s ``sql``)."""
        from .analyze.exposure import exposure

        return exposure(self.store, self.id, sql=sql)

    def kernels(self, kind: str | None = None, limit: int | None = None,
                name_width: int | None = None) -> "pl.DataFrame":
        """Kernel names by kind (classifier output) with spans, ranks and total time,
        heaviest first; ``limit`` names per kind, names cut to ``name_width`` characters."""
        from .analyze.exposure import kernels_table

        return kernels_table(self.store, self.id, kind, limit, name_width)

    def expert_gemm_gap(self, sql=None) -> str | None:
        """One line when the trace shows MoE work (MoE ranges, MoE kernels) but no kernel
        was classified expert_gemm (the share is unknown, not 0), else None
        (:func:`moetrace.analyze.kernel_gaps.expert_gemm_gap`)."""
        from .analyze.kernel_gaps import expert_gemm_gap

        return expert_gemm_gap(sql or self.store.sql, self.id)

    def waits(self) -> "WaitResult":
        """Who waited for whom: collective instances matched across ranks, each rank's wait
        charged to the last arriver, the wait matrix and the exposed split into waiting and
        transfer (:class:`moetrace.analyze.waits.WaitResult`; views of 45_rank_waits.sql)."""
        from .analyze.waits import wait_result

        return wait_result(self.store, self.id)

    def hang(self):
        """The hang post-mortem of the run's communication log (Flight Recorder dumps): per
        process group, each rank's progress, the collective the others wait in, the ranks
        that never reached it, and mismatched ops / sizes (:mod:`moetrace.analyze.hang`)."""
        from .analyze.hang import hang_result

        return hang_result(self.store, self.id)

    def wait_shift(self, steps_a, steps_b=None, by: str = "position"):
        """How much each rank's net wait rose in ``steps_a`` against ``steps_b`` (default:
        the other steps): the median shift and its standard error per rank
        (``by="layer"``) or per rank, collective and position in the layer
        (``by="position"``); a delay injected with ``refrun --delay-every 2`` shows at its
        rank and collective (:func:`moetrace.analyze.waits.wait_shift`)."""
        from .analyze.waits import wait_shift

        return wait_shift(self.store, self.id, steps_a, steps_b, by=by)

    def whatif(self, *, write: bool = True, trace_path=None, **options):
        """Two-micro-batch overlap, attention/FFN disaggregation and NVLink domain size on
        the recorded timeline (:func:`moetrace.replay.timeline_whatif_store.run_whatifs`;
        keyword options as :class:`~moetrace.replay.timeline_whatif_store.WhatIfOptions`;
        writes ``replay_whatif`` unless ``write=False``)."""
        from .replay.timeline_whatif_store import WhatIfOptions, run_whatifs

        return run_whatifs(self.store, self.id, WhatIfOptions(**options), write=write, trace_path=trace_path)

    def stored_whatifs(self) -> "pl.DataFrame | None":
        """The newest ``replay_whatif`` rows of each kind written for this run (long form,
        one metric per row); None when ``moetrace whatif`` never wrote any."""
        from .replay.timeline_whatif_store import latest

        return latest(self.store, self.id)

    def placement_whatif(self, max_cells: int = 2_000_000):
        """The report's in-memory placement what-if (nothing written): the recorded placement
        and a few plans fitted on the first half of the steps (of the first ``max_cells``
        steps x layers x experts), judged on the rest, net of moves
        (:class:`moetrace.replay.placement_whatif.PlacementWhatIf`; None without a rank count). Raises
        ``InputError`` when the run has no expert load to replay."""
        from .replay.placement_whatif import placement_whatif

        return placement_whatif(self.store, self.id, self._replay_shape, max_cells)

    # ------------------------------------------------------------------ what-ifs (replay)
    @cached_property
    def _replay_shape(self):
        from .replay.load import read_shape

        return read_shape(self.store, self.id)

    def _replay_opts(self, split="even", hardware="H200", fit_cost=True, rank_rows=True, stall_ms=0.0, overlap=0.0,
                     passes=None, cost_model=None, cluster: ClusterSpec | None = None, replica_dispatch="even",
                     balance_tolerance=None, layers_per_step=None, rank_speed=None):
        from dataclasses import replace

        from .replay.cost_fit import run_cost_model
        from .replay.results import ReplayOptions
        from .replay.strategies import MoveCost

        # the cluster's all-to-all kernel, SMs and node limit choose the preset's dispatch/combine model
        cost = run_cost_model(self.store, self.id, self._replay_shape, hardware.upper(), fit_cost, cost_model, cluster)
        if rank_speed is not None:
            from .replay.rank_speed import MEASURED, describe

            speed, _ = self.rank_speed(rank_speed, cluster.ranks if cluster else None)
            src = "measured from this run's expert spans, view rank_speed" if str(rank_speed).strip().lower() \
                == MEASURED else "stated"
            cost = replace(cost, rank_speed=tuple(speed.tolist()), source=f"{cost.source}; {describe(speed, src)}")
        stall_ns, stall_source = self.move_stall(stall_ms)
        return ReplayOptions(split=split, hardware=hardware.upper(), fit_cost=fit_cost, rank_rows=rank_rows,
                             move=MoveCost(stall_ns=stall_ns, overlap=overlap, stall_source=stall_source,
                                           layers_per_step=layers_per_step),
                             passes=passes, cost=cost, replica_dispatch=replica_dispatch,
                             balance_tolerance=balance_tolerance)

    def rank_speed(self, spec, ranks: int | None = None):
        """Each rank's expert-time factor for the cost model, [R], and notes: ``spec`` a dict
        {rank: factor} or ``"0:1.0,1:1.1"`` (stated; other ranks 1.0) or ``"measured"`` (the
        view ``rank_speed`` of this run's spans). ``ranks``: the replay's rank count
        (default the run's)."""
        from .replay import rank_speed as rs

        R = ranks or self.shape.num_ranks
        if not R:
            raise InputError(None, "--rank-speed: the run's rank count is unknown (give --ranks)")
        if isinstance(spec, str) and spec.strip().lower() == rs.MEASURED:
            rows = self.store.rows("SELECT rank, speed_ratio FROM rank_speed WHERE run_id = ?", [self.id]).rows
            if not rows:
                raise InputError(None, f"--rank-speed measured: run {self.id!r} has no expert_gemm spans with a step "
                                       "and layer to measure ranks by (view rank_speed is empty); state the factors "
                                       "instead, e.g. --rank-speed 0:1.0,1:1.1")
            return rs.measured_vector([r[0] for r in rows], [r[1] for r in rows], R)
        factors = spec if isinstance(spec, dict) else rs.parse_rank_speed(spec)
        return rs.speed_vector(factors, R), []

    def move_stall(self, stall_ms) -> tuple[float, str]:
        """(stall ns per plan change, where it came from): ``stall_ms`` a number (stated) or
        ``"measured"`` / ``"measured:RUN"`` (the median rebalance duration the engines logged,
        view ``rebalance_timing``, over the store's runs or RUN's)."""
        if not isinstance(stall_ms, str):
            return float(stall_ms or 0.0) * 1e6, "stated"
        text = stall_ms.strip()
        if not text.lower().startswith("measured"):
            try:
                return float(text) * 1e6, "stated"
            except ValueError:
                raise InputError(None, f"--move-stall-ms {stall_ms!r}: give milliseconds or 'measured[:RUN]'") from None
        _, _, src = text.partition(":")
        q = "SELECT run_id, engine, rebalances, median_s FROM rebalance_timing WHERE rebalances > 0"
        rows = self.store.rows(q + (" AND run_id = ?" if src else "") + " ORDER BY run_id, engine",
                               [src] if src else None).rows
        if not rows:
            raise InputError(None, "--move-stall-ms measured: no logged rebalance with a duration in "
                                   + (f"run {src!r}" if src else "this store") + " (ingest the engine's server log: "
                                   "SGLang [EPLBManager] rebalance end time=..., vLLM rearrangement lines)")
        run, engine, n, med = rows[0]
        return float(med) * 1e9, f"measured: median of {n} {engine} rebalances logged in run {run}"

    def cost_model(self, hardware: str = "H200", fit_cost: bool = True, cluster: ClusterSpec | None = None):
        """The cost model a replay of this run uses (:class:`moetrace.costmodel.step_cost.CostModel`;
        ``cluster``: its all-to-all kernel, SMs and node limit)."""
        return self._replay_opts(hardware=hardware, fit_cost=fit_cost, cluster=cluster).cost

    def plan(self, policy: str | None = None, *, cluster: ClusterSpec | None = None, options=None):
        """A placement plan: ``policy`` (``moetrace.placement.planners.PLANNERS``) fitted on the
        run's summed load on ``cluster`` (:class:`~moetrace.domain.shape.ClusterSpec`; None:
        the run's own) and renamed to keep experts where the start plan (default the recorded
        one) has them; or a plan file imported, or a stored plan re-planned with a move budget
        (``options``: a :class:`moetrace.placement.plans.PlanOptions`: fit window, start plan,
        import file, move budget, plan id, store, export). Returns a
        :class:`moetrace.placement.plans.PlanResult` (plan, moves, imbalance on the fit load)."""
        from functools import partial

        from .placement.plans import make_run_plan
        from .replay.fanout import cooccurrence_over
        from .replay.load import read_load_total

        shape = self._replay_shape.with_cluster(cluster)
        co = partial(cooccurrence_over, self.store, self.id, shape) if shape.has_routing else None
        return make_run_plan(self.store, self.id, shape, partial(read_load_total, self.store, self.id, shape),
                             policy, cluster, options, read_cooccurrence=co)

    def replay(self, plan=None, *, policy: str | None = None, cluster: ClusterSpec | None = None,
               fit_window: tuple[int, int] | None = None, in_sample: bool = False, write: bool = True,
               trace_steps=None, chrome_trace=None, **opts):
        """Judge ``plan`` (a Plan, a stored plan id, or ``"recorded"``: the run's own
        placement) or a ``policy`` fitted on ``fit_window`` (default the first half of the
        steps) on ``cluster`` (None: the run's own) against the recorded placement on the
        same steps: out-of-sample (the steps after the fit window) unless ``in_sample``.
        Options: split, hardware, fit_cost, rank_rows, stall_ms, overlap (share of the weight
        transfer hidden), passes. Writes ``replay_*`` tables unless ``write=False``; with
        ``chrome_trace`` (a path) the predicted timeline of ``trace_steps`` (default the first
        judged step) is written there. Returns a :class:`moetrace.replay.results.ReplayResult`
        (``.to_dict()`` is ``replay --json``)."""
        from .replay.judge import replay_run

        ro = self._replay_opts(cluster=cluster, **opts)
        return replay_run(self.store, self.id, self._replay_shape.with_cluster(cluster), ro, plan, policy=policy,
                          cluster=cluster, fit_window=fit_window, in_sample=in_sample, write=write,
                          trace_steps=trace_steps, chrome_trace=chrome_trace, params=opts)

    def drift(self, policy: str, every: int, window: int | None = None, *, cluster: ClusterSpec | None = None,
              max_moves: int | None = None, static_window: tuple[int, int] | None = None, write: bool = True,
              **opts):
        """Static plan vs re-planning every ``every`` steps from the trailing ``window``
        steps (default ``every``; with ``max_moves`` move-aware) vs an oracle, on ``cluster``
        (None: the run's own), judged on the steps after the first window against the
        recorded placement, net of moving experts.
        Returns a :class:`moetrace.replay.drift.DriftResult`."""
        from .replay.drift import drift

        shape = self._replay_shape.with_cluster(cluster)
        ps = shape.plan_shape(cluster)
        return drift(self.store, self.id, shape, policy, ps, every, window or every,
                     self._replay_opts(cluster=cluster, **opts), max_moves=max_moves, write=write,
                     static_window=static_window)

    def sweep(self, policy: str = "eplb", replicas=(0, 16, 32, 64), intervals=(), windows=None, *,
              cluster: ClusterSpec | None = None, write: bool = False, sweep_id: str | None = None,
              workers: int | None = None, scheduler: str | None = None, progress=None, **opts):
        """The operator's decision table: replica budgets x re-plan intervals x fit windows,
        judged on the same steps against the recorded placement: net time, extra memory per
        rank, moved bytes per hour, verdict (``cluster``: ranks, groups, nodes, ranks per node;
        its ``replicas`` is ignored, the budgets are ``replicas``). ``write`` stores every
        cell (``replay_runs`` kind ``sweep`` and its ``replay_layer`` rows). ``workers`` (a
        local Dask cluster of that many processes) or ``scheduler`` (an existing one,
        ``tcp://host:8786``) fan the cells out (:mod:`moetrace.replay.distributed`): same rows,
        written once, here. :func:`sweep_runs` with this one run. Returns a
        :class:`moetrace.replay.sweep.SweepResult` (``.frame()``, ``.rows``, ``.notes``)."""
        return sweep_runs(self.store, [self.id], policy, replicas=replicas, intervals=intervals, windows=windows,
                          cluster=cluster, write=write, sweep_id=sweep_id, workers=workers, scheduler=scheduler,
                          progress=progress, **opts)[0][0]

    def plan_sweep(self, policy: str = "eplb", replicas=(0, 16, 32, 64), intervals=(), windows=None, *,
                   cluster: ClusterSpec | None = None, write: bool = False, sweep_id: str | None = None, **opts):
        """The sweep's cells, checked, nothing judged yet (a
        :class:`moetrace.replay.sweep.SweepJob`; :func:`sweep_runs` judges them)."""
        from .replay.sweep import plan_sweep

        return plan_sweep(self.store, self.id, self._replay_shape.with_cluster(cluster), policy, list(replicas),
                          list(intervals), windows, self._replay_opts(cluster=cluster, **opts), cluster, write=write,
                          sweep_id=sweep_id)

    @property
    def hardware(self) -> str | None:
        """The hardware the run was measured on, as its collector recorded it (None: unknown)."""
        from .replay.calibrate import run_hardware

        return run_hardware(self.store, self.id)

    def error_band(self):
        """The error band of predicted times on this run's hardware: the newest out-of-sample
        calibration stored for it, else the uncalibrated default
        (:class:`moetrace.replay.calibrate.ErrorBand`)."""
        from .replay.calibrate import error_band

        return error_band(self.store, self.hardware)

    def calibrations(self) -> "pl.DataFrame | None":
        """One row per (calibration, role) stored for this run, newest first, metrics
        recomputed in SQL from the stored cells; None when the store holds no calibration."""
        from .replay.calibrate import stored_summary

        return stored_summary(self.store, self.id)

    def calibrate(self, judge=(), **kw) -> dict:
        """Fit the replay cost model on this run's measured spans (expert time = a·tokens +
        b·slots touched; all-to-all = latency + bytes / bandwidth) and judge it on the runs
        ``judge`` (ids); keyword arguments as :func:`moetrace.replay.calibrate.calibrate`."""
        from .replay.calibrate import calibrate

        return calibrate(self.store, self.id, list(judge), **kw)


def _clear_store_cache(store: Store) -> dict[str, int]:
    from .analyze.cache import clear

    return clear(store, None)


# ``store.run(run_id)`` and ``store.clear_cache()``: the store layer does not import this one
register_facade(Run, _clear_store_cache)


def sweep_runs(store, run_ids, policy: str = "eplb", *, workers: int | None = None, scheduler: str | None = None,
               progress=None, **kw) -> tuple[list, list[str]]:
    """The one sweep entry point: the sweep of every run in ``run_ids`` (keyword arguments
    as :meth:`Run.plan_sweep`), its cells judged in this process, or as independent tasks
    on a local Dask cluster of ``workers`` processes / the existing one at ``scheduler``
    (:mod:`moetrace.replay.distributed`); each stored sweep is written here, once per run.
    ``progress(done, total)`` is told the cells judged so far (in this process).
    Returns (one :class:`moetrace.replay.sweep.SweepResult` per run that can be swept,
    notes naming the runs that cannot and why). All runs refused: the first run's error."""
    from .errors import InputError

    jobs, skipped, first = [], [], None
    for rid in run_ids:
        try:
            jobs.append(store.run(rid).plan_sweep(policy, **kw))
        except InputError as e:
            first = first or e
            skipped.append(f"run {rid} not swept: {e.message}")
    if not jobs:
        raise first or InputError(None, "the store has no runs to sweep")
    if workers is None and scheduler is None:
        from .replay.sweep import finish_sweep, run_sweep_cells

        total, done = sum(len(j.cells) for j in jobs), [0]

        def tick():
            done[0] += 1
            if progress is not None:
                progress(done[0], total)
        return [finish_sweep(store, job, run_sweep_cells(store, job, done=tick)) for job in jobs], skipped
    from .replay import distributed

    with distributed.client_for(workers, scheduler) as client:
        return distributed.run_jobs(client, store, jobs), skipped


__all__ = ["Run", "Shape", "ClusterSpec", "SKEW_BY", "Store", "open_store", "sweep_runs"]
