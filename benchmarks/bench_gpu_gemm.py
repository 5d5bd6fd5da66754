"""Grouped expert GEMMs timed on one accelerator, and the cost-model coefficients fitted
from them (the GPU presets of ``moetrace.costmodel.step_cost`` from measurement, not from datasheets).

Per (experts per rank ``n``, tokens per expert ``t``) it times the gated MLP of ``n``
experts over ``t`` tokens each — ``x @ W_gate_up`` (hidden → 2·intermediate), SiLU·gate,
``@ W_down`` (intermediate → hidden) as batched matrix products, the shape grouped-GEMM
kernels (DeepGEMM ``m_grouped``, CUTLASS grouped) compute — and fits

    time ≈ a · (n · t) + b · n                    (the replay's a, b: per token-expert row, per slot touched)
    time ≈ a · n · tile · ceil(t / tile) + b · n  (the same with the rows rounded up to the GEMM tile)

by least squares, printed next to the preset's datasheet-derived a and b. DeepSeek-V3's
expert shape by default (hidden 7168, intermediate 2048, bf16).

    python benchmarks/bench_gpu_gemm.py --size full     # on a GPU: DeepSeek-V3 shape, bf16
    python benchmarks/bench_gpu_gemm.py --size small    # anywhere (CPU): a tiny shape, float32

No GPU was available when this was written: the presets stay datasheet figures (their
sources are in ``moetrace/replay/cost.py`` and docs/calibration.md) until this script's
full-size output, with date and GPU, is committed there.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Skipped, main, result  # noqa: E402

SIZES = {
    "small": dict(hidden=64, inter=32, dtype="float32", experts=[1, 2, 4], tokens=[1, 4, 16, 64], iters=5,
                  tile=16, device="cpu"),
    "full": dict(hidden=7168, inter=2048, dtype="bfloat16", experts=[1, 2, 4, 8, 16, 32],
                 tokens=[1, 8, 32, 64, 128, 256, 512, 1024], iters=20, tile=128, device="cuda"),
}


def time_grid(hidden: int, inter: int, dtype: str, experts: list[int], tokens: list[int], iters: int,
              device: str) -> list[dict]:
    """Median time (ns) of the gated MLP of ``n`` experts over ``t`` tokens each, per (n, t)."""
    import torch

    dt = getattr(torch, dtype)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)
    nmax = max(experts)
    wgu = (torch.randn(nmax, hidden, 2 * inter, generator=g) / hidden ** 0.5).to(dev, dt)
    wd = (torch.randn(nmax, inter, hidden, generator=g) / inter ** 0.5).to(dev, dt)
    rows = []
    for n in experts:
        for t in tokens:
            x = torch.randn(n, t, hidden, generator=g).to(dev, dt)

            def mlp(x=x, n=n):
                h = torch.bmm(x, wgu[:n])
                a, b = h.chunk(2, dim=-1)
                return torch.bmm(torch.nn.functional.silu(a) * b, wd[:n])
            mlp()
            sync()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                mlp()
                sync()
                ts.append(time.perf_counter_ns() - t0)
            rows.append({"experts": n, "tokens_per_expert": t, "ns": float(np.median(ts)),
                         "spread": float((np.percentile(ts, 75) - np.percentile(ts, 25)) / np.median(ts))})
    return rows


def fit(rows: list[dict], tile: int | None = None) -> dict:
    """Least squares of time = a · rows + b · experts (rows rounded up to ``tile`` per expert
    when given); relative residuals, so small and large cells weigh alike."""
    from moetrace.costmodel.calibrate import nonneg_lstsq

    n = np.array([r["experts"] for r in rows], np.float64)
    t = np.array([r["tokens_per_expert"] for r in rows], np.float64)
    y = np.array([r["ns"] for r in rows], np.float64)
    m = n * (np.ceil(t / tile) * tile if tile else t)
    X = np.stack([m, n], axis=1)
    a, b = nonneg_lstsq(X / y[:, None], np.ones_like(y))
    pred = a * m + b * n
    return {"a_ns": float(a), "b_ns": float(b), "mape": float(np.mean(np.abs(pred - y) / y)), "tile": tile}


def preset_ab(name: str, hidden: int, inter: int) -> tuple[float, float]:
    from moetrace.costmodel.step_cost import preset

    p = preset(name, hidden, 3 * hidden * inter, inter)
    return p.a_ns, p.b_ns


def run(size: str) -> list[dict]:
    import torch

    sz = SIZES[size]
    dev = sz["device"]
    if dev == "cuda" and not torch.cuda.is_available():
        raise Skipped("no GPU here: the full size needs one (the presets stay datasheet figures)")
    gpu = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    rows = time_grid(sz["hidden"], sz["inter"], sz["dtype"], sz["experts"], sz["tokens"], sz["iters"], dev)
    plain, tiled = fit(rows), fit(rows, sz["tile"])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"grouped expert GEMM, {gpu}, hidden {sz['hidden']}, intermediate {sz['inter']}, {sz['dtype']}, {date}",
          file=sys.stderr)
    print("| experts | tokens/expert | median us | spread |\n|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['experts']} | {r['tokens_per_expert']} | {r['ns'] / 1e3:.1f} | {100 * r['spread']:.0f}% |",
              file=sys.stderr)
    print(f"fit: a {plain['a_ns']:.2f} ns/row, b {plain['b_ns']:.0f} ns/slot, MAPE {100 * plain['mape']:.1f}%; "
          f"with rows rounded up to {sz['tile']}: a {tiled['a_ns']:.2f}, b {tiled['b_ns']:.0f}, "
          f"MAPE {100 * tiled['mape']:.1f}%", file=sys.stderr)
    out = [result("gpu_gemm", "a_ns_per_row", plain["a_ns"], "ns", notes=f"{gpu} {sz['dtype']}"),
           result("gpu_gemm", "b_ns_per_slot", plain["b_ns"], "ns", notes=f"{gpu} {sz['dtype']}"),
           result("gpu_gemm", "fit_mape", 100 * plain["mape"], "%", "tile-rounded fit", 100 * tiled["mape"])]
    if dev == "cuda":
        for name in ("H100", "H200", "B200"):
            a, b = preset_ab(name, sz["hidden"], sz["inter"])
            print(f"preset {name}: a {a:.2f} ns/row, b {b:.0f} ns/slot", file=sys.stderr)
    return out


if __name__ == "__main__":
    main(run)
