"""The one run shape (:class:`Shape`), the cluster a plan or replay asks for
(:class:`ClusterSpec`) and the cluster a planner plans for once they are resolved
(:class:`PlanShape`).

A :class:`Shape` says what the run records, as the SQL view ``run_shape`` sees it, and
None where the run does not say. A replay needs numbers where the run is silent (ranks
per node, hidden size, bytes per element and per expert): the replay's loader
(``moetrace.replay.load.read_shape``) fills them in and writes each assumption into
:attr:`Shape.notes`, which every replay answer reports. Dimensions are bounded by
:data:`SHAPE_MAX` (2^24: ranks, layers, experts, slots, groups), the one shape bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..safety import SHAPE_MAX
from .budget import STREAMED_STEPS, check_replay_memory, check_slots

if TYPE_CHECKING:   # numpy is imported where arrays are made: ``moetrace runs`` reads a Shape without it
    import numpy as np

__all__ = ["SHAPE_MAX", "ClusterSpec", "PlanShape", "Shape", "Timing", "check_shape", "gap_notes", "shape_gaps"]


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster settings a plan, replay, drift or sweep is asked for; None = the run's
    own (its ranks, slots, groups, ranks per node), or derived from the others (``nodes``
    gives ranks per node = ranks / nodes). ``replicas``: redundant slots per layer.

    The all-to-all a hardware preset times (``moetrace.costmodel.a2a.FAMILIES``): ``kernel``
    (None: DeepEP V1 ``normal``), the ``sms`` it runs on (None: the kernel's default) and
    ``max_nodes_per_token`` (node-limited routing; None: the kernel's default, 0: no limit)."""
    ranks: int | None = None
    replicas: int | None = None
    groups: int | None = None
    nodes: int | None = None
    ranks_per_node: int | None = None
    kernel: str | None = None
    sms: int | None = None
    max_nodes_per_token: int | None = None


