"""The replay's one store adapter: reads a run's shape, loads and plans from the store, runs
the numeric core (:mod:`.engine`, :mod:`.strategies`) and writes the ``replay_*`` tables.

Everything else in :mod:`moetrace.replay` takes arrays and returns arrays. The shape of a
run comes from the SQL view ``run_shape`` (the one the metrics use): ranks from
``runs.num_ranks`` or the recorded placement, never guessed; values the run does not
record are unknown (``None``) and every answer that needs them says what it assumed or
asks for the option to give.

- :func:`replay` -- one plan (stored, imported, fitted on a window, or the recorded one)
  judged against the recorded placement on the same steps: gross and net time, moves,
  break-even, verdict;
- :func:`drift` -- static vs re-planned vs oracle over time;
- :func:`sweep` -- the operator's decision table (replica budgets x re-plan intervals x windows);
- :func:`make_run_plan` -- what ``moetrace plan`` does (fit, import, re-plan from a plan,
  relabel, move accounting, store, export).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pyarrow as pa

from ..errors import InputError
from . import cost as costmod
from .engine import Block, approximation_notes, imbalance, replay_load, replay_routing
from .moves import moves_between, replan
from .planners import Plan, PlanShape, align_layers, check_shape, contiguous, make_plan
from .relabel import relabel
from .strategies import (Fixed, Judged, MoveCost, Oracle, Replan, Timing, compare_text, fastest, judge,
                         judge_stream)


# ----------------------------------------------------------------------------- shape
@dataclass
class RunShape:
    """A run's shape as the metrics see it. ``None`` = the run does not record it."""
    num_experts: int
    num_ranks: int | None
    ranks_per_node: int | None
    num_slots: int
    num_groups: int | None
    top_k: int | None
    hidden: int
    dtype_bytes: int
    expert_bytes: int
    layers: np.ndarray
    steps: np.ndarray
    has_slot: bool
    has_routing: bool
    notes: list[str] = field(default_factory=list)
    ranks_from: str | None = None
    #: the counts aggregate many passes (one pseudo-step per recording); passes when known
    aggregate: bool = False
    passes: int | None = None

    @property
    def bytes_per_token(self) -> int:
        return self.hidden * self.dtype_bytes

    def timing(self, passes: int | None = None) -> Timing:
        if not self.aggregate:
            return Timing()
        return Timing(timed=False, per_pass=passes or self.passes)

    def plan_shape(self, ranks=None, replicas=None, groups=None, nodes=None, rpn=None) -> PlanShape:
        """The cluster a planner plans for: the run's, with the options given. Contradictions
        exit 2 naming the options (:func:`planners.check_shape`)."""
        R = ranks or self.num_ranks
        if not R:
            raise InputError(None, "the run's expert-parallel rank count is unknown (runs.num_ranks empty, no "
                                   "recorded placement): give --ranks N (or ingest with --ranks)")
        if rpn is None and nodes:
            if R % nodes:
                raise InputError(None, f"--nodes {nodes} does not divide --ranks {R}")
            rpn = R // nodes
        if rpn is None:
            rpn = min(self.ranks_per_node, R) if self.ranks_per_node else R
        if replicas is not None:
            S = self.num_experts + replicas
        else:
            S = self.num_slots if ranks is None or ranks == self.num_ranks else self.num_experts
        ps = PlanShape(R, rpn, S, groups if groups is not None else self.num_groups, nodes)
        check_shape(ps, self.num_experts, None)
        return ps

    def describe(self) -> str:
        return (f"{self.num_ranks or '?'} ranks ({self.ranks_from or 'unknown'}), "
                f"{self.ranks_per_node or '?'} per node, {self.num_slots} slots, "
                f"{self.num_groups if self.num_groups is not None else '?'} groups, top_k {self.top_k or '?'}")

    @classmethod
    def from_store(cls, store, run_id: str) -> "RunShape":
        run = store.run_row(run_id)
        notes = []
        sh = store.sql("SELECT * FROM run_shape WHERE run_id = ?", [run_id])
        # step_layers / expert_load_long: the dense rows' steps and layers without unnesting them
        st = store.sql("""SELECT (SELECT min(step) FROM step_layers WHERE run_id = ?) lo,
                                 (SELECT count(slot) FROM expert_load_long WHERE run_id = ?) ns""",
                       [run_id, run_id]).row(0, named=True)
        if not sh.height or st["lo"] is None:
            raise InputError(None, f"run {run_id!r} has no expert_load rows to replay")
        sh = sh.row(0, named=True)
        steps = store.sql("SELECT DISTINCT step FROM step_layers WHERE run_id = ? ORDER BY step", [run_id])["step"].to_numpy()
        layers = store.sql("SELECT DISTINCT layer FROM step_layers WHERE run_id = ? ORDER BY layer", [run_id])["layer"].to_numpy()
        E, R, S = int(sh["num_experts"]), sh["num_ranks"], int(sh["num_slots"])
        if sh["experts_from"] != "runs":
            notes.append(f"runs.num_experts unknown: {E} ({sh['experts_from']})")
        rpn = run.get("ranks_per_node")
        if R is None:
            notes.append("expert-parallel rank count unknown (ingest with --ranks): give --ranks to plan or replay")
        elif not rpn:
            nodes = None
            if store.has_files("placement"):
                nodes = store.sql("SELECT max(node) + 1 AS n FROM placement WHERE run_id = ? AND plan_id = 'recorded'",
                                  [run_id])["n"][0]
            if nodes and R % int(nodes) == 0:
                rpn = R // int(nodes)
            else:
                notes.append("ranks per node unknown (ingest with --ranks-per-node): all ranks taken as one node "
                             "(all-to-all and expert moves over NVLink only)")
        G = run.get("num_groups")
        k = sh["top_k"]
        hidden = run.get("hidden")
        if not hidden:
            hidden = 7168
            notes.append("runs.hidden unknown: 7168 assumed for dispatch bytes")
        db = run.get("dtype_bytes")
        if not db:
            db = 2
            notes.append("runs.dtype_bytes unknown: 2 bytes per element assumed for dispatch bytes")
        eb = run.get("expert_bytes") or 3 * hidden * 2048
        if not run.get("expert_bytes"):
            notes.append(f"runs.expert_bytes unknown: 3 x hidden x 2048 = {eb} bytes per expert assumed")
        has_routing = store.has_files("routing") and store.sql(
            "SELECT count(*) n FROM (SELECT 1 FROM routing WHERE run_id = ? LIMIT 1)", [run_id])["n"][0] > 0
        approx = json.loads(run.get("approximations") or "[]")
        aggregate = any("pseudo-step" in a for a in approx)
        passes = None
        if aggregate:
            try:
                passes = json.loads(run.get("meta_json") or "{}").get("num_passes")
            except ValueError:
                passes = None
        return cls(E, int(R) if R else None, int(rpn) if rpn else None, S, int(G) if G else None,
                   int(k) if k else None, int(hidden), int(db), int(eb), layers.astype(np.int64),
                   steps.astype(np.int64), bool(st["ns"]), bool(has_routing), notes, sh["ranks_from"],
                   aggregate, int(passes) if passes else None)


def open_run(store, run_id: str | None) -> tuple[str, RunShape]:
    rid = store.resolve_run(run_id)
    return rid, RunShape.from_store(store, rid)


