"""Kernel classes by base name and role: name rules read a kernel's own name, not its
template arguments; MoE plumbing (top-k, softmax, permute, gather / scatter, finalize) is
moe_other; the router's gate GEMM is told apart from the experts' GEMMs. Checked on the
real traces in ../shared/data and on a real torch.profiler run of a tiny MoE module on CPU,
against counts made here independently (names listed by hand, the module's structure)."""
from __future__ import annotations

import gzip
import json
import re

import pytest

from moetrace.domain.kernels import Classifier, base_name, normalize_name
from moetrace.run import Store

from .helpers import shared_data
from .helpers.kineto_trace import ev_x, kernel, launch, write_trace

FINALIZE = ("void moe::dev::finalize::finalizeKernelVecLoad<moe::dev::finalize::KernelParams<cutlass::bfloat16_t, "
            "float, 8>>(moe::dev::finalize::KernelParams<cutlass::bfloat16_t, float, 8>)")
NVJET = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN"


def test_base_name_drops_template_arguments_but_keeps_a_launchers_kernel():
    assert base_name(normalize_name(FINALIZE)) == "moe::dev::finalize::finalizeKernelVecLoad"
    assert base_name("cutlass::device_kernel<flash::FlashAttnBwd<int>>(Params)") == \
        "cutlass::device_kernel<flash::FlashAttnBwd<int>>"
    assert base_name("(anonymous namespace)::dispatchKernel<4>(int)") == "(anonymous namespace)::dispatchKernel"
    assert base_name("operator<broken") == "operator<broken"       # unbalanced: whole


def test_roles_under_moe_ranges():
    c = Classifier()
    # the finalize kernel names cutlass only in a template argument: MoE plumbing, not a GEMM
    assert c.classify_how(FINALIZE, context=("vllm::moe_forward",)) == ("moe_other", "name")
    assert c.classify_how(NVJET, context=("router", "vllm::moe_forward")) == ("moe_other", "context")
    assert c.classify_how(NVJET, context=("mlp.gate",)) == ("moe_other", "context")
    # gate_up_proj is the experts' own weight, not the router
    assert c.classify_how(NVJET, context=("gate_up_proj", "experts")) == ("expert_gemm", "context")
    assert c.classify_how(NVJET, context=("expert_ffn",)) == ("expert_gemm", "context")
    assert c.classify_how("at::native::vectorized_gather_kernel<16, long>(char*)", context=("experts",)) == \
        ("moe_other", "context")
    assert c.classify_how("at::native::vectorized_gather_kernel<16, long>(char*)") == ("compute_other", "default")


def test_crafted_trace_finalize_and_gate_are_not_expert_gemms(tmp_path, runner, cli):
    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 1000),
          ev_x("cpu_op", "vllm::moe_forward", 100, 400),
          ev_x("user_annotation", "router", 105, 40), launch(110, 1),
          launch(200, 2), launch(300, 3),
          kernel(NVJET, 500, 10, 1), kernel(NVJET, 520, 30, 2), kernel(FINALIZE, 560, 5, 3)]
    st = tmp_path / "st"
    assert runner.invoke(cli, ["ingest", str(write_trace(tmp_path / "t.json", ev)), "--store", str(st)]).exit_code == 0
    got = Store(st).sql("SELECT correlation, kind, classified_by FROM spans ORDER BY correlation").rows()
    assert got == [(1, "moe_other", "context"), (2, "expert_gemm", "context"), (3, "moe_other", "name")]


def _kernel_events(p):
    with gzip.open(p, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]


def _kinds(p, tmp_path, runner, cli):
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(p), "--store", str(st)])
    assert res.exit_code == 0, res.output
    return dict(Store(st).sql("SELECT kind, count(*) FROM spans GROUP BY kind").rows())


def test_vllm_trace_hand_counts(tmp_path, runner, cli):
    p = shared_data("vllm_moe_piecewise_prefill_decode.json.gz")
    ev = _kernel_events(p)
    # listed by hand from the trace: triton_kernels' matmul_ogs expert GEMMs and its routing kernels
    experts = {"_matmul_ogs_NNT_bf16xbf16xmxfp4_128x128x128x1", "_matmul_ogs_NNT_bf16xbf16xmxfp4_128x128x128x1_swiglu"}
    plumbing = {"_topk_forward", "_combined_routing_memset", "_combined_routing_compute", "_sum_bitmatrix_rows",
                "_finalize_matmul_scatter_bf16"}
    want_e = sum(e["name"] in experts for e in ev)
    want_m = sum(e["name"] in plumbing for e in ev)
    assert (want_e, want_m) == (48, 120)
    k = _kinds(p, tmp_path, runner, cli)
    assert (k.get("expert_gemm"), k.get("moe_other")) == (want_e, want_m)


def test_deepseek_trace_expert_gemms_equal_a_hand_count(tmp_path, runner, cli):
    p = shared_data("deepseek_ep64_train_rank0.json.gz")
    ev = _kernel_events(p)
    # DeepSeek's grouped GEMMs are CUTLASS launchers of dpsk::grouped_gemm kernels; the
    # grouped_gemm utils (transpose, tensor-map fill) do no GEMM work
    want = sum(1 for e in ev if re.match(r"(?:void )?cutlass::device_kernel<dpsk::grouped_gemm::", e["name"]))
    assert want > 0
    assert _kinds(p, tmp_path, runner, cli).get("expert_gemm") == want


E, D, H, K, T, ITERS = 4, 16, 32, 2, 8, 2


def _tiny_moe():
    import torch
    import torch.nn as nn
    from torch.profiler import record_function

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(D, E, bias=False)          # the router: N = number of experts
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
                                         for _ in range(E))

        def forward(self, x):
            with record_function("moe_block"):
                with record_function("router"):
                    w, idx = torch.topk(torch.softmax(self.gate(x), -1), K)
                out = torch.zeros_like(x)
                with record_function("experts"):
                    for e in range(E):
                        rows, slot = (idx == e).nonzero(as_tuple=True)
                        if rows.numel():
                            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
                return out

    return MoE


def test_real_torch_profiler_tiny_moe_on_cpu(tmp_path, runner, cli):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    m, x = _tiny_moe()(), torch.randn(T, D)
    with torch.no_grad():
        hit = len(torch.unique(torch.topk(torch.softmax(m.gate(x), -1), K).indices))   # experts given tokens
    trace = tmp_path / "tiny_moe_trace.json"
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        for i in range(ITERS):
            with record_function(f"ProfilerStep#{i}"):
                m(x)
    prof.export_chrome_trace(str(trace))
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(trace), "--store", str(st)])
    assert res.exit_code == 0, res.output
    rows = Store(st).sql("""SELECT k.name, s.kind, s.moe_context, count(*) AS n FROM spans s
                            JOIN kernel_names k USING (run_id, name_id) GROUP BY ALL""").rows()
    got = {}
    for _name, kind, _ctx, n in rows:
        got[kind] = got.get(kind, 0) + n
    # by the module's structure, per forward: the experts' two Linears per expert given tokens;
    # the gate Linear, softmax and top-k under the router; per expert given tokens, its token
    # gather (x[rows], w[rows, slot]: two aten::index), nonzero and index_add_ under experts
    assert got["expert_gemm"] == ITERS * 2 * hit
    assert got["moe_other"] == ITERS * (3 + 4 * hit)
    gate = [(kind, n) for name, kind, ctx, n in rows if name == "aten::linear" and ctx == "router"]
    assert gate == [("moe_other", ITERS)]
