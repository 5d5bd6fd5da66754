"""What-ifs on a recorded timeline: arrays in, results out (no store, no files).

Three questions, each with its assumptions stated in the result (and in docs/explanation/timeline.md):

* :func:`overlap_two_micro_batches` -- what two micro-batches would have done to the
  exposed all-to-all and the step time: each micro-batch's all-to-all hides behind the
  other's compute.
* :func:`disaggregation` -- attention and expert FFNs on separate GPU pools
  (MegaScale-Infer): the best attention:expert GPU split and micro-batch count, and the
  per-GPU throughput against the co-located deployment.
* :func:`domain_sweep` -- ranks per NVLink domain (8, 16, 72, ...): the all-to-all bytes
  that cross domains and the transfer time they cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# ----------------------------------------------------------------------------- overlap
OVERLAP_ASSUMPTIONS = (
    "two equal micro-batches; per rank and layer, compute c = (step time - exposed all-to-all) / layers "
    "(the layer's share of everything that is not exposed all-to-all, spread evenly over layers); "
    "each micro-batch's exposed all-to-all e hides behind the other's compute: layer time max(c + extra, e); "
    "the second micro-batch's last combine has nothing to hide behind (+ half the last layer's exposed "
    "combine); waiting for a peer is treated like transfer; 'extra' is the cost of running each expert "
    "twice on half the tokens (split_extra_ns per layer, 0 = halves cost exactly half); each micro-batch pays "
    "the all-to-all's fixed latency again (a2a_latency_ns per layer, added to the exposed all-to-all); the "
    "transfer progresses without taking compute resources (true of NVLink/RDMA copy engines and DeepEP's few "
    "SMs, not of a CPU all-to-all); step time = slowest rank")


@dataclass
class OverlapResult:
    steps: np.ndarray               # [S] step ids
    before_ns: np.ndarray           # [S] recorded step time (slowest rank)
    after_ns: np.ndarray            # [S] predicted step time with two micro-batches (slowest rank)
    exposed_before_ns: np.ndarray   # [S] exposed all-to-all, mean over ranks
    exposed_after_ns: np.ndarray    # [S] predicted exposed all-to-all, mean over ranks
    split_extra_ns: float
    a2a_latency_ns: float = 0.0
    assumptions: str = OVERLAP_ASSUMPTIONS

    @property
    def speedup(self) -> float:
        return float(self.before_ns.sum() / max(self.after_ns.sum(), 1.0))


def overlap_two_micro_batches(steps, step_ns, exposed_ns, combine_exposed_ns, split_extra_ns: float = 0.0,
                              a2a_latency_ns: float = 0.0) -> OverlapResult:
    """``step_ns [S, R]`` recorded step time per rank; ``exposed_ns [S, L, R]`` exposed
    all-to-all (dispatch + combine) per layer; ``combine_exposed_ns [S, L, R]`` its combine
    part; ``a2a_latency_ns``: the all-to-all's fixed cost per layer (paid once more with two
    micro-batches). Returns before / after per step (see :data:`OVERLAP_ASSUMPTIONS`)."""
    step_ns = np.asarray(step_ns, np.float64)
    e = np.asarray(exposed_ns, np.float64)
    b = np.asarray(combine_exposed_ns, np.float64)
    S, L, R = e.shape
    if step_ns.shape != (S, R) or b.shape != e.shape:
        raise ValueError(f"shapes: step_ns {step_ns.shape}, exposed {e.shape}, combine {b.shape}")
    c = np.maximum(step_ns - e.sum(axis=1), 0.0)[:, None, :] / L          # [S, 1, R]
    cx = c + float(split_extra_ns)
    # the second micro-batch's last combine (half the last layer's combine) cannot hide
    hideable = e + float(a2a_latency_ns)
    hideable[:, -1, :] -= b[:, -1, :] / 2
    exposed_after = np.maximum(hideable - cx, 0.0).sum(axis=1) + b[:, -1, :] / 2   # [S, R]
    after = cx[:, 0, :] * L + exposed_after                                 # [S, R]
    return OverlapResult(np.asarray(steps), step_ns.max(axis=1), after.max(axis=1), e.sum(axis=1).mean(axis=1),
                         exposed_after.mean(axis=1), float(split_extra_ns), float(a2a_latency_ns))


# ----------------------------------------------------------------------------- disaggregation
DISAGG_ASSUMPTIONS = (
    "per layer, a batch of B tokens in m equal micro-batches; M attention GPUs (data parallel), N expert GPUs; "
    "Ta = fa + (B/m)/M * ta, Te = fe + (B/m)/N * te, Tc = (B/m)/min(M, N) * tc (one way); "
    "layer time = max(m * max(Ta, Te, Tc), Ta + Te + 2 Tc) (steady ping-pong once m covers a round trip); "
    "co-located on M + N GPUs: fa + fe + B/(M+N) * (ta + te + 2 tc); per-GPU throughput = B / (layer time x GPUs); "
    "times scale linearly with tokens beyond the fixed fa, fe")


@dataclass
class DisaggCandidate:
    attn_gpus: int
    expert_gpus: int
    micro_batches: int
    ta_ns: float
    te_ns: float
    tc_ns: float
    layer_ns: float
    tokens_per_gpu_s: float


@dataclass
class DisaggResult:
    best: DisaggCandidate
    colocated_layer_ns: float
    colocated_tokens_per_gpu_s: float
    gain: float                          # best per-GPU throughput / co-located
    min_micro_batches: int               # smallest m that covers the round trip at the best split
    candidates: list[DisaggCandidate] = field(default_factory=list)
    assumptions: str = DISAGG_ASSUMPTIONS


def _disagg_layer(B, M, N, m, ta, te, tc, fa, fe):
    bm = B / m
    Ta = fa + bm / M * ta
    Te = fe + bm / N * te
    Tc = bm / min(M, N) * tc
    return Ta, Te, Tc, max(m * max(Ta, Te, Tc), Ta + Te + 2 * Tc)


def disaggregation(tokens: float, gpus: int, ta_ns: float, te_ns: float, tc_ns: float, fa_ns: float = 0.0,
                   fe_ns: float = 0.0, max_micro_batches: int = 8) -> DisaggResult:
    """Best split of ``gpus`` into M attention + N expert GPUs and micro-batch count m
    (1..max_micro_batches) for a batch of ``tokens`` per layer; ``ta_ns``, ``te_ns``: ns per
    token on one GPU (attention; expert FFN with all its top-k experts); ``tc_ns``: ns per
    token to move its hidden state one way between the pools (per GPU link); ``fa_ns``,
    ``fe_ns``: fixed cost per micro-batch and layer (launches, reading expert weights).
    Ties: the fewest micro-batches, then the fewest attention GPUs."""
    if gpus < 2:
        raise ValueError("disaggregation needs at least 2 GPUs")
    B = float(tokens)
    cands = []
    for M in range(1, gpus):
        N = gpus - M
        for m in range(1, max_micro_batches + 1):
            Ta, Te, Tc, lay = _disagg_layer(B, M, N, m, ta_ns, te_ns, tc_ns, fa_ns, fe_ns)
            cands.append(DisaggCandidate(M, N, m, Ta, Te, Tc, lay, B / (lay * 1e-9) / gpus))
    best = max(cands, key=lambda c: (round(c.tokens_per_gpu_s, 6), -c.micro_batches, -c.attn_gpus))
    colo = fa_ns + fe_ns + B / gpus * (ta_ns + te_ns + 2 * tc_ns)
    colo_tput = B / (colo * 1e-9) / gpus
    m_min = next(m for m in range(1, max_micro_batches + 1)
                 if _disagg_layer(B, best.attn_gpus, best.expert_gpus, m, ta_ns, te_ns, tc_ns, fa_ns, fe_ns)[3]
                 <= best.layer_ns * (1 + 1e-12))
    return DisaggResult(best, colo, colo_tput, best.tokens_per_gpu_s / colo_tput, m_min, cands)


# ----------------------------------------------------------------------------- domain size
DOMAIN_ASSUMPTIONS = (
    "rank r sits in NVLink domain r // D; a token goes once to each distinct destination rank (none to its own); "
    "bytes inside a domain move at the NVLink rate, bytes between domains at the scale-out NIC rate; per (step, "
    "layer) the all-to-all takes the slowest rank's send time (dispatch; the combine moves the same bytes back)")


@dataclass
class DomainResult:
    domain_size: int
    domains: int
    intra_bytes: float        # over all steps and layers
    inter_bytes: float
    inter_share: float
    a2a_ns_per_step: float    # dispatch + combine, mean per step (slowest rank per layer, summed over layers)


def domain_sweep(traffic, bytes_per_token: float, sizes, intra_Bps: float, inter_Bps: float) -> list[DomainResult]:
    """``traffic [T, L, R, R]``: tokens sent from rank i to rank j per (step, layer)
    (distinct token-destination pairs; the diagonal is ignored). One result per domain size."""
    tr = np.asarray(traffic, np.float64).copy()
    T, L, R, R2 = tr.shape
    if R != R2:
        raise ValueError(f"traffic must be [T, L, R, R], got {tr.shape}")
    idx = np.arange(R)
    tr[:, :, idx, idx] = 0.0
    out = []
    for D in sizes:
        D = int(D)
        if D < 1:
            raise ValueError(f"domain size {D} < 1")
        same = (idx[:, None] // D) == (idx[None, :] // D)
        intra = (tr * same).sum(axis=3) * bytes_per_token         # [T, L, R] bytes each rank sends
        inter = (tr * ~same).sum(axis=3) * bytes_per_token
        t = intra / intra_Bps * 1e9 + inter / inter_Bps * 1e9
        per_step = 2 * t.max(axis=2).sum(axis=1)                  # [T]
        ib, eb = float(intra.sum()), float(inter.sum())
        out.append(DomainResult(D, -(-R // D), ib, eb, eb / (ib + eb) if ib + eb else 0.0,
                                float(per_step.mean()) if T else 0.0))
    return out
