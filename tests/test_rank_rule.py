"""One rank rule for replicas without a recorded placement, in SQL and in the replay.

A run with 8 experts on 12 slots over 4 ranks that records no placement: both the metric
views (``layer_skew``) and ``replay --plan recorded`` take vLLM's initial map (slot i holds
expert i mod 8, slot i on rank i // 3; a replicated expert's tokens split evenly over its
two slots), so they give the same imbalance, worked out here by hand."""
from __future__ import annotations

import pytest

from moetrace.run import Store

from .helpers import run_row

E, S, R = 8, 12, 4
# slot -> expert: 0 1 2 | 3 4 5 | 6 7 0 | 1 2 3  (experts 0-3 have two slots, 4-7 one)
STEPS = {
    0: [8, 4, 4, 4, 2, 2, 2, 2],   # ranks: 4+2+2=8, 2+2+2=6, 2+2+4=8, 2+2+2=6 -> max 8 / mean 7
    1: [0, 0, 0, 0, 6, 0, 0, 0],   # ranks: 0, 6, 0, 0 -> max 6 / mean 1.5 = 4
}
BY_HAND = [8 / 7, 4.0]


def _run(tmp_path) -> tuple[Store, str]:
    st = Store(tmp_path / "st", create=True)
    cols = {"step": [], "layer": [], "expert": [], "tokens": [], "slot": [], "src_rank": []}
    for step, toks in STEPS.items():
        for e, t in enumerate(toks):
            for k, v in (("step", step), ("layer", 0), ("expert", e), ("tokens", t), ("slot", None),
                         ("src_rank", None)):
                cols[k].append(v)
    run = run_row(num_experts=E, num_ranks=R, num_slots=S, top_k=1)
    return st, st.write_run(run, {"expert_load": cols}, run_id="r").run_id


def test_sql_and_replay_place_unrecorded_replicas_alike(tmp_path):
    st, rid = _run(tmp_path)
    sql = st.sql("SELECT step, imbalance, placement_source FROM layer_skew WHERE run_id = ? ORDER BY step", [rid])
    assert set(sql["placement_source"]) == {"contiguous"}
    assert sql["imbalance"].to_list() == pytest.approx(BY_HAND)
    mean_sql = st.sql("SELECT avg(imbalance) FROM layer_skew WHERE run_id = ?", [rid]).item()
    assert mean_sql == pytest.approx(sum(BY_HAND) / 2)
    res = st.run(rid).replay("recorded", write=False).to_dict()
    assert res["num_steps"] == 2
    assert res["mean_imbalance"] == pytest.approx(sum(BY_HAND) / 2)
    rl = st.sql("SELECT step, rank, tokens FROM rank_load WHERE run_id = ? ORDER BY step, rank", [rid])
    assert rl.filter(rl["step"] == 0)["tokens"].to_list() == pytest.approx([8, 6, 8, 6])


def test_store_is_a_context_manager(tmp_path):
    st, rid = _run(tmp_path)
    with Store(st.path) as again:
        assert again.run_ids() == [rid]
        assert again.sql("SELECT count(*) FROM runs").item() == 1
    assert again._con is None
