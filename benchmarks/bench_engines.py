"""Engine sources: SGLang per_pass dump collection speed (DeepSeek-V3 shape), capture
overhead on a tiny transformers model, and the wall time of the CPU reference run.

    python benchmarks/bench_engines.py --size full
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import main, peak_rss_mib, result, timer  # noqa: E402

from benchmarks.rank_fork import ranks_forked_here  # noqa: E402


def _sglang(size: str, tmp: Path) -> list[dict]:
    import torch

    from moetrace.collect import collect

    L, P, R = 61, 288, (4 if size == "small" else 32)
    passes = 10 if size == "small" else 100
    rng = np.random.default_rng(0)
    p2l = torch.from_numpy(np.tile(np.r_[np.arange(256), np.arange(32)], (L, 1)))
    paths = []
    for r in range(R):
        recs = [{"forward_pass_id": f, "rank": r, "gatherer_key": "primary",
                 "global_physical_count": torch.from_numpy(rng.poisson(2.0, size=(L, P)).astype(np.int32))}
                for f in range(passes)]
        p = tmp / f"expert_distribution_recorder_1.0_{r}.pt"
        torch.save({"records": recs, "last_physical_to_logical_map": p2l}, p)
        paths.append(p)
    mb = sum(p.stat().st_size for p in paths) / 2**20
    with timer() as t:
        rd = collect(paths)[0]
    rows = rd.tables["expert_load"].num_rows
    return [result("engines_sglang_per_pass", "collect_s", t(), "s",
                   notes=f"{R} ranks x {passes} passes x {L} layers x {P} slots, {mb:.0f} MiB of .pt, {rows} rows"),
            result("engines_sglang_per_pass", "throughput", R * passes / t(), "rank-passes/s"),
            result("engines_sglang_per_pass", "peak_rss", peak_rss_mib(), "MiB")]


def _capture(size: str) -> list[dict]:
    import torch

    from moetrace.produce.capture import capture, tiny_model

    model = tiny_model("qwen3_moe", hidden=64)
    # small: a smaller batch and 2 alternations (the path is the same; the figure is not quoted)
    batch, seq = (4, 32) if size == "small" else (8, 64)
    ids = torch.randint(0, 256, (batch, seq))
    reps = 2 if size == "small" else 20
    plain, hooked_t = [], []
    with torch.no_grad():
        model(input_ids=ids)
        for _ in range(reps):  # alternate, keep the best of each: the machine is shared
            with timer() as t0:
                model(input_ids=ids)
            plain.append(t0())
            with capture(model) as cap, timer() as t1:
                model(input_ids=ids)
            hooked_t.append(t1())
        cap.routing()
    base, hooked = min(plain), min(hooked_t)
    return [result("engines_capture", "forward_ms_with_capture", hooked * 1e3, "ms", baseline="no hooks",
                   baseline_value=base * 1e3, ratio=base / hooked,
                   notes=f"tiny Qwen3-MoE (2 layers, 8 experts, hidden 64), batch {batch} x {seq} tokens")]


def _refrun(size: str, tmp: Path) -> list[dict]:
    from moetrace.produce.refrun import RefRunConfig, run

    cfg = RefRunConfig(steps=2) if size == "small" else RefRunConfig(ranks=4, experts=16, steps=8, prefill_tokens=64,
                                                              idle=[(3, 2)])
    # small: the ranks forked from this process, which imports torch once (benchmarks.rank_fork), not
    # spawned (a fresh interpreter importing torch per rank); full: spawned, as `moetrace refrun` does
    small = size == "small"
    with ranks_forked_here(small):
        t = time.perf_counter()
        man = run(cfg, tmp / "rr")
        wall = time.perf_counter() - t
    start = "fork start" if small else "spawn"
    return [result("engines_refrun", "wall_s", wall, "s",
                   notes=f"{cfg.ranks} ranks x {cfg.steps} steps x {cfg.layers} layers, {cfg.experts} experts, "
                         f"profiler on ({start} + gloo init included; workers {man['wall_s']:.1f} s)")]


def run(size: str = "small") -> list[dict]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return [result("engines", "skipped", 0.0, "", notes="needs torch")]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if size == "small":   # the ranks forked before this process runs a torch operation (rank_fork)
            ref = _refrun(size, tmp)
            return _sglang(size, tmp) + _capture(size) + ref
        return _sglang(size, tmp) + _capture(size) + _refrun(size, tmp)


if __name__ == "__main__":
    main(run)
