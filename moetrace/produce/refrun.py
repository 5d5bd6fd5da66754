"""A real expert-parallel MoE run on CPU: the reference trace moetrace can produce anywhere.

``run(RefRunConfig(...), outdir)`` launches ``ranks`` processes with torch.distributed
(gloo, localhost). Every rank holds the physical expert slots ``[r*S/R, (r+1)*S/R)`` of
each MoE layer; the logical expert on each slot comes from the placement. Per step and
layer every rank routes its tokens with a real softmax top-k router, dispatches the
(token, choice) rows to the ranks holding the chosen slots with ``all_to_all_single``,
runs its local experts (gated MLPs), combines the results back with ``all_to_all_single``
and adds the gate-weighted sum to the residual stream. The PyTorch profiler records every
rank (``rank{r}_trace.json.gz``, Kineto Chrome trace); the routing, the tokens each rank
received per slot and the step boundaries are written as Parquet.

``skew`` makes the router favour experts: a Zipf(skew) log-prior is added to the router
logits, the favourite first in ``hot`` order. An ``idle`` (step, rank) pair gives that
rank no tokens in that step: it still joins every collective (a dummy step). The same
seed gives the same tokens and weights under any placement, so a replay of one run's
routing against another placement can be checked against a second real run.

Fit for measurement on a small machine: one thread per rank (a warning when there are
more ranks than CPU cores), ``warmup`` untimed iterations first, then ``repeats`` timed
passes over the same steps (the tokens of a (step, rank) are seeded, so every pass runs
the same traffic). Every rank times its dispatch, its local experts and its combine with
a monotonic clock (``timing_rank{r}.parquet``, one row per pass, step and layer); the
collector summarizes them per (step, layer, rank) by the median and its spread (table
``cell_times``) and the run's noise level (:func:`summarize_timing`) goes to the manifest
and ``runs.meta_json``. With ``repeats > 1`` the profiler records one extra pass, so the
timed passes run without its overhead.

The output folder is one run for ``moetrace ingest`` (collector ``refrun``).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..formats.refrun import MANIFEST, summarize_timing
from . import refrun_timeline


@dataclass
class RefRunConfig:
    ranks: int = 2
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    hidden: int = 256                 # big enough that expert GEMMs dominate the per-call overhead
    ffn: int = 512
    steps: int = 6
    tokens_per_rank: int = 32
    prefill_tokens: int = 0           # >0: step 0 is a prefill of this many tokens per rank
    skew: float = 1.0                 # Zipf exponent of the router prior (0: no preference)
    hot: list[int] | None = None      # favoured experts, most favoured first (default 0..E-1)
    placement: str | list = "contiguous"
    idle: list[tuple[int, int]] = field(default_factory=list)   # (step, rank) with no tokens
    seed: int = 0
    profile: bool = True
    threads_per_rank: int = 1
    timeout_s: float = 300.0
    delay_rank: int = -1              # this rank's compute is held delay_us per layer (-1: none)
    delay_us: float = 0.0
    delay_every: int = 1              # delay only steps s with s % delay_every == 0 (2: interleaved control)
    micro_batches: int = 1            # 2: two micro-batches, a2a of one while the other computes
    repeats: int = 1                  # timed passes over all steps (median and spread per cell)
    warmup: int = 1                   # untimed iterations of the first step before the timed passes
    progress: bool = True             # progress lines on stderr

    def validate(self) -> None:
        def bad(msg):
            raise InputError(None, f"refrun: {msg}")
        if self.ranks < 1:
            bad("--ranks must be >= 1")
        for k in ("experts", "top_k", "layers", "hidden", "ffn", "steps"):
            if getattr(self, k) < 1:
                bad(f"--{k.replace('_', '-')} must be >= 1")
        if self.top_k > self.experts:
            bad("--top-k exceeds --experts")
        if self.repeats < 1:
            bad("--repeats must be >= 1")
        if self.warmup < 0:
            bad("--warmup must be >= 0")
        if self.threads_per_rank < 1:
            bad("--threads-per-rank must be >= 1")
        if self.delay_rank >= self.ranks or self.delay_us < 0:
            bad("--delay-rank must be < --ranks and --delay-us >= 0")
        if self.delay_every < 1:
            bad("--delay-every must be >= 1")
        if self.micro_batches not in (1, 2):
            bad("--micro-batches must be 1 or 2")
        if self.tokens_per_rank < 0 or self.prefill_tokens < 0:
            bad("token counts must be >= 0")
        if self.hot is not None and sorted(set(self.hot)) != sorted(self.hot):
            bad("--hot lists an expert twice")
        if self.hot is not None and any(e < 0 or e >= self.experts for e in self.hot):
            bad("--hot expert outside 0..experts-1")
        for s, r in self.idle:
            if not (0 <= s < self.steps and 0 <= r < self.ranks):
                bad(f"--idle {s}:{r} outside steps x ranks")


# ----------------------------------------------------------------------------- plan
def parse_placement(spec, layers: int, experts: int, ranks: int) -> np.ndarray:
    """phy2log [layers, slots] from a name or a JSON file / list.

    Names: ``contiguous`` (slot s holds expert s), ``round_robin`` (expert e on rank
    e % R), ``reverse`` (slot s holds E-1-s), ``random:SEED`` (a per-layer permutation).
    Otherwise a JSON file holding ``[[...]]`` (layers x slots, or one row for every layer)
    or a dict with ``phy2log`` / ``physical_to_logical_map``; more slots than experts
    means replicas.
    """
    E, L, R = experts, layers, ranks
    if isinstance(spec, str) and spec in ("contiguous", "round_robin", "reverse") or (
            isinstance(spec, str) and spec.startswith("random:")):
        if E % R:
            raise InputError(None, f"placement {spec!r}: {E} experts do not split over {R} ranks")
        if spec == "contiguous":
            row = np.arange(E)
        elif spec == "reverse":
            row = np.arange(E)[::-1].copy()
        elif spec == "round_robin":
            spr = E // R
            row = np.array([j * R + r for r in range(R) for j in range(spr)])
        else:
            rng = np.random.default_rng(int(spec.split(":", 1)[1]))
            return np.stack([rng.permutation(E) for _ in range(L)])
        return np.tile(row, (L, 1))
    src = None
    if isinstance(spec, (str, os.PathLike)):
        src = Path(spec)
        if not src.exists():
            raise InputError(src, "placement is neither contiguous, round_robin, reverse, random:SEED nor a file")
        try:
            spec = json.loads(src.read_text())
        except ValueError as e:
            raise InputError(src, f"invalid JSON: {e}") from None
    if isinstance(spec, dict):
        spec = spec.get("phy2log", spec.get("physical_to_logical_map"))
    try:
        arr = np.asarray(spec, dtype=np.int64)
    except (TypeError, ValueError):
        raise InputError(src, "placement must be a [layers][slots] integer array") from None
    if arr.ndim == 1:
        arr = np.tile(arr, (L, 1))
    if arr.ndim != 2 or arr.shape[0] != L:
        raise InputError(src, f"placement shape {list(arr.shape)} is not [{L} layers, slots]")
    P = arr.shape[1]
    if P % R:
        raise InputError(src, f"{P} slots do not split evenly over {R} ranks")
    for layer in range(L):
        if arr[layer].min() < 0 or arr[layer].max() >= E or len(set(arr[layer].tolist())) != E:
            raise InputError(src, f"placement layer {layer}: every expert 0..{E - 1} needs at least one slot")
    return arr


def replica_tables(phy2log: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """log2phy [L, E, maxcnt] (-1 padded, slot order) and logcnt [L, E]."""
    L, P = phy2log.shape
    cnt = np.zeros((L, experts), np.int64)
    for layer in range(L):
        cnt[layer] = np.bincount(phy2log[layer], minlength=experts)
    m = int(cnt.max())
    l2p = np.full((L, experts, m), -1, np.int64)
    for layer in range(L):
        fill = np.zeros(experts, np.int64)
        for s in range(P):
            e = phy2log[layer, s]
            l2p[layer, e, fill[e]] = s
            fill[e] += 1
    return l2p, cnt


HASH_MUL = 2654435761  # Knuth's multiplicative hash: replica = (token * HASH_MUL mod 2^32) mod copies


def choose_slots(experts_chosen: np.ndarray, token_ids: np.ndarray, l2p_layer: np.ndarray,
                 cnt_layer: np.ndarray) -> np.ndarray:
    """Replica choice of the reference run (a per-token hash, as vLLM does): copy
    ``(token_id * 2654435761 mod 2^32) mod copies`` of each chosen expert, copies in slot order."""
    copies = cnt_layer[experts_chosen]
    h = (token_ids.astype(np.uint64) * np.uint64(HASH_MUL)) % np.uint64(1 << 32)
    which = (h[:, None] % copies.astype(np.uint64)).astype(np.int64)
    return l2p_layer[experts_chosen, which]


def router_prior(cfg: RefRunConfig) -> np.ndarray:
    """Log-prior added to the router logits: Zipf(skew) over the experts in ``hot`` order."""
    order = list(cfg.hot or []) + [e for e in range(cfg.experts) if e not in (cfg.hot or [])]
    prior = np.zeros(cfg.experts)
    for i, e in enumerate(order):
        prior[e] = -cfg.skew * np.log(i + 1.0)
    return prior


def tokens_of(cfg: RefRunConfig, step: int, rank: int) -> int:
    if (step, rank) in {tuple(x) for x in cfg.idle}:
        return 0
    if step == 0 and cfg.prefill_tokens:
        return cfg.prefill_tokens
    return cfg.tokens_per_rank


# ----------------------------------------------------------------------------- worker
def _seeded(torch, *key):
    g = torch.Generator()
    g.manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1)[0]))
    return g


_EXPERT_OP = None


def _expert_op():
    """The gated MLP of one expert slot as one torch custom op, ``refrun::moe_mlp``: the
    profiler records each call as one CPU op of that name, which the kernel classifier
    maps to ``expert_gemm`` (pattern ``moe_mlp``), so the trace carries one expert-compute
    span per (step, layer, rank, slot touched) with step and layer from the enclosing
    annotations (what ``moetrace calibrate`` fits). Registered once per process."""
    global _EXPERT_OP
    if _EXPERT_OP is None:
        import torch
        import torch.nn.functional as F

        def moe_mlp(x, wg, wd):
            a, b = (x @ wg.T).chunk(2, dim=-1)
            return (F.silu(a) * b) @ wd.T

        _EXPERT_OP = torch.library.custom_op("refrun::moe_mlp", moe_mlp, mutates_args=(),
                                             schema="(Tensor x, Tensor wg, Tensor wd) -> Tensor")
    return _EXPERT_OP


def worker(rank: int, cfg_dict: dict, phy2log_list: list, outdir: str, port: int) -> None:
    """One rank of the reference run (run by torch.multiprocessing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    cfg = RefRunConfig(**{**cfg_dict, "idle": [tuple(x) for x in cfg_dict["idle"]]})
    torch.set_num_threads(cfg.threads_per_rank)
    expert_mlp = _expert_op()
    R, E, K, L, H, FF = cfg.ranks, cfg.experts, cfg.top_k, cfg.layers, cfg.hidden, cfg.ffn
    phy2log = np.asarray(phy2log_list, np.int64)
    P = phy2log.shape[1]
    spr = P // R
    l2p, cnt = replica_tables(phy2log, E)
    slot_rank = np.arange(P) // spr
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    try:
        prior = torch.tensor(router_prior(cfg), dtype=torch.float32)
        w_router = [torch.randn(E, H, generator=_seeded(torch, cfg.seed, 1, layer)) / H ** 0.5 for layer in range(L)]
        w_attn = [torch.randn(H, H, generator=_seeded(torch, cfg.seed, 2, layer)) / H ** 0.5 for layer in range(L)]
        local = {}  # slot -> (w_gate_up [2F, H], w_down [H, F]), weights of its logical expert
        for layer in range(L):
            for s in range(rank * spr, (rank + 1) * spr):
                e = int(phy2log[layer, s])
                g = _seeded(torch, cfg.seed, 3, layer, e)
                local[(layer, s)] = (torch.randn(2 * FF, H, generator=g) / H ** 0.5,
                                     torch.randn(H, FF, generator=g) / FF ** 0.5)
        routing, received, steps = [], [], []
        # injected delay and two-micro-batch layers: the timeline what-ifs are checked against these (produce/refrun_timeline.py)
        tl = refrun_timeline.LayerEnv(torch, dist, F, rank, R, K, P, H, prior, w_router, w_attn, local, l2p, cnt,
                                      slot_rank, expert_mlp, cfg.delay_us if rank == cfg.delay_rank else 0.0,
                                      cfg.delay_every)

        def a2a(t, out_rows, in_splits, out_splits):
            out = t.new_empty((out_rows,) + tuple(t.shape[1:]))
            dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits)
            return out

        # (pass, step, layer, dispatch start, expert start, expert end, combine end) in monotonic ns, then the
        # CPU time of this rank's main thread (time.thread_time_ns: not advanced while the OS runs other
        # processes) in its experts and from dispatch start to combine end; -1: not measured
        timing = []

        def one_step(step, record, tpass):
            """Run ``step`` on this rank; ``record``: keep routing, load and step bounds;
            ``tpass`` >= 0: keep the timing of this pass."""
            n_all = [tokens_of(cfg, step, r) for r in range(R)]
            T = n_all[rank]
            base = sum(n_all[:rank])
            tok_ids = np.arange(base, base + T, dtype=np.int64)
            t0 = time.time_ns()
            step_rf = torch.profiler.record_function(f"ProfilerStep#{step}")
            step_rf.__enter__()
            x = torch.randn(T, H, generator=_seeded(torch, cfg.seed, 4, step, rank))
            for layer in range(L):
                if cfg.micro_batches == 2:
                    x, recs, tt = refrun_timeline.two_micro_batch_layer(tl, layer, x, tok_ids, choose_slots, step)
                    if record:
                        refrun_timeline.keep(recs, step, layer, R, P, routing, received)
                    if tpass >= 0:
                        timing.append((tpass, step, layer, *tt, -1, -1))   # CPU times: not split per micro-batch
                    continue
                with torch.profiler.record_function(f"attention layer {layer}"):
                    x = x + torch.tanh(x @ w_attn[layer]) * 0.5
                    tl.hold(step, layer)
                with torch.profiler.record_function(f"router layer {layer}"):
                    logits = x @ w_router[layer].T + prior
                    probs = F.softmax(logits, dim=-1)
                    gate, chosen = torch.topk(probs, K, dim=-1)
                    gate = gate / gate.sum(dim=-1, keepdim=True)
                ch = chosen.numpy().astype(np.int64)
                slots = choose_slots(ch, tok_ids, l2p[layer], cnt[layer]) if T else np.zeros((0, K), np.int64)
                dest = slot_rank[slots.ravel()]
                order = np.argsort(dest, kind="stable")
                send = np.bincount(dest, minlength=R).astype(np.int64)
                td0 = time.monotonic_ns()
                cd0 = time.thread_time_ns()
                with torch.profiler.record_function(f"dispatch layer {layer}"):
                    recv = torch.empty(R, dtype=torch.int64)
                    dist.all_to_all_single(recv, torch.from_numpy(send))
                    recv_l = recv.tolist()
                    rows = x.repeat_interleave(K, dim=0)[torch.from_numpy(order)] if T else x.new_zeros((0, H))
                    rx = a2a(rows, sum(recv_l), send.tolist(), recv_l)
                    rslot = a2a(torch.from_numpy(slots.ravel()[order]), sum(recv_l), send.tolist(), recv_l)
                te0 = time.monotonic_ns()
                ce0 = time.thread_time_ns()
                with torch.profiler.record_function(f"experts layer {layer}"):
                    rs = rslot.numpy()
                    # rows grouped by slot (stable: each slot's rows keep their order), one call per slot
                    y = refrun_timeline.experts(tl, layer, rx, rs)
                ce1 = time.thread_time_ns()
                te1 = time.monotonic_ns()
                if record and len(rs):
                    # tokens received per (source rank, slot): the measured load of this rank
                    src = np.repeat(np.arange(R), recv_l)
                    c = np.bincount(src * P + rs, minlength=R * P).reshape(R, P)
                    sr, ss = np.nonzero(c)
                    received.append((np.full(len(sr), step), np.full(len(sr), layer), sr, ss, c[sr, ss]))
                with torch.profiler.record_function(f"combine layer {layer}"):
                    back = a2a(y, T * K, recv_l, send.tolist())
                cc1 = time.thread_time_ns()
                tc1 = time.monotonic_ns()
                if tpass >= 0:
                    timing.append((tpass, step, layer, td0, te0, te1, tc1, ce1 - ce0, cc1 - cd0))
                if T:
                    out = torch.empty_like(back)
                    out[torch.from_numpy(order)] = back
                    x = x + (gate.unsqueeze(-1) * out.view(T, K, H)).sum(dim=1)
                    if record:
                        routing.append((np.full(T * K, step), np.full(T * K, layer), np.repeat(tok_ids, K),
                                        np.tile(np.arange(K), T), ch.ravel(), slots.ravel(),
                                        gate.detach().numpy().ravel()))
            step_rf.__exit__(None, None, None)
            t1 = time.time_ns()
            if record:
                steps.append((step, T, t0, t1))

        def say(msg):
            if cfg.progress and rank == 0:
                print(f"refrun: {msg}", file=sys.stderr, flush=True)

        dist.barrier()
        t_start = time.monotonic()
        for _ in range(cfg.warmup):
            one_step(0, False, -1)
        if cfg.warmup:
            say(f"{cfg.warmup} warm-up iteration(s) done ({time.monotonic() - t_start:.1f} s)")
        # with several timed passes the profiler gets a pass of its own (no overhead in the timings)
        extra = cfg.profile and cfg.repeats > 1
        passes = cfg.repeats + (1 if extra else 0)
        prof = None
        for p in range(passes):
            timed = p < cfg.repeats
            record = p == (passes - 1 if extra else 0)
            profiled = cfg.profile and p == passes - 1
            if profiled:
                from torch.profiler import ProfilerActivity, profile
                prof = profile(activities=[ProfilerActivity.CPU])
                with _quiet_fds():     # Kineto prints 'USDT: profiler_start' on the raw descriptors
                    prof.__enter__()
            tl.recording = record
            for step in range(cfg.steps):
                one_step(step, record, p if timed else -1)
            tl.recording = False
            if profiled:
                dist.barrier()
                with _quiet_fds():
                    prof.__exit__(None, None, None)
            say(f"pass {p + 1}/{passes} done ({'timed' if timed else 'profiled'}; {cfg.steps} steps; "
                f"{time.monotonic() - t_start:.1f} s)")
        dist.barrier()
        if prof is not None:
            raw = os.path.join(outdir, f".rank{rank}_trace.json")
            prof.export_chrome_trace(raw)
            _finish_trace(raw, os.path.join(outdir, f"rank{rank}_trace.json.gz"))
        cat = (lambda parts, i, dt: np.concatenate([p[i] for p in parts]).astype(dt) if parts else np.zeros(0, dt))
        pq.write_table(pa.table({
            "step": cat(routing, 0, np.int64), "layer": cat(routing, 1, np.int32), "token": cat(routing, 2, np.int64),
            "src_rank": np.full(sum(len(p[0]) for p in routing), rank, np.int32),
            "choice": cat(routing, 3, np.int8), "expert": cat(routing, 4, np.int32), "slot": cat(routing, 5, np.int32),
            "gate": cat(routing, 6, np.float32)}), os.path.join(outdir, f"routing_rank{rank}.parquet"))
        pq.write_table(pa.table({
            "step": cat(received, 0, np.int64), "layer": cat(received, 1, np.int32),
            "rank": np.full(sum(len(p[0]) for p in received), rank, np.int32),
            "src_rank": cat(received, 2, np.int32), "slot": cat(received, 3, np.int32),
            "tokens": cat(received, 4, np.int64)}), os.path.join(outdir, f"received_rank{rank}.parquet"))
        pq.write_table(pa.table({
            "step": np.array([s[0] for s in steps], np.int64), "rank": np.full(len(steps), rank, np.int32),
            "num_tokens": np.array([s[1] for s in steps], np.int64),
            "start_ns": np.array([s[2] for s in steps], np.int64),
            "end_ns": np.array([s[3] for s in steps], np.int64)}), os.path.join(outdir, f"steps_rank{rank}.parquet"))
        if tl.held:   # read, folded into the manifest and removed by run()
            with open(os.path.join(outdir, f".delay_rank{rank}.json"), "w", encoding="utf-8") as f:
                json.dump(tl.held, f)
        tm = np.array(timing, np.int64).reshape(-1, 9)
        pq.write_table(pa.table({
            "pass": tm[:, 0].astype(np.int32), "step": tm[:, 1], "layer": tm[:, 2].astype(np.int32),
            "rank": np.full(len(tm), rank, np.int32), "dispatch_start_ns": tm[:, 3], "expert_start_ns": tm[:, 4],
            "expert_end_ns": tm[:, 5], "combine_end_ns": tm[:, 6],
            "expert_cpu_ns": pa.array(tm[:, 7], mask=tm[:, 7] < 0), "moe_cpu_ns": pa.array(tm[:, 8], mask=tm[:, 8] < 0)}), os.path.join(outdir, f"timing_rank{rank}.parquet"))
    finally:
        dist.destroy_process_group()


