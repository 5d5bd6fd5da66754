"""Live capture from tiny randomly initialized transformers MoE models (no downloads): the
captured top-k and gates are checked against an independent numpy recomputation from the
router logits the model itself reports (output_router_logits=True)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="capture needs PyTorch (pip install 'moetrace[capture]')")
pytest.importorskip("transformers", reason="capture needs transformers (pip install 'moetrace[capture]')")

from moetrace.produce.capture import TINY, capture, tiny_model  # noqa: E402
from moetrace.run import Store  # noqa: E402

K = 2


def _softmax(x):
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def expected_routing(arch: str, logits: np.ndarray, router, config) -> tuple[np.ndarray, np.ndarray]:
    """(experts [T, K], gates [T, K]) from the logits, written from each model's routing rule."""
    logits = logits.astype(np.float64)
    if arch == "deepseek_v3":
        scores = 1.0 / (1.0 + np.exp(-logits))
        bias = router.e_score_correction_bias.detach().numpy().astype(np.float64)
        choice = scores + bias
        T, E = choice.shape
        G, TG = config.n_group, config.topk_group
        grouped = choice.reshape(T, G, E // G)
        gscore = np.sort(grouped, axis=-1)[:, :, -2:].sum(-1)
        keep = np.argsort(-gscore, axis=-1, kind="stable")[:, :TG]
        mask = np.zeros((T, G), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        masked = np.where(np.repeat(mask, E // G, axis=1), choice, -np.inf)
        idx = np.argsort(-masked, axis=-1, kind="stable")[:, :K]
        w = np.take_along_axis(scores, idx, axis=1)
        if config.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return idx, w * config.routed_scaling_factor
    p = _softmax(logits)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    w = np.take_along_axis(p, idx, axis=1)
    norm = True if arch == "mixtral" else bool(getattr(config, "norm_topk_prob", False))
    if norm:
        w = w / w.sum(-1, keepdims=True)
    return idx, w


@pytest.mark.parametrize("arch", TINY)
def test_captured_topk_matches_recomputation(arch):
    model = tiny_model(arch, seed=1, top_k=K)
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(5))
    with capture(model) as cap, torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    r = cap.routing().to_pydict()
    T = ids.numel()
    assert len(cap.routers) == 2 and cap.top_k == K and cap.num_experts == 8
    assert len(r["step"]) == T * K * 2
    for li, (layer, _name, router) in enumerate(cap.routers):
        logits = out.router_logits[li].detach().float().numpy().reshape(T, -1)
        want_idx, want_w = expected_routing(arch, logits, router, model.config)
        sel = [i for i, lay in enumerate(r["layer"]) if lay == layer]
        got_e = np.array([r["expert"][i] for i in sel]).reshape(T, K)
        got_g = np.array([r["gate"][i] for i in sel]).reshape(T, K)
        tok = np.array([r["token"][i] for i in sel]).reshape(T, K)
        assert (tok == np.arange(T)[:, None]).all()
        # same expert sets per token (DeepSeek returns them unsorted), and the same gate per expert
        order_got = np.argsort(got_e, axis=1)
        order_want = np.argsort(want_idx, axis=1)
        np.testing.assert_array_equal(np.take_along_axis(got_e, order_got, 1),
                                      np.take_along_axis(want_idx, order_want, 1))
        np.testing.assert_allclose(np.take_along_axis(got_g, order_got, 1),
                                   np.take_along_axis(want_w, order_want, 1), rtol=2e-3, atol=1e-5)
    # routing is not degenerate: several experts are used
    assert len(set(r["expert"])) >= 4


def test_steps_load_and_store(tmp_path):
    model = tiny_model("olmoe", seed=2, top_k=K)
    a = torch.randint(0, 256, (2, 6))
    with capture(model) as cap, torch.no_grad():
        model(input_ids=a)
        model(input_ids=a[:, :1])
    st = Store(tmp_path / "st", create=True)
    rid = cap.write(st).run_id
    run = st.run_row(rid)
    assert (run["num_layers"], run["num_experts"], run["top_k"], run["hidden"], run["num_ranks"]) == (2, 8, K, 32, 1)
    steps = st.sql("SELECT step, phase, num_tokens FROM steps WHERE run_id = ? ORDER BY step", [rid])
    assert steps.rows() == [(0, "prefill", 12), (1, "decode", 2)]
    # expert_load is the routing counted by hand
    rt = st.sql("SELECT step, layer, expert FROM routing WHERE run_id = ?", [rid])
    want = {}
    for s, layer, e in rt.iter_rows():
        want[(s, layer, e)] = want.get((s, layer, e), 0) + 1
    got = st.sql("SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = ? AND tokens > 0", [rid])
    assert {(s, layer, e): t for s, layer, e, t in got.iter_rows()} == want
    assert sum(want.values()) == (12 + 2) * K * 2


def test_cli_capture_tiny(tmp_path, runner, cli):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\nmixture of experts\n\nrouting\n")
    res = runner.invoke(cli, ["capture", str(tmp_path / "st"), "--tiny", "mixtral", "--prompts", str(prompts),
                              "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output
    # progress on stderr (one line per batch: 3 prompts in one batch, a prefill and 2 decode passes)
    assert "capture: 3 of 3 prompts, 3 forward passes recorded" in res.stderr and "capture:" not in res.stdout
    st = Store(tmp_path / "st")
    rid = st.run_ids()[0]
    steps = st.sql("SELECT step, phase, num_tokens FROM steps WHERE run_id = ? ORDER BY step", [rid])
    longest = len("mixture of experts")
    assert steps.rows() == [(0, "prefill", 3 * longest), (1, "decode", 3), (2, "decode", 3)]
    n = st.sql("SELECT count(*) n FROM routing WHERE run_id = ?", [rid])["n"][0]
    assert n == (3 * longest + 3 + 3) * K * 2


def test_cli_capture_needs_one_model(tmp_path, runner, cli):
    prompts = tmp_path / "p.txt"
    prompts.write_text("x\n")
    res = runner.invoke(cli, ["capture", str(tmp_path / "st"), "--prompts", str(prompts)])
    assert res.exit_code == 2 and "exactly one" in res.output
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    res = runner.invoke(cli, ["capture", str(tmp_path / "st"), "--tiny", "olmoe", "--prompts", str(empty)])
    assert res.exit_code == 2 and "no prompts" in res.output
