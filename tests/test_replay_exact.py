"""The exact half of a replay's answer (no time model): the per-layer straggler rank and its
tokens, recorded vs plan, computed by hand with numpy on a tiny hand-made run (20 steps,
2 layers, 8 experts, 4 ranks) and compared with replay --json, sweep --format json and the
facade; the load verdict can say "pays off"; the time band is the GPU cost model's."""
import json

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from moetrace.cli import cli
from moetrace.run import Store

from .helpers import make_store, module_fixture, run_row

T, L, E, R = 20, 2, 8, 4
LOAD_SCHEMA = pa.schema([("step", pa.int64()), ("layer", pa.int32()), ("expert", pa.int32()), ("slot", pa.int32()),
                         ("src_rank", pa.int32()), ("tokens", pa.int64())])
#: the plan: each rank pairs a hot expert with a cold one (recorded: contiguous, experts 0 and 1 on rank 0)
PHY2LOG = [[0, 7, 1, 6, 2, 5, 3, 4], [0, 7, 1, 6, 2, 5, 3, 4]]


def _load():
    rng = np.random.default_rng(11)
    base = np.array([90, 80, 40, 35, 20, 15, 10, 5])
    return base[None, None, :] + rng.integers(0, 30, (T, L, E))


@module_fixture
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("exact") / "st"
    tok = _load()
    n = T * L * E
    rows = {"step": np.repeat(np.arange(T), L * E), "layer": np.tile(np.repeat(np.arange(L), E), T),
            "expert": np.tile(np.arange(E), T * L), "slot": [None] * n, "src_rank": [None] * n, "tokens": tok.ravel()}
    run = run_row(source="tiny", source_sha256="e" * 64, num_layers=L, num_experts=E, top_k=2, hidden=16,
                  dtype_bytes=2, expert_bytes=1000, num_ranks=R, ranks_per_node=2, num_slots=E)
    make_store(path, run, {"expert_load": pa.table(rows, schema=LOAD_SCHEMA)}, run_id="tiny")
    plan_file = path.parent / "plan.json"
    plan_file.write_text(json.dumps({"physical_to_logical_map": PHY2LOG}))
    r = CliRunner().invoke(cli, ["plan", str(path), "--import", str(plan_file), "--plan-id", "pair"])
    assert r.exit_code == 0, r.output
    return path, tok


