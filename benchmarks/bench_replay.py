"""Replay throughput: 58 layers x 256 experts x 10,000 steps (full) against an EPLB plan
(288 slots on 32 ranks, 4 nodes), processed in chunks of 1,000 steps as the store reader
yields them; compared with a straightforward per-token Python loop on a subset; plus the
store read rate (expert_load rows into dense arrays) on a smaller run.

    python benchmarks/bench_replay.py --size full
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import main, peak_rss_mib, result, timer  # noqa: E402
from moetrace.costmodel.step_cost import preset  # noqa: E402
from moetrace.placement.planners import PlanShape, make_plan  # noqa: E402
from moetrace.replay.engine import layer_metrics, replay_load  # noqa: E402
from moetrace.replay.load import iter_load, read_shape  # noqa: E402
from moetrace.replay.token_replay import replay_routing  # noqa: E402
from moetrace.run import Store  # noqa: E402

L, E, K, B, R, RPN = 58, 256, 8, 8192, 32, 8
HIDDEN, DTYPE = 7168, 2


def _popularity(rng):
    w = np.exp(0.6 * rng.standard_normal((L, E)))
    return w / w.sum(axis=1, keepdims=True)


def _chunk(rng, p, steps):
    """[steps, L, E] counts: B*K draws per (step, layer) (with replacement: fine for timing)."""
    return rng.multinomial(B * K, p, size=(steps, L)).astype(np.float32)


def _loop_replay(tokens_experts, src, phy2log_row, spr):
    """The straightforward way: per token, per choice, look the rank up and count."""
    slots_of = {}
    for s, e in enumerate(phy2log_row):
        slots_of.setdefault(int(e), []).append(s)
    rank_tokens = [0] * R
    intra = [0] * R
    inter = [0] * R
    for t, experts in enumerate(tokens_experts):
        dsts = set()
        for e in experts:
            copies = slots_of[int(e)]
            slot = copies[(t * 2654435761 % 2**32) % len(copies)]
            r = slot // spr
            rank_tokens[r] += 1
            dsts.add(r)
        for r in dsts:
            if r != src[t]:
                if r // RPN == src[t] // RPN:
                    intra[r] += HIDDEN * DTYPE
                else:
                    inter[r] += HIDDEN * DTYPE
    return rank_tokens, intra, inter


def sweep_cell(rng, p, steps: int = 1000) -> dict:
    """One sweep cell (one plan judged on ``steps`` steps x 58 layers x 256 experts, every
    kernel of the replay: per-rank tokens, slots touched, dispatch estimate, cost model,
    imbalance, straggler) beside the plain numpy floor on the same arrays: loads -> per-rank
    sums (a gather per slot, summed per rank) -> max / mean."""
    import time

    plan = make_plan("eplb", p * 1e6, PlanShape(R, RPN, 288, num_groups=8))
    cost = preset("H200", HIDDEN)
    load = _chunk(rng, p, steps).astype(np.float64)
    flat = (np.arange(L)[:, None] * E + plan.phy2log).ravel()
    share = 1.0 / np.take_along_axis(plan.logcnt(), plan.phy2log, axis=1).ravel()
    best_cell = best_floor = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        m = layer_metrics(replay_load(load, plan, "even", None, K, HIDDEN * DTYPE), cost)
        best_cell = min(best_cell, time.process_time() - t0)
        t0 = time.process_time()
        ranks = (np.take(load.reshape(steps, L * E), flat, axis=1) * share).reshape(steps, L, R, -1).sum(axis=3)
        floor = ranks.max(axis=2) / ranks.mean(axis=2)
        best_floor = min(best_floor, time.process_time() - t0)
    assert np.allclose(floor, m.imbalance)
    return result("replay", "sweep cell: CPU seconds", best_cell, "s", baseline="numpy floor (loads -> rank sums -> max/mean)",
                  baseline_value=best_floor, ratio=best_cell / best_floor,
                  notes=f"{steps} steps x {L} layers x {E} experts, 288 slots / {R} ranks; best of 3, CPU time; "
                        f"{1 / best_cell:.2f} cells/s vs floor {1 / best_floor:.2f}")


def run(size: str = "small") -> list[dict]:
    steps = 10_000 if size == "full" else 500
    chunk = 1000 if size == "full" else 250
    rng = np.random.default_rng(0)
    p = _popularity(rng)
    plan = make_plan("eplb", p * 1e6, PlanShape(R, RPN, 288, num_groups=8))
    cost = preset("H200", HIDDEN)
    out = []
    # --- vectorized replay over (step, layer), chunk by chunk (generation not timed)
    elapsed = 0.0
    imb_sum = 0.0
    for i in range(0, steps, chunk):
        load = _chunk(rng, p, min(chunk, steps - i))
        with timer() as t:
            m = layer_metrics(replay_load(load, plan, "even", None, K, HIDDEN * DTYPE), cost)
            imb_sum += float(m.imbalance.sum())
        elapsed += t()
    rate = steps / elapsed
    # --- per-token Python loop on a subset (1 step x 2 layers), and numpy per-token replay
    sub_layers = 2
    toks = [np.argsort(rng.random((B, E)) / p[li], axis=1)[:, :K] for li in range(sub_layers)]
    src = (np.arange(B) * R) // B
    with timer() as t:
        for li in range(sub_layers):
            _loop_replay(toks[li], src, plan.phy2log[li], plan.slots_per_rank)
    loop_layer_s = t() / sub_layers
    loop_rate = 1.0 / (loop_layer_s * L)   # steps/s if every layer were looped
    out.append(result("replay", "aggregated replay steps/s", rate, "steps/s", baseline="per-token Python loop",
                      baseline_value=loop_rate, ratio=rate / loop_rate,
                      notes=f"{steps} steps x {L} layers x {E} experts, EPLB 288 slots / {R} ranks, chunks of {chunk}; "
                            f"total {elapsed:.2f} s; loop timed on {sub_layers} layers x {B} tokens"))
    ti = np.zeros(sub_layers * B * K, np.int64)
    li = np.repeat(np.arange(sub_layers), B * K)
    tok = np.tile(np.repeat(np.arange(B), K), sub_layers)
    ex = np.concatenate([x.ravel() for x in toks])
    sr = src[tok]
    sub_plan = make_plan("eplb", p[:sub_layers] * 1e6, PlanShape(R, RPN, 288, num_groups=8))
    with timer() as t:
        replay_routing(ti, li, tok, sr, ex, 1, sub_plan, "hash", HIDDEN * DTYPE)
    pt_rate = 1.0 / (t() / sub_layers * L)
    out.append(result("replay", "per-token exact replay steps/s", pt_rate, "steps/s", baseline="per-token Python loop",
                      baseline_value=loop_rate, ratio=pt_rate / loop_rate,
                      notes=f"numpy replay_routing, {B} tokens x top-{K} per layer, exact dispatch bytes"))
    # --- store read into dense arrays
    read_steps = 1000 if size == "full" else 100
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        st = Store(os.path.join(d, "st"), create=True)

        def chunks():
            for i in range(0, read_steps, 100):
                n = min(100, read_steps - i)
                load = _chunk(rng, p, n).astype(np.int64)
                yield pa.table({"step": np.repeat(np.arange(i, i + n), L * E).astype(np.int64),
                                "layer": np.tile(np.repeat(np.arange(L), E), n).astype(np.int32),
                                "expert": np.tile(np.arange(E), n * L).astype(np.int32),
                                "slot": pa.nulls(n * L * E, pa.int32()), "src_rank": pa.nulls(n * L * E, pa.int32()),
                                "tokens": load.ravel()})
        st.write_run({"source": "bench", "source_sha256": "b" * 64, "collector": "bench", "time_base": "none",
                      "num_experts": E, "num_ranks": R, "ranks_per_node": RPN, "num_slots": E, "top_k": K,
                      "hidden": HIDDEN, "dtype_bytes": DTYPE}, {"expert_load": chunks()}, run_id="bench")
        st = Store(os.path.join(d, "st"))
        with timer() as t:
            shape = read_shape(st, "bench")
            n = 0
            for ids, _load, _ in iter_load(st, "bench", shape, chunk_steps=500):
                n += ids.size
        read_s = t()
    rows = read_steps * L * E
    out.append(result("replay", "store read expert_load -> dense", rows / read_s / 1e6, "M rows/s",
                      notes=f"{read_steps} steps x {L} layers x {E} experts = {rows / 1e6:.1f} M rows in {read_s:.2f} s"))
    out.append(sweep_cell(rng, p, 1000 if size == "full" else 200))
    out.append(result("replay", "peak memory", peak_rss_mib(), "MiB", notes="whole benchmark process (ru_maxrss)"))
    return out


if __name__ == "__main__":
    main(run)
