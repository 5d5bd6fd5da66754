"""What a plan change costs when the engine spreads it over steps, as engines run it.

TensorRT-LLM's online balancer updates ``layer_updates_per_iter`` layers per iteration and
SGLang can rebalance in chunks of layers; vLLM and SGLang's default rearrange every layer
at once. With ``layers_per_step`` = N the change moves layers 0..N-1 at the change's step,
the next N at the step after, and so on; a layer serves the new plan from the step its
weights moved. So:

- the charge (stall + the transfer a synchronous engine waits for) is spread over
  ceil(L / N) steps: each step carries the stall in proportion to the layers it moves
  (a stated assumption: a rebalance's stall scales with the layers it rearranges) and the
  transfer in proportion to the expert copies it moves;
- the gain arrives layer by layer: the layers still on the old plan lose their gain for
  the steps they wait (``transition_loss_ns``);
- break-even steps = (charge + transition loss) / the full gain per step.

The stall per plan change is stated (``--move-stall-ms``) or measured: the median
rebalance duration the engines log (view ``rebalance_timing``: SGLang ``[EPLBManager]
rebalance end time=``, vLLM rearrangement lines and ``vllm:eplb_rearrangement_seconds``).
Arrays in, numbers out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScheduledChange:
    """One plan change under a move schedule. Times in ns."""
    layers_per_step: int            # layers moved per step (L: all at once)
    steps: int                      # steps the change is spread over
    charged_ns: float               # stall + waited transfer, all steps together
    worst_step_ns: float            # the largest charge one step carries
    transition_loss_ns: float       # gain not had while layers waited for their turn
    gain_per_step_ns: float         # the full gain per step once every layer moved
    break_even_steps: float | None  # None: the change gains nothing


def chunks(num_layers: int, layers_per_step: int | None) -> list[np.ndarray]:
    """The layer indices moved at each step of the change, in layer order."""
    n = num_layers if not layers_per_step else max(1, min(int(layers_per_step), num_layers))
    return [np.arange(a, min(a + n, num_layers)) for a in range(0, num_layers, n)]


def schedule_change(layer_gain_ns, layer_moves, transfer_ns: float, stall_ns: float,
                    layers_per_step: int | None = None, overlap: float = 0.0) -> ScheduledChange:
    """Spread one plan change over steps (module doc). ``layer_gain_ns`` [L]: each layer's
    gross gain per step under the new plan; ``layer_moves`` [L]: expert copies each layer
    moves; ``transfer_ns``: the whole change's weight transfer (slowest rank);
    ``stall_ns``: the engine's stall for the whole change; ``overlap``: the share of the
    transfer an asynchronous engine hides."""
    g = np.asarray(layer_gain_ns, np.float64)
    mv = np.asarray(layer_moves, np.float64)
    L = g.size
    parts = chunks(L, layers_per_step)
    total_moves = mv.sum()
    waited = transfer_ns * (1.0 - overlap)
    per_step = np.array([stall_ns * p.size / L + (waited * mv[p].sum() / total_moves if total_moves else 0.0)
                         for p in parts]) if L else np.zeros(0)
    turn = np.zeros(L)
    for j, p in enumerate(parts):
        turn[p] = j
    loss = float((g * turn).sum())
    gain = float(g.sum())
    charged = float(per_step.sum())
    be = (charged + loss) / gain if gain > 0 else None
    return ScheduledChange(layers_per_step=parts[0].size if parts else 0, steps=len(parts), charged_ns=charged,
                           worst_step_ns=float(per_step.max()) if per_step.size else 0.0,
                           transition_loss_ns=loss, gain_per_step_ns=gain, break_even_steps=be)


def scheduled_changes(changes, num_layers: int, stall_ns: float, layers_per_step: int | None, overlap: float,
                      layer_moves=None) -> list[ScheduledChange]:
    """:func:`schedule_change` of each of a replay's plan changes (``Change`` objects: gain
    per step, transfer). A change's gain is split evenly over its layers (the replay sums
    the gain over layers); its moved copies by ``layer_moves`` [L] where known, else evenly."""
    L = int(num_layers)
    mv = np.ones(L) if layer_moves is None else np.asarray(layer_moves, np.float64)
    return [schedule_change(np.full(L, c.gain_per_step_ns / L), mv, c.transfer_ns, stall_ns, layers_per_step,
                            overlap) for c in changes]
