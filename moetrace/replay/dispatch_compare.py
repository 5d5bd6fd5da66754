"""The load answer under each replica dispatch rule, side by side: ``even`` (every copy an
equal share, the replay's default) and ``least-loaded`` (per step, a replicated expert's
tokens water-filled onto its lightest copies' ranks: :mod:`moetrace.placement.replica_dispatch`).

Fed the judged steps' counts chunk by chunk (:meth:`DispatchCompare.add`), it keeps sums
per (rule, placement, layer): cells with tokens, the straggler rank's tokens and max/mean,
so its memory does not grow with the steps. A placement without replicated experts gives
the same numbers under both rules. Counts per logical expert only: a run whose recorded
placement is replayed from per-slot counts (exact per-rank tokens) is split here like any
plan, and the answer says which rule it used.
"""
from __future__ import annotations

import numpy as np

from ..placement.planners import Plan
from ..placement.replica_dispatch import DISPATCH, rank_tokens

#: --replica-dispatch values: one rule, or both side by side
CHOICES = (*DISPATCH, "both")


def rules_of(choice: str) -> tuple[str, ...]:
    """The rules a ``--replica-dispatch`` value asks for."""
    return DISPATCH if choice == "both" else (choice,)


class DispatchCompare:
    """Sums of the straggler's tokens and max/mean per (rule, placement, layer)."""

    def __init__(self, rules, plans: dict[str, Plan]):
        self.rules = tuple(rules)
        self.plans = plans
        self._n: dict[tuple[str, str], np.ndarray] = {}
        self._max: dict[tuple[str, str], np.ndarray] = {}
        self._ratio: dict[tuple[str, str], np.ndarray] = {}

    def add(self, load: np.ndarray) -> None:
        """Fold in ``load`` float [t, L, E] (tokens per logical expert of t judged steps)."""
        t, L, _ = load.shape
        for name, plan in self.plans.items():
            has_replicas = bool((plan.copies() > 0).sum(axis=2).max(initial=1) > 1)
            for rule in self.rules:
                key = (rule, name)
                if key not in self._n:
                    self._n[key], self._max[key], self._ratio[key] = np.zeros(L), np.zeros(L), np.zeros(L)
                use = rule if has_replicas else "even"      # same numbers; the cheap rule
                for li in range(L):
                    tok = rank_tokens(load[:, li, :], plan.phy2log[li], plan.num_ranks, use)
                    mx, mean = tok.max(axis=1), tok.mean(axis=1)
                    ok = mean > 0
                    self._n[key][li] += ok.sum()
                    self._max[key][li] += mx[ok].sum()
                    self._ratio[key][li] += (mx[ok] / mean[ok]).sum()

    def answer(self) -> dict:
        """{rule: {placement: {cells, straggler_tokens_mean, max_over_mean, layers: [...]}}}:
        means over the (step, layer) cells that routed tokens."""
        out: dict = {}
        for (rule, name), n in self._n.items():
            tot = float(n.sum())
            out.setdefault(rule, {})[name] = {
                "cells": int(tot),
                "straggler_tokens_mean": float(self._max[(rule, name)].sum() / tot) if tot else None,
                "max_over_mean": float(self._ratio[(rule, name)].sum() / tot) if tot else None,
                "layers": [{"straggler_tokens_mean": float(m / k) if k else None,
                            "max_over_mean": float(r / k) if k else None}
                           for m, r, k in zip(self._max[(rule, name)], self._ratio[(rule, name)], n)]}
        return out


def text(answer: dict) -> str:
    """One line per rule: the plan's and the recorded placement's straggler tokens and max/mean."""
    lines = []
    for rule, by in answer.items():
        if not isinstance(by, dict):
            continue
        parts = []
        for name in ("plan", "recorded"):
            a = by.get(name)
            if a and a["straggler_tokens_mean"] is not None:
                parts.append(f"{name} straggler {a['straggler_tokens_mean']:.1f} tokens, max/mean "
                             f"{a['max_over_mean']:.3f}")
        lines.append(f"replica dispatch {rule}: " + ("; ".join(parts) or "no cells with tokens"))
    return "\n".join(lines)
