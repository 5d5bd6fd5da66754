"""Replay's per-rank times from the GPU cost model (:mod:`moetrace.costmodel`), vectorized.

The replay core has, per (step, layer, rank), the tokens a rank computes, the expert slots
it touches and the dispatch bytes it receives (inside its node, from other nodes). The GPU
cost model times one rank's grouped GEMMs from its tokens per expert, and one dispatch /
combine from its bytes. This module maps the one onto the other:

- **expert MLP**: the rank's ``tokens`` spread evenly over its ``touched`` slots
  (``ceil(tokens / touched)`` per expert, the replay keeps no per-slot split), timed by
  :func:`moetrace.costmodel.gemm.expert_mlp_terms` (gate/up + down grouped GEMMs, tile and
  wave quantization, launch cost). One call per distinct (experts, tokens per expert)
  pair, cached; tokens per expert above 128 are rounded to the nearest point of a 2%
  geometric grid (about ±1% in time, well inside the band; up to 128 every count is exact,
  where tile quantization matters most);
- **dispatch / combine** (any kernel of :data:`moetrace.costmodel.a2a.FAMILIES`; the bytes
  are the replay's, the kernel only chooses the fitted efficiencies):
  ``latency + max(inter-node bytes / (eff_rdma x NIC), intra-node bytes / (eff_nvl x
  NVLink))`` on the rank's own bytes, the bottleneck link as DeepEP defines it. The
  replay counts BF16 activations per token; dispatch bytes are rescaled to the FP8
  message (values + one FP32 scale per 128) and combine bytes to the BF16 message. A
  kernel given ``sms`` SMs cannot move bytes faster than ``sms x sm_gbps``: the link time
  and that SM time combine as :func:`moetrace.costmodel.a2a.time_terms` does (P-norm). A
  rank that receives nothing (or a run without ``top_k``: no bytes at all) has no
  all-to-all time. The bytes are the replay's own (recorded routing, else estimated from
  the counts), whatever the kernel's byte pattern or node limit (:func:`kernel_inputs`
  says so);
- **band** of a step time: the larger of the expert-GEMM band and the all-to-all band
  (a sum of terms each within its relative band is within the largest of them), each the
  costmodel's band for this GPU and kernel (:func:`moetrace.costmodel.band`): measured on
  rows held out in whole groups where published rows exist, else the wider cross-hardware
  or cross-family error, and the source then says "not validated on <GPU>/<kernel>".
"""
from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from .. import costmodel
from .a2a import SM_NORM, message_bytes
from .gemm import GemmParams, expert_mlp_terms
from .hardware import GPUS, gpu

#: tokens per expert up to this are timed exactly; above, on a 2% geometric grid
EXACT_TOKENS = 128
_GRID = np.log(1.02)


def _a2a_params(kernel: str) -> dict:
    return costmodel.regime_params(kernel)


def kernel_inputs(hardware: str, kernel: str, sms: int | None = None,
                  max_nodes_per_token: int | None = None) -> tuple[int | None, list[str]]:
    """The SMs the all-to-all ``kernel`` runs on in a replay on ``hardware`` (None: not
    SM-limited) and what the replay says about its inputs, one line each. Bad input:
    :class:`moetrace.errors.UsageError` naming the option."""
    from ..errors import UsageError
    from .a2a import FAMILIES

    if kernel not in FAMILIES:
        raise UsageError(f"--kernel must be one of {', '.join(FAMILIES)}, got {kernel!r}")
    fam, hw = FAMILIES[kernel], gpu(hardware)
    if sms is not None and not 1 <= sms <= hw.sms:
        raise UsageError(f"--sms must be within 1..{hw.sms} (the SMs of {hw.name}), got {sms}")
    if max_nodes_per_token is not None and max_nodes_per_token < 0:
        raise UsageError(f"--max-nodes-per-token must be a non-negative integer, got {max_nodes_per_token}")
    used = (sms or fam["sms"]) if fam["sms"] is not None else None
    notes = [f"all-to-all timed as {fam['what'].split(';')[0]}" + (f", on {used} SMs" if used else ", not SM-limited")
             + (f" (--sms {sms} ignored: this kernel is not SM-limited)" if sms and used is None else "")
             + ("" if fam["regime"] else f" (no published row of this family: {fam['params_from']} parameters, "
                                        "band not validated)")]
    limit = fam["max_nodes"] if max_nodes_per_token is None else (max_nodes_per_token or None)
    bytes_from = ("the replay's dispatch bytes come from the run's routing (recorded per token, else estimated "
                  "from its expert counts), deduplicated per receiving rank, whatever the kernel's byte pattern")
    if limit is not None:
        notes.append(f"node-limited routing ({limit} nodes per token) is not applied to the replayed traffic: "
                     f"{bytes_from}; `moetrace cost --max-nodes-per-token` applies it to the model's estimate")
    else:
        notes.append(bytes_from)
    return used, notes


