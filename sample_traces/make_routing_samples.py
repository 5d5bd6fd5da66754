"""Regenerate the small routing / load samples of issue 24 in sample_traces/ (deterministic,
no engine needed; each file is written in the layout its tool's source uses, see
docs/engines.md — nothing is copied from a tool's output).

    python sample_traces/make_routing_samples.py

Writes:
- deepep/rank{0..3}.npz: DeepEP diagnosis counters of 4 EP ranks x 4 local experts, each
  rank's own tensors under DeepEP's names: cumulative_local_expert_recv_stats int32 [4],
  dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats int64 [4] (cycles per
  source rank); rank 2 is slow: every other rank waits longest for it.
- deepep_gathered.safetensors: the same counters gathered to one rank, [4, 4] each.
- megatron_trace/router_trace_rank{0,1}.jsonl: Megatron-LM RouterTracer records, 2 ranks,
  3 steps, MoE layers 1 and 2, 8 tokens per record, top-2 of 8 experts; rank 1's step 2
  layer 1 comes in two micro-batch records; one MTP record on rank 0 (skipped on ingest).
- megatron_tpe/rank{0..3}.jsonl: Megatron-LM tokens-per-expert records (iter 10 and 20,
  layers 1 and 2, 2 micro-batches x 2 local experts per rank).
- megatron_loads.npy: int64 loads[2 layers, 5 forwards, 8 experts].
- vllm_routed/req{0,1,2}_routed_experts.npy: vLLM CompletionOutput.routed_experts int32
  [tokens, 4 layers, top-2] of three requests (tokens 6, 9, 4), 16 experts.
- vllm_routed_outputs.jsonl: the same three saved as JSON lists, one request per line.
- routing_with_meta.jsonl: per-token routing rows (step, layer, token, choice, expert) with a
  {"type": "meta", ...} header line and a second one mid-file, as route-logging patches write.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _fresh(d: Path) -> Path:
    d.mkdir(exist_ok=True)
    for f in d.glob("*"):
        f.unlink()
    return d


def _topk(rng: np.random.Generator, n: int, E: int, k: int) -> np.ndarray:
    w = 1.0 / np.arange(1, E + 1)
    return np.array([rng.choice(E, k, replace=False, p=w / w.sum()) for _ in range(n)], np.int64).reshape(n, k)


def deepep(rng: np.random.Generator) -> None:
    from safetensors.numpy import save_file

    R, EL = 4, 4
    out = _fresh(HERE / "deepep")
    recv = rng.integers(50, 400, (R, EL)).astype(np.int32)
    # wait cycles [waiting rank, source rank]: ~1e5 background, 2e6 extra waiting for rank 2
    disp = rng.integers(80_000, 120_000, (R, R)).astype(np.int64)
    comb = rng.integers(40_000, 60_000, (R, R)).astype(np.int64)
    disp[:, 2] += 2_000_000
    comb[:, 2] += 500_000
    np.fill_diagonal(disp, 0)
    np.fill_diagonal(comb, 0)
    for r in range(R):
        np.savez(out / f"rank{r}.npz", cumulative_local_expert_recv_stats=recv[r],
                 dispatch_wait_recv_cost_stats=disp[r], combine_wait_recv_cost_stats=comb[r])
    save_file({"cumulative_local_expert_recv_stats": recv, "dispatch_wait_recv_cost_stats": disp,
               "combine_wait_recv_cost_stats": comb}, str(HERE / "deepep_gathered.safetensors"))


def megatron(rng: np.random.Generator) -> None:
    out = _fresh(HERE / "megatron_trace")
    for rank in (0, 1):
        lines = []
        for step in range(3):
            for layer in (1, 2):
                parts = (3, 5) if (rank, step, layer) == (1, 2, 1) else (8,)
                for n in parts:
                    lines.append({"step": step, "stage": "pre_dispatch", "block": "decoder", "layer": layer,
                                  "rank": rank, "num_tokens": n, "topk": 2, "top_indices": _topk(rng, n, 8, 2).tolist()})
            if rank == 0 and step == 0:
                lines.append({"step": 0, "stage": "pre_dispatch", "block": "mtp", "mtp_idx": 0, "layer": 1, "rank": 0,
                              "num_tokens": 8, "topk": 2, "top_indices": _topk(rng, 8, 8, 2).tolist()})
        (out / f"router_trace_rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = _fresh(HERE / "megatron_tpe")
    for rank in range(4):
        lines = [{"iter": it, "block": "decoder", "layer": layer, "tpe": rng.integers(0, 40, (2, 2)).tolist()}
                 for it in (10, 20) for layer in (1, 2)]
        (out / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    np.save(HERE / "megatron_loads.npy", rng.integers(0, 100, (2, 5, 8)).astype(np.int64))


def vllm(rng: np.random.Generator) -> None:
    out = _fresh(HERE / "vllm_routed")
    arrays = [np.stack([_topk(rng, n, 16, 2) for _ in range(4)], axis=1).astype(np.int32) for n in (6, 9, 4)]
    for i, a in enumerate(arrays):
        np.save(out / f"req{i}_routed_experts.npy", a)
    (HERE / "vllm_routed_outputs.jsonl").write_text("".join(
        json.dumps({"request_id": f"req{i}", "routed_experts": a.tolist()}) + "\n" for i, a in enumerate(arrays)))


def routing_meta(rng: np.random.Generator) -> None:
    lines = [{"type": "meta", "model": "synthetic-moe", "num_experts": 8, "top_k": 2, "logger": "route-log patch"}]
    for step in range(2):
        if step == 1:
            lines.append({"type": "meta", "event": "config reload", "num_experts": 8})
        for layer in range(2):
            idx = _topk(rng, 4, 8, 2)
            for t in range(4):
                for c in range(2):
                    lines.append({"step": step, "layer": layer, "token": t, "choice": c, "expert": int(idx[t, c])})
    (HERE / "routing_with_meta.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    rng = np.random.default_rng(24)
    deepep(rng)
    megatron(rng)
    vllm(rng)
    routing_meta(rng)
    print("wrote deepep/, deepep_gathered.safetensors, megatron_trace/, megatron_tpe/, megatron_loads.npy, "
          "vllm_routed/, vllm_routed_outputs.jsonl, routing_with_meta.jsonl")
