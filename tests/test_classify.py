"""The one kernel classifier: a table of real kernel names (and their CPU ops) with the
kind each must get, name normalization across profilers, and user rule files."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from moetrace.domain.kernels import Classifier, classify, normalize_collective, normalize_name
from moetrace.errors import InputError


@dataclass
class Case:
    name: str
    kind: str
    collective: str | None = None
    category: str | None = None


CASES = [
    # DeepEP v1 (intranode, internode, low latency) and layout
    Case("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*)", "dispatch"),
    Case("void deep_ep::intranode::combine<__nv_bfloat16, 8, 768, 4096>(...)", "combine"),
    Case("void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int)", "a2a_other"),
    Case("void deep_ep::intranode::cached_notify_dispatch<8>(void**, int)", "a2a_other"),
    Case("void deep_ep::intranode::cached_notify_combine<8>(void**, int)", "a2a_other"),
    Case("void deep_ep::internode::dispatch<false, 8, true, 8>(int4*)", "dispatch"),
    Case("void deep_ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*)", "combine"),
    Case("void deep_ep::internode::get_dispatch_layout<256, 32, 8>(long const*, int*)", "compute_other"),
    Case("void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*)", "compute_other"),
    Case("void deep_ep::internode_ll::dispatch<true, 3, 7168>(void*, float*)", "dispatch"),
    Case("void deep_ep::internode_ll::combine<false, 3, 7168, 9>(void*)", "combine"),
    Case("void deep_ep::internode_ll::clean_low_latency_buffer<32>(int*, int)", "a2a_other"),
    # DeepEP v2, AMD fork, DeepSeek internal
    Case("void deep_ep::legacy::intranode::dispatch<8, 768>(int4*)", "dispatch"),
    Case("void deep_ep::elastic::dispatch_impl<128>(void*)", "dispatch"),
    Case("void deep_ep::elastic::combine_impl<128>(void*)", "combine"),
    Case("void deep_ep::elastic::hybrid_dispatch<1>(void*)", "dispatch"),
    Case("void deep_ep::elastic::hybrid_combine<1>(void*)", "combine"),
    Case("void primus_turbo::deep_ep::intranode::dispatch<8>(int4*)", "dispatch"),
    Case("void dpsk::ep::internode::dispatch<false, 8, false, 8>(int4*, float*)", "dispatch"),
    Case("void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*)", "combine"),
    Case("void dpsk::ep::internode::notify_dispatch<false, 8>(int const*)", "a2a_other"),
    Case("void dpsk::ep::internode::cached_notify<false>(int, int, int)", "a2a_other"),
    Case("void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*)", "compute_other"),
    # NCCL old and new: SendRecv is an all-to-all only when its CPU op says so
    Case("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "a2a",
         "nccl:all_to_all"),
    Case("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "comm_other",
         "nccl:all_reduce"),
    Case("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "comm_other", None),
    Case("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "a2a", "all_to_allv"),
    Case("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "a2a", "c10d::alltoall_base_"),
    Case("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "comm_other", "nccl:_all_gather_base"),
    Case("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm_other"),
    Case("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "comm_other"),
    # host collective of a CPU-only run
    Case("gloo:all_to_all", "a2a"),
    # pplx, FlashInfer / TRT-LLM
    Case("void (anonymous namespace)::dispatchKernel<unsigned short, 16>(int*, unsigned long)", "dispatch"),
    Case("void (anonymous namespace)::combineKernel<__nv_bfloat16, unsigned short>(void*)", "combine"),
    Case("void tensorrt_llm::kernels::moe_comm::moeA2ADispatchKernel<__nv_bfloat16, 8>(int)", "dispatch"),
    Case("void tensorrt_llm::kernels::moe_comm::moeA2ACombineKernel<__nv_bfloat16, 8>(int)", "combine"),
    Case("void tensorrt_llm::kernels::moe_comm::moeA2APrepareDispatchKernel(int)", "a2a_other"),
    Case("void tensorrt_llm::kernels::moe_comm::moeA2ASanitizeExpertIdsKernel(int)", "a2a_other"),
    # expert GEMMs and fused MoE
    Case("void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(Params)", "expert_gemm"),
    # its helper kernels are not expert GEMMs
    Case("void dpsk::grouped_gemm::cuda::utils::transpose<__nv_bfloat16, 64>(__nv_bfloat16 const*, int)",
         "compute_other"),
    Case("void dpsk::grouped_gemm::cuda::utils::fill_tensormaps_kernel<128>(CUtensorMap*, int const*)",
         "compute_other"),
    Case("fused_moe_kernel", "expert_gemm"),
    Case("_matmul_ogs_NNT_bf16xbf16xmxfp4_128x128x128x1_swiglu", "expert_gemm"),
    Case("void deep_gemm::fp8_gemm_kernel<m_grouped_masked>(...)", "expert_gemm"),
    # attention
    Case("void flash::compute_attn_ws<Flash_fwd_kernel_traits<192, 128>>(Params)", "attention"),
    Case("void cutlass::device_kernel<flash::FlashAttnBwd<flash::CollectiveMainloopBwd<2>>>(Params)", "attention"),
    Case("kernel_unified_attention_2d", "attention"),
    Case("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>(...)", "attention"),
    # other compute, copies
    Case("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)", "compute_other"),
    Case("Memcpy DtoD (Device -> Device)", "memcpy", None, "gpu_memcpy"),
    Case("Memset (Device)", "memset", None, "gpu_memset"),
    Case("anything at all", "memcpy", None, "gpu_memcpy"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}:{c.name[:40]}:{c.collective}" for c in CASES])
def test_kernel_table(case):
    assert classify(case.name, case.collective, case.category) == case.kind


@pytest.mark.parametrize("nsight,kineto", [
    ("void deep_ep::internode_ll::dispatch<(bool)1, (int)3, (int)7168>(void *, float *)",
     "void deep_ep::internode_ll::dispatch<true, 3, 7168>(void *, float *)"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<(unsigned long)4096>)",
     "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"),
    ("void  f<(unsigned int)7,   (long)2>(int)", "void f<7u, 2l>(int)"),
])
def test_nsight_and_kineto_demangling_normalize_alike(nsight, kineto):
    assert normalize_name(nsight) == normalize_name(kineto)
    assert not normalize_name(kineto).startswith("void ")


def test_normalized_nsight_name_classifies_like_kineto():
    assert classify("void deep_ep::internode_ll::combine<(bool)0, (int)3>(void *)") == "combine"


@pytest.mark.parametrize("text,canon", [
    ("nccl:all_to_all", "all_to_all"), ("nccl:all_to_allv", "all_to_all"), ("c10d::alltoall_base_", "all_to_all"),
    ("gloo:all_to_all", "all_to_all"), ("allreduce", "all_reduce"), ("nccl:_all_gather_base", "all_gather"),
    ("nccl:reduce_scatter", "reduce_scatter"), (None, None), ("", None),
])
def test_collective_names(text, canon):
    assert normalize_collective(text) == canon


def test_user_rules_csv_come_first(tmp_path):
    f = tmp_path / "rules.csv"
    f.write_text("kind,pattern,collective,comment\n"
                 "dispatch,^my_ep::send_tokens,,our in-house dispatch\n"
                 "combine,^my_ep::recv_tokens,,\n"
                 "expert_gemm,per_token_cast_to_fp8,,override a built-in compute_other\n")
    c = Classifier(f)
    assert c.classify("void my_ep::send_tokens<4>(int)") == "dispatch"
    assert c.classify("my_ep::recv_tokens(int)") == "combine"
    assert c.classify("void cuda::per_token_cast_to_fp8_with_channels<128>(int)") == "expert_gemm"
    assert classify("void my_ep::send_tokens<4>(int)") == "compute_other"  # the built-in table is unchanged


def test_user_rules_json_with_collective(tmp_path):
    f = tmp_path / "rules.json"
    f.write_text(json.dumps([{"kind": "a2a", "pattern": "^myccl_kernel", "collective": "all_to_all"}]))
    c = Classifier(f)
    assert c.classify("myccl_kernel_v2", "nccl:all_to_all") == "a2a"
    assert c.classify("myccl_kernel_v2", "nccl:all_reduce") == "compute_other"


@pytest.mark.parametrize("text,where", [
    ("kind,pattern\nteleport,^x\n", "rule 1"),
    ("kind,pattern\ndispatch,([unclosed\n", "rule 1"),
    ("kind,pattern\ncombine,^ok\ndispatch,\n", "rule 2"),
    ("name,regex\ndispatch,^x\n", None),
])
def test_bad_user_rules_name_the_file(tmp_path, text, where):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(InputError) as ei:
        Classifier(f)
    assert str(f) in str(ei.value)
    if where:
        assert where in str(ei.value)
