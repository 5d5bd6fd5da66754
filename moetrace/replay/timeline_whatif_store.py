"""The what-ifs' store adapter: reads a run's recorded timeline and routing through the SQL
views, calls the pure models of :mod:`moetrace.replay.whatif`, writes ``replay_whatif``
rows and (optionally) a Chrome trace of the overlap what-if.

Inputs, each from one view:

* overlap: per (step, rank) the step time (``steps``) and per layer the exposed
  all-to-all and its combine part (``a2a_exposure``);
* disaggregation: per token and layer on one GPU, the expert time (``expert_gemm`` spans),
  the rest of the compute (every other compute span: attention and everything around it)
  and the one-way transfer (``rank_waits.transfer_ns`` of all-to-all instances, half of
  dispatch + combine), over the tokens of ``steps.num_tokens``; any of them can be given
  instead (a preset or another measurement);
* domain size: tokens sent between ranks per (step, layer) from ``routing`` (each token
  once per distinct destination rank: its recorded slot's rank, else the recorded
  placement's first copy of the expert, else contiguous placement), bytes per token
  ``runs.hidden x runs.dtype_bytes``, NVLink and NIC rates of a hardware preset.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..costmodel import step_cost as costmod
from ..domain.model_shape import DEFAULT_DTYPE_BYTES, DEFAULT_HIDDEN
from ..domain.ranks import ranks_per_node_or_all
from .timeline_whatif import (
    DOMAIN_ASSUMPTIONS,
    DisaggResult,
    DomainResult,
    OverlapResult,
    disaggregation,
    domain_sweep,
    overlap_two_micro_batches,
)

TABLE = "replay_whatif"


@dataclass
class WhatIfReport:
    whatif_id: str
    run_id: str
    overlap: OverlapResult | None = None
    overlap_inputs: dict | None = None
    disagg: DisaggResult | None = None
    disagg_inputs: dict | None = None
    domains: list[DomainResult] | None = None
    domain_inputs: dict | None = None
    notes: list[str] = field(default_factory=list)
    rel_error: float = costmod.UNCALIBRATED_REL_ERROR
    rel_error_source: str = costmod.UNCALIBRATED_SOURCE
    rows: int = 0

    def frame(self):
        """The report as ``replay_whatif`` rows (polars, long form, without ``run_id``)."""
        import polars as pl

        return pl.from_arrow(rows_table(self)).drop("run_id")


# ----------------------------------------------------------------------------- inputs
def overlap_inputs(store, run_id: str) -> dict | None:
    """Arrays for :func:`overlap_two_micro_batches` (None when the run has no all-to-all
    with a known step and layer, or no step times)."""
    g = store.sql("""SELECT step, layer, rank, sum(exposed_ns) AS e,
                            coalesce(sum(exposed_ns) FILTER (WHERE kind = 'combine'), 0) AS b
                     FROM a2a_exposure WHERE run_id = ? AND step IS NOT NULL AND layer IS NOT NULL
                     GROUP BY ALL""", [run_id])
    st = store.sql("""SELECT step, rank, (end_ns - start_ns) AS ns FROM steps
                      WHERE run_id = ? AND start_ns IS NOT NULL AND end_ns IS NOT NULL""", [run_id])
    if g.height == 0 or st.height == 0:
        return None
    steps = np.intersect1d(np.unique(g["step"].to_numpy()), np.unique(st["step"].to_numpy()))
    ranks = np.intersect1d(np.unique(g["rank"].to_numpy()), np.unique(st["rank"].to_numpy()))
    layers = np.unique(g["layer"].to_numpy())
    if steps.size == 0 or ranks.size == 0:
        return None
    S, L, R = steps.size, layers.size, ranks.size
    e = np.zeros((S, L, R))
    b = np.zeros((S, L, R))
    step_ns = np.full((S, R), np.nan)
    for s_, l_, r_, ev, bv in g.iter_rows():
        i, j, k = np.searchsorted(steps, s_), np.searchsorted(layers, l_), np.searchsorted(ranks, r_)
        if i < S and steps[i] == s_ and k < R and ranks[k] == r_:
            e[i, j, k], b[i, j, k] = ev, bv
    for s_, r_, ns in st.iter_rows():
        i, k = np.searchsorted(steps, s_), np.searchsorted(ranks, r_)
        if i < S and steps[i] == s_ and k < R and ranks[k] == r_:
            step_ns[i, k] = ns
    keep = ~np.isnan(step_ns).any(axis=1)
    if not keep.any():
        return None
    lat = store.sql("""SELECT quantile_cont(min_transfer_ns, 0.1) AS lat, count(*) AS n,
                              count(DISTINCT (step, layer)) AS cells
                       FROM coll_instances WHERE run_id = ? AND coll_key = 'all_to_all' AND step IS NOT NULL
                       AND layer IS NOT NULL AND NOT clock_inconsistent""", [run_id]).row(0, named=True)
    per_layer = (max(float(lat["lat"]), 0.0) * lat["n"] / lat["cells"]) if lat["cells"] else 0.0
    return {"steps": steps[keep], "layers": layers, "ranks": ranks, "step_ns": step_ns[keep],
            "exposed_ns": e[keep], "combine_exposed_ns": b[keep], "a2a_latency_ns": per_layer,
            "a2a_latency_from": (f"measured: 10th percentile of the all-to-all instances' transfer after the last "
                                 f"arrival ({float(lat['lat'] or 0) / 1e3:.1f} µs) x {lat['n'] / lat['cells']:.1f} "
                                 "instances per layer") if lat["cells"] else "no matched all-to-all instances: 0"}


def disagg_inputs(store, run_id: str) -> dict:
    """Measured per-token times of the run (None for what it cannot measure)."""
    sp = store.sql("""SELECT coalesce(sum(end_ns - start_ns) FILTER (WHERE kind = 'expert_gemm'), 0) AS expert_ns,
                             coalesce(sum(end_ns - start_ns) FILTER (WHERE kind IN ('moe_other', 'attention', 'compute_other')), 0)
                                 AS other_ns,
                             count(DISTINCT layer) FILTER (WHERE kind IN ('dispatch', 'combine')) AS layers
                      FROM spans WHERE run_id = ? AND step IS NOT NULL""", [run_id]).row(0, named=True)
    tok = store.sql("""SELECT sum(num_tokens) AS tokens, count(DISTINCT step) AS steps, count(DISTINCT rank) AS ranks
                       FROM steps WHERE run_id = ? AND num_tokens IS NOT NULL""", [run_id]).row(0, named=True)
    tr = store.sql("""SELECT coalesce(sum(transfer_ns), 0) AS ns FROM rank_waits
                      WHERE run_id = ? AND coll_key = 'all_to_all' AND step IS NOT NULL""", [run_id])["ns"][0]
    out = {"tokens": None, "gpus": tok["ranks"] or None, "ta_ns": None, "te_ns": None, "tc_ns": None,
           "from": "measured"}
    L = sp["layers"] or store.run_row(run_id).get("num_layers")
    if tok["tokens"] and L:
        per = float(tok["tokens"]) * L       # token-layers over all steps and ranks
        out["tokens"] = float(tok["tokens"]) / max(tok["steps"], 1)
        out["te_ns"] = sp["expert_ns"] / per if sp["expert_ns"] else None
        out["ta_ns"] = sp["other_ns"] / per if sp["other_ns"] else None
        out["tc_ns"] = float(tr) / 2 / per if tr else None
    return out


def traffic(store, run_id: str) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
    """Tokens sent between ranks per (step, layer): ``[T, L, R, R]``, the step ids and notes.
    None without routing rows or a rank count."""
    sh = store.sql("SELECT num_ranks, num_slots, num_experts FROM run_shape WHERE run_id = ?", [run_id])
    if sh.height == 0 or sh["num_ranks"][0] is None:
        return None
    R, S, E = int(sh["num_ranks"][0]), sh["num_slots"][0], sh["num_experts"][0]
    if not store.has_files("routing"):
        return None
    notes = []
    has_pl = store.has_files("placement") and store.sql(
        "SELECT count(*) AS n FROM placement WHERE run_id = ? AND plan_id = 'recorded'", [run_id])["n"][0] > 0
    spr = int(S) // R if S and int(S) % R == 0 else None
    pl_join = ("LEFT JOIN (SELECT layer, expert, arg_min(rank, slot) AS prank FROM placement "
               "WHERE run_id = ? AND plan_id = 'recorded' GROUP BY layer, expert) p "
               "ON p.layer = r.layer AND p.expert = r.expert") if has_pl else ""
    slot_rank = "r.slot // ?" if spr else "NULL"
    # parameters in the order the query text uses them
    params = [R] + ([spr] if spr else []) + [R, E or 1] + ([run_id] if has_pl else []) + [run_id]
    df = store.sql(f"""
        WITH d AS (
            SELECT r.step, r.layer, r.token,
                   coalesce(r.src_rank, r.token % ?) AS src,
                   coalesce({slot_rank}, {'p.prank' if has_pl else 'NULL'}, (r.expert * ?) // ?) AS dst,
                   r.slot IS NULL AS no_slot, r.src_rank IS NULL AS no_src
            FROM routing r {pl_join}
            WHERE r.run_id = ?
        )
        SELECT step, layer, src, dst, count(DISTINCT token) AS tokens,
               bool_or(no_slot) AS no_slot, bool_or(no_src) AS no_src
        FROM d GROUP BY step, layer, src, dst""", params)
    if df.height == 0:
        return None
    if df["no_slot"].any():
        notes.append("routing rows without a slot: destination = the recorded placement's first copy of the expert"
                     if has_pl else "routing rows without a slot and no recorded placement: contiguous placement "
                                    "assumed for the destination rank")
    if df["no_src"].any():
        notes.append("routing rows without a source rank: token % ranks assumed")
    steps = np.unique(df["step"].to_numpy())
    layers = np.unique(df["layer"].to_numpy())
    t = np.zeros((steps.size, layers.size, R, R))
    src = np.clip(df["src"].to_numpy(), 0, R - 1)
    dst = np.clip(df["dst"].to_numpy(), 0, R - 1)
    np.add.at(t, (np.searchsorted(steps, df["step"].to_numpy()), np.searchsorted(layers, df["layer"].to_numpy()),
                  src, dst), df["tokens"].to_numpy().astype(np.float64))
    return t, steps, notes


# ----------------------------------------------------------------------------- run
@dataclass(frozen=True)
class WhatIfOptions:
    """Which timeline what-ifs to run and the inputs that override what the run measured:
    ``overlap`` (two micro-batches: ``split_extra_ns`` added per split, ``a2a_latency_ns``),
    ``disagg`` (attention/FFN disaggregation: ``tokens``, ``gpus``, attention / expert /
    transfer time ``ta_ns`` / ``te_ns`` / ``tc_ns``, fixed costs ``fa_ns`` / ``fe_ns``, at most
    ``max_micro_batches``) and the NVLink ``domains`` sizes (on ``hardware``'s links)."""
    overlap: bool = True
    disagg: bool = True
    domains: tuple = (8, 16, 72)
    split_extra_ns: float = 0.0
    a2a_latency_ns: float | None = None
    hardware: str = "H200"
    tokens: float | None = None
    gpus: int | None = None
    ta_ns: float | None = None
    te_ns: float | None = None
    tc_ns: float | None = None
    fa_ns: float = 0.0
    fe_ns: float = 0.0
    max_micro_batches: int = 8


def run_whatifs(store, run_id: str, options: WhatIfOptions | None = None, *, write: bool = True,
                trace_path: str | Path | None = None) -> WhatIfReport:
    """Run the what-ifs the run has data for (:class:`WhatIfOptions`), write ``replay_whatif``
    rows (``write``) and the overlap's Chrome trace (``trace_path``). Options given override
    measured inputs."""
    o = options or WhatIfOptions()
    overlap, disagg, domains, split_extra_ns = o.overlap, o.disagg, o.domains, o.split_extra_ns
    a2a_latency_ns, hardware, tokens, gpus = o.a2a_latency_ns, o.hardware, o.tokens, o.gpus
    ta_ns, te_ns, tc_ns, fa_ns, fe_ns, max_micro_batches = o.ta_ns, o.te_ns, o.tc_ns, o.fa_ns, o.fe_ns, \
        o.max_micro_batches
    rep = WhatIfReport(f"w-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}", run_id)
    run = store.run_row(run_id)
    if overlap:
        inp = overlap_inputs(store, run_id)
        if inp is None:
            rep.notes.append("overlap: no all-to-all spans with a step and layer, or no step times: skipped")
        else:
            if a2a_latency_ns is not None:
                inp["a2a_latency_ns"], inp["a2a_latency_from"] = float(a2a_latency_ns), "given"
            rep.overlap_inputs = inp
            rep.overlap = overlap_two_micro_batches(inp["steps"], inp["step_ns"], inp["exposed_ns"],
                                                    inp["combine_exposed_ns"], split_extra_ns, inp["a2a_latency_ns"])
    if disagg:
        inp = disagg_inputs(store, run_id)
        given = {"tokens": tokens, "gpus": gpus, "ta_ns": ta_ns, "te_ns": te_ns, "tc_ns": tc_ns}
        for k, v in given.items():
            if v is not None:
                inp[k] = v
        inp["given"] = sorted(k for k, v in given.items() if v is not None)
        missing = [k for k in ("tokens", "gpus", "ta_ns", "te_ns", "tc_ns") if not inp.get(k)]
        if missing:
            rep.notes.append("disaggregation: the run does not measure " + ", ".join(missing)
                             + " (give --tokens, --gpus, --attn-ns, --expert-ns, --transfer-ns): skipped")
        elif int(inp["gpus"]) < 2:
            rep.notes.append("disaggregation: needs at least 2 GPUs (--gpus): skipped")
        else:
            inp.update(fa_ns=fa_ns, fe_ns=fe_ns)
            rep.disagg_inputs = inp
            rep.disagg = disaggregation(inp["tokens"], int(inp["gpus"]), inp["ta_ns"], inp["te_ns"], inp["tc_ns"],
                                        fa_ns, fe_ns, max_micro_batches)
    if domains:
        tr = traffic(store, run_id)
        if tr is None:
            rep.notes.append("domain size: no routing rows (or no rank count): skipped")
        else:
            t, steps, notes = tr
            rep.notes.extend(f"domain size: {n}" for n in notes)
            hidden, db = run.get("hidden"), run.get("dtype_bytes")
            if not hidden:
                rep.notes.append(f"domain size: runs.hidden unknown, {DEFAULT_HIDDEN} assumed for bytes per token")
            if not db:
                rep.notes.append(f"domain size: runs.dtype_bytes unknown, {DEFAULT_DTYPE_BYTES} assumed for bytes per token")
            bpt = (hidden or DEFAULT_HIDDEN) * (db or DEFAULT_DTYPE_BYTES)
            cm = costmod.preset(hardware)
            rpn = ranks_per_node_or_all(run.get("ranks_per_node"), t.shape[2])
            sizes = [int(rpn)] + [int(d) for d in domains if int(d) != int(rpn)]
            rep.domains = domain_sweep(t, bpt, sizes, cm.nvlink_Bps, cm.internode_Bps)
            rep.domain_inputs = {"bytes_per_token": bpt, "ranks": t.shape[2], "steps": int(steps.size),
                                 "recorded_domain": int(rpn), "hardware": hardware,
                                 "intra_GBps": cm.nvlink_Bps / 1e9, "inter_GBps": cm.internode_Bps / 1e9,
                                 "ranks_per_node_from": "runs" if run.get("ranks_per_node") else "all ranks (unknown)"}
    if write:
        tbl = rows_table(rep)
        if tbl.num_rows:
            store.append(run_id, {TABLE: tbl})
            rep.rows = tbl.num_rows
    if trace_path is not None and rep.overlap is not None:
        chrome_trace(trace_path, rep)
    return rep


def rows_table(rep: WhatIfReport) -> pa.Table:
    """The report as ``replay_whatif`` rows (long form: one metric per row)."""
    now = time.time_ns()
    rows = []

    def add(kind, scenario, step, metric, before, after, unit, assumptions, params):
        rows.append({"whatif_id": rep.whatif_id, "created_at_ns": now, "kind": kind, "scenario": scenario,
                     "step": step, "metric": metric, "before": None if before is None else float(before),
                     "after": None if after is None else float(after), "unit": unit,
                     "rel_error": rep.rel_error, "assumptions": assumptions, "params_json": json.dumps(params)})

    o = rep.overlap
    if o is not None:
        p = {"split_extra_ns": o.split_extra_ns, "a2a_latency_ns": o.a2a_latency_ns,
             "a2a_latency_from": rep.overlap_inputs.get("a2a_latency_from"), "error_band_source": rep.rel_error_source}
        for i, s in enumerate(o.steps):
            add("overlap", "two micro-batches", int(s), "step_ns", o.before_ns[i], o.after_ns[i], "ns", o.assumptions, p)
            add("overlap", "two micro-batches", int(s), "exposed_a2a_ns", o.exposed_before_ns[i],
                o.exposed_after_ns[i], "ns", o.assumptions, p)
        add("overlap", "two micro-batches", None, "step_ns", o.before_ns.mean(), o.after_ns.mean(), "ns",
            o.assumptions, p)
        add("overlap", "two micro-batches", None, "exposed_a2a_ns", o.exposed_before_ns.mean(),
            o.exposed_after_ns.mean(), "ns", o.assumptions, p)
    d = rep.disagg
    if d is not None:
        b = d.best
        p = {k: v for k, v in (rep.disagg_inputs or {}).items()}
        p["error_band_source"] = rep.rel_error_source
        sc = f"{b.attn_gpus} attention : {b.expert_gpus} expert GPUs, {b.micro_batches} micro-batches"
        add("disaggregation", sc, None, "tokens_per_gpu_s", d.colocated_tokens_per_gpu_s, b.tokens_per_gpu_s,
            "tokens/s/GPU", d.assumptions, p)
        add("disaggregation", sc, None, "layer_ns", d.colocated_layer_ns, b.layer_ns, "ns", d.assumptions, p)
        for M in sorted({c.attn_gpus for c in d.candidates}):
            c = max((c for c in d.candidates if c.attn_gpus == M),
                    key=lambda c: (round(c.tokens_per_gpu_s, 6), -c.micro_batches))
            add("disaggregation", f"{c.attn_gpus}:{c.expert_gpus}, {c.micro_batches} micro-batches", None,
                "tokens_per_gpu_s", d.colocated_tokens_per_gpu_s, c.tokens_per_gpu_s, "tokens/s/GPU",
                d.assumptions, p)
    if rep.domains:
        base = rep.domains[0]
        p = dict(rep.domain_inputs or {}, error_band_source=rep.rel_error_source)
        for r in rep.domains:
            sc = f"{r.domain_size} ranks per NVLink domain"
            add("domain", sc, None, "inter_domain_bytes", base.inter_bytes, r.inter_bytes, "bytes", DOMAIN_ASSUMPTIONS, p)
            add("domain", sc, None, "a2a_ns_per_step", base.a2a_ns_per_step, r.a2a_ns_per_step, "ns",
                DOMAIN_ASSUMPTIONS, p)
    from ..storage.schema import conform

    cols = ["whatif_id", "created_at_ns", "kind", "scenario", "step", "metric", "before", "after", "unit",
            "rel_error", "assumptions", "params_json"]
    data = {c: [r[c] for r in rows] for c in cols}
    data["run_id"] = [rep.run_id] * len(rows)
    return conform(TABLE, data)


# ----------------------------------------------------------------------------- Chrome trace
def chrome_trace(path, rep: WhatIfReport) -> Path:
    """Perfetto / chrome://tracing view of the overlap what-if for the step with the most
    exposed all-to-all: per rank, the recorded layers (compute, exposed all-to-all) and the
    predicted two-micro-batch layers (compute, what stays exposed)."""
    o, inp = rep.overlap, rep.overlap_inputs
    i = int(np.argmax(o.exposed_before_ns))
    e = inp["exposed_ns"][i]                        # [L, R]
    b = inp["combine_exposed_ns"][i]
    L, R = e.shape
    c = np.maximum(inp["step_ns"][i] - e.sum(axis=0), 0) / L          # [R]
    cx = c + o.split_extra_ns
    hide = e + o.a2a_latency_ns
    hide[-1] -= b[-1] / 2
    after = np.maximum(hide - cx, 0)
    after[-1] += b[-1] / 2
    ev = []
    for pid, (label, comp, exp) in enumerate((("recorded", c, e), ("two micro-batches (predicted)", cx, after)), 1):
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"step {int(o.steps[i])}: {label}"}})
        for r in range(R):
            ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r,
                       "args": {"name": f"rank {int(inp['ranks'][r])}"}})
            t = 0.0
            for li in range(L):
                for name, dur, cat in ((f"compute L{int(inp['layers'][li])}", comp[r], "compute"),
                                       ("exposed all-to-all", exp[li, r], "a2a")):
                    if dur > 0:
                        ev.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": r, "ts": t / 1e3,
                                   "dur": dur / 1e3, "args": {"layer": int(inp["layers"][li])}})
                    t += dur
    doc = {"traceEvents": ev, "displayTimeUnit": "ns",
           "otherData": {"generator": "moetrace whatif", "assumptions": o.assumptions,
                         "error_band": f"±{100 * rep.rel_error:.0f}% ({rep.rel_error_source})"}}
    from ..output import write_output

    return write_output(path, json.dumps(doc), "trace")


def latest(store, run_id: str):
    """The latest ``replay_whatif`` rows of each kind for ``run_id`` (None: none written)."""
    if not store.has_files(TABLE):
        return None
    df = store.sql(f"""SELECT * EXCLUDE (run_id) FROM {TABLE} WHERE run_id = ? AND whatif_id IN (
                           SELECT arg_max(whatif_id, created_at_ns) FROM {TABLE} WHERE run_id = ? GROUP BY kind)
                       ORDER BY kind, step NULLS FIRST, scenario, metric""", [run_id, run_id])
    return df if df.height else None

