"""The per-layer cost model of a MoE layer under expert parallelism.

For one (step, layer) and rank r::

    work_r     = a_ns · tokens_r + b_ns · slots_touched_r            (GEMM work + weight reads)
    compute_r  = fixed_ns + work_r + contention · Σ_{j≠r} min(work_j, work_r)
    dispatch_r = latency_ns / 2 + bytes_intra_r / nvlink_Bps + bytes_inter_r / internode_Bps
    combine_r  = dispatch_r                                       (the same rows travel back)
    rank_r     = dispatch_r + compute_r + combine_r
    layer      = max_r rank_r                                     (the combine is a barrier)

The contention term (measured on the reference runs): the ranks start their experts together after the
dispatch, and for every ns that another rank computes at the same time a rank loses
``contention`` ns (ranks that share cores, caches or memory bandwidth; 0 where every rank
has its own device, as the GPU presets assume). With it, ``rank_ns`` needs the ranks on
the last axis. It is 0 unless fitted on request: the fidelity matrix did not confirm it on
held-out runs (docs/calibration.md), so the replay's fit leaves it out.

A named hardware preset times ranks with the GPU cost model instead (:mod:`.gpu_cost`
over :mod:`moetrace.costmodel`: grouped-GEMM time from tokens per expert with tile
quantization, dispatch/combine from the bottleneck link, a band measured on published
kernel rows); the linear terms are fitted from the run's ``expert_gemm`` spans (least squares of span duration
against the rank's tokens and slots touched). Every prediction records which parameters it
used (:meth:`CostModel.describe`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from ..domain.model_shape import DEFAULT_DTYPE_BYTES, DEFAULT_HIDDEN, default_expert_bytes
from . import replay_gpu as gpu_cost
from .hardware import GPUS

#: the hardware presets: every GPU the GPU cost model (moetrace.costmodel) knows, with its
#: datasheet source; their times come from that model (:mod:`.gpu_cost`)
PRESETS: dict[str, dict] = {name: {"source": g.source} for name, g in GPUS.items()}


@dataclass
class CostModel:
    a_ns: float            # ns per token-expert assignment on a rank
    b_ns: float            # ns per physical slot touched (reading its weights)
    nvlink_Bps: float      # bytes per second inside a node
    internode_Bps: float   # bytes per second between nodes
    source: str            # "preset H200 (...)" or "fitted from N expert_gemm spans ..."
    fit: dict | None = None
    #: relative error of a predicted time (e.g. 0.25 = ±25%) and where it comes from; None:
    #: not stated, :func:`error_band` gives the uncalibrated default
    rel_error: float | None = None
    rel_error_source: str | None = None
    #: measured terms (each justified in docs/calibration.md by the fidelity matrix):
    #: a fixed cost per rank and layer (framework overhead of the expert block, idle ranks
    #: included) and a per-layer all-to-all latency (dispatch + combine, half each), the
    #: time a layer costs beyond the slowest rank's compute and bytes
    fixed_ns: float = 0.0
    latency_ns: float = 0.0
    contention: float = 0.0
    #: a hardware preset's GPU cost model (:mod:`.gpu_cost`: hardware, hidden, intermediate,
    #: weight dtype, kernel regime, message dtypes); None: the linear terms above time it
    gpu: dict | None = None
    #: what the replay's answers say about the model's inputs (the all-to-all kernel, its
    #: SMs, node-limited routing), one line each
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.describe(), sort_keys=True)

    def transfer_ns(self, bytes_intra, bytes_inter):
        """Time to move bytes over NVLink (intra-node) and the NIC (inter-node), one after the other."""
        return (np.asarray(bytes_intra, np.float64) * (1e9 / self.nvlink_Bps)
                + np.asarray(bytes_inter, np.float64) * (1e9 / self.internode_Bps))

    #: the all-to-all can be timed from received tokens (:meth:`comm_received_ns`)
    fused_comm = True

    def compute_ns(self, tokens, touched) -> np.ndarray:
        """Per-rank expert compute ns (the compute term of :meth:`rank_ns`), a fresh array.
        ``touched`` None: one slot per rank, touched where the rank has tokens."""
        if self.gpu is not None:
            work = gpu_cost.expert_ns(self.gpu, tokens, touched)
        else:
            if touched is None:
                touched = np.greater(tokens, 0).astype(np.int32)
            work = self.a_ns * np.asarray(tokens) + self.b_ns * np.asarray(touched)
        if self.contention:
            compute = self.fixed_ns + work
            compute = compute + self.contention * overlap_ns(work)
        elif isinstance(work, np.ndarray) and work.dtype == np.float64 and work.ndim:
            compute = work      # a fresh array: fixed_ns + work in place (the same sums)
            if self.fixed_ns:   # (+ 0.0 changes no time: they are >= 0, never -0.0)
                compute += self.fixed_ns
        else:
            compute = self.fixed_ns + work
        return np.asarray(compute, np.float64)

    def comm_received_ns(self, received, per_token: tuple[float, float]) -> np.ndarray:
        """Dispatch + combine ns per rank when the bytes are ``received`` tokens times
        ``per_token`` = (intra-node, inter-node) bytes per received token (the estimate's
        form): the sum of :meth:`rank_ns`'s dispatch and combine, in one pass (equal up to
        float rounding: both links scale with the received tokens)."""
        a, b = per_token
        if self.gpu is not None:
            return gpu_cost.comm_received_ns(self.gpu, received, a, b)
        k = 2 * (a * (1e9 / self.nvlink_Bps) + b * (1e9 / self.internode_Bps))
        out = np.multiply(received, k, dtype=np.float64)
        out += self.latency_ns
        return out

    def rank_ns(self, tokens, touched, bytes_intra, bytes_inter):
        """Per-rank (dispatch, compute, combine) in ns, broadcasting over any shape (ranks on
        the last axis when ``contention`` > 0)."""
        if self.gpu is not None:
            disp, comb = gpu_cost.comm_ns(self.gpu, bytes_intra, bytes_inter)
            work = gpu_cost.expert_ns(self.gpu, tokens, touched)
        else:
            disp = comb = self.transfer_ns(bytes_intra, bytes_inter) + self.latency_ns / 2
            work = self.a_ns * np.asarray(tokens) + self.b_ns * np.asarray(touched)
        compute = self.fixed_ns + work
        if self.contention:
            compute = compute + self.contention * overlap_ns(work)
        return disp, compute, comb


def overlap_ns(work) -> np.ndarray:
    """Per rank (last axis): Σ over the other ranks j of min(work_j, work_r), the time other
    ranks compute while rank r does, when all start together. O(R log R) per row (sort and
    cumulative sum), no R × R array."""
    w = np.asarray(work, np.float64)
    if w.ndim == 0 or w.shape[-1] < 2:
        return np.zeros_like(w)
    R = w.shape[-1]
    order = np.argsort(w, axis=-1, kind="stable")
    ws = np.take_along_axis(w, order, -1)
    # sorted position i: the i smaller ranks count whole, the R-1-i others count ws[i] each
    ov = (np.cumsum(ws, axis=-1) - ws) + ws * (R - 1 - np.arange(R))
    out = np.empty_like(ov)
    np.put_along_axis(out, order, ov, -1)
    return out


def preset(name: str, hidden: int | None = None, expert_bytes: int | None = None,
           moe_intermediate: int | None = None, kernel: str | None = "normal", sms: int | None = None,
           max_nodes_per_token: int | None = None) -> CostModel:
    """The GPU cost model of hardware ``name`` (:mod:`moetrace.costmodel`, fitted on
    published kernel measurements) for a model with ``hidden`` and ``expert_bytes`` (FP8
    weights: 3 matrices hidden x intermediate, one byte each), with its measured band.
    ``kernel`` (None: ``normal``), ``sms`` and ``max_nodes_per_token`` as ``moetrace cost``
    takes them: the kernel chooses the fitted all-to-all efficiencies, its SM limit and
    band. ``a_ns``/``b_ns``/bandwidths are the model's large-batch slopes (display, weight moves)."""
    key = name.upper()
    if key not in PRESETS:
        raise KeyError(f"unknown hardware preset {name!r} (choose from {', '.join(PRESETS)})")
    kernel = kernel or "normal"
    used_sms, notes = gpu_cost.kernel_inputs(key, kernel, sms, max_nodes_per_token)
    hidden = hidden or DEFAULT_HIDDEN
    expert_bytes = expert_bytes or default_expert_bytes(hidden)
    inter = moe_intermediate or max(1, expert_bytes // (3 * hidden))   # FP8: 1 byte per weight
    spec = {"hardware": key, "hidden": int(hidden), "intermediate": int(inter), "weight_dtype": "fp8",
            "kernel": kernel, "sms": used_sms, "dispatch_dtype": "fp8", "combine_dtype": "bf16",
            "token_bytes": int(hidden) * DEFAULT_DTYPE_BYTES}
    lin = gpu_cost.linear_terms(key, int(hidden), int(inter), kernel=kernel)
    rel, src = gpu_cost.band(key, kernel)
    on = f" on {used_sms} SMs" if used_sms else ""
    return CostModel(a_ns=lin["a_ns"], b_ns=lin["b_ns"], nvlink_Bps=lin["nvlink_Bps"],
                     internode_Bps=lin["internode_Bps"],
                     source=f"preset {key}: GPU cost model (moetrace.costmodel: grouped-GEMM roofline with tile "
                            f"quantization, {kernel} all-to-all{on}); {PRESETS[key]['source']}; hidden {hidden}, "
                            f"expert_bytes {expert_bytes}",
                     rel_error=rel, rel_error_source=src, gpu=spec, notes=notes)


def fit_expert_time(tokens, touched, duration_ns, base: CostModel) -> CostModel | None:
    """Least-squares fit of duration ≈ a·tokens + b·touched (both ≥ 0). None when the data
    cannot determine the two parameters (fewer than 8 points, or no spread in tokens)."""
    x1 = np.asarray(tokens, np.float64)
    x2 = np.asarray(touched, np.float64)
    y = np.asarray(duration_ns, np.float64)
    if y.size < 8 or np.ptp(x1) == 0:
        return None
    A = np.stack([x1, x2], axis=1)
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    a, b = (float(c) for c in coef)
    if a < 0 or b < 0:  # fall back to a one-parameter fit on the dominant term
        if a < 0:
            a, b = 0.0, float((x2 @ y) / max(float(x2 @ x2), 1e-12))
        else:
            a, b = float((x1 @ y) / max(float(x1 @ x1), 1e-12)), 0.0
    pred = a * x1 + b * x2
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else None
    return CostModel(a_ns=a, b_ns=b, nvlink_Bps=base.nvlink_Bps, internode_Bps=base.internode_Bps,
                     source=f"fitted from {y.size} expert_gemm spans (a, b); bandwidths from {base.source.split(':')[0]}",
                     fit={"points": int(y.size), "r2": r2})


#: the error band of a cost model nobody calibrated on this hardware (an assumption, said as
#: such wherever it is used; ``moetrace calibrate`` measures the real one)
UNCALIBRATED_REL_ERROR = 0.25
UNCALIBRATED_SOURCE = "uncalibrated: assumed, not measured; moetrace calibrate measures it"


class ErrorBand(NamedTuple):
    """The relative error of a predicted time (0.12 = ±12%) and where it comes from, in
    words: the one error-band type (a cost model's, a stored calibration's). ``rel_error``
    None: nobody measured it (an uncalibrated preset). A tuple ``(rel_error, source)``, so
    it unpacks and serializes as the pair."""
    rel_error: float | None
    source: str

    def text(self) -> str:
        return (f"±{100 * self.rel_error:.1f}% ({self.source})" if self.rel_error is not None
                else self.source)

    def unvalidated(self) -> str | None:
        """The "not validated on <GPU>/<kernel>" clause of a band carried over from rows of
        another GPU or kernel (None: measured where it is used). A verdict on such a band
        says so, and decides only beyond it."""
        i = self.source.find("not validated on ")
        if i < 0:
            return None
        j = min((k for k in (self.source.find(":", i), len(self.source)) if k >= 0))
        return self.source[i:j]

    def within(self, relative_difference: float) -> bool:
        """A predicted relative difference this small is within the model's error (not a win)."""
        return self.rel_error is not None and abs(relative_difference) <= self.rel_error


def error_band(cost: CostModel) -> ErrorBand:
    """The relative error of a predicted time and where it comes from: the model's own when
    it states one, else the uncalibrated default."""
    if cost.rel_error is not None:
        return ErrorBand(float(cost.rel_error), cost.rel_error_source or "stated by the cost model")
    return ErrorBand(UNCALIBRATED_REL_ERROR, UNCALIBRATED_SOURCE)