def known(hardware: str) -> bool:
    return str(hardware).upper() in GPUS


def quantize_tokens(m: np.ndarray) -> np.ndarray:
    """Tokens per expert as timed: integers (rounded up) up to :data:`EXACT_TOKENS`, then
    the nearest point of a 2% geometric grid."""
    m = np.ceil(np.asarray(m, np.float64))
    big = m > EXACT_TOKENS
    if big.any():
        k = np.rint(np.log(m[big] / EXACT_TOKENS) / _GRID)
        m = m.copy()
        m[big] = np.ceil(EXACT_TOKENS * np.exp(k * _GRID))
    return m


@lru_cache(maxsize=200_000)
def _mlp_ns(hardware: str, hidden: int, intermediate: int, dtype: str, experts: int, m: int) -> float:
    if experts <= 0 or m <= 0:
        return 0.0
    params = GemmParams(**costmodel.fitted()["regimes"]["gemm_grouped"]["params"])
    return expert_mlp_terms(gpu(hardware), params, [m] * experts, hidden, intermediate, dtype)["time_s"] * 1e9


#: integer tokens per expert up to this are looked up in a table (:class:`_MlpTable`);
#: beyond it (aggregate counts of many passes) each distinct pair is timed as before
TABLE_MAX_TOKENS = 1 << 20


class _MlpTable:
    """Expert-MLP ns of (slots touched g, integer tokens per expert m) for one GPU model:
    ``qcol[m]`` is the column of m's quantized count (:func:`quantize_tokens`; non-decreasing
    in m), ``vals[g, col]`` its time, filled for columns ``< filled[g]`` (every column up to
    the largest m seen). The same numbers as a call of :func:`_mlp_ns` per distinct pair,
    without sorting the pairs of every block."""

    def __init__(self, key):
        self.key = key
        self.qcol = np.zeros(0, np.int64)
        self.qval = np.zeros(0, np.int64)        # quantized count of each column
        self.vals = np.zeros((1, 0))
        self.filled = np.zeros(1, np.int64)
        self._lock = threading.Lock()

    def _grow_m(self, m_max: int) -> None:
        n = max(m_max + 1, 2 * self.qcol.size, 1024)
        q = quantize_tokens(np.arange(n, dtype=np.float64)).astype(np.int64)
        qval = np.unique(q)                      # a prefix of the old columns: qcol is monotone
        vals = np.zeros((self.vals.shape[0], qval.size))
        vals[:, :self.vals.shape[1]] = self.vals
        self.qcol, self.qval, self.vals = np.searchsorted(qval, q), qval, vals

    def _fill(self, g_max: int, col_max: int) -> None:
        if g_max >= self.vals.shape[0]:
            vals = np.zeros((g_max + 1, self.vals.shape[1]))
            vals[:self.vals.shape[0]] = self.vals
            self.vals = vals
            self.filled = np.concatenate([self.filled, np.zeros(g_max + 1 - self.filled.size, np.int64)])
        hw, h, i, dt = self.key
        for g in range(g_max + 1):
            for col in range(int(self.filled[g]), col_max + 1):
                self.vals[g, col] = _mlp_ns(hw, h, i, dt, g, int(self.qval[col]))
            self.filled[g] = max(int(self.filled[g]), col_max + 1)

    def lookup(self, g: np.ndarray | None, m: np.ndarray, g_max: int, m_max: int) -> np.ndarray:
        """Times of integer arrays ``g`` (slots touched) and ``m`` (tokens per expert, >= 0;
        0 where g is 0), whose maxima are ``g_max`` and ``m_max``."""
        with self._lock:    # replay threads share the table: it grows under the lock, is read from a snapshot
            if m_max >= self.qcol.size:
                self._grow_m(m_max)
            col_max = int(self.qcol[m_max])
            if g_max >= self.filled.size or (self.filled[:g_max + 1] <= col_max).any():
                self._fill(g_max, col_max)
            qcol, vals = self.qcol, self.vals       # replaced, never shrunk, when the table grows
        if g_max <= 1:      # m is 0 where g is 0, and every g's time of m = 0 is 0: row 1 serves both
            # one gather: the row's time of every count up to m_max (qcol composed with the row)
            return np.take(np.take(vals[min(g_max, 1)], qcol[:m_max + 1]), m)
        assert g is not None        # g_max > 1: the slots touched were given
        idx = np.take(qcol, m)
        idx += g * vals.shape[1]
        return np.take(vals.reshape(-1), idx)