def _by_hand(tok, phy2log, steps):
    """Per layer: (straggler rank mode, mean and p99 of the straggler's tokens) over ``steps``."""
    p = np.asarray(phy2log)
    out = []
    for li in range(L):
        rank_tok = tok[steps, li][:, p[li]].reshape(len(steps), R, E // R).sum(axis=2)   # [steps, ranks]
        mx, arg = rank_tok.max(axis=1), rank_tok.argmax(axis=1)
        out.append((int(np.bincount(arg).argmax()), float(mx.mean()), float(np.percentile(mx, 99)),
                    float((mx / rank_tok.mean(axis=1)).mean())))
    return out


def _check_layers(rows, tok, plan_p2l, steps):
    rec = _by_hand(tok, [list(range(E))] * L, steps)
    new = _by_hand(tok, plan_p2l, steps)
    for row, (rr, rm, rp, ri), (pr, pm, pp, pi) in zip(rows, rec, new):
        assert row["recorded_straggler_rank"] == rr and row["plan_straggler_rank"] == pr
        assert row["recorded_straggler_tokens_mean"] == pytest.approx(rm)
        assert row["recorded_straggler_tokens_p99"] == pytest.approx(rp)
        assert row["plan_straggler_tokens_mean"] == pytest.approx(pm)
        assert row["plan_straggler_tokens_p99"] == pytest.approx(pp)
        assert row["recorded_max_over_mean"] == pytest.approx(ri)
        assert row["plan_max_over_mean"] == pytest.approx(pi)
    return rec, new


def test_replay_states_the_straggler_exactly_and_the_load_verdict_pays_off(tiny):
    path, tok = tiny
    r = CliRunner().invoke(cli, ["replay", str(path), "--plan", "pair", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    ld = d["load"]
    rec, new = _check_layers(ld["layers"], tok, PHY2LOG, np.arange(T))
    assert rec[0][0] == 0                                        # experts 0 and 1 share rank 0: it straggles
    assert ld["recorded_straggler_tokens_mean"] == pytest.approx(np.mean([x[1] for x in rec]))
    assert ld["straggler_tokens_mean"] == pytest.approx(np.mean([x[1] for x in new]))
    assert ld["exact"] is True and ld["steps"] == f"steps 0-{T - 1}"
    assert d["load_verdict"] == "pays off" and ld["reason"].startswith("straggler tokens cut from")
    # the facade returns the same figures (one definition)
    from moetrace.replay.results import load_answer

    res = Store(path).run("tiny").replay("pair", write=False)
    la = load_answer(res.judged)
    assert la.verdict == "pays off" and res.load.to_dict() == la.to_dict()
    _check_layers(la.layers(), tok, PHY2LOG, np.arange(T))
    # the human output prints the exact half before the modelled time
    r = CliRunner().invoke(cli, ["replay", str(path), "--plan", "pair"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.index("load (exact, no time model): pays off") < out.index("modelled time")
    assert f"layer 0: straggler rank {rec[0][0]}" in out


def test_time_band_is_the_gpu_cost_models_band(tiny):
    from moetrace import costmodel

    path, _ = tiny
    r = CliRunner().invoke(cli, ["replay", str(path), "--plan", "pair", "--hardware", "H800", "--json"])
    d = json.loads(r.output)
    pre = costmodel.preset("H800")["regimes"]
    assert d["error_band"]["rel"] == pytest.approx(max(pre["gemm_grouped"]["band"], pre["a2a_normal"]["band"]))
    assert "uncalibrated" not in d["error_band"]["source"] and "H800, validated" in d["error_band"]["source"]
    r = CliRunner().invoke(cli, ["replay", str(path), "--plan", "pair", "--hardware", "H200", "--json"])
    d = json.loads(r.output)
    assert "not validated on H200/gemm_grouped" in d["error_band"]["source"]
    assert "uncalibrated" not in d["verdict_reason"]


def test_sweep_rows_carry_the_exact_straggler_tokens(tiny):
    from moetrace.replay.load import read_shape
    from moetrace.replay.results import ReplayOptions
    from moetrace.replay.sweep import finish_sweep, plan_sweep, run_sweep_cells

    path, tok = tiny
    st = Store(path)
    shape = read_shape(st, "tiny")
    job = plan_sweep(st, "tiny", shape, "greedy", [0], [], [8], ReplayOptions(fit_cost=False))
    cells = run_sweep_cells(st, job)
    res = finish_sweep(st, job, cells)
    steps = np.arange(8, T)
    row, judged = res.rows[0], cells[0].judged
    rec = _by_hand(tok, [list(range(E))] * L, steps)
    new = _by_hand(tok, judged.plan.phy2log.tolist(), steps)
    assert row.recorded_straggler_tokens == pytest.approx(np.mean([x[1] for x in rec]))
    assert row.straggler_tokens == pytest.approx(np.mean([x[1] for x in new]))
    assert row.load_verdict == ("pays off" if row.straggler_tokens < row.recorded_straggler_tokens else
                                "does not pay off")
    # the command prints the same figures
    r = CliRunner().invoke(cli, ["sweep", str(path), "--policy", "greedy", "--replicas", "0", "--window", "8",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    got = got[0] if isinstance(got, list) else got
    assert got["recorded_straggler_tokens"] == pytest.approx(row.recorded_straggler_tokens)
    assert got["straggler_tokens"] == pytest.approx(row.straggler_tokens)
