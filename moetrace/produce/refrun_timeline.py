"""Timeline options of the reference run (:mod:`moetrace.produce.refrun`): a known
per-layer delay of one rank (the cause the wait attribution must find) and the
two-micro-batch mode (the all-to-all of one micro-batch in flight while the other
computes), which the overlap what-if (:mod:`moetrace.replay.timeline_whatif`) is checked against.

Two micro-batches, per MoE layer (tokens split in halves A = first T//2, B = the rest;
per-token math is unchanged, so routing and outputs equal the one-batch run's):

1. attention + router of A; exchange A's counts (blocking, 8 bytes per rank); launch A's
   dispatch (rows, slot ids) asynchronously;
2. attention + router of B while A's dispatch is in flight; B's counts; launch B's dispatch;
3. wait for A's dispatch; experts of A while B's dispatch is in flight; launch A's combine;
4. wait for B's dispatch; experts of B while A's combine is in flight; launch B's combine;
5. wait for A's combine and add it to A's residual stream; the same for B.

Every rank issues the collectives in the same order (gloo runs them on its worker
threads, so they progress while this thread computes). Each expert runs once per
micro-batch (two smaller GEMMs instead of one): that cost is part of what is measured.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


def delay(us: float) -> int:
    """Hold this thread for ``us`` microseconds: sleep most of it, spin the last 300 µs
    (sleep alone overshoots by tens of µs). Returns the nanoseconds actually held, which on
    a loaded machine exceed ``us`` by however late the OS woke the thread (0 for no delay)."""
    if us <= 0:
        return 0
    t0 = time.perf_counter_ns()
    end = t0 + int(us * 1000)
    rest = us * 1e-6 - 300e-6
    if rest > 0:
        time.sleep(rest)
    while time.perf_counter_ns() < end:
        pass
    return time.perf_counter_ns() - t0


@dataclass
class LayerEnv:
    """What a rank's layer needs (built once per rank in the worker)."""
    torch: object
    dist: object
    F: object
    rank: int
    R: int
    K: int
    P: int
    H: int
    prior: object
    w_router: list
    w_attn: list
    local: dict
    l2p: np.ndarray
    cnt: np.ndarray
    slot_rank: np.ndarray
    expert_mlp: object
    delay_us: float = 0.0           # this rank's injected delay per layer (0: none)
    delay_every: int = 1            # the delay is injected in steps s with s % delay_every == 0

    def delay_at(self, step: int) -> float:
        """The delay (µs) this rank injects in each layer of ``step``: ``delay_us`` in every
        ``delay_every``-th step (from step 0), else 0 — with 2, the undelayed steps are a
        control run interleaved with the delayed ones, under the same machine load."""
        return self.delay_us if self.delay_us > 0 and step % self.delay_every == 0 else 0.0

    held: list = field(default_factory=list)  # (step, layer, ns actually held) of the recorded pass
    recording: bool = False                   # set by the worker during the recorded (= profiled) pass

    def hold(self, step: int, layer: int) -> None:
        """Inject this step's delay and, in the recorded pass, keep how long it really held
        (the manifest's ``injected_delay``: the ground truth the wait shift is judged against)."""
        ns = delay(self.delay_at(step))
        if ns and self.recording:
            self.held.append((step, layer, ns))


def experts(env: LayerEnv, layer: int, rx, rs: np.ndarray):
    """Local experts over received rows, grouped by slot (stable: each slot's rows keep
    their order), one call per slot; the same in one- and two-micro-batch layers."""
    torch = env.torch
    perm = np.argsort(rs, kind="stable")
    uniq, first = np.unique(rs[perm], return_index=True)
    bounds = list(first) + [len(rs)]
    perm_t = torch.from_numpy(perm)
    xs = rx[perm_t]
    ys = torch.empty_like(xs)
    for i, s in enumerate(uniq):
        wg, wd = env.local[(layer, int(s))]
        ys[bounds[i]:bounds[i + 1]] = env.expert_mlp(xs[bounds[i]:bounds[i + 1]], wg, wd)
    y = torch.empty_like(rx)
    y[perm_t] = ys
    return y