_TABLES: dict[tuple, _MlpTable] = {}


def _table(hw, h, i, dt) -> _MlpTable:
    key = (hw, h, i, dt)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = _MlpTable(key)
    return table


def expert_ns(spec: dict, tokens, touched) -> np.ndarray:
    """Expert-MLP time (ns) of every rank, broadcasting over any shape. Tokens are >= 0, and
    0 on a rank that touches no slot (as every replay block has them). ``touched`` None: one
    slot per rank, touched where it has tokens (no pass to find the most slots touched)."""
    tok = np.asarray(tokens, np.float64)
    hw, h, i, dt = spec["hardware"], int(spec["hidden"]), int(spec["intermediate"]), spec["weight_dtype"]
    if touched is None:     # at most one slot touched per rank: no pass over g for its maximum
        g: np.ndarray | None = None
        g_max = 1
    else:
        t = np.asarray(touched)
        if t.dtype.kind not in "iu":
            t = np.rint(t.astype(np.float64)).astype(np.int64)
        g = np.broadcast_to(t, tok.shape)
        g_max = int(g.max(initial=0))
    if g_max <= 1:          # tokens / 1 (and 0 where nothing is touched)
        m_max = float(np.ceil(tok.max(initial=0.0)))     # = ceil(tok).max(): ceil is monotone
        if m_max < TABLE_MAX_TOKENS:
            # the integer tokens per expert in one pass: ceil, then the exact cast of an integral float
            mi = np.ceil(tok, out=np.empty(tok.shape, np.int64), casting="unsafe")
            return _table(hw, h, i, dt).lookup(g, mi, g_max, int(m_max))
        if g is None:
            g = np.greater(tok, 0).astype(np.int64)
        m = np.ceil(tok)
    else:
        assert g is not None        # more than one slot touched: touched was given
        m = np.divide(tok, np.maximum(g, 1))
        np.ceil(m, out=m)
        m[g <= 0] = 0.0
        m_max = float(m.max(initial=0.0))
    if m_max < TABLE_MAX_TOKENS:
        return _table(hw, h, i, dt).lookup(g, m.astype(np.int64), g_max, int(m_max))
    assert g is not None
    mq = np.where(g > 0, quantize_tokens(m), 0).astype(np.int64)
    key = g.astype(np.int64) * (1 << 32) + mq
    uniq, inv = np.unique(key.ravel(), return_inverse=True)
    vals = np.array([_mlp_ns(hw, h, i, dt, int(k >> 32), int(k & 0xFFFFFFFF)) for k in uniq.tolist()], np.float64)
    return vals[inv].reshape(tok.shape)


def comm_ns(spec: dict, bytes_intra, bytes_inter) -> tuple[np.ndarray, np.ndarray]:
    """(dispatch, combine) ns of every rank from the BF16 bytes it receives."""
    hw = gpu(spec["hardware"])
    p = _a2a_params(spec["kernel"])
    intra = np.asarray(bytes_intra, np.float64)
    inter = np.asarray(bytes_inter, np.float64)
    token = float(spec["token_bytes"])
    shape = np.broadcast_shapes(intra.shape, inter.shape)
    idle = np.add(intra, inter) <= 0          # receives nothing: no all-to-all time
    c_inter, c_intra = p["eff_rdma"] * hw.rdma_Bps, p["eff_nvl"] * hw.nvlink_Bps
    c_sm = _sm_Bps(spec, p)
    lat = p["latency_us"] * 1e3
    out = []
    for dtype in (spec["dispatch_dtype"], spec["combine_dtype"]):
        scale = message_bytes(int(spec["hidden"]), dtype) / token
        # the same operations as max(inter * scale / c_inter, intra * scale / c_intra), in place
        t = np.multiply(inter, scale, out=np.empty(shape))
        t /= c_inter
        u = np.multiply(intra, scale)
        u /= c_intra
        if c_sm:        # the link and SM times combined as a2a.time_terms: (link^P + sm^P)^(1/P)
            sm = np.add(inter, intra)
            sm *= scale / c_sm
            np.maximum(t, u, out=t)
            t = np.power(np.power(t, SM_NORM) + np.power(sm, SM_NORM), 1.0 / SM_NORM)
        else:
            np.maximum(t, u, out=t)
        t *= 1e9
        np.add(lat, t, out=t)
        t[idle] = 0.0
        out.append(t)
    return out[0], out[1]


