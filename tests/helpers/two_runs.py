"""The two-run store of test_analysis_materialize.py and test_analysis_cache.py, built once
per session (conftest's ``two_runs_template``), and its plain views computed once
(``two_runs_live``): the modules compared batched, materialized and stored rows against
the same plain views of the same rows, each computing them itself (the slowest part of
both: ``skew_by_batch`` alone is seconds). The tests never write to the template: they
open their own ``Store`` on it (their TEMP tables live on their own connection) or write
into a byte-for-byte copy of it."""
from __future__ import annotations

import json

import numpy as np
import polars as pl

from . import run_row

#: sort keys of the views compared row by row
KEYS = {"run_shape": ["run_id"], "layer_placement": ["layer"], "layer_skew": ["step", "layer"],
        "tokens_per_expert": ["step", "layer"], "skew_by_batch": ["layer", "steps_per_batch"],
        "skew_decomposition": ["layer"], "rank_totals": ["layer", "rank"], "expert_token_hist": ["layer", "tokens"],
        "expert_step_bins": ["layer", "bin", "expert"], "skew_summary": ["layer"], "run_skew_summary": ["run_id"]}
#: the dense (synth) run next to the recorded one
SYNTH = dict(layers=3, experts=32, top_k=4, ranks=8, ranks_per_node=4, steps=37, tokens_per_step=128, sigma=0.7)


def write_recorded_run(st) -> str:
    """41 step numbers with gaps, 2 layers x 6 experts on 4 ranks, experts 0 and 4 replicated
    (fractional rank loads), layer 1 without placement for expert 5 (recorded+contiguous),
    one all-zero (step, layer)."""
    rng = np.random.default_rng(7)
    E, S, R = 6, 8, 4
    phy2log = [4, 1, 0, 2, 3, 0, 5, 4]
    pl1 = [0, 1, 2, 3, 4, 0, 1, 2]                          # layer 1: expert 5 has no slot
    placement = {"plan_id": ["recorded"] * 2 * S, "layer": [0] * S + [1] * S, "slot": list(range(S)) * 2,
                 "rank": [s // 2 for s in range(S)] * 2, "node": [0] * 2 * S, "expert": phy2log + pl1}
    steps = [s for s in range(50) if s not in (7, 20, 21, 22, 30, 31, 32, 33, 34)]
    rows = {"step": [], "layer": [], "expert": [], "tokens": [], "slot": [], "src_rank": []}
    for s in steps:
        for layer in (0, 1):
            x = rng.poisson([60, 5, 9, 30, 41, 3]) if not (s == 13 and layer == 0) else np.zeros(E, int)
            for e in range(E):
                if x[e] == 0 and e % 2:                      # some experts absent rather than 0
                    continue
                rows["step"].append(s)
                rows["layer"].append(layer)
                rows["expert"].append(e)
                rows["tokens"].append(int(x[e]))
                rows["slot"].append(None)
                rows["src_rank"].append(None)
    run = run_row(source="t", num_experts=E, num_ranks=R, num_slots=S, top_k=2, approximations=json.dumps([]))
    return st.write_run(run, {"expert_load": rows, "placement": placement}, run_id="rec").run_id


def build(path) -> list[str]:
    """The recorded run and the synth run (seed 5) in a new store at ``path``: their run ids."""
    from moetrace.produce.synth import SynthConfig, synth
    from moetrace.run import Store

    st = Store(path, create=True)
    rids = [write_recorded_run(st), synth(st, SynthConfig(**SYNTH, seed=5)).run_id]
    st.close()
    return rids


def plain(st, view: str, rid: str) -> pl.DataFrame:
    """One run's rows of a view, sorted by its keys."""
    return st.sql(f"SELECT * FROM {view} WHERE run_id = ?", [rid]).sort(KEYS[view])


def live_views(path, rids: list[str]) -> dict[str, dict[str, pl.DataFrame]]:
    """Every view of :data:`KEYS` of each run, computed by the plain views on a fresh store
    connection (nothing materialized, nothing stored)."""
    from moetrace.run import Store

    st = Store(path)
    try:
        return {rid: {v: plain(st, v, rid) for v in KEYS} for rid in rids}
    finally:
        st.close()


def _assert_same(got: pl.DataFrame, want: pl.DataFrame, what: str):
    assert got.columns == want.columns, what
    assert got.height == want.height, f"{what}: {got.height} rows, view has {want.height}"
    assert got.height > 0, what
    for c in want.columns:
        g, w = got[c], want[c]
        assert g.dtype == w.dtype, f"{what}.{c}: {g.dtype} vs {w.dtype}"
        assert g.null_count() == w.null_count() and (g.is_null() == w.is_null()).all(), f"{what}.{c} nulls"
        if w.dtype.is_float():
            # sums of fractional replica loads may be added in another order: last-bit differences only
            np.testing.assert_allclose(g.drop_nulls().to_numpy(), w.drop_nulls().to_numpy(), rtol=1e-12,
                                       atol=0, err_msg=f"{what}.{c}")
        else:
            assert g.to_list() == w.to_list(), f"{what}.{c}"
