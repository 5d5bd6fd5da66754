"""The router's gate GEMM told apart from the experts' GEMMs by its shape (output width N =
number of experts), with no router/gate range around it: on a real ``torch.profiler`` run
(``record_shapes=True``) of a tiny MoE on CPU, and on a crafted GPU trace whose GEMM ops
carry ``Input Dims`` as Kineto writes them."""
from __future__ import annotations

import pytest

from moetrace.collect._gemm_shape import gemm_out_n
from moetrace.run import Store

from .helpers.kineto_trace import ev_x, kernel, launch, write_trace

E, D, H, K, T, ITERS = 4, 16, 24, 2, 8, 2   # D, H != E: only the gate's width is E
NVJET = "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"


def test_gemm_out_n_follows_each_ops_signature():
    assert gemm_out_n("aten::linear", b"[[8, 16], [4, 16], []]") == 4
    assert gemm_out_n("aten::mm", b"[[8, 16], [16, 4]]") == 4
    assert gemm_out_n("aten::addmm", b"[[4], [8, 16], [16, 4]]") == 4
    assert gemm_out_n("aten::bmm", b"[[2, 8, 16], [2, 16, 4]]") == 4
    assert gemm_out_n("aten::baddbmm", b"[[2, 8, 4], [2, 8, 16], [2, 16, 4]]") == 4
    assert gemm_out_n("aten::matmul", b"[[3, 8, 16], [16, 4]]") == 4
    assert gemm_out_n("aten::matmul", b"[[16], [16]]") is None          # a dot product has no N
    assert gemm_out_n("aten::relu", b"[[8, 16]]") is None               # not a GEMM op
    assert gemm_out_n("aten::mm", b'[["x"]]') is None                   # malformed: no shape, no refusal


def _profile_tiny_moe(path, record_shapes=True):
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(D, E, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
                                         for _ in range(E))

        def forward(self, x):
            with record_function("moe"):   # one MoE range; no router / gate range around the gate
                w, idx = torch.topk(torch.softmax(self.gate(x), -1), K)
                out = torch.zeros_like(x)
                for e in range(E):
                    rows, slot = (idx == e).nonzero(as_tuple=True)
                    if rows.numel():
                        out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
                return out

    torch.manual_seed(0)
    m, x = MoE(), torch.randn(T, D)
    with torch.no_grad():
        hit = len(torch.unique(torch.topk(torch.softmax(m.gate(x), -1), K).indices))   # experts given tokens
    with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof, torch.no_grad():
        for i in range(ITERS):
            with record_function(f"ProfilerStep#{i}"):
                m(x)
    prof.export_chrome_trace(str(path))
    return hit


def _linear_kinds(runner, cli, trace, st, *opts):
    res = runner.invoke(cli, ["ingest", str(trace), "--store", str(st), *opts])
    assert res.exit_code == 0, res.output
    return dict(((k, b), n) for k, b, n in Store(st).sql(
        """SELECT s.kind, s.classified_by, count(*) FROM spans s JOIN kernel_names k USING (run_id, name_id)
           WHERE k.name = 'aten::linear' GROUP BY ALL""").rows())


def test_real_profiler_gate_without_router_range_is_told_by_shape(tmp_path, runner, cli):
    trace = tmp_path / "tiny_moe_shapes.json"
    hit = _profile_tiny_moe(trace)
    # by the module's structure, per forward: one gate Linear, two Linears per expert given tokens
    assert _linear_kinds(runner, cli, trace, tmp_path / "a", "--experts", str(E)) == {
        ("expert_gemm", "context"): ITERS * 2 * hit, ("moe_other", "shape"): ITERS}
    # without the number of experts the shape says nothing: the gate counts as an expert GEMM
    assert _linear_kinds(runner, cli, trace, tmp_path / "b") == {("expert_gemm", "context"): ITERS * (2 * hit + 1)}


def test_real_profiler_without_shapes_keeps_the_context_answer(tmp_path, runner, cli):
    trace = tmp_path / "tiny_moe_noshapes.json"
    hit = _profile_tiny_moe(trace, record_shapes=False)
    assert _linear_kinds(runner, cli, trace, tmp_path / "a", "--experts", str(E)) == {
        ("expert_gemm", "context"): ITERS * (2 * hit + 1)}


def test_gpu_kernel_takes_the_width_of_the_gemm_op_it_was_launched_under(tmp_path, runner, cli):
    # Kineto's nesting for nn.Linear on CUDA: aten::linear > aten::addmm (or aten::mm) >
    # cudaLaunchKernel; both ops carry Input Dims with record_shapes=True
    dims = {"gate": ([[T, D], [E, D], []], [[E], [T, D], [D, E]]),
            "expert": ([[T, D], [H, D], [H]], [[H], [T, D], [D, H]])}
    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 1000), ev_x("user_annotation", "moe", 10, 900)]
    for i, which in enumerate(("gate", "expert", "expert")):
        t0 = 100 + 200 * i
        lin, addmm = dims[which]
        ev += [ev_x("cpu_op", "aten::linear", t0, 50, **{"Input Dims": lin}),
               ev_x("cpu_op", "aten::addmm", t0 + 5, 40, **{"Input Dims": addmm}),
               launch(t0 + 10, i + 1), kernel(NVJET, t0 + 60, 20, i + 1)]
    ev.append(launch(800, 9))   # a launch after the GEMM ops ended: no width
    ev.append(kernel(NVJET, 850, 5, 9))
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(write_trace(tmp_path / "t.json", ev)), "--store", str(st),
                              "--experts", str(E)])
    assert res.exit_code == 0, res.output
    got = Store(st).sql("SELECT correlation, kind, classified_by FROM spans ORDER BY correlation").rows()
    assert got == [(1, "moe_other", "shape"), (2, "expert_gemm", "context"), (3, "expert_gemm", "context"),
                   (9, "expert_gemm", "context")]
