"""Imbalance against batch size: sampling noise shrinks as batches grow, the structural
skew of the popularity under the placement stays.

Every sentence here is derived from the numbers it describes (``batch_facts``): the
section says "falls and levels off" only when the merged batches' imbalance does fall
and flatten, and keeps drift over the run apart from batch size by comparing each merged
window with the very steps it merges (``skew_by_batch.step_imbalance_mean``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from .. import plots
from ..base import Figure, ReportContext, Section, md_table

ORDER = 30
MAX_SERIES = 3
#: a change of imbalance smaller than this (relative) is "no change" in the captions
FLAT = 0.005
#: first vs second half of the run differing by more than this (relative) is "drift"
DRIFT = 0.03


@dataclass
class LayerBatch:
    """What merging steps did to one layer, from skew_by_batch and layer_skew."""
    layer: int
    w: np.ndarray                 # steps per batch
    tokens: np.ndarray            # tokens per batch
    merged: np.ndarray            # mean max/mean of the merged batches
    same_steps: np.ndarray        # mean one-step max/mean of the steps those batches cover
    structural: float | None      # whole-run rank totals: max/mean
    drop: float                   # 1 - merged/same_steps at the largest window (>= 0: merging helped)
    levels_off: bool              # the last doubling changed the gain by < a quarter of the total drop
    halves: tuple[float, float, int, int, int, int] | None   # mean imbalance of each half and their step ranges
    halves_se: float = 0.0        # standard error of the difference of the two halves' means

    @property
    def max_change(self) -> float:
        return float(np.max(np.abs(1 - self.merged / self.same_steps)))

    @property
    def flat(self) -> bool:
        return self.max_change < FLAT

    @property
    def drifts(self) -> bool:
        """The halves differ by more than DRIFT and by more than 3 standard errors (not noise)."""
        if self.halves is None:
            return False
        a, b = self.halves[:2]
        return abs(a - b) > max(DRIFT * min(a, b), 3 * self.halves_se)

    def sentence(self) -> str:
        big = len(self.w) - 1
        s = f"Layer {self.layer}: "
        if self.flat:
            s += (f"merging up to {int(self.w[big])} steps ({self.tokens[big]:,.0f} tokens per batch) changes the "
                  f"imbalance of the same steps by {100 * self.max_change:.1f}% at most — it is structural "
                  "(placement and popularity), not sampling noise.")
        elif self.drop < 0:
            s += (f"merging {int(self.w[big])} steps raises the imbalance of the same steps from "
                  f"{self.same_steps[big]:.3f}× to {self.merged[big]:.3f}× (steps with more tokens were more "
                  "skewed).")
        else:
            s += (f"merging {int(self.w[big])} steps ({self.tokens[big]:,.0f} tokens per batch) lowers the imbalance "
                  f"of the same steps from {self.same_steps[big]:.3f}× to {self.merged[big]:.3f}× "
                  f"(−{100 * self.drop:.1f}%)")
            s += (", and the last doubling barely changes it (levels off)." if self.levels_off else
                  "; it is still falling at the largest batch the run allows.")
        if self.drifts:
            a, b, a0, a1, b0, b1 = self.halves
            s += (f" The run drifts: steps {a0}–{a1} average {a:.3f}×, steps {b0}–{b1} {b:.3f}×; a long batch merges "
                  "steps of different popularity, so compare each point with the same steps taken one at a time "
                  "(dotted), not with the other points.")
        return s


def batch_facts(sb: pl.DataFrame, dec: pl.DataFrame, ls: pl.DataFrame, layer: int) -> LayerBatch | None:
    d = sb.filter(pl.col("layer") == layer).sort("steps_per_batch")
    if d.height == 0:
        return None
    # every full window of the tiling plus the window of the last w steps: every step is in some window
    merged = d["imbalance_all"].to_numpy().astype(float)
    same = d["step_imbalance_all"].to_numpy().astype(float)
    gain = merged / same
    drop = float(1 - gain[-1])
    levels = len(gain) >= 3 and drop > 0 and abs(gain[-1] - gain[-2]) < 0.25 * drop
    st = dec.filter(pl.col("layer") == layer)["structural_imbalance"]
    steps = ls.filter(pl.col("layer") == layer).sort("step")
    halves, se = None, 0.0
    if steps.height >= 4:
        h = steps.height // 2
        a, b = steps.head(h), steps.tail(steps.height - h)
        halves = (float(a["imbalance"].mean()), float(b["imbalance"].mean()), int(a["step"][0]), int(a["step"][-1]),
                  int(b["step"][0]), int(b["step"][-1]))
        se = float(np.sqrt(a["imbalance"].var() / a.height + b["imbalance"].var() / b.height))
    return LayerBatch(layer=int(layer), w=d["steps_per_batch"].to_numpy(), tokens=d["tokens_per_batch"].to_numpy(),
                      merged=merged, same_steps=same, structural=float(st[0]) if st.len() else None,
                      drop=drop, levels_off=bool(levels), halves=halves, halves_se=se)


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    sb = ctx.sql("SELECT * FROM skew_by_batch WHERE run_id = ? AND imbalance_all IS NOT NULL "
                 "AND step_imbalance_all IS NOT NULL ORDER BY layer, steps_per_batch", [rid])
    dec = ctx.sql("SELECT * FROM skew_decomposition WHERE run_id = ? ORDER BY imbalance_mean DESC", [rid])
    if sb.height == 0 or dec.height == 0:
        return None
    if sb["steps_per_batch"].max() == 1 and dec["steps"].max() <= 1:
        text = ("The run has a single step (or one aggregate pseudo-step), so sampling noise and structural skew "
                "cannot be told apart: all of its imbalance shows as structural.")
        return Section(key="batch", title="Imbalance vs batch size", markdown=text, terminal=text)
    tot = dec.select(pl.col("imbalance_mean").mean(), pl.col("structural_imbalance").mean(),
                     pl.col("sampling_excess").mean()).row(0)
    # the facts of every layer (the headline speaks for all of them), sentences and curves for the most skewed
    order = [int(v) for v in dec["layer"].to_list()]
    ls = ctx.sql("SELECT layer, step, imbalance FROM layer_skew WHERE run_id = ? AND imbalance IS NOT NULL", [rid])
    every = [f for f in (batch_facts(sb, dec, ls, lyr) for lyr in order) if f is not None]
    facts = every[:MAX_SERIES]
    text = (f"Averaged over layers, a step's imbalance of **{tot[0]:.2f}×** splits into a structural part of "
            f"**{tot[1]:.2f}×** (the rank loads summed over the whole run: the popularity under this placement, "
            "which no batch size removes) and ")
    drift = any(f.drifts for f in every)
    if abs(tot[2]) < 0.005:
        text += "no measurable sampling noise on top (less than 0.005). "
    elif every and all(f.flat for f in every):
        text += f"**{tot[2]:+.2f}** on top, which merging steps removes in no layer"
        text += (" — drift, not sampling noise: the whole-run totals mix early and late popularity, which lowers "
                 "the structural figure. " if drift else ". ")
    else:
        text += f"**{tot[2]:+.2f}** on top (sampling noise, which shrinks as batches grow"
        text += (", plus drift: the whole-run totals mix early and late popularity). " if drift else "). ")
    text += "Re-placing or replicating experts attacks the structural part; bigger batches only the sampling part."
    lines = [f.sentence() for f in facts]
    rest = every[MAX_SERIES:]
    if rest:
        lines.append(f"The other {len(rest)} layer(s): merging changes the imbalance of the same steps by at most "
                     f"{100 * max(f.max_change for f in rest):.1f}%"
                     + (f"; {sum(f.drifts for f in rest)} of them drift{'s' if sum(f.drifts for f in rest) == 1 else ''}"
                        if any(f.drifts for f in rest) else "")
                     + ".")
    md = [text, ""] + [f"- {ln}" for ln in lines] + [
        "", "Per layer, most skewed first:", "",
        md_table(dec.select("layer", "steps", "imbalance_mean", "structural_imbalance", "sampling_excess",
                            "structural_fraction"), max_rows=64)]
    term = [text.replace("**", ""), ""] + lines + [
        "", _render(dec.select("layer", "imbalance_mean", "structural_imbalance", "sampling_excess").head(8))]
    notes = ["Larger batches are emulated by summing the rank loads of consecutive steps (1, 2, 4, ... steps): "
             "what one step with that many tokens would see under the same routing. Every full window of the tiling "
             "from the first step is used, plus the window of the last w steps where the tiling leaves steps out, so "
             "every step is in some batch at every size (skew_by_batch.imbalance_all over windows_all)."]
    figs = []
    if facts:
        path = plots.plateau(ctx.outdir / "batch_plateau.png",
                             [(f"layer {f.layer}", f.tokens, f.merged, f.same_steps, f.structural) for f in facts],
                             title="Imbalance vs tokens per batch (most skewed layers)",
                             xlabel="tokens per batch (log scale; consecutive steps merged)",
                             ylabel="max / mean rank tokens (×)")
        figs.append(Figure(path, _caption(facts)))
    return Section(key="batch", title="Imbalance vs batch size", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)


def _caption(facts: list[LayerBatch]) -> str:
    """One caption that is true of every layer drawn."""
    falls = [f for f in facts if not f.flat and f.drop > 0]
    flat = [f for f in facts if f.flat]
    rises = [f for f in facts if not f.flat and f.drop <= 0]
    parts = ["Light solid band: imbalance of merged batches; black dotted: the same steps one at a time (where it lies on "
             "the solid line, merging changed nothing); dashed: the structural skew (whole-run rank totals); y axis "
             "from 1.0 (perfect balance)."]
    if flat and not falls:
        parts.append("Merging steps does not lower the imbalance here (less than "
                     f"{100 * FLAT:.1f}% at every batch size): it is structural, and only placement fixes it.")
    elif falls and all(f.levels_off for f in falls) and not flat and not rises:
        parts.append("Imbalance falls as batches grow (sampling noise averages out) and levels off.")
    else:
        for f in falls:
            parts.append(f"Layer {f.layer}: falls by {100 * f.drop:.1f}%"
                         + (" and levels off." if f.levels_off else ", still falling at the largest batch."))
        for f in flat:
            parts.append(f"Layer {f.layer}: flat (structural).")
        for f in rises:
            parts.append(f"Layer {f.layer}: merged batches are more skewed than the same steps one at a time.")
    drift = [f for f in facts if f.drifts]
    if drift:
        parts.append("The run drifts (" + ", ".join(f"layer {f.layer}: {f.halves[0]:.2f}× in the first half, "
                                                   f"{f.halves[1]:.2f}× in the second" for f in drift)
                     + "): a long window merges steps of different popularity, so a point differs from its "
                       "neighbours by time as well as batch size; the dotted line (the same steps one at a time) "
                       "holds time fixed.")
    return " ".join(parts)


def _render(df):
    from ...output import render_table

    return render_table(df, float_precision=3)
