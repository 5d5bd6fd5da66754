"""How the facade's results show themselves in a notebook (Jupyter, VS Code): a title, the
answer in words, a short table. ``NotebookView`` gives a class ``_repr_markdown_`` and
``_repr_html_`` from one ``_notebook_view()`` of (title, answer, rows, notes); the views of
``Run`` and the replay, drift and sweep results are below. Ground module: it reads the
objects by their attributes only and imports nothing of moetrace."""
from __future__ import annotations

from .units import ns_to_ms, pct_change

#: at most this many table rows in a notebook cell (the full data: .frame(), .to_dict())
MAX_ROWS = 12


class NotebookView:
    """Mixin: ``_repr_markdown_`` / ``_repr_html_`` from ``self._notebook_view()``, which
    returns ``(title, answer, rows, notes)``: rows a list of dicts (one column per key)."""

    def _notebook_view(self):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _repr_markdown_(self) -> str:
        return markdown(*self._notebook_view())

    def _repr_html_(self) -> str:
        return to_html(*self._notebook_view())


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def markdown(title: str, answer: str, rows: list[dict], notes=()) -> str:
    out = [f"**{title}**", "", answer]
    if rows:
        cols = list(rows[0])
        out += ["", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows[:MAX_ROWS]]
        if len(rows) > MAX_ROWS:
            out.append(f"\n({len(rows)} rows, first {MAX_ROWS} shown)")
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return "\n".join(out)


def to_html(title: str, answer: str, rows: list[dict], notes=()) -> str:
    import html  # here: the commands that never render a notebook view do not pay for it

    e = html.escape
    out = [f'<div class="moetrace"><p><strong>{e(title)}</strong></p><p>{e(answer)}</p>']
    if rows:
        cols = list(rows[0])
        out.append("<table><thead><tr>" + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr></thead><tbody>")
        out += ["<tr>" + "".join(f"<td>{e(_cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows[:MAX_ROWS]]
        out.append("</tbody></table>")
        if len(rows) > MAX_ROWS:
            out.append(f"<p>({len(rows)} rows, first {MAX_ROWS} shown)</p>")
    if notes:
        out.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul>")
    return "".join(out) + "</div>"


# ----------------------------------------------------------------------------- the views
def run_view(run) -> tuple:
    """A run: its source and shape, and what its shape leaves unknown."""
    r = run.row
    shape = ", ".join(f"{k} {r[c]}" for k, c in (("layers", "num_layers"), ("experts", "num_experts"),
                                                   ("top-k", "top_k"), ("ranks", "num_ranks"),
                                                   ("ranks/node", "ranks_per_node"), ("slots", "num_slots"))
                      if r.get(c) is not None)
    unknown = [c for c in ("num_ranks", "top_k") if r.get(c) is None]
    answer = (f"Run {run.id} from {r.get('source')} (collector {r.get('collector')}): {shape or 'shape unknown'}."
              + (f" Unknown: {', '.join(unknown)} (ingest --ranks / --top-k records them)." if unknown else ""))
    rows = [{k: r.get(k) for k in ("run_id", "collector", "num_layers", "num_experts", "top_k", "num_ranks",
                                   "ranks_per_node", "num_slots", "inconsistent")}]
    return f"moetrace run {run.id}", answer, rows, list(run.approximations)


def replay_view(res) -> tuple:
    """One replay: max/mean rank tokens and time, plan against the recorded placement on the
    same steps, and the verdict."""
    j, s = res.judged, res.judged.summary
    rows = [{"placement": "recorded", "mean_imbalance": j.recorded.mean_imbalance,
             "gross_ms": ns_to_ms(j.recorded_step_ns), "net_ms": ns_to_ms(j.recorded_step_ns), "moved_experts": 0}]
    if j.kind != "recorded":
        rows.append({"placement": res.policy, "mean_imbalance": s.mean_imbalance, "gross_ms": ns_to_ms(j.gross_step_ns),
                     "net_ms": ns_to_ms(j.net_step_ns), "moved_experts": j.moved_experts})
    imb = ("" if s.mean_imbalance is None or j.recorded.mean_imbalance is None else
           f"The busiest rank carries {s.mean_imbalance:.2f}× the mean rank's tokens vs {j.recorded.mean_imbalance:.2f}× "
           "recorded. ")
    answer = f"{imb}{res.headline()[0].upper()}{res.headline()[1:]}; judged on {res.judged_on}."
    if j.kind != "recorded":
        answer += f" Verdict: {j.verdict} ({j.verdict_reason})."
    return f"replay {res.replay_id} of run {res.run_id}: {res.plan_desc}", answer, rows, []


def drift_view(d) -> tuple:
    """Static vs re-planned vs oracle: imbalance, net time with moves charged, verdicts."""
    rows, rec_ns = [], None
    for k, j in d.results.items():
        rec_ns = j.recorded_step_ns if rec_ns is None else rec_ns
        rows.append({"plan": k, "mean_imbalance": j.summary.mean_imbalance, "gross_ms": ns_to_ms(j.gross_step_ns),
                     "net_ms": ns_to_ms(j.net_step_ns), "moved_experts": j.moved_experts, "verdict": j.verdict})
    f = d.fastest()
    answer = (f"Re-planning every {d.every} steps from the last {d.window}, judged on {d.steps.size} steps against the "
              f"recorded placement ({ns_to_ms(rec_ns):.3f} ms per step). " if rec_ns is not None else
              f"Re-planning every {d.every} steps from the last {d.window}, judged on {d.steps.size} steps. ")
    if f is not None and f.net_step_ns is not None:
        lead = ("Fastest net" if f.recorded_step_ns is None or f.net_step_ns < f.recorded_step_ns else
                "No plan beats the recorded placement net; the closest")
        answer += (f"{lead}: {f.kind}, {ns_to_ms(f.net_step_ns):.3f} ms{pct_change(f.net_step_ns, f.recorded_step_ns)} "
                   f"with its {f.moved_experts} expert moves charged (the oracle is a bound, not a plan).")
    else:
        answer += "No plan has a time per step to compare."
    return f"drift replay of run {d.run_id}: {d.policy}", answer, rows, []


def sweep_view(sw) -> tuple:
    """The decision table: its fastest net cell in words, the cells as rows."""
    ok = [r for r in sw.rows if r.skipped is None and r.net_ms is not None]
    rows = [{"replicas": r.replicas, "replan_every": r.replan_every, "window": r.window,
             "imbalance": r.mean_imbalance, "net_ms": r.net_ms, "net_vs_rec_%": r.vs_recorded_pct,
             "moved_GiB": r.moved_gib, "verdict": r.verdict if r.skipped is None else f"skipped: {r.skipped}"}
            for r in sw.rows]
    if ok:
        b = min(ok, key=lambda r: r.net_ms)
        how = "a static plan" if b.replan_every is None else f"re-planning every {b.replan_every} steps"
        lead = ("Fastest net" if b.recorded_ms is None or b.net_ms < b.recorded_ms else
                "No cell beats the recorded placement net; the closest")
        answer = (f"{lead}: {b.replicas} redundant slots, {how} (fit window {b.window}): {b.net_ms:.3f} ms vs "
                  f"{b.recorded_ms:.3f} ms recorded{pct_change(b.net_ms, b.recorded_ms)}, verdict: {b.verdict}; all "
                  f"{len(ok)} cells judged on the same steps.")
    else:
        answer = "No cell has a net time per step."
    return f"sweep of run {sw.run_id}", answer, rows, []
