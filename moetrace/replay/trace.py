"""Chrome trace (Perfetto / chrome://tracing) of predicted steps: one process per step,
one lane (thread) per rank, and per layer the rank's dispatch, expert compute, combine
and the time it waits at the barrier for the straggler."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class PredictedSteps:
    """A replay's predicted timeline of a few steps: ``steps [t]``, ``layers [L]``;
    tokens / touched / dispatch_ns / compute_ns ``[t, L, R]`` (``combine_ns`` too; None:
    the combine takes as long as the dispatch); ``layer_ns [t, L]``; the cost model's
    ``cost_source``."""
    steps: np.ndarray
    layers: np.ndarray
    tokens: np.ndarray
    touched: np.ndarray
    dispatch_ns: np.ndarray
    compute_ns: np.ndarray
    layer_ns: np.ndarray
    cost_source: str
    combine_ns: np.ndarray | None = None


def chrome_trace(path, predicted: PredictedSteps, plan_desc: str) -> Path:
    """Write ``predicted`` (:class:`PredictedSteps`) to ``path``. Times are laid out from 0;
    each layer starts when the previous layer's barrier releases."""
    p = predicted
    steps, layers, tokens, touched, layer_ns = p.steps, p.layers, p.tokens, p.touched, p.layer_ns
    dispatch_ns, compute_ns, cost_source = p.dispatch_ns, p.compute_ns, p.cost_source
    combine_ns = dispatch_ns if p.combine_ns is None else p.combine_ns
    ev = []
    T, L, R = tokens.shape
    for ti in range(T):
        pid = ti + 1
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"predicted step {int(steps[ti])} ({plan_desc})"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for r in range(R):
            ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": r, "args": {"sort_index": r}})
        t0 = 0.0
        for li in range(L):
            strag = int(np.argmax(dispatch_ns[ti, li] + compute_ns[ti, li] + combine_ns[ti, li]))
            for r in range(R):
                d, c, cb = float(dispatch_ns[ti, li, r]), float(compute_ns[ti, li, r]), float(combine_ns[ti, li, r])
                args = {"layer": int(layers[li]), "tokens": float(tokens[ti, li, r]),
                        "slots_touched": int(touched[ti, li, r]), "straggler": r == strag}
                t = t0
                for name, dur, cat in (("dispatch", d, "a2a"),
                                       (f"experts L{int(layers[li])}" + (" (straggler)" if r == strag else ""), c, "expert"),
                                       ("combine", cb, "a2a")):
                    ev.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": r, "ts": t / 1e3,
                               "dur": dur / 1e3, "args": args})
                    t += dur
                wait = t0 + float(layer_ns[ti, li]) - t
                if wait > 0.5:   # ns; float rounding leaves the straggler a few attoseconds
                    ev.append({"ph": "X", "name": "wait (barrier)", "cat": "idle", "pid": pid, "tid": r,
                               "ts": t / 1e3, "dur": wait / 1e3, "args": {"layer": int(layers[li]), "straggler_rank": strag}})
            t0 += float(layer_ns[ti, li])
    doc = {"traceEvents": ev, "displayTimeUnit": "ns",
           "otherData": {"generator": "moetrace replay", "plan": plan_desc, "cost_model": cost_source}}
    from ..output import write_output

    return write_output(path, json.dumps(doc), "trace")
