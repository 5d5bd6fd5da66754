"""Steps of a GPU trace are the steps' GPU activity, not CPU start to last kernel end.

The GPU runs behind the host: kernels launched inside ProfilerStep#N often run while the
CPU is already in step N+1. Crafted traces with a known lag give the windows by hand;
the real multi-rank trace checks that summed step time never exceeds the trace span."""
from __future__ import annotations

import pytest

from moetrace.run import Store

from .helpers import shared_data
from .helpers.kineto_trace import ev_x, kernel, launch, write_trace

GEMM = "void cutlass::device_kernel<grouped_gemm::Kernel>(Params)"
DISPATCH = "void deep_ep::intranode::dispatch<8>(int4*)"


def _ingest(runner, cli, tmp_path, events):
    p = write_trace(tmp_path / "t.json", events, rank=0, world=1)
    res = runner.invoke(cli, ["ingest", str(p), "--store", str(tmp_path / "st")])
    assert res.exit_code == 0, res.output
    return Store(tmp_path / "st")


def test_gpu_lagging_the_cpu_gives_disjoint_gpu_windows(tmp_path, runner, cli):
    # CPU: step 1 = [0, 100) us, step 2 = [100, 200) us. Step 1 launches at 10 and 50 us but
    # its kernels run 150..260 and 260..300; step 2 launches at 110, its kernel runs 300..400.
    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 100), ev_x("user_annotation", "ProfilerStep#2", 100, 100),
          launch(10, 1), launch(50, 2), launch(110, 3),
          kernel(GEMM, 150, 110, 1), kernel(GEMM, 260, 40, 2), kernel(GEMM, 300, 100, 3)]
    st = _ingest(runner, cli, tmp_path, ev)
    steps = st.sql("SELECT step, start_ns, end_ns FROM steps ORDER BY step").rows()
    assert steps == [(1, 150_000, 300_000), (2, 300_000, 400_000)]
    host = st.sql("SELECT step, start_ns, end_ns, gpu_lag_ns FROM host_steps ORDER BY step").rows()
    assert host == [(1, 0, 100_000, 200_000), (2, 100_000, 200_000, 200_000)]
    # by hand: the CPU-start-to-last-kernel windows would be [0, 300) and [100, 400): 600 us for 400 us
    total = sum(b - a for _, a, b in steps)
    assert total == 250_000 <= 400_000 - 150_000
    approx = st.sql("SELECT approximations FROM runs")["approximations"][0]
    assert "GPU windows" in approx and "200.0 ms" not in approx and "0.2 ms" in approx


def test_a_kernel_running_past_the_next_steps_first_kernel_is_not_counted_twice(tmp_path, runner, cli):
    # step 1's dispatch on stream 20 runs 280..350; step 2's first kernel starts at 300
    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 100), ev_x("user_annotation", "ProfilerStep#2", 100, 100),
          launch(10, 1), launch(20, 2), launch(110, 3),
          kernel(GEMM, 150, 100, 1), kernel(DISPATCH, 280, 70, 2, stream=20), kernel(GEMM, 300, 100, 3)]
    st = _ingest(runner, cli, tmp_path, ev)
    steps = st.sql("SELECT step, start_ns, end_ns FROM steps ORDER BY step").rows()
    assert steps == [(1, 150_000, 350_000), (2, 350_000, 400_000)]
    assert "0.050 ms" in st.sql("SELECT approximations FROM runs")["approximations"][0]


def test_real_two_rank_trace_steps_tile_the_gpu_time(tmp_path, runner, cli):
    d = shared_data("nccl_a2a_2rank")
    res = runner.invoke(cli, ["ingest", str(d), "--store", str(tmp_path / "st")])
    assert res.exit_code == 0, res.output
    st = Store(tmp_path / "st")
    for rank in (0, 1):
        s = st.sql("SELECT start_ns, end_ns FROM steps WHERE rank = ? ORDER BY step", [rank]).rows()
        g = st.sql("SELECT min(start_ns), max(end_ns) FROM spans WHERE rank = ? AND device >= 0", [rank]).rows()[0]
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(s, s[1:]))          # disjoint, in order
        assert sum(b - a for a, b in s) <= g[1] - g[0]                      # summed step time <= trace span
        assert s[0][0] == g[0] and s[-1][1] == g[1]                          # first/last kernel bound the steps


@pytest.mark.parametrize("name", ["deepseek_ep64_train_rank0.json.gz", "vllm_moe_piecewise_prefill_decode.json.gz",
                                  "sglang_dense_decode.json.gz"])
def test_single_file_real_traces_steps_within_span(tmp_path, runner, cli, name):
    p = shared_data(name)
    res = runner.invoke(cli, ["ingest", str(p), "--store", str(tmp_path / "st")])
    assert res.exit_code == 0, res.output
    st = Store(tmp_path / "st")
    s = st.sql("SELECT start_ns, end_ns FROM steps ORDER BY step").rows()
    g = st.sql("SELECT min(start_ns), max(end_ns) FROM spans").rows()[0]
    assert sum(b - a for a, b in s) <= g[1] - g[0]