# ----------------------------------------------------------------------------- plans
def plan_from_rows(df, plan_id: str, num_experts: int, ranks_per_node: int | None = None) -> Plan:
    """A Plan from placement rows (layer, slot, rank, node, expert) of one plan."""
    if df.height == 0:
        raise InputError(None, f"no placement rows for plan {plan_id!r}")
    layers = np.unique(df["layer"].to_numpy())
    S = int(df["slot"].max()) + 1
    L = layers.size
    p2l = np.full((L, S), -1, np.int64)
    li = np.searchsorted(layers, df["layer"].to_numpy())
    p2l[li, df["slot"].to_numpy()] = df["expert"].to_numpy()
    if (p2l < 0).any():
        raise InputError(None, f"plan {plan_id!r}: some (layer, slot) have no expert")
    rank_of = np.zeros(S, np.int64)
    rank_of[df["slot"].to_numpy()] = df["rank"].to_numpy()
    R = int(rank_of.max()) + 1
    if S % R or not np.array_equal(rank_of, np.arange(S) // (S // R)):
        raise InputError(None, f"plan {plan_id!r}: slots are not laid out as slot // slots_per_rank")
    node_of = np.zeros(R, np.int64)
    node_of[df["rank"].to_numpy()] = df["node"].to_numpy()
    nn = int(node_of.max()) + 1
    rpn = R // nn if R % nn == 0 else (ranks_per_node or R)
    try:
        return Plan(p2l, max(num_experts, int(p2l.max()) + 1), R, rpn, layers=layers, policy="stored", plan_id=plan_id)
    except ValueError as e:   # e.g. a recorded placement that leaves experts without a slot
        raise InputError(None, f"plan {plan_id!r} cannot be replayed: {e}") from None


def recorded_plan(store, run_id: str, shape: RunShape) -> Plan:
    """The run's own placement (plan_id 'recorded'), else contiguous (slot = expert)."""
    df = store.sql("SELECT layer, slot, rank, node, expert FROM placement WHERE run_id = ? AND plan_id = 'recorded'",
                   [run_id]) if store.has_files("placement") else None
    if df is not None and df.height:
        p = align_layers(plan_from_rows(df, "recorded", shape.num_experts, shape.ranks_per_node), shape.layers)
        p.policy = "recorded"
        return p
    ps = shape.plan_shape()
    p = contiguous(np.zeros((shape.layers.size, shape.num_experts)), ps)
    p.layers, p.plan_id, p.policy = shape.layers, "recorded", "recorded (contiguous assumed)"
    return p


def load_plan(store, run_id: str, plan_id: str, shape: RunShape) -> Plan:
    if plan_id == "recorded":
        return recorded_plan(store, run_id, shape)
    df = store.sql("SELECT layer, slot, rank, node, expert FROM placement WHERE run_id = ? AND plan_id = ?",
                   [run_id, plan_id]) if store.has_files("placement") else None
    if df is None or df.height == 0:
        ids = store.sql("SELECT DISTINCT plan_id FROM placement WHERE run_id = ?", [run_id])["plan_id"].to_list() \
            if store.has_files("placement") else []
        raise InputError(None, f"run {run_id!r} has no plan {plan_id!r} (plans: {', '.join(ids) or 'none'})")
    p = align_layers(plan_from_rows(df, plan_id, shape.num_experts, shape.ranks_per_node), shape.layers)
    from .plan_io import plan_meta

    meta = plan_meta(store, run_id, plan_id)
    if meta is not None:
        p.policy = meta["policy"]
        try:
            p.params = {**json.loads(meta["params_json"] or "{}"), **p.params}
        except ValueError:
            pass
    return p


# ----------------------------------------------------------------------------- reading
def iter_load(store, run_id: str, shape: RunShape, chunk_steps: int = 2000,
              with_slots: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Yield (step ids [t], load [t, L, E] float64, slot_load [t, L, S] or None) by step chunks."""
    steps, layers, E, S = shape.steps, shape.layers, shape.num_experts, shape.num_slots
    want_slots = with_slots and shape.has_slot
    cols = "step, layer, expert, tokens" + (", slot" if want_slots else "")
    for i in range(0, steps.size, chunk_steps):
        ids = steps[i:i + chunk_steps]
        if not want_slots:      # counts per logical expert: the dense reader (no SQL for dense runs)
            from ..analyze.dense import read_counts

            got, got_layers, counts = read_counts(store, run_id, ids)
            if counts.shape[2] > E:
                raise InputError(None, f"run {run_id!r}: expert_load holds expert {counts.shape[2] - 1} but the run "
                                       f"has {E} experts")
            load = np.zeros((ids.size, layers.size, E))
            if np.array_equal(got, ids) and np.array_equal(got_layers, layers):
                load[:, :, :counts.shape[2]] = counts
            else:
                load[np.ix_(np.searchsorted(ids, got), np.searchsorted(layers, got_layers),
                            np.arange(counts.shape[2]))] = counts
            yield ids, load, None
            continue
        tbl = store.arrow(f"SELECT {cols} FROM expert_load WHERE run_id = ? AND step BETWEEN ? AND ?",
                          [run_id, int(ids[0]), int(ids[-1])])
        ti = np.searchsorted(ids, tbl.column("step").to_numpy())
        keep = (ti < ids.size) & (ids[np.minimum(ti, ids.size - 1)] == tbl.column("step").to_numpy())
        li = np.searchsorted(layers, tbl.column("layer").to_numpy())
        cell = (ti * layers.size + li)[keep]
        tok = tbl.column("tokens").to_numpy().astype(np.float64)[keep]
        n = ids.size * layers.size
        ex = tbl.column("expert").to_numpy()[keep]
        if ex.size and (ex.min() < 0 or ex.max() >= E):
            raise InputError(None, f"run {run_id!r}: expert_load holds expert {int(ex.max())} but the run has {E} experts")
        # bincount sums rows that repeat a (step, layer, expert): per slot, per source rank
        load = np.bincount(cell * E + ex, weights=tok, minlength=n * E).reshape(ids.size, layers.size, E)
        slot_load = None
        if want_slots:
            sl = tbl.column("slot").to_numpy(zero_copy_only=False).astype(np.float64)[keep]
            ok = ~np.isnan(sl)
            if ok.any() and (sl[ok].min() < 0 or sl[ok].max() >= S):
                raise InputError(None, f"run {run_id!r}: expert_load holds slot {int(sl[ok].max())} but the run has {S} slots")
            slot_load = np.bincount(cell[ok] * S + sl[ok].astype(np.int64), weights=tok[ok],
                                    minlength=n * S).reshape(ids.size, layers.size, S)
        yield ids, load, slot_load


def read_load(store, run_id: str, shape: RunShape, step_range: tuple[int, int] | None = None,
              max_steps: int | None = None, with_slots: bool = False):
    """(step ids, load [T, L, E], slot_load or None) for all steps (or lo <= step < hi; at most max_steps)."""
    steps = shape.steps
    if step_range:
        steps = steps[(steps >= step_range[0]) & (steps < step_range[1])]
    if max_steps is not None:
        steps = steps[:max_steps]
    if steps.size == 0:
        return steps, np.zeros((0, shape.layers.size, shape.num_experts)), None
    parts = list(iter_load(store, run_id, replace(shape, steps=steps), with_slots=with_slots))
    sl = None if parts[0][2] is None else np.concatenate([p[2] for p in parts])
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), sl


def routing_has_slots(store, run_id) -> bool:
    """True when every per-token routing row records its physical slot."""
    r = store.sql("SELECT count(*) AS n, count(slot) AS s FROM routing WHERE run_id = ?", [run_id]).row(0)
    return r[0] > 0 and r[0] == r[1]


def routing_block(store, run_id, shape: RunShape, plan: Plan, split: str, ids: np.ndarray,
                  use_recorded_slot: bool = False) -> Block:
    """Exact replay of the run's per-token routing rows of steps ``ids`` against ``plan``."""
    tbl = store.arrow("""SELECT step, layer, token, src_rank, expert, slot FROM routing
                         WHERE run_id = ? AND step BETWEEN ? AND ?""", [run_id, int(ids[0]), int(ids[-1])])
    steps = tbl.column("step").to_numpy()
    ti = np.searchsorted(ids, steps)
    keep = (ti < ids.size) & (ids[np.minimum(ti, ids.size - 1)] == steps)
    li = np.searchsorted(plan.layers, tbl.column("layer").to_numpy())
    src = tbl.column("src_rank").to_numpy(zero_copy_only=False).astype(np.float64)
    tok = tbl.column("token").to_numpy()
    src = np.where(np.isnan(src), tok % plan.num_ranks, src).astype(np.int64)
    rs = tbl.column("slot").to_numpy(zero_copy_only=False)[keep] if use_recorded_slot else None
    return replay_routing(ti[keep], li[keep], tok[keep], src[keep], tbl.column("expert").to_numpy()[keep], ids.size,
                          plan, split, shape.bytes_per_token, recorded_slot=rs)


# ----------------------------------------------------------------------------- cost model
def fit_cost_from_store(store, run_id: str, base: costmod.CostModel, shape: RunShape | None = None):
    """Fit a and b from the run's expert_gemm spans that carry step, layer and rank,
    against the recorded per-rank tokens and slots touched. None when the run has too few."""
    if not store.has_files("spans"):
        return None
    df = store.sql("""SELECT step, layer, rank, sum(end_ns - start_ns) AS dur FROM spans
                      WHERE run_id = ? AND kind = 'expert_gemm' AND step IS NOT NULL AND layer IS NOT NULL
                      GROUP BY ALL""", [run_id])
    if df.height < 8:
        return None
    shape = shape or RunShape.from_store(store, run_id)
    if shape.num_ranks is None:
        return None
    plan = recorded_plan(store, run_id, shape)
    steps = np.unique(df["step"].to_numpy())
    ids, dense, _ = read_load(store, run_id, replace(shape, steps=np.intersect1d(shape.steps, steps)))
    if ids.size == 0:
        return None
    L, R = plan.num_layers, plan.num_ranks
    tokens = np.einsum("tle,ler->tlr", dense, plan.share())
    touched = np.einsum("tle,ler->tlr", (dense > 0).astype(np.float64), plan.copies())
    s_i = np.searchsorted(ids, df["step"].to_numpy())
    l_raw = df["layer"].to_numpy()
    l_i = np.searchsorted(plan.layers, l_raw)
    r = df["rank"].to_numpy()
    ok = (l_i < L) & (r < R) & (r >= 0) & (s_i < ids.size)
    ok &= plan.layers[np.minimum(l_i, L - 1)] == l_raw
    ok &= ids[np.minimum(s_i, ids.size - 1)] == df["step"].to_numpy()
    if ok.sum() < 8:
        return None
    return costmod.fit_expert_time(tokens[s_i[ok], l_i[ok], r[ok]], touched[s_i[ok], l_i[ok], r[ok]],
                                   df["dur"].to_numpy()[ok].astype(np.float64), base)


def cost_model(store, run_id: str, shape: RunShape, hardware: str = "H200", fit: bool = True) -> costmod.CostModel:
    """The preset, or (with ``fit``) the model fitted from the run's expert_gemm spans. The
    measured error band and the timed-pass fit come on top in
    :func:`moetrace.replay.run_cost.run_cost_model` (what the run facade passes in as
    ``ReplayOptions.cost``); this module does not read calibrations."""
    model = costmod.preset(hardware, shape.hidden, shape.expert_bytes)
    if fit:
        model = fit_cost_from_store(store, run_id, model, shape) or model
    return model


def _cost(store, run_id, shape: RunShape, opts) -> costmod.CostModel:
    return opts.cost if opts.cost is not None else cost_model(store, run_id, shape, opts.hardware, opts.fit_cost)


# ----------------------------------------------------------------------------- options, results
@dataclass
class ReplayOptions:
    split: str = "even"
    hardware: str = "H200"
    fit_cost: bool = True
    rank_rows: bool = True
    chunk_steps: int = 1000
    move: MoveCost = field(default_factory=MoveCost)
    #: passes per pseudo-step of an aggregate run (times per pass then); None: the run's
    passes: int | None = None
    #: the cost model to use (None: :func:`cost_model`, preset or fitted from spans)
    cost: costmod.CostModel | None = None


def new_replay_id(prefix: str = "r") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _time_note(shape: RunShape, timing: Timing) -> list[str]:
    if not shape.aggregate:
        return []
    if timing.per_pass:
        return [f"the counts aggregate {timing.per_pass} passes per recorded step: times are per pass (the "
                "aggregate divided by the pass count), not per step"]
    return ["the counts aggregate many passes into one pseudo-step (see runs.approximations) and the number of "
            "passes is unknown: imbalance and tokens only, no time per step (give --passes N for times per pass)"]


@dataclass
class ReplayResult:
    """One judged plan (or policy) of a run, with everything its answer prints."""
    replay_id: str
    run_id: str
    judged: Judged
    plan_desc: str
    split: str
    exact_bytes: bool
    cost: costmod.CostModel
    judged_on: str
    notes: list[str]
    error_band: tuple[float, str]
    move: MoveCost
    timing: Timing
    policy: str
    nodes_per_token_max: int | None = None
    nodes_per_token_mean: float | None = None
    traffic: np.ndarray | None = None
    recorded_traffic: np.ndarray | None = None
    trace: dict | None = None

    def headline(self) -> str:
        j = self.judged
        unit = "pass" if self.timing.per_pass else "step"
        if j.gross_step_ns is None:
            return ("no time per step: the counts aggregate many passes of unknown number (imbalance and tokens "
                    "only; --passes N gives times per pass)")
        if j.kind == "recorded":
            return f"predicted MoE time per {unit} {j.gross_step_ns / 1e6:.3f} ms (the recorded placement: the baseline)"
        return (f"net {compare_text(j.net_step_ns, j.recorded_step_ns, unit)}; gross "
                f"{compare_text(j.gross_step_ns, j.recorded_step_ns, unit)}")

    def to_dict(self) -> dict:
        j, s, p = self.judged, self.judged.summary, self.judged.plan
        d = {"replay_id": self.replay_id, "run_id": self.run_id, "kind": j.kind, "policy": self.policy,
             "plan_id": p.plan_id, "plan": self.plan_desc, "split": self.split, "judged_on": self.judged_on,
             "num_steps": int(j.steps.size), "num_layers": p.num_layers, "num_ranks": p.num_ranks,
             "ranks_per_node": p.ranks_per_node, "num_nodes": p.num_nodes, "num_slots": p.num_slots,
             "num_groups": p.num_groups, "redundant_slots": p.replicas,
             **asdict(s),
             "recorded_mean_imbalance": j.recorded.mean_imbalance,
             "time_per": "pass" if self.timing.per_pass else ("step" if j.gross_step_ns is not None else None),
             "gross_step_ns": _int(j.gross_step_ns), "net_step_ns": _int(j.net_step_ns),
             "recorded_step_ns": _int(j.recorded_step_ns), "vs_recorded": self.headline(),
             "moved_experts": j.moved_experts, "moved_bytes": j.moved_bytes,
             "changes": [asdict(c) for c in j.changes],
             "break_even_steps": [c.break_even_steps for c in j.changes],
             "verdict": j.verdict, "verdict_reason": j.verdict_reason,
             "error_band": {"rel": self.error_band[0], "source": self.error_band[1]},
             "move_cost": {**asdict(self.move), "text": self.move.describe()},
             "exact_bytes": self.exact_bytes, "cost": self.cost.describe(), "approximations": self.notes}
        d["predicted_step_ns"] = d["gross_step_ns"]
        if self.nodes_per_token_max is not None:
            d["nodes_per_token_max"] = self.nodes_per_token_max
            d["nodes_per_token_mean"] = self.nodes_per_token_mean
        return d


def _int(x):
    return None if x is None else int(round(x))


def _nan_none(a: np.ndarray) -> pa.Array:
    a = np.asarray(a, np.float64).ravel()
    return pa.array(a, pa.float64(), mask=np.isnan(a))


def _layer_table(ids, layers, m, replay_id, plan_id, ages=None) -> pa.Table:
    T, L = m.imbalance.shape
    n = T * L
    strag = m.straggler.ravel()
    return pa.table({
        "replay_id": pa.array([replay_id] * n, pa.string()),
        "step": np.repeat(ids, L).astype(np.int64), "layer": np.tile(layers, T).astype(np.int32),
        "plan_id": pa.array([plan_id] * n, pa.string()),
        "plan_age_steps": pa.array(np.repeat(ages, L) if ages is not None else [None] * n, pa.int64()),
        "max_rank_tokens": m.max_tokens.ravel(), "mean_rank_tokens": m.mean_tokens.ravel(),
        "imbalance": _nan_none(m.imbalance), "straggler_rank": pa.array(strag.astype(np.int32), mask=strag < 0),
        "predicted_ns": np.rint(m.layer_ns.ravel()).astype(np.int64)})


def _rank_table(ids, layers, block: Block, m, replay_id) -> pa.Table:
    T, L, R = block.tokens.shape
    n = T * L * R
    return pa.table({
        "replay_id": pa.array([replay_id] * n, pa.string()),
        "step": np.repeat(ids, L * R).astype(np.int64),
        "layer": np.tile(np.repeat(layers, R), T).astype(np.int32),
        "rank": np.tile(np.arange(R), T * L).astype(np.int32),
        "tokens": block.tokens.ravel().astype(np.float64),
        "slots_touched": np.rint(block.touched).ravel().astype(np.int32),
        "dispatch_bytes_intra": np.rint(block.bytes_intra).ravel().astype(np.int64),
        "dispatch_bytes_inter": np.rint(block.bytes_inter).ravel().astype(np.int64),
        "predicted_ns": np.rint(m.rank_ns).ravel().astype(np.int64)})


def traffic_table(replay_id: str, plan: Plan, which: str, traffic: np.ndarray, steps: int) -> pa.Table:
    """Rows of ``replay_traffic``: dispatch bytes source rank x destination rank."""
    R = traffic.shape[0]
    src, dst = np.divmod(np.arange(R * R), R)
    keep = traffic.ravel() > 0
    rpn = plan.ranks_per_node
    return pa.table({"replay_id": pa.array([replay_id] * int(keep.sum()), pa.string()),
                     "plan": pa.array([which] * int(keep.sum()), pa.string()),
                     "plan_id": pa.array([plan.plan_id] * int(keep.sum()), pa.string()),
                     "src_rank": src[keep].astype(np.int32), "dst_rank": dst[keep].astype(np.int32),
                     "inter_node": (src[keep] // rpn) != (dst[keep] // rpn),
                     "bytes": np.rint(traffic.ravel()[keep]).astype(np.int64),
                     "steps": pa.array([steps] * int(keep.sum()), pa.int64())})


def _runs_row(res: ReplayResult, kind: str, params: dict) -> pa.Table:
    j, s, p = res.judged, res.judged.summary, res.judged.plan
    d = res.to_dict()
    return pa.table({
        "replay_id": [res.replay_id], "created_at_ns": [time.time_ns()], "kind": [kind], "policy": [res.policy],
        "plan_id": pa.array([p.plan_id], pa.string()), "split": [res.split],
        "num_steps": [int(j.steps.size)], "num_layers": [p.num_layers], "num_ranks": [p.num_ranks],
        "num_slots": [p.num_slots], "mean_imbalance": pa.array([s.mean_imbalance], pa.float64()),
        "p99_imbalance": pa.array([s.p99_imbalance], pa.float64()),
        "predicted_step_ns": pa.array([_int(j.gross_step_ns)], pa.int64()),
        "mean_efficiency": pa.array([s.mean_efficiency], pa.float64()), "moved_experts": [j.moved_experts],
        "moved_bytes": [j.moved_bytes], "exact_bytes": [res.exact_bytes], "cost_json": [res.cost.to_json()],
        "params_json": [json.dumps(params, sort_keys=True, default=str)],
        "summary_json": [json.dumps(d, sort_keys=True, default=str)],
        "approximations": [json.dumps(res.notes)],
        "recorded_step_ns": pa.array([_int(j.recorded_step_ns)], pa.int64()),
        "net_step_ns": pa.array([_int(j.net_step_ns)], pa.int64()),
        "recorded_mean_imbalance": pa.array([j.recorded.mean_imbalance], pa.float64()),
        "undefined_cells": [s.undefined_cells], "judged_on": [res.judged_on], "verdict": [j.verdict],
        "verdict_reason": [j.verdict_reason], "time_per": pa.array([d["time_per"]], pa.string()),
        "plan_desc": [res.plan_desc]})


# ----------------------------------------------------------------------------- replay of one plan
@dataclass
class JudgedSteps:
    """Which steps judge a plan, and how to say it."""
    steps: np.ndarray
    text: str
    notes: list[str] = field(default_factory=list)


def judged_steps(shape: RunShape, fit: tuple[int, int] | None, in_sample: bool, plan_id: str | None = None) -> JudgedSteps:
    """Out-of-sample by default: a plan fitted on [a, b) is judged on the steps from b on;
    ``in_sample`` judges it on every step (and says so)."""
    all_steps = shape.steps
    if fit is None:
        return JudgedSteps(all_steps, f"all {all_steps.size} step(s)")
    a, b = fit
    if in_sample:
        return JudgedSteps(all_steps, f"all {all_steps.size} step(s), IN-SAMPLE (the plan was fitted on steps [{a}, {b}))",
                           [f"in-sample judgement (asked for): the plan was fitted on steps [{a}, {b}) and is judged on "
                            "all steps, those included"])
    after = all_steps[all_steps >= b]
    if after.size == 0:
        raise InputError(None, f"no recorded step after the fit window [{a}, {b})"
                               + (f" of plan {plan_id!r}" if plan_id else "") + ": nothing to judge it on "
                               "out of sample (give an earlier --fit-window, or --in-sample to judge it on the steps "
                               "it was fitted on)")
    return JudgedSteps(after, f"{after.size} steps after the fit window [{a}, {b}) (out-of-sample)",
                       [f"backtest: plan fitted on steps [{a}, {b}), judged on the {after.size} recorded steps from "
                        f"{int(after[0])} on"])


def default_fit_window(shape: RunShape, fit_window, in_sample: bool) -> tuple[tuple[int, int], list[str]]:
    """--fit-window, else the first half of the steps (all steps with --in-sample)."""
    if fit_window is not None:
        return tuple(fit_window), []
    st = shape.steps
    if in_sample or st.size < 2:
        return (int(st[0]), int(st[-1]) + 1), []
    half = st[st.size // 2]
    return (int(st[0]), int(half)), [f"no --fit-window: plan fitted on the first half of the steps [{int(st[0])}, "
                                     f"{int(half)}) and judged on the rest"]


def _replay_fn(store, run_id, shape: RunShape, split: str, recorded_slots: str):
    """The block replayer the core calls: per-token routing when the run has it, recorded
    per-slot counts for the recorded plan when it has them, else the counts."""
    use_routing = shape.has_routing

    def fn(ids, load, slot_load, plan, is_recorded):
        if use_routing and not (is_recorded and recorded_slots == "counts"):
            return routing_block(store, run_id, shape, plan, split, ids, is_recorded and recorded_slots == "routing")
        return replay_load(load, plan, split, slot_load if is_recorded else None, shape.top_k, shape.bytes_per_token)

    return fn


def _recorded_mode(store, run_id, shape: RunShape) -> str:
    """How the recorded plan is replayed: 'routing' (per-token rows with slots), 'counts'
    (per-slot counts: exact per-rank tokens), or 'plan' (the split over replicas)."""
    if shape.has_routing and routing_has_slots(store, run_id):
        return "routing"
    if shape.has_slot:
        return "counts"
    return "plan"


def replay(store, run_id: str, shape: RunShape, plan: Plan, opts: ReplayOptions, *, judged: JudgedSteps | None = None,
           kind: str = "replay", policy: str | None = None, params: dict | None = None, write: bool = True,
           extra_notes=(), trace_steps=None, fitted: bool = False) -> ReplayResult:
    """Judge ``plan`` against the recorded placement on ``judged`` steps (default all),
    stream the run in step chunks, write ``replay_layer``/``replay_rank``/``replay_runs``
    (and ``replay_traffic`` with per-token routing)."""
    replay_id = new_replay_id()
    cost = _cost(store, run_id, shape, opts)
    recorded = recorded_plan(store, run_id, shape)
    is_rec = plan.plan_id == "recorded"
    if is_rec:
        plan = recorded
    judged = judged or JudgedSteps(shape.steps, f"all {shape.steps.size} step(s)")
    mode = _recorded_mode(store, run_id, shape)
    fn = _replay_fn(store, run_id, shape, opts.split, mode)
    timing = shape.timing(opts.passes)
    # a chunk's [steps, layers, ranks] arrays exist twice (the plan and the recorded baseline): half
    # the chunk of a single replay keeps the peak memory where one replay had it
    chunk = max(1, opts.chunk_steps // (1 if is_rec else 2))
    if shape.has_routing:   # per-token rows are k x tokens per (step, layer): keep chunks near 4 M rows
        n = store.sql("SELECT count(*) AS n FROM routing WHERE run_id = ?", [run_id])["n"][0]
        chunk = max(1, min(chunk, int(4_000_000 * shape.steps.size // max(int(n), 1))))
    sub = replace(shape, steps=judged.steps)
    layer_tbls, rank_tbls, kept = [], [], []
    agg = {"nmax": [], "nmean": [], "traffic": None, "rtraffic": None}
    with_slots = mode == "counts"

    def on_block(ids, p, blk, m):
        if write:
            layer_tbls.append(_layer_table(ids, p.layers, m, replay_id, p.plan_id))
            if opts.rank_rows:
                rank_tbls.append(_rank_table(ids, p.layers, blk, m, replay_id))
        if blk.nodes_per_token_max is not None:
            agg["nmax"].append(blk.nodes_per_token_max)
            agg["nmean"].append(blk.nodes_per_token_mean)
        if blk.traffic is not None:
            agg["traffic"] = blk.traffic if agg["traffic"] is None else agg["traffic"] + blk.traffic
        if trace_steps is not None:
            sel = np.isin(ids, trace_steps)
            if sel.any():
                kept.append((ids[sel], blk.tokens[sel], blk.touched[sel], m.dispatch_ns[sel], m.compute_ns[sel],
                             m.layer_ns[sel]))

    def on_recorded(ids, blk):   # the recorded placement's traffic, on the same steps
        if blk.traffic is not None:
            agg["rtraffic"] = blk.traffic if agg["rtraffic"] is None else agg["rtraffic"] + blk.traffic

    chunks = iter_load(store, run_id, sub, chunk, with_slots=with_slots)
    try:
        j = judge_stream(chunks, plan, recorded, fn, cost, shape.expert_bytes, opts.move, timing=timing, kind=kind,
                         on_block=on_block, on_recorded=on_recorded, name=policy or plan.policy)
    except ValueError as e:
        raise InputError(None, f"replay of run {run_id!r}: {e}") from None
    split = "recorded" if is_rec and mode in ("counts", "routing") else opts.split
    notes = list(shape.notes) + _time_note(shape, timing)
    blk_probe = Block(np.zeros((0, 0, 0)), None, None, None, exact_bytes=shape.has_routing and not
                      (is_rec and mode == "counts"))
    notes += approximation_notes(blk_probe, opts.split, is_rec and mode == "counts", shape.has_routing,
                                 shape.top_k is not None)
    notes += judged.notes + list(extra_notes)
    if is_rec and "contiguous assumed" in (recorded.policy or ""):
        notes.append("no placement recorded for this run: its own layout is taken as contiguous (slot = expert)")
    if is_rec and mode == "routing":
        notes.append("per-token routing with recorded slots: tokens and dispatch bytes exact")
    elif is_rec and mode == "counts" and shape.has_routing:
        notes.append("per-rank tokens from recorded per-slot counts; per-token routing has no slots, so "
                     "dispatch bytes are estimated")
    if j.summary.undefined_cells:
        notes.append(f"{j.summary.undefined_cells} of {j.summary.cells} (step, layer) cells routed no tokens: "
                     "imbalance undefined there, left out of the means (as in skew_summary)")
    if not is_rec:
        notes.append(f"baseline: the recorded placement ({recorded.policy}) replayed on the same steps with the same "
                     "cost model")
    res = ReplayResult(replay_id, run_id, j, plan.describe(), split, bool(shape.has_routing and not
                       (is_rec and mode == "counts")), cost, judged.text, notes, costmod.error_band(cost), opts.move,
                       timing, policy or (f"plan {plan.plan_id}" if plan.plan_id and not fitted else plan.policy),
                       max(agg["nmax"]) if agg["nmax"] else None,
                       float(np.mean(agg["nmean"])) if agg["nmean"] else None, agg["traffic"], agg["rtraffic"])
    if kept:
        res.trace = {"steps": np.concatenate([k[0] for k in kept]),
                     **{name: np.concatenate([k[i] for k in kept])
                        for i, name in enumerate(("tokens", "touched", "dispatch_ns", "compute_ns", "layer_ns"), 1)},
                     "layers": plan.layers, "cost_source": cost.source}
    if write:
        tables = {"replay_layer": layer_tbls, "replay_rank": rank_tbls,
                  "replay_runs": _runs_row(res, kind, params or {})}
        if res.traffic is not None:
            steps = int(j.steps.size)
            tt = [traffic_table(replay_id, plan, "recorded" if is_rec else "plan", res.traffic, steps)]
            if not is_rec and res.recorded_traffic is not None:
                tt.append(traffic_table(replay_id, recorded, "recorded", res.recorded_traffic, steps))
            tables["replay_traffic"] = tt
        store.append(run_id, tables)
    return res


def fit_plan(store, run_id, shape: RunShape, policy: str, plan_shape: PlanShape, fit_window=None,
             plan_id=None, in_sample: bool = False) -> tuple[Plan, JudgedSteps]:
    """Plan ``policy`` fitted on the steps of ``fit_window`` (default the first half), and
    the steps that judge it (after the window; all with ``in_sample``)."""
    fw, notes = default_fit_window(shape, fit_window, in_sample)
    ids, load, _ = read_load(store, run_id, shape, fw)
    if ids.size == 0:
        raise InputError(None, f"--fit-window {fw[0]}:{fw[1]} holds no recorded steps")
    plan = make_plan(policy, load.sum(axis=0), plan_shape, layers=shape.layers, plan_id=plan_id)
    js = judged_steps(shape, fw, in_sample)
    js.notes = notes + js.notes
    return plan, js


def _too_short(shape: RunShape, T: int, what: str, hint: str = "") -> str:
    if shape.aggregate:
        return (f"the run's counts aggregate a recording into {T} pseudo-step(s): there are no steps to re-plan over "
                "or judge after a window; moetrace replay --policy P --in-sample answers imbalance on them")
    return f"the run has {T} steps; {what} leaves none to judge{hint}"


@dataclass
class _InMemory:
    """A run's counts in memory with what every strategy loop needs: the recorded plan, how
    it is replayed, the cost model, the timing, and the block replayer (counts only; the
    recorded plan from its per-slot counts when the run has them)."""
    ids: np.ndarray
    load: np.ndarray
    slot_load: np.ndarray | None
    recorded: Plan
    mode: str
    cost: costmod.CostModel
    timing: Timing
    fn: object


def _in_memory(store, run_id, shape: RunShape, split: str, cost: costmod.CostModel, passes=None,
               max_steps=None) -> _InMemory:
    mode = _recorded_mode(store, run_id, shape)
    ids, load, slot_load = read_load(store, run_id, shape, max_steps=max_steps, with_slots=mode == "counts")

    def fn(bids, bl, bsl, plan, is_rec):
        return replay_load(bl, plan, split, bsl if is_rec and mode == "counts" else None, shape.top_k,
                           shape.bytes_per_token)

    return _InMemory(ids, load, slot_load, recorded_plan(store, run_id, shape), mode, cost, shape.timing(passes), fn)


# ----------------------------------------------------------------------------- drift
@dataclass
class DriftResult:
    run_id: str
    policy: str
    every: int
    window: int
    max_moves: int | None
    results: dict[str, Judged]          # static, replan, oracle
    replay_ids: dict[str, str]
    steps: np.ndarray
    cost: costmod.CostModel
    move: MoveCost
    timing: Timing
    unrelabeled_moves: int | None
    notes: list[str]

    def fastest(self) -> Judged | None:
        return fastest(self.results.values())

    def replan_by_age(self) -> dict:
        j = self.results["replan"]
        ages = np.array([a or 0 for a in j.ages])
        rng = range(1, min(self.every, ages.size) + 1)
        return {"age": list(rng), "mean_imbalance": [float(np.nanmean(j.series[ages == a])) for a in rng]}

    def static_by_age_quartile(self) -> list[float]:
        st = self.results["static"].series
        q = np.array_split(st, 4) if st.size >= 4 else [st]
        return [float(np.nanmean(x)) for x in q]

    def to_dict(self, series: bool = False) -> dict:
        out = {"run_id": self.run_id, "policy": self.policy, "every": self.every, "window": self.window,
               "max_moves": self.max_moves, "judged_steps": int(self.steps.size), "cost": self.cost.describe(),
               "move_cost": {**asdict(self.move), "text": self.move.describe()},
               "error_band": dict(zip(("rel", "source"), costmod.error_band(self.cost))),
               "approximations": self.notes}
        for k, j in self.results.items():
            s = {**asdict(j.summary), "gross_step_ns": _int(j.gross_step_ns), "net_step_ns": _int(j.net_step_ns),
                 "recorded_step_ns": _int(j.recorded_step_ns), "vs_recorded": j.vs_recorded(),
                 "moved_experts": j.moved_experts, "moved_bytes": j.moved_bytes, "verdict": j.verdict,
                 "verdict_reason": j.verdict_reason, "replay_id": self.replay_ids.get(k),
                 "plan": j.plan.describe(), "replans": [asdict(c) for c in j.changes],
                 "break_even_steps": [c.break_even_steps for c in j.changes]}
            s["predicted_step_ns"] = s["gross_step_ns"]
            out[k] = s
        if self.unrelabeled_moves is not None:
            out["replan"]["moved_experts_without_relabel"] = self.unrelabeled_moves
        out["recorded"] = {**asdict(self.results["static"].recorded),
                           "predicted_step_ns": _int(self.results["static"].recorded_step_ns)}
        f = self.fastest()
        out["fastest_net"] = f.kind if f else None
        out["static_by_age_quartile"] = self.static_by_age_quartile()
        out["replan_by_age"] = self.replan_by_age()
        for k in ("mean_imbalance", "p99_imbalance", "predicted_step_ns", "moved_experts", "moved_bytes", "replay_id",
                  "net_step_ns", "verdict"):
            out[k] = out["replan"][k]
        if series:
            out["series"] = {"step": self.steps.tolist(),
                             **{k: j.series.tolist() for k, j in self.results.items()}}
        return out


def drift(store, run_id: str, shape: RunShape, policy: str, plan_shape: PlanShape, every: int, window: int,
          opts: ReplayOptions, max_moves: int | None = None, write: bool = True, static_window=None) -> DriftResult:
    """Static plan (fitted on the ``window`` steps before the judged ones, or
    ``static_window``) vs re-planning every ``every`` steps from the trailing ``window``
    steps vs an oracle; all judged on the steps after the first ``window``, against the
    recorded placement on the same steps, net of moving experts."""
    if every < 1 or window < 1:
        raise InputError(None, "--replan-every and --window must be >= 1")
    m = _in_memory(store, run_id, shape, opts.split, _cost(store, run_id, shape, opts),
                   opts.passes)      # drift replays the counts (per-token routing not used)
    ids, load, slot_load, recorded, mode, cost, fn = m.ids, m.load, m.slot_load, m.recorded, m.mode, m.cost, m.fn
    T = ids.size
    if T <= window:
        raise InputError(None, _too_short(shape, T, f"--window {window}"))

    if static_window:
        lo, hi = static_window
        sl = (ids >= lo) & (ids < hi)
        if not sl.any():
            raise InputError(None, f"--fit-window {lo}:{hi} holds no recorded steps")
    else:
        sl = np.arange(T) < window
    static = make_plan(policy, load[sl].sum(axis=0), plan_shape, layers=shape.layers, plan_id=f"{policy}-static")
    static, _ = relabel(recorded, static)
    policy = static.policy          # 'eplb-global' when EPLB could not be hierarchical
    timing = m.timing
    rp = Replan(policy, plan_shape, every, window, window, shape.layers, max_moves)
    strategies = {"static": Fixed(static, kind="static"), "replan": rp,
                  "oracle": Oracle(policy, plan_shape, every, window, shape.layers)}
    base_id = new_replay_id("d")
    results, rids = {}, {}
    notes = list(shape.notes) + _time_note(shape, timing) + [
        "drift replay uses aggregated expert_load (per-token routing not used)",
        f"baseline: the recorded placement ({recorded.policy}) on the same {T - window} steps, same cost model",
        opts.move.describe()]
    if shape.top_k is None:
        notes.append("top_k unknown (ingest with --top-k): no all-to-all bytes or time predicted (expert compute only)")
    elif not (mode == "counts"):
        notes.append("no per-token routing: dispatch bytes estimated")
    for k, strat in strategies.items():
        tables = {"l": []}
        rid = f"{base_id}-{k}"

        def on_block(bids, plan, blk, m, _t=tables, _rid=rid, _k=k):
            if write:
                ages = np.arange(1, bids.size + 1) if _k == "replan" else None
                _t["l"].append(_layer_table(bids, plan.layers, m, _rid, plan.plan_id, ages))

        j = judge(ids, load, slot_load, window, strat, recorded, fn, cost, shape.expert_bytes, opts.move,
                  name=policy, timing=timing, on_block=on_block)
        results[k], rids[k] = j, rid
        if write:
            res = ReplayResult(rid, run_id, j, j.plan.describe(), opts.split, False, cost,
                               f"{T - window} steps after the first {window}", notes, costmod.error_band(cost),
                               opts.move, timing, policy)
            params = {"policy": policy, "every": every, "window": window, "max_moves": max_moves,
                      "split": opts.split, "static_window": list(static_window) if static_window else [0, window]}
            store.append(run_id, {"replay_layer": tables["l"], "replay_runs": _runs_row(res, f"drift-{k}", params)})
    return DriftResult(run_id, policy, every, window, max_moves, results, rids, ids[window:], cost, opts.move, timing,
                       rp.unrelabeled_moves if max_moves is None else None, notes)


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


@dataclass
class SweepResult:
    rows: list[SweepRow]
    notes: list[str]
    #: the stored sweep's id (its cells are ``replay_runs`` rows ``<sweep_id>-<cell>``); None: not stored
    sweep_id: str | None = None
    run_id: str | None = None

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
                 "median_break_even_steps": "break_even_steps", "mean_imbalance": "imbalance"})
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
    shape: RunShape
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


def plan_sweep(store, run_id: str, shape: RunShape, policy: str, replicas: list[int], intervals: list[int],
               windows: list[int] | None, opts: ReplayOptions, ranks: int | None = None, groups=None, nodes=None,
               rpn=None, *, write: bool = False, sweep_id: str | None = None) -> SweepJob:
    """The cells of a sweep, checked before anything is read or run: replica budgets x
    (static, re-plan intervals) x fit windows. The cost model is fixed here (every cell,
    wherever it runs, uses the same one)."""
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
            ps = shape.plan_shape(ranks=ranks, replicas=rep, groups=groups, nodes=nodes, rpn=rpn)
            check_shape(ps, shape.num_experts, policy)
            if not described:
                described.append(
                    f"plans: {policy} on {ps.num_ranks} ranks ({ps.nodes()} nodes x {ps.ranks_per_node} ranks per "
                    f"node), {shape.num_experts} experts + replicas slots, " + (
                        f"{ps.num_groups} expert groups" if policy == "eplb" else "expert groups not used"))
        except InputError as e:
            items.append(SweepRow(f"replicas {rep}", rep, None, 0, 0, 0.0, None, None, None, None, None, 0, 0.0, None,
                                  None, "", "", skipped=e.message))
            continue
        for every in [None] + list(intervals):
            for w in windows:
                i = len(items)
                items.append(SweepCell(run_id, i, rep, every, w, ps, f"{sid}-{i}" if sid else None))
    if items and not any(isinstance(c, SweepCell) for c in items):
        raise InputError(None, "no replica budget can be planned: " + items[0].skipped)
    params = {"policy": policy, "replicas": list(replicas), "replan_every": list(intervals), "windows": windows,
              "ranks": ranks, "groups": groups, "nodes": nodes, "ranks_per_node": rpn, "split": opts.split,
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
    row = SweepRow(
        f"+{rep} replicas, " + ("static" if every is None else f"re-plan every {every}") + f", window {w}",
        rep, every, w, int(j.steps.size), mem, j.summary.mean_imbalance,
        None if j.recorded_step_ns is None else j.recorded_step_ns / 1e6,
        None if j.gross_step_ns is None else j.gross_step_ns / 1e6,
        None if j.net_step_ns is None else j.net_step_ns / 1e6,
        None if j.net_step_ns is None else (j.net_step_ns / j.recorded_step_ns - 1) * 100,
        j.moved_experts, j.moved_bytes / 2**30,
        sum(c.bytes for c in j.changes[1:]) / 2**30 / hours if hours > 0 else None,
        float(np.median(be)) if be else None, j.verdict, j.verdict_reason)
    return SweepCellResult(cell.index, row, j, layer_tbls)


def run_sweep_cells(store, job: SweepJob, cells: list[SweepCell] | None = None) -> list[SweepCellResult]:
    """Judge ``cells`` (default all of the job's) in this process."""
    m = sweep_context(store, job)
    return [sweep_cell(m, job, c) for c in (job.cells if cells is None else cells)]


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
    notes = list(shape.notes) + _time_note(shape, timing) + job.described + [
        f"every row judged on the same {T - J} steps (from step {int(shape.steps[J])}), after the largest fit window "
        f"{J}; static plans fitted on the `window` steps before them, re-plans on the trailing `window` steps",
        f"baseline: the recorded placement ({job.recorded_policy}) on those steps, same cost model "
        f"({cost.source.split(':')[0]})",
        "net = predicted MoE time per step + the cost of moving experts (bytes over NVLink / NIC from the cost "
        "model, " + opts.move.describe() + "), spread over the judged steps; the first plan is charged its moves "
        "from the recorded placement",
        f"verdict: pays off / does not pay off beyond the model's ±{band[0]:.0%} error ({band[1]}); fewer than "
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


def sweep(store, run_id: str, shape: RunShape, policy: str, replicas: list[int], intervals: list[int],
          windows: list[int] | None, opts: ReplayOptions, ranks: int | None = None, groups=None, nodes=None,
          rpn=None, *, write: bool = False, sweep_id: str | None = None) -> SweepResult:
    """Replica budgets x (static, re-plan intervals) x fit windows, all judged on the same
    steps (after the largest window) against the recorded placement, net of moves, in this
    process (:func:`moetrace.replay.distributed.sweep` fans the same cells out on a Dask
    cluster). Returns the rows and the notes that qualify them; ``write`` stores each cell
    (``replay_runs`` kind ``sweep``, ids ``<sweep_id>-<cell>``, and its ``replay_layer`` rows)."""
    job = plan_sweep(store, run_id, shape, policy, replicas, intervals, windows, opts, ranks, groups, nodes, rpn,
                     write=write, sweep_id=sweep_id)
    return finish_sweep(store, job, run_sweep_cells(store, job))


# ----------------------------------------------------------------------------- moetrace plan
@dataclass
class PlanResult:
    """What ``moetrace plan`` made: the plan, what it was fitted on, its moves from the plan it replaces."""
    run_id: str
    plan_id: str
    plan: Plan
    start: Plan
    fit_steps: int
    fit_window: tuple[int, int] | None
    imbalance_on_fit: float | None
    start_imbalance_on_fit: float | None
    moved: int | None
    moved_bytes: int | None
    relabeled: bool
    moves_without_relabel: int | None
    stored_rows: int | None = None
    out: str | None = None
    out_format: str | None = None
    fitted: bool = False

    def to_dict(self) -> dict:
        p = self.plan
        d = {"run_id": self.run_id, "plan_id": self.plan_id, "policy": p.policy, "plan": p.describe(),
             "layers": p.num_layers, "slots": p.num_slots, "ranks": p.num_ranks, "ranks_per_node": p.ranks_per_node,
             "nodes": p.num_nodes, "groups": p.num_groups, "redundant_slots": p.replicas,
             "fit_steps": self.fit_steps, "fit_window": list(self.fit_window) if self.fit_window else None,
             "mean_imbalance_on_fit_load": self.imbalance_on_fit, "start_plan": self.start.plan_id,
             "start_mean_imbalance_on_fit_load": self.start_imbalance_on_fit,
             "moved_experts_vs_start": self.moved, "moved_bytes_vs_start": self.moved_bytes,
             "relabeled": self.relabeled,
             "moved_experts_without_relabel": self.moves_without_relabel if self.relabeled else None,
             "params": p.params}
        if self.stored_rows is not None:
            d["stored_rows"] = self.stored_rows
        if self.out:
            d["out"], d["out_format"] = self.out, self.out_format
        return d


def _mean_imbalance(plan: Plan, total: np.ndarray) -> float | None:
    v = imbalance(np.einsum("le,ler->lr", total, plan.share()))
    return float(np.nanmean(v)) if np.isfinite(v).any() else None


def make_run_plan(store, run_id: str, shape: RunShape, *, policy=None, ranks=None, replicas=None, groups=None,
                  nodes=None, rpn=None, fit_window=None, start_plan_id=None, import_file=None, max_moves=None,
                  target_imbalance=None, plan_id=None, store_plan=True, out_file=None, out_format="sglang",
                  relabel_to_start=True) -> PlanResult:
    """Fit (``policy``), import (``import_file``), re-plan with a move budget from
    ``start_plan_id``, or export a stored plan; relabel, count moves, store and export."""
    from . import plan_io

    moves_mode = max_moves is not None or target_imbalance is not None
    if import_file is not None:
        ignored = [n for n, v in (("--policy", policy), ("--replicas", replicas), ("--groups", groups),
                                  ("--fit-window", fit_window), ("--max-moves", max_moves),
                                  ("--target-imbalance", target_imbalance), ("--plan", start_plan_id)) if v is not None]
        if ignored:
            raise InputError(None, f"--import reads the plan as it is in the file: {', '.join(ignored)} would be "
                                   "ignored; leave them out (use moetrace plan --policy to fit a new plan)")
    if moves_mode and (not start_plan_id or policy):
        raise InputError(None, "--max-moves / --target-imbalance re-plan from --plan ID (without --policy)")
    if not (policy or import_file or start_plan_id):
        raise InputError(None, "give one of --policy (optionally with --plan PREV), --import, --plan ID (export), "
                               "or --plan ID with --max-moves")
    if policy and import_file:
        raise InputError(None, "give --policy or --import, not both")
    ids, load, _ = read_load(store, run_id, shape, fit_window)
    if ids.size == 0 and (policy or moves_mode):
        what = f"--fit-window {fit_window[0]}:{fit_window[1]}" if fit_window else "the run"
        raise InputError(None, f"{what} holds no recorded steps")
    total = load.sum(axis=0)
    base = load_plan(store, run_id, "recorded", shape) if shape.num_ranks else None
    info, relabel_info = {}, None
    if policy:
        ps = shape.plan_shape(ranks=ranks, replicas=replicas, groups=groups, nodes=nodes, rpn=rpn)
        p = make_plan(policy, total, ps, layers=shape.layers)
        if start_plan_id:
            base = load_plan(store, run_id, start_plan_id, shape)
        if relabel_to_start and base is not None:
            p, relabel_info = relabel(base, p)
    elif import_file:
        R = ranks or shape.num_ranks
        if not R:
            raise InputError(None, "the run's rank count is unknown: give --ranks for the imported plan")
        ps = shape.plan_shape(ranks=R, nodes=nodes, rpn=rpn)
        p = plan_io.import_plan(import_file, shape.num_experts, R, ps.ranks_per_node, shape.layers,
                                shape.num_groups or 1)
    else:
        start = load_plan(store, run_id, start_plan_id, shape)
        if moves_mode:
            p, info = replan(start, total, max_moves=max_moves, target_imbalance=target_imbalance)
            base = start
        else:
            p = start
    base = base or p
    pid = plan_id or (p.plan_id if p.plan_id and not policy else None) or (
        f"moves{max_moves}" if info else (policy or "imported"))
    try:
        moved = int(moves_between(base, p).sum()) if base.num_ranks == p.num_ranks else None
    except ValueError:
        moved = None
    res = PlanResult(run_id, pid, p, base, int(ids.size), tuple(fit_window) if fit_window else None,
                     _mean_imbalance(p, total), _mean_imbalance(base, total) if base.num_slots else None, moved,
                     moved * shape.expert_bytes if moved is not None else None,
                     bool(relabel_info and relabel_info["relabeled"]),
                     relabel_info["moves_before"] if relabel_info and relabel_info["relabeled"] else None,
                     fitted=bool(policy or info))
    if store_plan and not (start_plan_id and pid == start_plan_id):
        fit = ((fit_window[0], fit_window[1]) if fit_window else (int(ids.min()), int(ids.max()) + 1)) \
            if res.fitted and ids.size else None
        res.stored_rows = plan_io.save_plan(store, run_id, p, pid, fit=fit + (int(ids.size),) if fit else None,
                                            start_plan_id=base.plan_id if (policy and relabel_info) or info else None)
    if out_file:
        res.out, res.out_format = str(plan_io.export_plan(p, out_file, out_format)), out_format
    return res


# ----------------------------------------------------------------------------- report what-if
@dataclass
class WhatIf:
    """The report's in-memory what-if (nothing written): the recorded placement and a few
    plans fitted on the first half of the steps, judged on the second half."""
    results: list[Judged]
    notes: list[str]
    timing: Timing
    cost: costmod.CostModel

    def fastest(self) -> Judged | None:
        """The fastest net among the plans one could deploy (:func:`.strategies.fastest`)."""
        return fastest(self.results)

    @property
    def error_band(self) -> tuple[float, str]:
        """(relative error of every predicted time, its source): the cost model's band."""
        return costmod.error_band(self.cost)


def whatif(store, run_id: str, shape: RunShape, max_cells: int = 2_000_000, hardware: str = "H200",
           move: MoveCost | None = None) -> WhatIf | None:
    """Recorded vs greedy, eplb-global and hierarchical EPLB (when the group count is known;
    with one replica per rank too), fitted on the first half of the (first ``max_cells``
    steps x layers x experts) steps and judged on the rest, net of moves; a one-step run
    (aggregate counts) is judged in-sample and says so."""
    if shape.num_ranks is None:
        return None
    max_steps = max(2, max_cells // max(1, shape.layers.size * shape.num_experts))
    m = _in_memory(store, run_id, shape, "even", costmod.preset(hardware, shape.hidden, shape.expert_bytes),
                   max_steps=max_steps)
    ids, load, slot_load, recorded, cost, fn, timing = m.ids, m.load, m.slot_load, m.recorded, m.cost, m.fn, m.timing
    if ids.size == 0:
        return None
    in_sample = ids.size < 2
    half = 0 if in_sample else ids.size // 2
    fit = load[:max(half, 1)].sum(axis=0)

    cands = [("recorded", Fixed(recorded, kind="recorded"))]
    notes = []
    pols = [("greedy", 0), ("eplb-global", 0)]
    if shape.num_groups is not None:
        pols += [("eplb", 0), ("eplb", shape.num_ranks)]
    else:
        notes.append("hierarchical EPLB left out: the run does not record its expert group count (ingest with --groups)")
    for pol, rep in pols:
        try:
            ps = shape.plan_shape(replicas=rep)
            p = make_plan(pol, fit, ps, layers=shape.layers, plan_id=f"{pol}+{rep}")
        except InputError as e:
            notes.append(f"{pol} +{rep} replicas left out: {e.message}")
            continue
        p, _ = relabel(recorded, p)
        cands.append((f"{p.policy} +{rep}", Fixed(p, kind="replay")))
    res = [judge(ids, load, slot_load, half, strat, recorded, fn, cost, shape.expert_bytes, move, name=name,
                 timing=timing) for name, strat in cands]
    if in_sample:
        notes.insert(0, "What-if computed in memory on the run's only (pseudo-)step: plans fitted and judged on it "
                        "(in-sample); even split over replicas; H200 preset cost model.")
    else:
        notes.insert(0, f"What-if computed in memory: plans fitted on steps {int(ids[0])}..{int(ids[half - 1])}, "
                        f"judged on steps {int(ids[half])}..{int(ids[-1])} (out-of-sample) against the recorded "
                        "placement on the same steps; even split over replicas; H200 preset cost model; moves charged "
                        "as bytes over NVLink/NIC, synchronous, no extra stall.")
    if ids.size < shape.steps.size:
        notes.append(f"What-if limited to the first {ids.size} of {shape.steps.size} steps (report time bound).")
    return WhatIf(res, notes + list(shape.notes) + _time_note(shape, timing), timing, cost)
