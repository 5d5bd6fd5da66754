"""The GPU cost model checked on the GPU this runs on: one prepared script, under 5 minutes.

Where ``torch.cuda`` sees a GPU it times

* grouped expert GEMMs, the DeepSeek-V3 expert shape (hidden 7168, intermediate 2048):
  gate/up ``[m, 7168] x [7168, 4096]`` and down ``[m, 2048] x [2048, 7168]`` for 1..32
  experts and 1..8192 tokens per expert; BF16 as one batched launch (``torch.bmm``, the
  model's grouped GEMM) and FP8 where the GPU has it (``torch._scaled_mm``, one launch per
  expert, so modelled as that many one-group GEMMs), else FP8 is skipped with the reason;
* with two or more GPUs, a uniform all-to-all of FP8-sized token messages
  (``torch.distributed.all_to_all_single`` over NCCL) inside the node, against the
  normal-kernel model's NVLink term;

and prints, per row, the measured time, the model's time and its error next to the
preset's stated band. The fitted parameters come from DeepGEMM/DeepEP kernels on H800; a
different kernel library (cuBLAS, NCCL) or GPU is exactly what this measures.

    python benchmarks/gpu_costmodel_check.py --out benchmarks/results   # writes gpu_costmodel_<date>_<gpu>.md

Without a GPU it prints ``skipped: no GPU`` and exits 0.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetrace import costmodel  # noqa: E402
from moetrace.costmodel.a2a import A2AParams, normal_terms  # noqa: E402
from moetrace.costmodel.gemm import GemmParams, gemm_terms  # noqa: E402
from moetrace.costmodel.hardware import GPUS  # noqa: E402

HIDDEN, INTER = 7168, 2048
EXPERTS = (1, 4, 8, 32)
TOKENS = (1, 8, 64, 128, 256, 512, 1024, 4096, 8192)
MAX_ACT_BYTES = 2 ** 31          # skip shapes whose activations exceed 2 GiB (time and memory)


def hardware_of(name: str) -> str | None:
    for key in ("B200", "H200", "H100", "H800", "H20"):   # H200 before H20: the name contains both
        if key in name.upper():
            return key
    return None


def bench(fn, sync, iters: int = 10) -> float:
    fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def gemm_rows(torch, hw: str, deadline: float) -> list[dict]:
    params = GemmParams(**costmodel.fitted()["regimes"]["gemm_grouped"]["params"])
    band = costmodel.fitted()["regimes"]["gemm_grouped"]["band"]
    gpu = GPUS[hw]
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    fp8 = hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm") and "fp8" in gpu.tensor_flops \
        and torch.cuda.get_device_capability()[0] >= 9
    if not fp8:
        print("FP8 skipped: " + ("this GPU has no FP8 tensor math (compute capability < 9.0)"
                                 if torch.cuda.get_device_capability()[0] < 9 else "torch lacks _scaled_mm/float8"))
    rows = []
    for n, k in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        w = torch.randn(max(EXPERTS), n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        for e in EXPERTS:
            for m in TOKENS:
                if e * m * k * 2 > MAX_ACT_BYTES or time.monotonic() > deadline:
                    continue
                x = torch.randn(e, m, k, device=dev, dtype=torch.bfloat16)
                wt = w[:e].transpose(1, 2)
                t = bench(lambda x=x, wt=wt: torch.bmm(x, wt), sync)
                mod = gemm_terms(gpu, params, [m] * e, n, k, "bf16")["time_s"]
                rows.append(dict(kind="gemm", dtype="bf16", experts=e, m=m, n=n, k=k, measured_us=t * 1e6,
                                 model_us=mod * 1e6, band=band, launches=1))
                if fp8:
                    xq = x.to(torch.float8_e4m3fn)
                    wq = w[:e].to(torch.float8_e4m3fn)     # [e, n, k]: wq[i].t() is column-major as _scaled_mm wants
                    one = torch.ones((), device=dev)

                    def run_fp8(e=e, xq=xq, wq=wq, one=one):
                        for i in range(e):
                            torch._scaled_mm(xq[i], wq[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                    try:
                        t8 = bench(run_fp8, sync)
                    except (RuntimeError, TypeError) as exc:   # shape rules of the FP8 kernel (m % 16 and the like)
                        rows.append(dict(kind="gemm", dtype="fp8", experts=e, m=m, n=n, k=k, skipped=str(exc)[:80]))
                        continue
                    mod8 = e * gemm_terms(gpu, params, [m], n, k, "fp8")["time_s"]
                    rows.append(dict(kind="gemm", dtype="fp8", experts=e, m=m, n=n, k=k, measured_us=t8 * 1e6,
                                     model_us=mod8 * 1e6, band=band, launches=e))
                del x
        del w
        torch.cuda.empty_cache()
    return rows


def _a2a_worker(rank: int, world: int, tokens: int, top_k: int, q) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    msg = HIDDEN + HIDDEN // 128 * 4
    buf = torch.empty(tokens * top_k * msg, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(buf)
    t = bench(lambda: dist.all_to_all_single(out, buf), torch.cuda.synchronize, iters=20)
    ts = [None] * world
    dist.all_gather_object(ts, t)
    if rank == 0:
        q.put(max(ts))
    dist.destroy_process_group()


def a2a_rows(torch, hw: str) -> list[dict]:
    world = torch.cuda.device_count()
    if world < 2:
        print("all-to-all skipped: one GPU")
        return []
    import torch.multiprocessing as mp
    d = costmodel.fitted()["regimes"]["a2a_normal"]
    params = A2AParams(**d["params"])
    rows = []
    for tokens in (128, 4096):
        q = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_a2a_worker, args=(world, tokens, 8, q), nprocs=world, join=True)
        t = q.get()
        # a uniform all-to-all: every (token, expert) message moves, 1/world of them stays local
        m = normal_terms(GPUS[hw], A2AParams(params.latency_us, params.eff_rdma, params.eff_nvl), ep=world,
                         ranks_per_node=world, tokens=tokens, top_k=8, hidden=HIDDEN, dtype="fp8", topk_groups=None)
        nvl = tokens * 8 * (HIDDEN + HIDDEN // 128 * 4) * (1 - 1 / world)
        mod = params.latency_us * 1e-6 + nvl / (params.eff_nvl * GPUS[hw].nvlink_Bps)
        rows.append(dict(kind="a2a", dtype="fp8", experts=world, m=tokens, n=8, k=HIDDEN, measured_us=t * 1e6,
                         model_us=mod * 1e6, band=d["band"], launches=1, dedup_model_us=m["time_s"] * 1e6))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_costmodel_<date>_<gpu>.md")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new GEMM shapes after this")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: no GPU (torch is not installed)")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no GPU")
        return 0
    name = torch.cuda.get_device_name()
    hw = hardware_of(name)
    if hw is None:
        print(f"skipped: {name} is not one of the modelled GPUs ({', '.join(GPUS)})")
        return 0
    start = time.monotonic()
    rows = gemm_rows(torch, hw, start + a.budget_s) + a2a_rows(torch, hw)
    when = dt.datetime.now(dt.timezone.utc)
    lines = [f"# GPU cost model on {name} ({hw} preset), {when:%Y-%m-%d %H:%M} UTC", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s); "
             f"{time.monotonic() - start:.0f} s", "",
             "| kind | dtype | experts | tokens/expert | n | k | launches | measured us | model us | err | band |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['kind']} | {r['dtype']} | {r['experts']} | {r['m']} | {r['n']} | {r['k']} | | "
                         f"skipped: {r['skipped']} | | | |")
            continue
        err = r["model_us"] / r["measured_us"] - 1
        lines.append(f"| {r['kind']} | {r['dtype']} | {r['experts']} | {r['m']} | {r['n']} | {r['k']} | {r['launches']} | "
                     f"{r['measured_us']:,.1f} | {r['model_us']:,.1f} | {err:+.1%} | ±{r['band']:.0%} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"gpu_costmodel_{when:%Y-%m-%d}_{hw}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
