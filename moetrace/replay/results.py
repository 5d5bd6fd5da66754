"""A replay's options and result, and the ``replay_*`` tables written from it."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa

from ..costmodel import step_cost as costmod
from ..domain.budget import STREAMED_STEPS
from ..domain.ranks import node_of
from ..domain.shape import Shape, Timing
from ..notebook import NotebookView
from ..placement.planners import Plan
from ..storage.schema import repeated_string
from .accumulate import LoadTotals, rel_error_text
from .engine import Block
from .strategies import DOES_NOT, NOT_ENOUGH, PAYS_OFF, Judged, MoveCost, compare_text
from .trace import PredictedSteps


# ----------------------------------------------------------------------------- the exact half
@dataclass
class LayerLoad:
    """One layer's exact load under one placement, over the judged steps (no time model):
    the rank that straggled most often (ties: the lowest rank) and on how many steps, the
    straggler's tokens (the most tokens on one rank) mean and p99 over the steps, the mean
    rank tokens, and max/mean (the mean over steps of the straggler's tokens over the mean
    rank tokens)."""
    layer: int
    straggler_rank: int | None
    straggler_steps: int
    straggler_tokens_mean: float | None
    straggler_tokens_p99: float | None
    mean_rank_tokens: float | None
    max_over_mean: float | None


def _layer_loads(layers: np.ndarray, la: LoadTotals) -> list[LayerLoad]:
    """Per layer from the streamed totals (:class:`.accumulate.LoadTotals`): the straggler
    rank's mode (ties: the lowest rank), the means, and the p99 (``np.percentile``'s linear
    definition, exact unless ``la.p99_rel_error`` says otherwise)."""
    out = []
    for li, layer in enumerate(np.asarray(layers).tolist()):
        n = int(la.n[li])
        if not n:
            out.append(LayerLoad(int(layer), None, 0, None, None, None, None))
            continue
        cnt = la.rank_counts[li]
        top = int(np.argmax(cnt))
        out.append(LayerLoad(int(layer), top, int(cnt[top]), float(la.sum_max[li] / n), float(la.p99_max[li]),
                             float(la.sum_mean[li] / n), float(la.sum_ratio[li] / n)))
    return out


def _mean_over_layers(xs) -> float | None:
    v = [x for x in xs if x is not None]
    return float(np.mean(v)) if v else None


def steps_text(steps: np.ndarray) -> str:
    """'steps 100-199' (contiguous) or 'the 50 judged steps 100..299'."""
    s = np.asarray(steps)
    if s.size == 0:
        return "no steps"
    lo, hi = int(s.min()), int(s.max())
    return f"steps {lo}-{hi}" if s.size == hi - lo + 1 else f"the {s.size} judged steps {lo}..{hi}"


@dataclass
class LoadAnswer:
    """The exact half of a replay's answer: per layer the straggler rank and its tokens under
    the recorded placement and under the plan, max/mean, and the moves; counted from the
    recorded routing on the judged steps, no time model, so no error band. The one
    definition every command, the facade and the report read."""
    steps: str
    judged_steps: int
    plan: list[LayerLoad]
    recorded: list[LayerLoad]
    moved_experts: int
    verdict: str
    reason: str
    #: relative error of the straggler tokens' p99 (0.0: exact, the usual case: token counts
    #: have few distinct values; else a bounded-memory sketch's, :mod:`.accumulate`)
    p99_rel_error: float = 0.0

    @property
    def straggler_tokens(self) -> float | None:
        """The plan's straggler tokens, mean over the judged steps and the layers."""
        return _mean_over_layers(x.straggler_tokens_mean for x in self.plan)

    @property
    def recorded_straggler_tokens(self) -> float | None:
        return _mean_over_layers(x.straggler_tokens_mean for x in self.recorded)

    @property
    def straggler_tokens_p99(self) -> float | None:
        return _mean_over_layers(x.straggler_tokens_p99 for x in self.plan)

    @property
    def recorded_straggler_tokens_p99(self) -> float | None:
        return _mean_over_layers(x.straggler_tokens_p99 for x in self.recorded)

    def layers(self) -> list[dict]:
        """One row per layer: recorded and plan side by side."""
        rows = []
        for r, p in zip(self.recorded, self.plan):
            rows.append({"layer": r.layer,
                         **{f"recorded_{k}": v for k, v in asdict(r).items() if k != "layer"},
                         **{f"plan_{k}": v for k, v in asdict(p).items() if k != "layer"}})
        return rows

    def to_dict(self) -> dict:
        return {"exact": True, "steps": self.steps, "judged_steps": self.judged_steps,
                "straggler_tokens_mean": self.straggler_tokens,
                "recorded_straggler_tokens_mean": self.recorded_straggler_tokens,
                "straggler_tokens_p99": self.straggler_tokens_p99,
                "recorded_straggler_tokens_p99": self.recorded_straggler_tokens_p99,
                "straggler_tokens_p99_rel_error": self.p99_rel_error,
                "moved_experts": self.moved_experts, "verdict": self.verdict, "reason": self.reason,
                "layers": self.layers()}


