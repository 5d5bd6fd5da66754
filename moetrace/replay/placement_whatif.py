"""The report's placement what-if: the recorded placement against a few planners on the
run's own load (not the timeline what-ifs of :mod:`.timeline_whatif`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..costmodel import step_cost as costmod
from ..domain.shape import ClusterSpec, Shape, Timing
from ..errors import InputError
from ..placement.planners import make_plan
from ..placement.relabel import relabel
from .judge import _in_memory
from .results import LoadAnswer, _time_note, load_answer
from .strategies import Fixed, Judged, MoveCost, fastest, judge


# ----------------------------------------------------------------------------- report what-if
@dataclass
class PlacementWhatIf:
    """The report's in-memory what-if (nothing written): the recorded placement and a few
    plans fitted on the first half of the steps, judged on the second half."""
    results: list[Judged]
    notes: list[str]
    timing: Timing
    cost: costmod.CostModel

    def fastest(self) -> Judged | None:
        """The fastest net among the plans one could deploy (:func:`.strategies.fastest`)."""
        return fastest(self.results)

    def load_answer(self, j: Judged) -> LoadAnswer | None:
        """The exact half of ``j``'s answer (:func:`.results.load_answer`): straggler tokens
        before and after, no time model."""
        return load_answer(j)

    @property
    def error_band(self) -> costmod.ErrorBand:
        """The relative error of every predicted time and its source: the cost model's band."""
        return costmod.error_band(self.cost)


def placement_whatif(store, run_id: str, shape: Shape, max_cells: int = 2_000_000, hardware: str = "H200",
                     move: MoveCost | None = None) -> PlacementWhatIf | None:
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
            ps = shape.plan_shape(ClusterSpec(replicas=rep))
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
    return PlacementWhatIf(res, notes + list(shape.notes) + _time_note(shape, timing), timing, cost)
