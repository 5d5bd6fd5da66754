"""The GPU cost model checked on the GPU this runs on: one prepared script, under 5 minutes.

Where ``torch.cuda`` sees a GPU it measures the inputs the model depends on:

* the **SM count** (``torch.cuda.get_device_properties().multi_processor_count``) against
  the preset's datasheet figure;
* **grouped expert GEMMs** over sizes, the DeepSeek-V3 expert shape (hidden 7168,
  intermediate 2048): gate/up ``[m, 7168] x [7168, 4096]`` and down ``[m, 2048] x
  [2048, 7168]`` for 1..32 experts and 1..8192 tokens per expert; BF16 as one batched launch
  (``torch.bmm``, the model's grouped GEMM) and FP8 where the GPU has it
  (``torch._scaled_mm``, one launch per expert, so modelled as that many one-group GEMMs);
* with two or more GPUs, **NCCL all-to-all** (``torch.distributed.all_to_all_single``) of
  FP8-sized token messages inside the node at several sizes and at several SM budgets
  (``NCCL_MAX_CTAS``: one CTA per SM), against the model's ``nccl`` kernel and its band;

and prints, per row, the measured time, the model's time, its error and the band the model
states for this GPU and kernel (validated or not). Nothing else needs it.

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
from moetrace.costmodel.a2a import A2AParams, time_terms  # noqa: E402
from moetrace.costmodel.gemm import GemmParams, gemm_terms  # noqa: E402
from moetrace.costmodel.hardware import GPUS  # noqa: E402

HIDDEN, INTER = 7168, 2048
EXPERTS = (1, 4, 8, 32)
TOKENS = (1, 8, 64, 128, 256, 512, 1024, 4096, 8192)
MAX_ACT_BYTES = 2 ** 31          # skip shapes whose activations exceed 2 GiB (time and memory)


def hardware_of(name: str) -> str | None:
    # longest names first: "GB200" contains "B200", "H200" contains "H20"
    for key in ("GB200", "B300", "B200", "H200", "H100", "H800", "H20", "MI355X", "MI300X"):
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
    band = costmodel.band(hw, "gemm_grouped")["band"]
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


def _a2a_worker(rank: int, world: int, sizes: tuple, ctas: int | None, q) -> None:
    if ctas:        # NCCL's SM budget for its kernels (one CTA per SM); set before NCCL starts
        os.environ["NCCL_MAX_CTAS"] = os.environ["NCCL_MIN_CTAS"] = str(ctas)
    import torch
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    msg = HIDDEN + HIDDEN // 128 * 4
    out_t = []
    for tokens in sizes:
        buf = torch.empty(tokens * 8 * msg // world * world, dtype=torch.uint8, device="cuda")
        out = torch.empty_like(buf)
        t = bench(lambda out=out, buf=buf: dist.all_to_all_single(out, buf), torch.cuda.synchronize, iters=20)
        ts = [None] * world
        dist.all_gather_object(ts, t)
        out_t.append(max(ts))
    if rank == 0:
        q.put(out_t)
    dist.destroy_process_group()


A2A_TOKENS = (128, 1024, 4096)
A2A_CTAS = (None, 4, 16, 32)     # None: NCCL's own choice


def a2a_rows(torch, hw: str) -> list[dict]:
    world = torch.cuda.device_count()
    if world < 2:
        print("all-to-all skipped: one GPU")
        return []
    import torch.multiprocessing as mp
    params = A2AParams(**costmodel.regime_params("nccl"))
    b = costmodel.band(hw, "nccl")
    rows = []
    for ctas in A2A_CTAS:
        q = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_a2a_worker, args=(world, A2A_TOKENS, ctas, q), nprocs=world, join=True)
        for tokens, t in zip(A2A_TOKENS, q.get()):
            # a uniform all-to-all of every (token, expert) message: 1/world of it stays on the GPU
            logical = tokens * 8 * (HIDDEN + HIDDEN // 128 * 4)
            moved = {"rdma_bytes": 0.0, "nvlink_bytes": logical * (1 - 1 / world), "logical_bytes": logical,
                     "routing": None}
            mod = time_terms(GPUS[hw], params, moved, ctas)["time_s"]
            rows.append(dict(kind=f"nccl a2a{'' if ctas is None else f' {ctas} SMs'}", dtype="fp8", experts=world,
                             m=tokens, n=8, k=HIDDEN, measured_us=t * 1e6, model_us=mod * 1e6, band=b["band"],
                             launches=1))
    print(f"all-to-all band: ±{b['band']:.0%}, {b.words()} ({b['how']})")
    return rows


def sm_row(torch, hw: str) -> str:
    props = torch.cuda.get_device_properties(0)
    have, preset = props.multi_processor_count, GPUS[hw].sms
    return (f"SMs: {have} on the device, {preset} in the {hw} preset"
            + ("" if have == preset else f" (differs: the model's tiles-per-wave use {preset})"))


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
    sms = sm_row(torch, hw)
    print(sms)
    rows = gemm_rows(torch, hw, start + a.budget_s) + a2a_rows(torch, hw)
    when = dt.datetime.now(dt.timezone.utc)
    lines = [f"# GPU cost model on {name} ({hw} preset), {when:%Y-%m-%d %H:%M} UTC", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s); "
             f"{time.monotonic() - start:.0f} s", "", sms, "",
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