def _tok(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}")


def load_answer(j: Judged) -> LoadAnswer | None:
    """The exact half of ``j``'s answer (None when the judge kept no load arrays)."""
    if j.load is None or j.recorded_load is None:
        return None
    layers = j.plan.layers
    plan, rec = _layer_loads(layers, j.load), _layer_loads(layers, j.recorded_load)
    st = steps_text(j.steps)
    ans = LoadAnswer(st, int(j.steps.size), plan, rec, j.moved_experts, NOT_ENOUGH, "",
                     max(j.load.p99_rel_error, j.recorded_load.p99_rel_error))
    a, b = ans.recorded_straggler_tokens, ans.straggler_tokens
    where = f"mean over {st} and {len(layers)} layer(s), exact"
    if j.kind == "recorded":
        ans.verdict, ans.reason = "baseline", f"straggler tokens {_tok(a)} ({where})"
    elif a is None or b is None:
        ans.reason = "no (step, layer) routed any token"
    elif j.kind == "oracle":
        ans.reason = (f"straggler tokens {_tok(a)} -> {_tok(b)} ({where}); the oracle is fitted on the steps it is "
                      "judged on: a lower bound, not a plan")
    elif b < a:
        ans.verdict, ans.reason = PAYS_OFF, f"straggler tokens cut from {_tok(a)} to {_tok(b)} ({where})"
    elif b > a:
        ans.verdict, ans.reason = DOES_NOT, f"straggler tokens up from {_tok(a)} to {_tok(b)} ({where})"
    else:
        ans.verdict, ans.reason = DOES_NOT, f"straggler tokens unchanged at {_tok(a)} ({where})"
    return ans


def load_lines(ans: LoadAnswer, indent: str = "  ", max_layers: int = 8) -> list[str]:
    """The exact half as text lines: the headline, then per layer the straggler rank and its
    tokens recorded -> plan (the first ``max_layers`` layers, the rest counted)."""
    out = [f"{indent}load (exact, no time model): {ans.verdict if ans.verdict != NOT_ENOUGH else 'n/a'}: {ans.reason}"]
    if ans.recorded_straggler_tokens_p99 is not None:
        out.append(f"{indent}  straggler tokens p99 {_tok(ans.recorded_straggler_tokens_p99)} recorded -> "
                   f"{_tok(ans.straggler_tokens_p99)} plan (mean over layers){rel_error_text(ans.p99_rel_error)}; "
                   f"moves {ans.moved_experts} expert copies")
    for r, p in list(zip(ans.recorded, ans.plan))[:max_layers]:
        if r.straggler_rank is None:
            out.append(f"{indent}  layer {r.layer}: no tokens routed")
            continue
        out.append(f"{indent}  layer {r.layer}: straggler rank {r.straggler_rank} ({r.straggler_steps}/"
                   f"{ans.judged_steps} steps) {_tok(r.straggler_tokens_mean)} tokens (p99 "
                   f"{_tok(r.straggler_tokens_p99)}), max/mean {r.max_over_mean:.3f} -> plan rank {p.straggler_rank} "
                   f"{_tok(p.straggler_tokens_mean)} (p99 {_tok(p.straggler_tokens_p99)}), max/mean "
                   f"{p.max_over_mean:.3f}")
    if len(ans.plan) > max_layers:
        out.append(f"{indent}  ... {len(ans.plan) - max_layers} more layer(s) in --json / replay_layer")
    return out


