"""Regenerate the small engine-format samples in sample_traces/ (deterministic, no engine
needed; every file is written here in the layout the engine's own source uses, see
docs/engines.md — nothing is copied from an engine's output).

    python sample_traces/make_engine_samples.py

Writes:
- trtllm_stats/: a TensorRT-LLM expert-statistics folder (meta_info.json, rank{0..3}.safetensors):
  4 EP ranks, 16 experts, top-2, MoE layers 1 and 2 (layer 0 dense, as in DeepSeek's first
  layers), iterations 100..107, 32 tokens per rank per iteration; rank 3 idles in iteration 103.
- trtllm_moe_load_balancer.yaml: a static TensorRT-LLM EPLB config for it (20 slots, hot
  experts replicated), the placement the statistics were "recorded" under.
- vllm_ascend_expert_map.json: a vllm-ascend expert map (2 MoE layers, 4 devices x 5 slots).
- routing_wide/layer_{1,2}.parquet: per-token routing in the public-dataset layout, one file
  per layer, a row per token with `indices list<int16>[2]` and `scores list<float16>[2]`
  (256 tokens; ingest with --set tokens_per_step=64 for 4 steps).
- metrics_scrapes/metrics_{unix time}.prom: five Prometheus text scrapes a minute apart with
  vLLM's EPLB gauges and rearrangement counter and SGLang's eplb_balancedness summary, plus
  two unrelated families (counted by the collector, not read).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RANKS, EXPERTS, TOP_K, LAYERS, ITERS, TOKENS = 4, 16, 2, (1, 2), range(100, 108), 32


def routing(rng: np.random.Generator, n: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """top-k choices [n, k] and gate scores of n tokens: a Zipf(1) preference over a per-layer
    expert order, k distinct experts per token."""
    order = np.random.default_rng(layer).permutation(EXPERTS)
    w = 1.0 / np.arange(1, EXPERTS + 1)
    p = np.empty(EXPERTS)
    p[order] = w / w.sum()
    idx = np.array([rng.choice(EXPERTS, TOP_K, replace=False, p=p) for _ in range(n)]).reshape(n, TOP_K)
    gates = rng.dirichlet(np.ones(TOP_K), size=n)
    gates = -np.sort(-gates, axis=1)
    return idx.astype(np.int64), gates


def trtllm(rng: np.random.Generator) -> dict:
    from safetensors.numpy import save_file

    out = HERE / "trtllm_stats"
    out.mkdir(exist_ok=True)
    for f in out.glob("*"):
        f.unlink()
    (out / "meta_info.json").write_text(json.dumps({"num_experts": EXPERTS, "num_experts_per_token": TOP_K}))
    total = np.zeros((len(LAYERS), EXPERTS), np.int64)
    for r in range(RANKS):
        rec = {}
        for it in ITERS:
            n = 0 if (r, it) == (3, 103) else TOKENS
            for li, layer in enumerate(LAYERS):
                idx, _ = routing(rng, n, layer)
                c = np.bincount(idx.ravel(), minlength=EXPERTS).astype(np.int64)
                rec[f"{it}_{layer}"] = c          # TensorRT-LLM: torch.bincount(..., minlength=E), int64
                total[li] += c
        save_file(rec, str(out / f"rank{r}.safetensors"))
    return {"total": total}


def trtllm_yaml(total: np.ndarray) -> None:
    """20 slots (4 redundant): the 4 hottest experts of each layer get a second copy; ranks hold
    consecutive blocks of 5 slots, copies dealt round-robin so each rank gets one."""
    lines = ["num_slots: 20", "layer_updates_per_iter: 0", "initial_global_assignments:"]
    for li, layer in enumerate(LAYERS):
        hot = np.argsort(-total[li], kind="stable")[:4]
        rows = [[e for e in range(EXPERTS) if e % RANKS == r] + [int(hot[r])] for r in range(RANKS)]
        lines.append(f"  {layer}: [{', '.join(str(e) for row in rows for e in row)}]")
    (HERE / "trtllm_moe_load_balancer.yaml").write_text("\n".join(lines) + "\n")


def vllm_ascend_map() -> None:
    layers = []
    for i in range(len(LAYERS)):
        devs = [{"device_id": d, "device_expert": [(d * 4 + j + i) % EXPERTS for j in range(4)] + [(d + 5 * i) % EXPERTS]}
                for d in range(RANKS)]
        layers.append({"layer_id": i, "device_count": RANKS, "device_list": devs})
    (HERE / "vllm_ascend_expert_map.json").write_text(
        json.dumps({"moe_layer_count": len(LAYERS), "layer_list": layers}, indent=1) + "\n")


def routing_wide(rng: np.random.Generator) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = HERE / "routing_wide"
    out.mkdir(exist_ok=True)
    for layer in LAYERS:
        idx, gates = routing(rng, 256, layer)
        pq.write_table(pa.table({"indices": pa.array(list(idx.astype(np.int16)), pa.list_(pa.int16())),
                                 "scores": pa.array(list(gates.astype(np.float16)), pa.list_(pa.float16()))}),
                       out / f"layer_{layer}.parquet", compression="zstd")


def metrics_scrapes() -> None:
    out = HERE / "metrics_scrapes"
    out.mkdir(exist_ok=True)
    for f in out.glob("*"):
        f.unlink()
    t0, rearr, cnt, tot = 1764547200, 0, 0, 0.0
    for i in range(5):
        avg = 0.62 + 0.06 * i                    # balancedness improving as EPLB rearranges
        rearr += 1 if i in (1, 3) else 0
        cnt += 120
        tot += 120 * (0.55 + 0.07 * i)
        lab = 'engine="0",model_name="deepseek-ai/DeepSeek-V3"'
        text = ["# HELP vllm:eplb_balancedness_avg Mean EPLB balancedness across MoE layers.",
                "# TYPE vllm:eplb_balancedness_avg gauge", f"vllm:eplb_balancedness_avg{{{lab}}} {avg:.4f}",
                "# TYPE vllm:eplb_balancedness_min gauge", f"vllm:eplb_balancedness_min{{{lab}}} {avg - 0.2:.4f}",
                "# TYPE vllm:eplb_balancedness_p50 gauge", f"vllm:eplb_balancedness_p50{{{lab}}} {avg + 0.02:.4f}",
                "# TYPE vllm:eplb_balancedness_p90 gauge", f"vllm:eplb_balancedness_p90{{{lab}}} {avg - 0.1:.4f}",
                "# TYPE vllm:eplb_rearrangements_total counter", f"vllm:eplb_rearrangements_total{{{lab}}} {rearr}.0",
                "# TYPE vllm:eplb_rearrangement_seconds gauge",
                f"vllm:eplb_rearrangement_seconds{{{lab}}} {1.2 + 0.1 * rearr:.2f}",
                "# TYPE sglang:eplb_balancedness summary",
                f'sglang:eplb_balancedness_count{{forward_mode="decode",moe_ep_rank="0"}} {cnt}.0',
                f'sglang:eplb_balancedness_sum{{forward_mode="decode",moe_ep_rank="0"}} {tot:.4f}',
                "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} {8 + i}.0",
                "# TYPE process_cpu_seconds_total counter", f"process_cpu_seconds_total {30.5 + 60 * i:.1f}"]
        (out / f"metrics_{t0 + 60 * i}.prom").write_text("\n".join(text) + "\n")


def main() -> None:
    rng = np.random.default_rng(15)
    t = trtllm(rng)
    trtllm_yaml(t["total"])
    vllm_ascend_map()
    routing_wide(rng)
    metrics_scrapes()
    for f in sorted(HERE.glob("trtllm*")) + [HERE / "vllm_ascend_expert_map.json", HERE / "routing_wide",
                                              HERE / "metrics_scrapes"]:
        size = sum(x.stat().st_size for x in f.rglob("*")) if f.is_dir() else f.stat().st_size
        print(f"{f.name}: {size / 1e3:.1f} kB")


if __name__ == "__main__":
    main()