def comm_received_ns(spec: dict, received, intra_per_token: float, inter_per_token: float) -> np.ndarray:
    """Dispatch + combine ns of every rank that receives ``received`` tokens of
    ``intra_per_token`` / ``inter_per_token`` BF16 bytes each: :func:`comm_ns`'s sum when the
    bytes are those products (the bottleneck link is then the same for every rank and both
    messages), in one pass. Equal to it up to float rounding."""
    hw = gpu(spec["hardware"])
    p = _a2a_params(spec["kernel"])
    token = float(spec["token_bytes"])
    scale = sum(message_bytes(int(spec["hidden"]), d) / token for d in (spec["dispatch_dtype"], spec["combine_dtype"]))
    per = max(inter_per_token / (p["eff_rdma"] * hw.rdma_Bps), intra_per_token / (p["eff_nvl"] * hw.nvlink_Bps))
    c_sm = _sm_Bps(spec, p)
    if c_sm:                # both terms scale with the tokens received: the P-norm of the per-token times
        per = (per ** SM_NORM + ((intra_per_token + inter_per_token) / c_sm) ** SM_NORM) ** (1.0 / SM_NORM)
    r = np.asarray(received)
    if not intra_per_token + inter_per_token > 0:      # no bytes per token: nobody has all-to-all time
        return np.zeros(r.shape)
    out = np.multiply(r, scale * per * 1e9, dtype=np.float64)
    out += 2 * p["latency_us"] * 1e3
    out[r <= 0] = 0.0
    return out


def _sm_Bps(spec: dict, p: dict) -> float:
    """Bytes per second the kernel's SMs move (0: not SM-limited)."""
    sms = spec.get("sms")
    return float(sms) * p.get("sm_gbps", 0.0) * 1e9 if sms and p.get("sm_gbps", 0.0) > 0 else 0.0


def band(hardware: str, kernel: str = "normal", weight_dtype: str = "fp8") -> tuple[float, str]:
    """The step-time band of the GPU model on ``hardware`` and where it comes from; the words
    "not validated on <GPU>/<kernel>" lead the source wherever a term's band was not measured
    on that GPU and kernel (a verdict then says so)."""
    g, a = costmodel.band(hardware, "gemm_grouped"), costmodel.band(hardware, kernel)
    rel = max(float(g["band"]), float(a["band"]))
    unvalidated = [b.words() for b in (g, a) if not b["validated"]]
    if weight_dtype != "fp8":
        unvalidated.append(f"not validated on {g['key'].split('/')[0]}/{weight_dtype.upper()} weights")
    how = "; ".join(unvalidated) if unvalidated else "validated"
    src = (f"GPU cost model {g['key'].split('/')[0]}, {how}: the larger of the expert-GEMM band ±{g['band']:.0%} and "
           f"the {kernel} all-to-all band ±{a['band']:.0%} (error on published rows held out by whole "
           f"source/GPU/version/layout; moetrace/costmodel/data/published.csv)")
    return rel, src


def validated(hardware: str, kernel: str = "normal", weight_dtype: str = "fp8") -> bool:
    """Whether both bands of :func:`band` were measured on this GPU and kernel."""
    return (weight_dtype == "fp8" and costmodel.band(hardware, "gemm_grouped")["validated"]
            and costmodel.band(hardware, kernel)["validated"])


def linear_terms(hardware: str, hidden: int, intermediate: int, weight_dtype: str = "fp8",
                 kernel: str = "normal") -> dict:
    """The GPU model's large-batch slopes as the linear model's terms (for display, the
    spans fit's base and weight moves): ns per token-expert at the achieved tensor rate,
    ns per expert read at the achieved HBM rate, the achieved NVLink and NIC bandwidths."""
    hw = gpu(hardware)
    r = costmodel.fitted()["regimes"]
    gp, ap = r["gemm_grouped"]["params"], costmodel.regime_params(kernel)
    flops = 2.0 * 3 * hidden * intermediate
    wbytes = 3.0 * hidden * intermediate * {"fp8": 1.0, "bf16": 2.0, "fp4": 0.53125}[weight_dtype]
    return {"a_ns": flops / (gp["eff_compute"] * hw.tensor_flops[weight_dtype if weight_dtype != "fp4" else "fp8"]) * 1e9,
            "b_ns": wbytes / (gp["eff_hbm"] * hw.hbm_Bps) * 1e9,
            "nvlink_Bps": ap["eff_nvl"] * hw.nvlink_Bps, "internode_Bps": ap["eff_rdma"] * hw.rdma_Bps}