# ----------------------------------------------------------------------------- options, results
@dataclass
class ReplayOptions:
    split: str = "even"
    hardware: str = "H200"
    fit_cost: bool = True
    rank_rows: bool = True
    chunk_steps: int = STREAMED_STEPS
    move: MoveCost = field(default_factory=MoveCost)
    #: passes per pseudo-step of an aggregate run (times per pass then); None: the run's
    passes: int | None = None
    #: the cost model to use (None: :func:`cost_model`, preset or fitted from spans)
    cost: costmod.CostModel | None = None


def new_replay_id(prefix: str = "r") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _time_note(shape: Shape, timing: Timing) -> list[str]:
    if not shape.aggregate:
        return []
    if timing.per_pass:
        return [f"the counts aggregate {timing.per_pass} passes per recorded step: times are per pass (the "
                "aggregate divided by the pass count), not per step"]
    return ["the counts aggregate many passes into one pseudo-step (see runs.approximations) and the number of "
            "passes is unknown: imbalance and tokens only, no time per step (give --passes N for times per pass)"]


@dataclass
class ReplayResult(NotebookView):
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
    error_band: costmod.ErrorBand
    move: MoveCost
    timing: Timing
    policy: str
    nodes_per_token_max: int | None = None
    nodes_per_token_mean: float | None = None
    traffic: np.ndarray | None = None
    recorded_traffic: np.ndarray | None = None
    trace: PredictedSteps | None = None

    @property
    def load(self) -> LoadAnswer | None:
        """The exact half of the answer (:func:`load_answer`): straggler rank and tokens per
        layer, recorded vs plan, no time model."""
        return load_answer(self.judged)

    def _notebook_view(self):
        """In a notebook: the answer in words and a short table (moetrace.notebook)."""
        from ..notebook import replay_view

        return replay_view(self)

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
        la = load_answer(j)
        d = {"replay_id": self.replay_id, "run_id": self.run_id, "kind": j.kind, "policy": self.policy,
             "plan_id": p.plan_id, "plan": self.plan_desc, "split": self.split, "judged_on": self.judged_on,
             # the exact half first (counted, no band), then the modelled time with its band
             "load": la.to_dict() if la else None, "load_verdict": la.verdict if la else None,
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
             "verdict": j.verdict, "verdict_reason": j.verdict_reason, "time_verdict": j.verdict,
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


def _arr(a: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """``pa.array(a, mask=mask)`` of a numeric numpy array, over the same buffer (null where
    ``mask``), built from buffers: pyarrow imports pandas the first time ``pa.array`` is
    called (0.2-0.3 s of every replay's start-up)."""
    a = np.ascontiguousarray(a).ravel()
    validity, nulls = None, 0
    if mask is not None:
        nulls = int(np.count_nonzero(mask))
        if nulls:
            validity = pa.py_buffer(np.packbits(~np.asarray(mask, bool).ravel(), bitorder="little"))
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [validity, pa.py_buffer(a)], null_count=nulls)


def _nan_none(a: np.ndarray) -> pa.Array:
    a = np.asarray(a, np.float64).ravel()
    return _arr(a, np.isnan(a))


def _strings(value: str | None, n: int) -> pa.Array:
    """``pa.array([value] * n, pa.string())`` built from buffers (see :func:`_arr`)."""
    if value is None:
        return pa.nulls(n, pa.string())
    got = repeated_string(value, n)
    return got if got.type == pa.string() else got.cast(pa.string())


def _one(v, typ: pa.DataType) -> pa.Array:
    """A one-value array of ``typ`` (``pa.array([v], typ)``) built from buffers (see :func:`_arr`)."""
    if v is None:
        return pa.nulls(1, typ)
    if typ == pa.string():
        return _strings(v, 1)
    if typ == pa.bool_():
        return pa.Array.from_buffers(typ, 1, [None, pa.py_buffer(bytes([int(bool(v))]))])
    return _arr(np.array([v], {pa.float64(): np.float64, pa.int32(): np.int32}.get(typ, np.int64)))


#: the constant columns of the last few replay_layer tables: (replay_id, plan_id, rows) -> arrays
_CONST_COLUMNS: dict = {}


def _const_columns(replay_id, plan_id, n: int):
    """(replay_id, plan_id, plan_age_steps null) columns of ``n`` rows: a replay's pieces
    all have the same, built once (immutable Arrow arrays, shared by the tables)."""
    key = (replay_id, plan_id, n)
    got = _CONST_COLUMNS.get(key)
    if got is None:
        if len(_CONST_COLUMNS) > 8:
            _CONST_COLUMNS.clear()
        got = _CONST_COLUMNS[key] = (_strings(replay_id, n), _strings(plan_id, n), pa.nulls(n, pa.int64()))
    return got


def _layer_table(ids, layers, m, replay_id, plan_id, ages=None) -> pa.Table:
    T, L = m.imbalance.shape
    n = T * L
    strag = m.straggler.ravel()
    lstrag = (m.load_straggler if m.load_straggler is not None else m.straggler).ravel()
    rid, pid, no_age = _const_columns(replay_id, plan_id, n)
    return pa.table({
        "replay_id": rid,
        "step": _arr(np.repeat(ids, L).astype(np.int64)), "layer": _arr(np.tile(layers, T).astype(np.int32)),
        "plan_id": pid,
        "plan_age_steps": _arr(np.repeat(ages, L).astype(np.int64)) if ages is not None else no_age,
        "max_rank_tokens": _arr(m.max_tokens), "mean_rank_tokens": _arr(m.mean_tokens),
        "imbalance": _nan_none(m.imbalance), "straggler_rank": _arr(strag.astype(np.int32), strag < 0),
        # the most loaded rank (exact, as layer_skew.straggler_rank); straggler_rank above is the slowest modelled
        "load_straggler_rank": _arr(lstrag.astype(np.int32), lstrag < 0),
        "predicted_ns": _arr(np.rint(m.layer_ns.ravel()).astype(np.int64))})


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
                     "inter_node": node_of(src[keep], rpn) != node_of(dst[keep], rpn),
                     "bytes": np.rint(traffic.ravel()[keep]).astype(np.int64),
                     "steps": pa.array([steps] * int(keep.sum()), pa.int64())})


