"""Dispatch fan-out and expert co-occurrence, from per-token routing (views dispatch_fanout
and expert_cooccurrence): to how many ranks and nodes a token is sent, the bytes that
implies, and which experts fire together."""
from __future__ import annotations

from math import comb

from ..base import ReportContext, Section, md_table

ORDER = 44

NO_ROUTING = ("this run has no per-token routing (the routing table): counts per expert cannot say which experts "
              "one token chose together. Sources that record it: SGLang per_token dumps, vLLM routed experts and "
              "route logs, Megatron router traces, `moetrace capture` and `moetrace refrun`.")


def _bytes(b: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def uniform_ranks_per_token(E: int, R: int, k: int) -> float | None:
    """Distinct ranks a token reaches when it picks k of E experts uniformly at random and
    each rank holds E / R of them (one slot each): R x (1 - C(E - E/R, k) / C(E, k))."""
    if not (E and R and k) or E % R or k > E:
        return None
    return R * (1 - comb(E - E // R, k) / comb(E, k))


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    title = "Dispatch fan-out and expert co-occurrence"
    has = ctx.sql("SELECT count(*) AS n FROM (SELECT 1 FROM routing WHERE run_id = ? LIMIT 1)", [rid])["n"][0]
    if not has:
        text = f"Dispatch fan-out and expert co-occurrence: not available — {NO_ROUTING}"
        return Section(key="fanout", title=title, markdown=text, terminal=text.replace("`", ""))
    run = ctx.run
    md: list[str] = []
    term: list[str] = []
    notes: list[str] = []
    per_layer = ctx.sql(
        "SELECT layer, sum(tokens) AS tokens, sum(ranks_per_token * tokens) / sum(tokens) AS ranks_per_token, "
        "max(max_ranks_per_token) AS max_ranks_per_token, "
        "sum(nodes_per_token * tokens) / sum(tokens) AS nodes_per_token, "
        "avg(dispatch_bytes) AS dispatch_bytes_per_step, bool_or(expected) AS expected, "
        "string_agg(DISTINCT placement_source, ',') AS placement_source, any_value(nodes_from) AS nodes_from, "
        "any_value(hidden_from) AS hidden_from, any_value(dtype_from) AS dtype_from "
        "FROM dispatch_fanout WHERE run_id = ? GROUP BY layer ORDER BY layer", [rid])
    if per_layer.height == 0:
        text = ("Dispatch fan-out: unknown — the number of ranks is unknown (runs.num_ranks is empty; ingest "
                "--ranks N records it), so a token's destination ranks cannot be named.")
        md.append(text)
        term.append(text)
    else:
        tok = float(per_layer["tokens"].sum())
        rpt = float((per_layer["ranks_per_token"] * per_layer["tokens"]).sum() / tok)
        npt = float((per_layer["nodes_per_token"] * per_layer["tokens"]).sum() / tok)
        R, k, E = run.get("num_ranks"), run.get("top_k"), run.get("num_experts")
        sources = set(",".join(per_layer["placement_source"].to_list()).replace("+", ",").split(","))
        where = ("the recorded slots" if sources == {"slot"} else "the recorded placement"
                 if "contiguous" not in sources else "contiguous placement (ASSUMED: no placement recorded)")
        text = (f"A token was sent to **{rpt:.2f}** distinct ranks and **{npt:.2f}** nodes on average "
                f"(of {R} ranks" + (f", top-{k}" if k else "") + f"), under {where}. The dispatch moves one copy "
                "of the token per destination rank, so its bytes and messages scale with this number "
                "(TensorRT-LLM's report_send_ranks_per_token.py counts the same).")
        uni = uniform_ranks_per_token(E, R, k) if sources <= {"contiguous"} and run.get("num_slots") in (None, E) \
            else None
        if uni is not None:
            text += f" Independent uniform choices would reach {uni:.2f} ranks."
        md += [text, "", md_table(per_layer.select("layer", "tokens", "ranks_per_token", "max_ranks_per_token",
                                                   "nodes_per_token", "dispatch_bytes_per_step")), ""]
        term.append(text.replace("**", ""))
        term.append("mean dispatch per step and layer: "
                    f"{_bytes(float(per_layer['dispatch_bytes_per_step'].mean()))}")
        if per_layer["expected"].any():
            notes.append("Some choices went to replicated experts without a recorded slot: ranks per token is the "
                         "expectation under an even random pick of a copy.")
        for col, what in (("hidden_from", "hidden size"), ("dtype_from", "bytes per element"),
                          ("nodes_from", "ranks per node")):
            v = per_layer[col][0]
            if v != "runs":
                notes.append(f"The run does not record its {what}: {v}.")
    pairs = ctx.sql("SELECT layer, expert_a, expert_b, tokens, tokens_a, tokens_b, lift FROM expert_cooccurrence "
                    "WHERE run_id = ? AND tokens >= greatest(5, 0.01 * layer_tokens) "
                    "ORDER BY lift DESC, tokens DESC, layer, expert_a, expert_b LIMIT 12", [rid])
    strong = ctx.sql("SELECT count(*) AS n, count(*) FILTER (WHERE lift >= 2 AND tokens >= greatest(5, 0.01 * "
                     "layer_tokens)) AS strong FROM expert_cooccurrence WHERE run_id = ?", [rid]).row(0, named=True)
    co = (f"Co-occurrence: {strong['n']} expert pairs were chosen together by some token; {strong['strong']} of "
          "them at least twice as often as independent choices would be (lift >= 2, on at least 1% of the layer's "
          "tokens). Pairs that fire together cost one dispatch copy when they share a rank: "
          "`moetrace replay --policy cooccurrence` packs them.")
    md += [co, "", "Pairs that fire together most (lift over independent choices):", "", md_table(pairs)]
    term.append(co.replace("`", ""))
    return Section(key="fanout", title=title, markdown="\n".join(md), terminal="\n".join(term), notes=notes)