def two_micro_batch_layer(env: LayerEnv, layer: int, x, tok_ids: np.ndarray, choose_slots, step: int = 0):
    """One MoE layer with two micro-batches (see the module docstring).

    Returns ``(x_out, records, times)``: ``records`` one tuple per micro-batch
    ``(tok_ids, chosen [T, K], slots [T, K], gate [T, K], recv_l, rslot)`` for the
    caller's routing / load tables; ``times`` (dispatch start, first expert start, last
    expert end, last combine end) in monotonic ns."""
    torch, dist, F = env.torch, env.dist, env.F
    R, K, H = env.R, env.K, env.H
    rec = torch.profiler.record_function
    T = x.shape[0]
    cut = T // 2
    parts = [(0, slice(0, cut)), (1, slice(cut, T))]
    st = {}
    td0 = time.monotonic_ns()
    for m, sl in parts:
        xm, ids = x[sl], tok_ids[sl]
        n = xm.shape[0]
        with rec(f"attention layer {layer} micro_batch {m}"):
            xm = xm + torch.tanh(xm @ env.w_attn[layer]) * 0.5
            if m == 0:
                env.hold(step, layer)
        with rec(f"router layer {layer} micro_batch {m}"):
            probs = F.softmax(xm @ env.w_router[layer].T + env.prior, dim=-1)
            gate, chosen = torch.topk(probs, K, dim=-1)
            gate = gate / gate.sum(dim=-1, keepdim=True)
        ch = chosen.numpy().astype(np.int64)
        slots = choose_slots(ch, ids, env.l2p[layer], env.cnt[layer]) if n else np.zeros((0, K), np.int64)
        dest = env.slot_rank[slots.ravel()]
        order = np.argsort(dest, kind="stable")
        send = np.bincount(dest, minlength=R).astype(np.int64)
        with rec(f"dispatch layer {layer} micro_batch {m}"):
            recv = torch.empty(R, dtype=torch.int64)
            dist.all_to_all_single(recv, torch.from_numpy(send))
            recv_l = recv.tolist()
            rows = xm.repeat_interleave(K, dim=0)[torch.from_numpy(order)] if n else xm.new_zeros((0, H))
            rx = rows.new_empty((sum(recv_l), H))
            w_rows = dist.all_to_all_single(rx, rows.contiguous(), recv_l, send.tolist(), async_op=True)
            sl_send = torch.from_numpy(np.ascontiguousarray(slots.ravel()[order]))
            rslot = sl_send.new_empty((sum(recv_l),))
            w_slots = dist.all_to_all_single(rslot, sl_send, recv_l, send.tolist(), async_op=True)
        st[m] = dict(xm=xm, ids=ids, n=n, ch=ch, slots=slots, gate=gate, order=order, send=send, recv_l=recv_l,
                     rx=rx, rslot=rslot, waits=(w_rows, w_slots))
    te0 = te1 = None
    for m, _ in parts:
        s = st[m]
        with rec(f"wait dispatch layer {layer} micro_batch {m}"):
            for w in s["waits"]:
                w.wait()
        t = time.monotonic_ns()
        te0 = t if te0 is None else te0
        with rec(f"experts layer {layer} micro_batch {m}"):
            y = experts(env, layer, s["rx"], s["rslot"].numpy())
        te1 = time.monotonic_ns()
        with rec(f"combine layer {layer} micro_batch {m}"):
            back = y.new_empty((s["n"] * K, H))
            s["back"] = back
            s["cwait"] = dist.all_to_all_single(back, y.contiguous(), s["send"].tolist(), s["recv_l"], async_op=True)
    outs, records = [], []
    for m, _ in parts:
        s = st[m]
        with rec(f"wait combine layer {layer} micro_batch {m}"):
            s["cwait"].wait()
        xm = s["xm"]
        if s["n"]:
            out = torch.empty_like(s["back"])
            out[torch.from_numpy(s["order"])] = s["back"]
            xm = xm + (s["gate"].unsqueeze(-1) * out.view(s["n"], K, H)).sum(dim=1)
        outs.append(xm)
        records.append((s["ids"], s["ch"], s["slots"], s["gate"], s["recv_l"], s["rslot"].numpy()))
    tc1 = time.monotonic_ns()
    return torch.cat(outs, dim=0), records, (td0, te0, te1, tc1)


def keep(records, step: int, layer: int, R: int, P: int, routing: list, received: list) -> None:
    """Append a two-micro-batch layer's routing rows and received load (summed over both
    micro-batches: one row per (source rank, slot)) in the worker's tuple layouts."""
    K = None
    c = np.zeros((R, P), np.int64)
    for ids, ch, slots, gate, recv_l, rs in records:
        K = ch.shape[1] if ch.ndim == 2 else K
        if len(rs):
            src = np.repeat(np.arange(R), recv_l)
            c += np.bincount(src * P + rs, minlength=R * P).reshape(R, P)
        n = len(ids)
        if n:
            routing.append((np.full(n * K, step), np.full(n * K, layer), np.repeat(ids, K), np.tile(np.arange(K), n),
                            ch.ravel(), slots.ravel(), gate.detach().numpy().ravel()))
    sr, ss = np.nonzero(c)
    if len(sr):
        received.append((np.full(len(sr), step), np.full(len(sr), layer), sr, ss, c[sr, ss]))
