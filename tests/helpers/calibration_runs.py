"""One run with per-token routing, expert load, a recorded placement and profiler spans
whose durations are known costs (``A_TRUE`` ns per token, ``B_TRUE`` ns per slot touched,
an all-to-all of ``LAT`` + ``CI``/``CO`` ns per byte), for the calibration tests
(test_calibrate.py, test_calibrate_trace.py); ``_truth`` counts the cost model's inputs
independently of moetrace."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moetrace.run import Store

from . import run_row

R, RPN, E, K, L, T, H, DB = 4, 2, 8, 2, 2, 10, 16, 2
SPR = E // R
A_TRUE, B_TRUE = 37.0, 1500.0                     # ns per token, ns per slot touched
LAT, CI, CO = 4000.0, 0.5, 4.0                   # ns, ns per byte intra node, ns per byte inter node
SPAN_COLS = ("rank", "device", "stream", "kind", "name_id", "start_ns", "end_ns", "step", "layer", "micro_batch",
             "inferred", "correlation", "collective", "process_group", "classified_by", "moe_context")


def _routing(seed, steps=T):
    """Per-token routing: token t of a step comes from rank t % R and picks K distinct experts."""
    rng = np.random.default_rng(seed)
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05])
    rows = []
    for s in range(steps):
        n = int(rng.integers(6, 60))
        for layer in range(L):
            pl_ = rng.permutation(p) if layer else p
            for tok in range(n):
                for c, e in enumerate(rng.choice(E, K, replace=False, p=pl_)):
                    rows.append((s, layer, tok, tok % R, c, int(e)))
    return np.array(rows, np.int64)


def _truth(rt, phy2log):
    """Independent per (step, layer, rank): tokens, slots touched, bytes received intra / inter node
    (each token once per distinct destination rank, nothing for its own rank)."""
    slot_of = {(layer, int(e)): int(np.flatnonzero(phy2log[layer] == e)[0]) for layer in range(L) for e in range(E)}
    tok = np.zeros((T, L, R))
    touched = [[[set() for _ in range(R)] for _ in range(L)] for _ in range(T)]
    dest = {}
    for s, layer, t, src, _c, e in rt:
        sl = slot_of[(layer, e)]
        r = sl // SPR
        tok[s, layer, r] += 1
        touched[s][layer][r].add(sl)
        dest.setdefault((s, layer, t, src), set()).add(r)
    tch = np.array([[[len(touched[s][la][r]) for r in range(R)] for la in range(L)] for s in range(T)], float)
    bi, bo = np.zeros((T, L, R)), np.zeros((T, L, R))
    for (s, layer, _t, src), rs in dest.items():
        for r in rs:
            if r == src:
                continue
            if r // RPN == src // RPN:
                bi[s, layer, r] += H * DB
            else:
                bo[s, layer, r] += H * DB
    return tok, tch, bi, bo


def _write(st, run_id, rt, phy2log, expert_ns, comm_ns, per_slot_spans=True, what="all", span_step_shift=0):
    """A run with routing (slots recorded), expert_load, recorded placement and spans whose
    durations are the given per-cell times (expert time split over the slots touched)."""
    slot = np.array([int(np.flatnonzero(phy2log[la] == e)[0]) for la, e in zip(rt[:, 1], rt[:, 5])])
    routing = {"step": rt[:, 0], "layer": rt[:, 1].astype(np.int32), "token": rt[:, 2],
               "src_rank": rt[:, 3].astype(np.int32), "choice": rt[:, 4].astype(np.int8),
               "expert": rt[:, 5].astype(np.int32), "slot": slot.astype(np.int32),
               "gate": np.full(len(rt), 0.5, np.float32)}
    df = pl.DataFrame({"step": rt[:, 0], "layer": rt[:, 1], "expert": rt[:, 5], "slot": slot, "src_rank": rt[:, 3]})
    load = df.group_by(["step", "layer", "expert", "slot", "src_rank"]).len().rename({"len": "tokens"})
    load = load.with_columns(pl.col("layer").cast(pl.Int32), pl.col("expert").cast(pl.Int32),
                             pl.col("slot").cast(pl.Int32), pl.col("src_rank").cast(pl.Int32),
                             pl.col("tokens").cast(pl.Int64))
    S = phy2log.shape[1]
    placement = {"plan_id": ["recorded"] * (L * S), "layer": np.repeat(np.arange(L), S).astype(np.int32),
                 "slot": np.tile(np.arange(S), L).astype(np.int32), "rank": np.tile(np.arange(S) // SPR, L).astype(np.int32),
                 "node": np.tile(np.arange(S) // SPR // RPN, L).astype(np.int32), "expert": phy2log.ravel().astype(np.int32)}
    spans = {k: [] for k in SPAN_COLS}

    def add(r, kind, t0, dur, s, layer):
        for k, v in (("rank", r), ("device", r), ("stream", 7), ("kind", kind), ("name_id", 0), ("start_ns", t0),
                     ("end_ns", t0 + int(dur)), ("step", s + span_step_shift), ("layer", layer), ("micro_batch", None),
                     ("inferred", False), ("correlation", None), ("collective", None), ("process_group", None),
                     ("classified_by", None), ("moe_context", None)):
            spans[k].append(v)

    for s in range(T):
        for layer in range(L):
            for r in range(R):
                t0 = (s * L + layer) * 10**8
                if expert_ns[s, layer, r] > 0:
                    if per_slot_spans:     # two spans per cell: the fit must sum them
                        half = int(expert_ns[s, layer, r]) // 2
                        add(r, "expert_gemm", t0, half, s, layer)
                        add(r, "expert_gemm", t0 + 10**6, int(expert_ns[s, layer, r]) - half, s, layer)
                    else:
                        add(r, "expert_gemm", t0, expert_ns[s, layer, r], s, layer)
                if comm_ns is not None:
                    d = int(comm_ns[s, layer, r])
                    add(r, "dispatch", t0 + 2 * 10**7, d // 3, s, layer)
                    add(r, "combine", t0 + 3 * 10**7, d - d // 3, s, layer)
                add(r, "attention", t0 + 4 * 10**7, 999, s, layer)   # not expert time: must be ignored
    run = run_row(source=f"test {run_id}", source_sha256=run_id * 64, num_layers=L, num_experts=E, top_k=K,
                  hidden=H, dtype_bytes=DB, expert_bytes=1000, num_ranks=R, ranks_per_node=RPN,
                  num_slots=S, num_groups=1)
    tables = {"routing": routing, "expert_load": load, "placement": placement, "spans": spans}
    if what == "spans":
        tables = {"spans": spans}
    elif what == "load":
        tables.pop("spans")
    st.write_run(run, tables, run_id=run_id)


CONTIG = np.tile(np.arange(E), (L, 1))
SHUFFLED = np.array([[7, 0, 6, 1, 5, 2, 4, 3], [3, 4, 2, 5, 1, 6, 0, 7]])


@pytest.fixture()
def exact_store(tmp_path):
    rt = _routing(1)
    tok, tch, bi, bo = _truth(rt, CONTIG)
    ex = np.round(A_TRUE * tok + B_TRUE * tch)
    cm = np.round(LAT + CI * bi + CO * bo)
    st = Store(tmp_path / "st", create=True)
    _write(st, "a", rt, CONTIG, ex, cm)
    return st, (tok, tch, bi, bo)
