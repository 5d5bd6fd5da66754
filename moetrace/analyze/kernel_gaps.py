"""Never a silent zero: an MoE trace in which no kernel was classified an expert GEMM.

The evidence that a run is MoE work comes from the trace itself: kernels launched under
MoE ranges (``spans.moe_context``: ``vllm::moe_forward``, ``FusedMoE``, ``experts``,
``expert_ffn``, dispatch/combine annotations, ...) or MoE plumbing kernels by name
(``topk_softmax``, ``moe_align_block_size``, ...: ``MOE_KERNEL_RE`` of the classifier).
When there is such evidence and no span is ``expert_gemm``, the expert GEMM share is not
0 but unknown: :func:`expert_gemm_gap` words that in one line, names the heaviest
unclassified kernels under the MoE ranges (else the heaviest unclassified kernels) and
says how to add a rule. ``moetrace kernels``, ``moetrace exposure`` and the report's
kernel section print it.
"""
from __future__ import annotations

from ..domain.kernels import MOE_KERNEL_RE

TOP = 3


def expert_gemm_gap(sql, run_id: str) -> str | None:
    """The one-line warning, or None when the run has an expert GEMM span, no profiler
    span at all, or no sign of MoE work. ``sql(query, params)`` runs over the views."""
    c = sql("""SELECT count(*) AS n, count(*) FILTER (WHERE kind = 'expert_gemm') AS eg,
                      count(moe_context) AS under_moe
               FROM spans WHERE run_id = ?""", [run_id]).row(0, named=True)
    if not c["n"] or c["eg"]:
        return None
    names = sql("SELECT name FROM kernel_names WHERE run_id = ?", [run_id])["name"].to_list()
    moe_kernels = sorted({n for n in names if n and MOE_KERNEL_RE.search(n)})
    if not c["under_moe"] and not moe_kernels:
        return None
    ranges = sql("""SELECT moe_context, count(*) AS n FROM spans WHERE run_id = ? AND moe_context IS NOT NULL
                    GROUP BY moe_context ORDER BY n DESC, moe_context LIMIT ?""", [run_id, TOP])
    under = "AND s.moe_context IS NOT NULL" if c["under_moe"] else ""
    heavy = sql(f"""SELECT kn.name, sum(s.end_ns - s.start_ns) AS ns, count(*) AS spans
                    FROM spans s JOIN kernel_names kn ON kn.run_id = s.run_id AND kn.name_id = s.name_id
                    WHERE s.run_id = ? AND s.kind = 'compute_other' AND coalesce(s.classified_by, 'default') = 'default'
                          {under}
                    GROUP BY kn.name ORDER BY ns DESC, kn.name LIMIT ?""", [run_id, TOP])
    evidence = []
    if c["under_moe"]:
        shown = ", ".join(repr(_cut(r)) for r in ranges["moe_context"].to_list())
        evidence.append(f"{c['under_moe']} kernels launched under MoE ranges such as {shown}")
    if moe_kernels:
        evidence.append("MoE kernels such as " + ", ".join(repr(_cut(n)) for n in moe_kernels[:TOP]))
    msg = (f"run {run_id}: MoE work is in the trace ({'; '.join(evidence)}) but no kernel is classified expert_gemm, "
           "so the expert GEMM share is unknown, not 0.")
    if heavy.height:
        where = "under those ranges" if under else "in the run"
        msg += f" Heaviest unclassified kernels {where}: " + ", ".join(
            f"{_cut(n)!r} ({ns / 1e6:.3f} ms, {k} spans)" for n, ns, k in heavy.iter_rows()) + "."
    msg += (" Add a rule and re-ingest: moetrace ingest --kernel-rules FILE with a CSV line "
            "'expert_gemm,name,<regex of the kernel name>' or 'expert_gemm,context,<name regex>,<range regex>' "
            "(docs/reference/kernels.md).")
    return msg


def _cut(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[:n - 3] + "..."