@dataclass
class PlanShape:
    """The cluster a planner plans for. ``num_groups`` None = unknown (hierarchical EPLB
    refuses it). Contradictions (nodes x ranks per node != ranks, slots that do not divide
    over ranks) are refused by :func:`check_shape`."""
    num_ranks: int
    ranks_per_node: int
    num_slots: int
    num_groups: int | None = 1
    num_nodes: int | None = None

    def nodes(self) -> int:
        return self.num_nodes or max(1, self.num_ranks // self.ranks_per_node)


def check_shape(shape: PlanShape, num_experts: int, policy: str | None = None) -> None:
    """InputError naming the options when the cluster settings contradict each other."""
    R, rpn, S = shape.num_ranks, shape.ranks_per_node, shape.num_slots
    if R < 1 or rpn < 1:
        raise InputError(None, f"--ranks {R} and --ranks-per-node {rpn} must be >= 1")
    if shape.num_nodes is not None and shape.num_nodes * rpn != R:
        raise InputError(None, f"--nodes {shape.num_nodes} x --ranks-per-node {rpn} = {shape.num_nodes * rpn} is not "
                               f"--ranks {R}")
    if S < num_experts:
        raise InputError(None, f"{S} slots cannot hold {num_experts} experts (--replicas must be >= 0)")
    if policy != "one-per-rank" and S % R:
        first = (-num_experts) % R
        fits = ", ".join(str(first + i * R) for i in range(3))
        raise InputError(None, f"--replicas {S - num_experts}: {S} slots ({num_experts} experts + {S - num_experts} "
                               f"redundant) do not divide evenly over --ranks {R}; use --replicas {fits}, …")
    if policy == "eplb":
        if shape.num_groups is None:
            raise InputError(None, "hierarchical EPLB needs the model's expert group count, which this run does not "
                                   "record: give --groups N (DeepSeek-V3/R1: 8; ingest with --groups to store it), "
                                   "or use --policy eplb-global")
        if num_experts % shape.num_groups:
            raise InputError(None, f"--groups {shape.num_groups} does not divide the {num_experts} experts")


@dataclass
class Timing:
    """How time per step is told: per step (``per_pass`` None, ``timed`` True), per pass
    of an aggregate with a known pass count, or not at all (aggregate, passes unknown)."""
    timed: bool = True
    per_pass: int | None = None


def _no_ids() -> np.ndarray:
    import numpy as np

    return np.zeros(0, np.int64)


@dataclass(eq=False)
class Shape:
    """A run's model and cluster shape, as the SQL views see it (view ``run_shape``), plus
    the sizes only the ``runs`` row records. None where the run does not say.

    A replay's shape (``moetrace.replay.load.read_shape``) also carries the steps and
    layers it reads, what the store holds for them (per-slot counts, per-token routing),
    and fills ``ranks_per_node``, ``hidden``, ``dtype_bytes`` and ``expert_bytes`` where the
    run is silent: each value it assumed is a line of :attr:`notes`."""

    num_experts: int | None
    experts_from: str | None       # 'runs' or 'max expert id + 1'
    num_ranks: int | None          # None: no rank metrics (runs.num_ranks and a recorded placement both absent)
    ranks_from: str | None         # 'runs' or 'recorded placement'
    num_slots: int | None
    top_k: int | None
    num_layers: int | None = None
    ranks_per_node: int | None = None
    num_groups: int | None = None
    hidden: int | None = None
    dtype_bytes: int | None = None
    expert_bytes: int | None = None
    # ---- what a replay reads (empty on the facade's ``Run.shape``)
    #: the layer ids and step ids of the recorded load, ascending
    layers: np.ndarray = field(default_factory=_no_ids, repr=False)
    steps: np.ndarray = field(default_factory=_no_ids, repr=False)
    has_slot: bool = False         # per-slot counts recorded
    has_routing: bool = False      # per-token routing recorded
    #: the counts aggregate many passes (one pseudo-step per recording); passes when known
    aggregate: bool = False
    passes: int | None = None
    #: every value assumed where the run is silent, one line each (replays report them)
    notes: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def from_rows(cls, view_row: dict, runs_row: dict) -> "Shape":
        """The view's columns first, the ``runs`` row for the columns the view lacks."""
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in ("layers", "steps", "has_slot", "has_routing", "aggregate", "passes", "notes"):
                continue
            kw[f.name] = view_row.get(f.name) if f.name in view_row else runs_row.get(f.name)
        return cls(**kw)

    @property
    def bytes_per_token(self) -> int:
        """Dispatch bytes of one token: hidden x bytes per element (0 when either is unknown)."""
        return (self.hidden or 0) * (self.dtype_bytes or 0)

    def timing(self, passes: int | None = None) -> Timing:
        if not self.aggregate:
            return Timing()
        return Timing(timed=False, per_pass=passes or self.passes)

    def plan_shape(self, cluster: ClusterSpec | None = None, streamed: bool = False) -> PlanShape:
        """The cluster a planner plans for: the run's, with the settings ``cluster`` gives.
        Contradictions exit 2 naming the options (:func:`check_shape`). The memory check
        sizes the steps held at once: all of them (drift, sweep: the run's load in memory),
        or with ``streamed`` one read of :data:`.budget.STREAMED_STEPS` (a replay of one
        plan reads the run in chunks: an hour and a week of a fleet need the same memory)."""
        from .ranks import ranks_per_node_or_all

        c = cluster or ClusterSpec()
        E = int(self.num_experts or 0)
        R = c.ranks or self.num_ranks
        if not R:
            raise InputError(None, "the run's expert-parallel rank count is unknown (runs.num_ranks empty, no "
                                   "recorded placement): give --ranks N (or ingest with --ranks)")
        rpn = c.ranks_per_node
        if rpn is None and c.nodes:
            if R % c.nodes:
                raise InputError(None, f"--nodes {c.nodes} does not divide --ranks {R}")
            rpn = R // c.nodes
        if rpn is None:
            rpn = ranks_per_node_or_all(self.ranks_per_node, R)
        if c.replicas is not None:
            S = E + c.replicas
        else:
            S = int(self.num_slots or 0) if c.ranks is None or c.ranks == self.num_ranks else E
        ps = PlanShape(R, rpn, S, c.groups if c.groups is not None else self.num_groups, c.nodes)
        check_slots(S, E)   # before any array is sized by it (domain/budget.py)
        check_shape(ps, E, None)
        held = min(int(self.steps.size), STREAMED_STEPS) if streamed else int(self.steps.size)
        check_replay_memory(S, held, int(self.layers.size))
        return ps

    def with_cluster(self, cluster: ClusterSpec | None) -> "Shape":
        """This shape, or where the run records no rank count and ``cluster`` gives one
        (``--ranks N``), a copy on N ranks: the recorded placement is then taken as
        contiguous over them (slot = expert), said in :attr:`notes`."""
        from dataclasses import replace

        if self.num_ranks is not None or cluster is None or not cluster.ranks:
            return self
        R = int(cluster.ranks)
        note = (f"the run records no rank count: --ranks {R} used, and the recorded placement taken as "
                f"contiguous over {R} ranks")
        notes = [n for n in self.notes if "rank count unknown" not in n] + [note]
        return replace(self, num_ranks=R, ranks_from="--ranks", num_slots=self.num_slots or self.num_experts,
                       notes=notes)

    def describe(self) -> str:
        return (f"{self.num_ranks or '?'} ranks ({self.ranks_from or 'unknown'}), "
                f"{self.ranks_per_node or '?'} per node, {self.num_slots} slots, "
                f"{self.num_groups if self.num_groups is not None else '?'} groups, top_k {self.top_k or '?'}")


# ----------------------------------------------------------------------------- what a shape leaves unknown
# One sentence per gap, said by ``ingest`` (stderr, right after the write), ``runs`` and
# ``skew`` (notes under the table), so a null in a table always has its reason next to it.
#: (runs column, the ingest option that records it, what stays null without it)
GAPS = (
    ("num_ranks", "--ranks N", "no rank loads: imbalance, efficiency, the straggler rank and every replay are null"),
    ("top_k", "--top-k K", "tokens per step (assignments / top-k) and the experts a step is expected to touch are "
                           "null; counts are token-expert assignments"),
)


def shape_gaps(run: dict) -> list[str]:
    """One line per shape value the run lacks: which, how to record it, what is null because
    of it (``run``: a ``runs`` row as a dict)."""
    return [f"{col} unknown (not in the source; ingest {opt} records it): {what}"
            for col, opt, what in GAPS if run.get(col) is None]


def gap_notes(run: dict) -> list[str]:
    """:func:`shape_gaps` prefixed with the run id, for notes under a table of several runs."""
    return [f"run {run.get('run_id')}: {g}" for g in shape_gaps(run)]
