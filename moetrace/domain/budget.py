"""Resource budgets checked before a plan, replay or sweep starts: the slot count a
``--replicas`` asks for against the shape bound, the memory its per-step arrays need
against ``max_replay_bytes``, and a sweep's cell count against ``max_sweep_cells``.

The estimate is the replay's largest arrays: per (step, layer, slot) token loads and the
per-slot work derived from them, float64, about :data:`BYTES_PER_CELL` bytes per cell
(a fixed multiple, stated; the real peak of a replay is below it on the runs measured in
tests/test_hostile_families.py)."""
from __future__ import annotations

from ..errors import InputError
from ..safety import LIMITS, SHAPE_MAX, limit

#: bytes per (step, layer, slot) cell a replay holds at once (loads, split, per-rank sums)
BYTES_PER_CELL = 32
#: steps a streamed replay (one plan against the recorded one: ``moetrace replay``) holds
#: at once: one read of ``ReplayOptions.chunk_steps``, whatever the run's length
STREAMED_STEPS = 1000


def _raise(name: str) -> str:
    return f"raise it with {LIMITS[name].env}=N"


def check_slots(num_slots: int, num_experts: int) -> None:
    if num_slots > SHAPE_MAX:
        raise InputError(None, f"{num_slots} slots per layer ({num_slots - num_experts} redundant, --replicas) "
                               f"exceed the shape bound 2^24 ({SHAPE_MAX})")


def check_replay_memory(num_slots: int, steps: int, layers: int) -> None:
    """Refuse before planning when ``steps x layers x num_slots`` cells cannot fit."""
    need = max(1, steps) * max(1, layers) * num_slots * BYTES_PER_CELL
    cap = limit("max_replay_bytes")
    if need > cap:
        raise InputError(None, f"{num_slots} slots x {layers} layers x {steps} steps need about {need / 2**30:.1f} "
                               f"GiB ({BYTES_PER_CELL} bytes per cell), over the limit max_replay_bytes={cap} "
                               f"({cap / 2**30:.1f} GiB); lower --replicas, or {_raise('max_replay_bytes')}")


def check_sweep_cells(cells: int) -> None:
    cap = limit("max_sweep_cells")
    if cells > cap:
        raise InputError(None, f"the sweep has {cells} cells (replica budgets x re-plan intervals x windows), over "
                               f"the limit max_sweep_cells={cap}; give fewer values, or {_raise('max_sweep_cells')}")
