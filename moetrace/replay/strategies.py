"""Judging placement strategies against the recorded one: one loop, arrays in, typed results out.

A strategy says which plan serves each judged step: :class:`Fixed` (one plan: a stored,
imported or static plan fitted on a window), :class:`Replan` (re-planned every N steps
from the trailing W steps, fully or with a move budget) and :class:`Oracle` (fitted on the
very steps it is judged on: a lower bound, never a plan one could deploy). :func:`judge`
runs them over the same steps as the recorded placement, with the same cost model, and
charges every plan change its cost:

- **moved bytes**: each expert copy a rank must receive weighs ``expert_bytes``; it comes
  over NVLink when a rank of the same node held the expert, else over the NIC
  (:func:`moves.move_copies`); ranks receive in parallel, so a re-plan's transfer time
  is the slowest rank's;
- **stall**: ``MoveCost.stall_ns`` per re-plan (what the engine stops for while it
  rearranges); a synchronous engine (``overlap`` 0) also waits for the whole transfer, an
  asynchronous one hides ``overlap`` of it behind compute.

The first plan of a strategy replaces the recorded placement, so it is charged its moves
from it. Gross time per step is the predicted MoE time; net adds the charges, spread over
the judged steps. The break-even step count of a re-plan is its charge over its gross
gain per step (against keeping the plan it replaces, on the steps it serves). The
verdict (:func:`verdict`) compares net with the recorded placement's time and the cost
model's error band.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..costmodel.step_cost import CostModel, error_band
from ..domain.shape import PlanShape, Timing
from ..placement.moves import move_copies, replan
from ..placement.planners import Plan, make_plan
from ..placement.relabel import relabel
from ..units import DOES_NOT, NOT_ENOUGH, PAYS_OFF, compare_word  # noqa: F401  (the verdict words live in units)
from .accumulate import LoadAccumulator, LoadTotals, SummaryAccumulator
from .engine import Block, LayerMetrics, Summary, layer_metrics, ordered_map, reuse_freed_memory

#: fewer judged steps than this cannot carry a verdict
MIN_JUDGED_STEPS = 10

@dataclass
class MoveCost:
    """What a plan change costs besides the bytes: ``stall_ns`` per re-plan (``stall_source``:
    stated, or measured from the engines' logged rebalances), the share ``overlap`` of the
    weight transfer an asynchronous engine hides (0 = synchronous), and ``layers_per_step``:
    the layers the engine moves per step (None: all at once; :mod:`.move_schedule` spreads a
    change over steps and gives its break-even under that schedule)."""
    stall_ns: float = 0.0
    overlap: float = 0.0
    stall_source: str = "stated"
    layers_per_step: int | None = None

    def describe(self) -> str:
        mode = "synchronous (the transfer stalls the step)" if self.overlap == 0 else (
            f"asynchronous ({self.overlap:.0%} of the transfer hidden)")
        src = "" if self.stall_source == "stated" else f" ({self.stall_source})"
        sched = "" if not self.layers_per_step else f", {self.layers_per_step} layer(s) moved per step"
        return f"moves: {mode}, stall {self.stall_ns / 1e6:g} ms per re-plan{src}{sched}"


@dataclass
class Change:
    """One plan change: at ``step``, ``moves`` expert copies (``bytes``) received, the
    slowest rank's transfer time, the charge, the gross gain per step against keeping the
    previous plan on the ``served_steps`` this plan serves, and the break-even step count
    (None when the plan gains nothing: it never pays back)."""
    step: int
    moves: int
    bytes: int
    bytes_inter: int
    transfer_ns: float
    charged_ns: float
    gain_per_step_ns: float         # 0 with no time per step (aggregate counts)
    served_steps: int
    break_even_steps: float | None

    @property
    def pays_back(self) -> bool:
        return self.break_even_steps is not None and self.break_even_steps <= self.served_steps


@dataclass
class PlanRun:
    """``steps`` consecutive judged steps served by plan ``plan_id``; ``aged``: a re-plan's
    block, whose plan ages 1, 2, ... over it (else no age)."""
    plan_id: str
    steps: int
    aged: bool = False


@dataclass
class Judged:
    """A strategy judged against the recorded placement on the same steps.

    Memory: the per-(step, layer) results are folded into fixed-size totals while the
    steps stream (:mod:`.accumulate`); what grows with the judged steps is ``steps`` (the
    judged step ids, 8 bytes a step) and ``series`` (one float64 a step), and
    ``plan_runs`` grows with the number of re-plans (run-length: one entry per block)."""
    name: str
    kind: str                      # replay | static | replan | oracle | recorded
    plan: Plan                     # the first plan (the only one for fixed plans)
    steps: np.ndarray              # judged step ids
    summary: Summary
    recorded: Summary              # the recorded placement on the same steps
    gross_step_ns: float | None
    net_step_ns: float | None
    recorded_step_ns: float | None
    changes: list[Change] = field(default_factory=list)
    verdict: str = NOT_ENOUGH
    verdict_reason: str = ""
    series: np.ndarray | None = None            # mean imbalance over layers per judged step
    plan_runs: list[PlanRun] = field(default_factory=list)   # which plan served which steps
    load: LoadTotals | None = None              # the plan's exact load per layer
    recorded_load: LoadTotals | None = None     # the recorded placement's, same steps

    @property
    def plan_ids(self) -> list[str]:
        """The plan id of every judged step (expanded from :attr:`plan_runs`)."""
        return [r.plan_id for r in self.plan_runs for _ in range(r.steps)]

    @property
    def ages(self) -> list[int | None]:
        """Steps since the serving plan was made (1 on its first step), per judged step; None
        for a fixed plan."""
        return [a for r in self.plan_runs for a in (range(1, r.steps + 1) if r.aged else [None] * r.steps)]

    def age_array(self) -> np.ndarray:
        """:attr:`ages` as int64, 0 for None."""
        return np.concatenate([np.arange(1, r.steps + 1) if r.aged else np.zeros(r.steps, np.int64)
                               for r in self.plan_runs]) if self.plan_runs else np.zeros(0, np.int64)

    @property
    def moved_experts(self) -> int:
        return sum(c.moves for c in self.changes)

    @property
    def moved_bytes(self) -> int:
        return sum(c.bytes for c in self.changes)

    def vs_recorded(self, net: bool = True) -> str:
        """'X ms vs Y ms recorded (−Z%)' (net by default)."""
        x = self.net_step_ns if net else self.gross_step_ns
        return compare_text(x, self.recorded_step_ns)


def compare_text(x_ns: float | None, rec_ns: float | None, unit: str = "step") -> str:
    if x_ns is None or rec_ns is None:
        return f"no time per {unit} (see notes)"
    pct = (x_ns / rec_ns - 1) * 100 if rec_ns else 0.0
    return f"{x_ns / 1e6:.3f} ms vs {rec_ns / 1e6:.3f} ms recorded ({pct:+.1f}%)".replace("-", "−")


def verdict(net_ns: float | None, recorded_ns: float | None, judged_steps: int, cost: CostModel,
            min_steps: int = MIN_JUDGED_STEPS) -> tuple[str, str]:
    """(verdict, reason): pays off / does not pay off / not enough evidence (no time, too
    few steps, or a difference within the cost model's error band)."""
    if net_ns is None or recorded_ns is None:
        return NOT_ENOUGH, "no predicted time per step (the counts aggregate many passes)"
    if judged_steps < min_steps:
        return NOT_ENOUGH, f"only {judged_steps} steps judged (fewer than {min_steps})"
    eb = error_band(cost)          # its full source is said once per answer, with the cost model
    band = eb[0]
    word, _ = compare_word(net_ns, recorded_ns, band)
    d = f"{(net_ns - recorded_ns) / recorded_ns if recorded_ns else 0.0:+.1%}".replace("-", "−")
    where = "within" if word == NOT_ENOUGH else "beyond"
    unval = eb.unvalidated() if hasattr(eb, "unvalidated") else None
    return word, f"net {d} vs recorded, {where} the model's ±{band:.0%} band" + (f" ({unval})" if unval else "")


def fastest_text(nets: dict[str, float | None], band: float, bound: tuple[str, ...] = ("oracle",)) -> str:
    """"fastest net: static" when it beats every other plan by more than ±``band``, else
    what the band allows one to say ("static and replan within the ±10% band: no predicted
    winner"); ``bound`` (the oracle) is left out: a bound, not a plan."""
    known = {k: v for k, v in nets.items() if v is not None and k not in bound}
    if not known:
        return "fastest net: none (no predicted time per step)"
    best = min(known, key=lambda k: known[k])
    tied = [k for k, v in known.items() if k != best and compare_word(known[best], v, band)[0] == NOT_ENOUGH]
    if tied:
        return (f"fastest net: {best} predicted, but {', '.join(tied)} within the ±{band:.0%} band of it: "
                "no predicted winner")
    if len(known) == 1:
        return f"fastest net: {best} (the only plan with a time)"
    return f"fastest net: {best}, beyond the ±{band:.0%} band of the others"


def change_cost(prev: Plan, new: Plan, expert_bytes: int, cost: CostModel, mc: MoveCost) -> tuple[int, int, int, float, float]:
    """(moves, bytes, inter-node bytes, slowest rank's transfer ns, charged ns) of replacing ``prev`` by ``new``."""
    intra, inter = move_copies(prev, new)
    moves = int(intra.sum() + inter.sum())
    if moves == 0:
        return 0, 0, 0, 0.0, 0.0
    t = float(cost.transfer_ns(intra * float(expert_bytes), inter * float(expert_bytes)).max())
    return moves, moves * int(expert_bytes), int(inter.sum()) * int(expert_bytes), t, mc.stall_ns + t * (1 - mc.overlap)


# ----------------------------------------------------------------------------- strategies
class Strategy:
    """Which plan serves each judged step. ``boundaries(n)`` gives the judged-step indices
    where the plan may change; ``plan_at(i0, i1, history)`` the plan for judged steps
    [i0, i1), ``history(lo, hi)`` giving the summed load of all-steps indices [lo, hi)."""
    kind = "replay"
    charged = True

    def boundaries(self, n: int) -> list[int]:
        return [0]

    def plan_at(self, prev: Plan, j0: int, j1: int, history) -> tuple[Plan, bool]:
        raise NotImplementedError


@dataclass
class Fixed(Strategy):
    plan: Plan
    kind: str = "replay"
    charged: bool = True

    def plan_at(self, prev, j0, j1, history):
        return self.plan, True


@dataclass
class Replan(Strategy):
    """Re-plan every ``every`` judged steps from the trailing ``window`` steps (all-steps
    indices before the block); with ``max_moves`` the move-aware re-planner starts from the
    previous plan, else a full re-plan renamed to keep experts in place (:mod:`.relabel`)."""
    policy: str
    shape: PlanShape
    every: int
    window: int
    first: int                      # all-steps index of the first judged step
    layers: np.ndarray
    max_moves: int | None = None
    kind: str = "replan"
    charged: bool = True
    unrelabeled_moves: int = 0

    def boundaries(self, n):
        return list(range(0, n, self.every))

    def plan_at(self, prev, j0, j1, history):
        a = self.first + j0
        wl = history(max(0, a - self.window), a)
        same = prev.num_slots == self.shape.num_slots and prev.num_ranks == self.shape.num_ranks
        if self.max_moves is not None and same:   # (from a plan of another shape: a full plan first)
            plan, _ = replan(prev, wl, max_moves=self.max_moves, policy_name=f"{self.policy}+moves")
        else:
            fresh = make_plan(self.policy, wl, self.shape, layers=self.layers)
            plan, info = relabel(prev, fresh)
            self.unrelabeled_moves += info.get("moves_before", 0)
        return plan, True


@dataclass
class Oracle(Strategy):
    """Fitted on each block's own steps: a lower bound, not charged for moves."""
    policy: str
    shape: PlanShape
    every: int
    first: int
    layers: np.ndarray
    kind: str = "oracle"
    charged: bool = False

    def boundaries(self, n):
        return list(range(0, n, self.every))

    def plan_at(self, prev, j0, j1, history):
        return make_plan(self.policy, history(self.first + j0, self.first + j1), self.shape, layers=self.layers), True


# ----------------------------------------------------------------------------- the loop
ReplayFn = Callable[[np.ndarray, np.ndarray, "np.ndarray | None", Plan, bool], Block]


def _metrics(replay_fn, ids, load, slot_load, plan, recorded, cost, per_pass) -> tuple[Block, LayerMetrics]:
    block = replay_fn(ids, load, slot_load, plan, recorded)
    m = layer_metrics(block, cost)
    if per_pass:   # aggregate counts: the time of one pass, from load / passes
        scaled = replay_fn(ids, load / per_pass, None if slot_load is None else slot_load / per_pass, plan, recorded)
        m2 = layer_metrics(scaled, cost)
        m.layer_ns, m.rank_ns, m.dispatch_ns, m.compute_ns = m2.layer_ns, m2.rank_ns, m2.dispatch_ns, m2.compute_ns
    return block, m


def _rank_mean(m: LayerMetrics) -> np.ndarray:
    return m.rank_ns_mean if m.rank_ns_mean is not None else m.rank_ns.mean(axis=2)


class _Acc:
    """Streaming totals of the judged plan and the recorded one (:mod:`.accumulate`): memory
    independent of the number of judged steps but for the step ids and the series (8 bytes
    a step each) and one run-length entry per block."""

    def __init__(self, expect_cells: int | None = None):
        self.sum = SummaryAccumulator(expect_cells=expect_cells)
        self.rsum = SummaryAccumulator(expect_cells=expect_cells)
        self.load, self.rload = LoadAccumulator(), LoadAccumulator()
        self.runs: list[PlanRun] = []
        self.steps: list[np.ndarray] = []
        self.series: list[np.ndarray] = []
        self.n = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the fixed-size totals (the step ids and the series are not counted)."""
        return self.sum.nbytes + self.rsum.nbytes + self.load.nbytes + self.rload.nbytes

    def add(self, ids, m: LayerMetrics, mr: LayerMetrics, plan_id: str, replan: bool):
        R, rR = m.rank_ns.shape[2], mr.rank_ns.shape[2]
        self.sum.add(m.imbalance, m.layer_ns, _rank_mean(m), R)
        self.load.add(m.max_tokens, m.load_straggler, m.mean_tokens, R)
        if mr is m:
            self.rsum.add(m.imbalance, m.layer_ns, _rank_mean(m), R)
            self.rload.add(m.max_tokens, m.load_straggler, m.mean_tokens, R)
        else:
            self.rsum.add(mr.imbalance, mr.layer_ns, _rank_mean(mr), rR)
            self.rload.add(mr.max_tokens, mr.load_straggler, mr.mean_tokens, rR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # steps where no layer routed a token
            self.series.append(np.nanmean(np.asarray(m.imbalance, np.float64), axis=1))
        self.steps.append(np.asarray(ids))
        self.n += ids.size
        last = self.runs[-1] if self.runs else None
        if not replan and last is not None and not last.aged and last.plan_id == plan_id:
            last.steps += ids.size
        else:
            self.runs.append(PlanRun(plan_id, int(ids.size), bool(replan)))

    def finish(self, name, strategy: Strategy, first_plan: Plan, changes: list[Change], cost: CostModel,
               timing: Timing) -> Judged:
        steps = np.concatenate(self.steps)
        n = steps.size
        s, r = self.sum.summary(), self.rsum.summary()
        timed = timing.timed or bool(timing.per_pass)
        gross = self.sum.sum_layer_ns / n if timed else None
        rec = self.rsum.sum_layer_ns / n if timed else None
        charges = sum(c.charged_ns for c in changes)
        net = None if gross is None else gross + charges / (n * (timing.per_pass or 1))
        if not timed:   # aggregate counts of unknown passes: moves are counted, no time to weigh them against
            s.predicted_step_ns = r.predicted_step_ns = None
            for c in changes:
                c.transfer_ns = c.charged_ns = c.gain_per_step_ns = 0.0
                c.break_even_steps = None
        if strategy.kind == "oracle":
            v, why = NOT_ENOUGH, "the oracle is fitted on the steps it is judged on: a lower bound, not a plan"
        elif strategy.kind == "recorded":
            v, why = NOT_ENOUGH, "the recorded placement is the baseline"
        else:
            v, why = verdict(net, rec, n, cost)
        return Judged(name or strategy.kind, strategy.kind, first_plan, steps, s, r, gross, net, rec, changes, v, why,
                      series=np.concatenate(self.series), plan_runs=self.runs,
                      load=self.load.totals(), recorded_load=self.rload.totals())


def _charge(prev, plan, expert_bytes, cost, mc, step, gain, served) -> Change | None:
    try:
        mv, by, byi, t, charged = change_cost(prev, plan, expert_bytes, cost, mc)
    except ValueError:     # plans of other layers or experts: every slot is new
        mv = plan.num_slots * plan.num_layers
        by, byi, t, charged = mv * int(expert_bytes), 0, 0.0, mc.stall_ns
    if not (mv or charged):
        return None
    return Change(int(step), mv, by, byi, t, charged, gain, served, charged / gain if gain > 0 else None)


def _per_pass(timing: Timing | None):
    return None if timing is None or timing.timed else timing.per_pass


def judge(ids: np.ndarray, load: np.ndarray, slot_load: np.ndarray | None, first: int, strategy: Strategy,
          recorded: Plan, replay_fn: ReplayFn, cost: CostModel, expert_bytes: int, mc: MoveCost | None = None,
          name: str | None = None, timing: Timing | None = None,
          on_block: Callable[[np.ndarray, Plan, Block, LayerMetrics], None] | None = None) -> Judged:
    """Judge ``strategy`` on steps ``ids[first:]`` of ``load [T, L, E]`` (in memory) against
    the recorded placement on the same steps. ``replay_fn(ids, load, slot_load, plan,
    is_recorded)`` replays one block (the adapter's: per-token routing or counts).
    ``on_block`` sees every block the strategy served (to write result rows)."""
    mc, timing = mc or MoveCost(), timing or Timing()
    n = ids.size - first
    if n <= 0:
        raise ValueError("no judged steps")
    sums = np.concatenate([np.zeros((1,) + load.shape[1:]), np.cumsum(load, axis=0, dtype=np.float64)])

    def history(lo, hi):
        return sums[hi] - sums[lo]

    bounds = strategy.boundaries(n) + [n]
    prev, first_plan, acc, changes = recorded, None, _Acc(), []
    pp = _per_pass(timing)
    with reuse_freed_memory():
        for j0, j1 in zip(bounds[:-1], bounds[1:]):
            a, b = first + j0, first + j1
            bid, bl = ids[a:b], load[a:b]
            bsl = None if slot_load is None else slot_load[a:b]
            plan, _ = strategy.plan_at(prev, j0, j1, history)
            if plan.plan_id is None:
                plan.plan_id = f"{strategy.kind}@{int(ids[a])}"
            first_plan = first_plan or plan
            is_rec = plan is recorded
            blk, m = _metrics(replay_fn, bid, bl, bsl, plan, is_rec, cost, pp)
            mr = m if is_rec else _metrics(replay_fn, bid, bl, bsl, recorded, True, cost, pp)[1]
            if on_block is not None:
                on_block(bid, plan, blk, m)
            acc.add(bid, m, mr, plan.plan_id, strategy.kind == "replan")
            if strategy.charged and plan is not prev and not is_rec:
                pm = mr if prev is recorded else _metrics(replay_fn, bid, bl, bsl, prev, False, cost, pp)[1]
                gain = float((pm.layer_ns.sum(axis=1) - m.layer_ns.sum(axis=1)).mean())
                ch = _charge(prev, plan, expert_bytes, cost, mc, ids[a], gain, b - a)
                if ch:
                    changes.append(ch)
            prev = plan
    return acc.finish(name, strategy, first_plan, changes, cost, timing)


def judge_stream(chunks: Iterable[tuple[np.ndarray, np.ndarray, "np.ndarray | None"]], plan: Plan, recorded: Plan,
                 replay_fn: ReplayFn, cost: CostModel, expert_bytes: int, mc: MoveCost | None = None,
                 name: str | None = None, timing: Timing | None = None, kind: str = "replay",
                 on_block: Callable[[np.ndarray, Plan, Block, LayerMetrics], None] | None = None,
                 on_recorded: Callable[[np.ndarray, Block], None] | None = None,
                 expect_cells: int | None = None) -> Judged:
    """:func:`judge` for one fixed ``plan`` over step chunks (bounded memory on long runs):
    the switch from the recorded placement is charged once, at the first judged step.
    ``on_recorded`` sees the recorded placement's block of every chunk. ``expect_cells``: the
    (step, layer) cells the chunks hold, if known (the accumulators' buffers are sized for
    them from the start: memory flat over the replay)."""
    mc, timing = mc or MoveCost(), timing or Timing()
    strategy = Fixed(plan, kind="recorded" if plan is recorded else kind)
    acc, pp = _Acc(expect_cells), _per_pass(timing)
    # both placements in one pass where the replayer can (replay_fn.pair: engine.replay_pair),
    # pieces side by side on the replay threads; else one plan after the other, piece by piece
    pair = getattr(replay_fn, "pair", None)
    kernel = pair(plan, recorded, cost) if pair is not None and pp is None and plan is not recorded else None

    def one(c):
        bid, bl, bsl = c
        if kernel is not None:
            (blk, m), (rblk, mr) = kernel(bid, bl, bsl)
            return bid, blk, m, rblk, mr
        blk, m = _metrics(replay_fn, bid, bl, bsl, plan, plan is recorded, cost, pp)
        rblk, mr = (blk, m) if plan is recorded else _metrics(replay_fn, bid, bl, bsl, recorded, True, cost, pp)
        return bid, blk, m, rblk, mr

    with reuse_freed_memory():
        for bid, blk, m, rblk, mr in ordered_map(one, (c for c in chunks if c[0].size),
                                                 threads=None if kernel is not None else 1):
            if on_block is not None:
                on_block(bid, plan, blk, m)
            if on_recorded is not None:
                on_recorded(bid, rblk)
            acc.add(bid, m, mr, plan.plan_id or kind, False)
    if not acc.steps:
        raise ValueError("no judged steps")
    changes = []
    if plan is not recorded:
        gain = (acc.rsum.sum_layer_ns - acc.sum.sum_layer_ns) / acc.n
        ch = _charge(recorded, plan, expert_bytes, cost, mc, acc.steps[0][0], gain, acc.n)
        if ch:
            changes.append(ch)
    return acc.finish(name, strategy, plan, changes, cost, timing)


def fastest(results: Iterable[Judged]) -> Judged | None:
    """The fastest net among plans one could deploy (the oracle is a bound, not a plan)."""
    pool = [r for r in results if r.kind not in ("oracle", "recorded") and r.net_step_ns is not None]
    return min(pool, key=lambda r: r.net_step_ns) if pool else None
