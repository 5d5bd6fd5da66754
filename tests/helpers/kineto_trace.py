"""Crafted Kineto (PyTorch profiler) traces: events as JSON text and the files that hold them."""
from __future__ import annotations

import gzip
import json
from pathlib import Path


# ---------------------------------------------------------------- crafted traces
def ev_x(cat, name, ts, dur, pid=100, tid=1, **args) -> str:
    """One complete event as JSON text; ``ts``/``dur`` are written verbatim (decimal text)."""
    a = json.dumps(args) if args else "{}"
    return (f'{{"ph": "X", "cat": "{cat}", "name": {json.dumps(name)}, "pid": {json.dumps(pid)}, '
            f'"tid": {json.dumps(tid)}, "ts": {ts}, "dur": {dur}, "args": {a}}}')


def kernel(name, ts, dur, corr, stream=7, device=0, **extra) -> str:
    return ev_x("kernel", name, ts, dur, pid=device, tid=stream, device=device, stream=stream, correlation=corr,
                **extra)


def launch(ts, corr, pid=100, tid=1) -> str:
    return ev_x("cuda_runtime", "cudaLaunchKernel", ts, 1, pid=pid, tid=tid, correlation=corr)


def write_trace(path: Path, events: list[str], rank: int | None = None, base: int | None = None,
                world: int | None = None, gz: bool = False) -> Path:
    head = ['"schemaVersion": 1']
    if rank is not None:
        head.append(f'"distributedInfo": {{"backend": "nccl", "rank": {rank}, "world_size": {world or 2}}}')
    if base is not None:
        head.append(f'"baseTimeNanoseconds": {base}')
    text = "{" + ", ".join(head) + ', "traceEvents": [\n' + ",\n".join(events) + "\n]}"
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


SENDRECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


GEMM = "void cutlass::device_kernel<grouped_gemm::Kernel>(Params)"
DISPATCH = "void deep_ep::intranode::dispatch<8>(int4*)"
COMBINE = "void deep_ep::intranode::combine<8>(int4*)"


def annotated_events() -> list[str]:
    """Step 3: annotated dispatch/combine of layer 5 + an all-reduce; step 4: two plain a2a."""
    return [
        ev_x("user_annotation", "ProfilerStep#3", 1000, 1000),
        ev_x("user_annotation", "moe dispatch layer 5", 1010, 100),
        ev_x("cpu_op", "c10d::alltoall_base_", 1020, 50),
        ev_x("cpu_op", "nccl:all_to_all", 1030, 30),
        launch(1040, 1),
        ev_x("user_annotation", "experts layer 5", 1120, 50),
        launch(1130, 2),
        ev_x("user_annotation", "combine layer 5", 1200, 100),
        ev_x("cpu_op", "nccl:all_to_all", 1210, 30),
        launch(1220, 3),
        ev_x("cpu_op", "nccl:all_reduce", 1400, 30),
        launch(1410, 4),
        kernel(SENDRECV, 1100, 50, 1, stream=20),
        kernel(GEMM, 1160, 100, 2, stream=7),
        kernel(SENDRECV, 1300, 40, 3, stream=20),
        kernel(SENDRECV, 1500, 70, 4, stream=20),
        ev_x("user_annotation", "ProfilerStep#4", 2000, 1000),
        ev_x("cpu_op", "nccl:all_to_all", 2010, 30),
        launch(2020, 5),
        ev_x("cpu_op", "nccl:all_to_all", 2110, 30),
        launch(2120, 6),
        kernel(SENDRECV, 2100, 50, 5, stream=20),
        kernel(SENDRECV, 2200, 60, 6, stream=20),
    ]


def ingest(runner, cli, st, *paths):
    """``moetrace ingest PATHS --store st`` through the click runner (exit 0), the Store."""
    from moetrace.run import Store

    res = runner.invoke(cli, ["ingest", *map(str, paths), "--store", str(st)])
    assert res.exit_code == 0, res.output
    return Store(st)