def _runs_row(res: ReplayResult, kind: str, params: dict) -> pa.Table:
    j, s, p = res.judged, res.judged.summary, res.judged.plan
    d = res.to_dict()
    S, I, I32, F, B = pa.string(), pa.int64(), pa.int32(), pa.float64(), pa.bool_()
    return pa.table({
        "replay_id": _one(res.replay_id, S), "created_at_ns": _one(time.time_ns(), I), "kind": _one(kind, S),
        "policy": _one(res.policy, S),
        "plan_id": _one(p.plan_id, S), "split": _one(res.split, S),
        "num_steps": _one(int(j.steps.size), I), "num_layers": _one(p.num_layers, I32), "num_ranks": _one(p.num_ranks, I32),
        "num_slots": _one(p.num_slots, I32), "mean_imbalance": _one(s.mean_imbalance, F),
        "p99_imbalance": _one(s.p99_imbalance, F),
        "predicted_step_ns": _one(_int(j.gross_step_ns), I),
        "mean_efficiency": _one(s.mean_efficiency, F), "moved_experts": _one(j.moved_experts, I),
        "moved_bytes": _one(j.moved_bytes, I), "exact_bytes": _one(res.exact_bytes, B),
        "cost_json": _one(res.cost.to_json(), S),
        "params_json": _one(json.dumps(params, sort_keys=True, default=str), S),
        "summary_json": _one(json.dumps(d, sort_keys=True, default=str), S),
        "approximations": _one(json.dumps(res.notes), S),
        "recorded_step_ns": _one(_int(j.recorded_step_ns), I),
        "net_step_ns": _one(_int(j.net_step_ns), I),
        "recorded_mean_imbalance": _one(j.recorded.mean_imbalance, F),
        "undefined_cells": _one(s.undefined_cells, I), "judged_on": _one(res.judged_on, S),
        "verdict": _one(j.verdict, S),
        "verdict_reason": _one(j.verdict_reason, S), "time_per": _one(d["time_per"], S),
        "plan_desc": _one(res.plan_desc, S)})