def _injected_delay(out: Path, cfg: RefRunConfig) -> dict:
    """What the injected delay really held in the recorded pass (``{}`` without one): the
    requested µs, and the mean / max µs held over the delayed (step, layer)s — on a loaded
    machine the OS wakes the sleeping rank late, so the held delay exceeds the request."""
    f = out / f".delay_rank{cfg.delay_rank}.json"
    if cfg.delay_rank < 0 or not f.exists():
        return {}
    held = np.array([h[2] for h in json.loads(f.read_text())], np.float64) / 1000.0
    f.unlink()
    return {"injected_delay": {"rank": cfg.delay_rank, "requested_us": cfg.delay_us, "n": int(len(held)),
                               "held_mean_us": round(float(held.mean()), 3), "held_max_us": round(float(held.max()), 3)}}


class _quiet_fds:
    """Send the process's stdout and stderr descriptors to /dev/null for a while (C++
    libraries print there directly, past Python's sys.stdout)."""

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


def cpu_name() -> str:
    """The CPU model, as the hardware key of a reference run (``runs.meta_json`` ``hardware``):
    calibrations of runs with the same key are comparable."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _finish_trace(raw: str, dest: str) -> None:
    """gzip the exported trace and name it by its file (Kineto writes its temp path into traceName)."""
    import gzip

    with open(raw, encoding="utf-8") as f:
        doc = json.load(f)
    doc["traceName"] = os.path.basename(dest)
    with gzip.open(dest, "wt", encoding="utf-8", compresslevel=6) as f:
        json.dump(doc, f, separators=(",", ":"))
    os.unlink(raw)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cfg: RefRunConfig, outdir: str | Path) -> dict:
    """Run the reference run into ``outdir`` (created; must be empty). Returns the manifest."""
    from ..collect._torchload import import_torch

    cfg.validate()
    torch = import_torch(None)
    import torch.multiprocessing as mp

    out = Path(outdir)
    if out.exists() and any(out.iterdir()):
        raise InputError(out, "output folder is not empty")
    out.mkdir(parents=True, exist_ok=True)
    phy2log = parse_placement(cfg.placement, cfg.layers, cfg.experts, cfg.ranks)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cores = cpu_cores()
    threads = cfg.ranks * cfg.threads_per_rank
    oversubscribed = threads > cores
    if cfg.progress:
        print(f"refrun: {cfg.ranks} ranks x {cfg.threads_per_rank} thread(s) on {cores} CPU core(s)"
              + (": OVERSUBSCRIBED, ranks share cores and the timings are noisier" if oversubscribed else "")
              + f"; {cfg.warmup} warm-up iteration(s), {cfg.repeats} timed pass(es) of {cfg.steps} steps"
              + ("" if not cfg.profile else ", profiler on" + (" (one extra pass)" if cfg.repeats > 1 else ""))
              + "; starting the rank processes", file=sys.stderr, flush=True)
    t0 = time.time()
    cfg_dict = asdict(cfg)
    cfg_dict["placement"] = cfg.placement if isinstance(cfg.placement, str) else "custom"
    from ..safety import (
        arrow_path,  # the ranks write with Arrow: absolute, so '~' and 'file:' are literal
    )

    ctx = mp.start_processes(worker, args=(cfg_dict, phy2log.tolist(), arrow_path(out), _free_port()),
                             nprocs=cfg.ranks, join=False, start_method="spawn")
    deadline = time.time() + cfg.timeout_s
    while not ctx.join(timeout=1.0):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise RuntimeError(f"reference run did not finish within {cfg.timeout_s:.0f} s")
    import polars as pl

    # bytes, not a path: polars reads a path as a pattern (an --out a[1] would read a1's files)
    timing = pl.concat([pl.read_parquet((out / f"timing_rank{r}.parquet").read_bytes()) for r in range(cfg.ranks)])
    _, noise = summarize_timing(timing)
    noise.update({"cpu_cores": cores, "oversubscribed": oversubscribed,
                  "loadavg_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None})
    manifest = {
        "moetrace_refrun": 1,
        **_injected_delay(out, cfg),
        # a placement file is named, not located: the manifest travels with the traces
        "config": {**cfg_dict, "placement": os.path.basename(cfg_dict["placement"])
                   if os.path.isfile(cfg_dict["placement"]) else cfg_dict["placement"]},
        "phy2log": phy2log.tolist(),
        "num_slots": int(phy2log.shape[1]), "slots_per_rank": int(phy2log.shape[1] // cfg.ranks),
        "replica_choice": "(token_id * 2654435761 mod 2^32) mod copies, copies in slot order", "router_prior": router_prior(cfg).tolist(),
        "torch": torch.__version__, "wall_s": round(time.time() - t0, 3), "noise": noise,
        "hardware": cpu_name(),
        "files": sorted(p.name for p in out.iterdir()),
    }
    from ..output import write_output

    write_output(out / MANIFEST, json.dumps(manifest) + "\n", "manifest")
    return manifest
