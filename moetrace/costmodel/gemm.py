"""Time of one grouped GEMM (all experts of a rank in one launch) on a GPU, from physics.

For G groups (experts), group g with m_g rows (tokens), each [m_g, k] x [k, n]:

* tiles: block sizes chosen the way DeepGEMM's SM90 heuristic does (block_m 64/128/256,
  block_n 16..160; fewest waves, then the fullest last wave, then the bigger tile);
  ``tiles = sum_g ceil(m_g/bm) * ceil(n/bn)``, ``waves = ceil(tiles / SMs)``;
* compute (quantized): ``t_c = waves * (2*bm*bn*k / (eff_c * peak / SMs) + c_tile)``: a
  wave costs a full tile on every SM even when it is partly idle or the tile partly empty,
  plus a per-tile cost (pipeline fill and epilogue);
* memory: ``t_m = bytes / (eff_m * HBM)``, bytes = activations ``sum m_g*k`` + weights
  ``G*n*k`` (in their dtypes) + BF16 output ``2*sum m_g*n``;
* ``t = (t_c^p + t_m^p)^(1/p) + t_launch``: the p-norm lets compute and memory overlap
  partly (p=1 is a plain sum, p->inf a plain max); the published rows fit p near 2.

eff_c, eff_m, p, c_tile and t_launch are fitted on DeepGEMM's published rows (H800, H20;
:mod:`.fit`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .hardware import DTYPE_BYTES, GPU

OUT_BYTES = 2.0   # BF16 output


@dataclass(frozen=True)
class GemmParams:
    eff_compute: float
    eff_hbm: float
    p: float
    tile_us: float
    launch_us: float


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_config(ms, n: int, sms: int, contiguous: bool = False) -> tuple[int, int, int, int]:
    """(block_m, block_n, tiles, waves) for groups with rows ``ms`` and width ``n``."""
    return _tile_config(tuple(sorted(int(m) for m in ms if m > 0)), int(n), int(sms), bool(contiguous))


@lru_cache(maxsize=4096)
def _tile_config(ms: tuple, n: int, sms: int, contiguous: bool) -> tuple[int, int, int, int]:
    bms = (128,) if contiguous else (64, 128, 256)
    bns = tuple(range(16, 129, 8)) + (144, 160)
    best = None
    for bm in bms:
        for bn in bns:
            if bm > 128 and bn > 128:
                continue
            tiles = sum(_cdiv(m, bm) for m in ms) * _cdiv(n, bn)
            waves = _cdiv(tiles, sms)
            last = tiles % sms or sms
            if best is None:
                best = (bm, bn, tiles, waves, last)
                continue
            b_bm, b_bn, _, b_w, b_last = best
            if waves != b_w:
                better = waves < b_w
            elif last != b_last:
                better = last > b_last
            else:   # equal utilisation: the smaller of two tiles that differ on one side, else the wider one
                better = ((bm == b_bm and bn < b_bn) or (bn == b_bn and bm < b_bm)
                          or (bm != b_bm and bn > b_bn))
            if better:
                best = (bm, bn, tiles, waves, last)
    assert best is not None     # bms and bns are never empty
    bm, bn, tiles, waves, _ = best
    return bm, bn, tiles, waves


def gemm_terms(hw: GPU, params: GemmParams, ms, n: int, k: int, weight_dtype: str = "fp8",
               act_dtype: str | None = None, contiguous: bool = False) -> dict:
    """Every term of one grouped GEMM's time (seconds), the total under ``time_s``."""
    act_dtype = act_dtype or ("fp8" if weight_dtype == "fp4" else weight_dtype)
    ms = [int(m) for m in ms]
    if not any(m > 0 for m in ms):
        return {"time_s": 0.0, "compute_s": 0.0, "memory_s": 0.0, "launch_s": 0.0, "tiles": 0, "waves": 0,
                "block_m": 0, "block_n": 0, "flops": 0.0, "bytes": 0.0}
    # the tensor rate of the narrower operand pair (FP8 activations x FP4 weights run at the FP8 rate)
    rate_dtype = act_dtype if DTYPE_BYTES[act_dtype] >= DTYPE_BYTES[weight_dtype] else weight_dtype
    peak = hw.tensor_flops[rate_dtype]
    bm, bn, tiles, waves = tile_config(ms, n, hw.sms, contiguous)
    groups = sum(1 for m in ms if m > 0)
    rows = sum(ms)
    t_tile = 2.0 * bm * bn * k / (params.eff_compute * peak / hw.sms) + params.tile_us * 1e-6
    t_c = waves * t_tile
    nbytes = rows * k * DTYPE_BYTES[act_dtype] + groups * n * k * DTYPE_BYTES[weight_dtype] + rows * n * OUT_BYTES
    t_m = nbytes / (params.eff_hbm * hw.hbm_Bps)
    p = params.p
    t = (t_c ** p + t_m ** p) ** (1.0 / p) + params.launch_us * 1e-6
    return {"time_s": t, "compute_s": t_c, "memory_s": t_m, "launch_s": params.launch_us * 1e-6,
            "tiles": tiles, "waves": waves, "block_m": bm, "block_n": bn,
            "flops": 2.0 * rows * n * k, "bytes": nbytes}


def expert_mlp_terms(hw: GPU, params: GemmParams, tokens_per_expert, hidden: int, intermediate: int,
                     weight_dtype: str = "fp8") -> dict:
    """The MLPs of all touched experts on one rank: gate/up [m, hidden] x [hidden, 2*intermediate]
    then down [m, intermediate] x [intermediate, hidden], each one grouped launch. The SwiGLU
    and re-quantization between them are not modelled (the published rows time GEMMs only)."""
    up = gemm_terms(hw, params, tokens_per_expert, 2 * intermediate, hidden, weight_dtype)
    down = gemm_terms(hw, params, tokens_per_expert, hidden, intermediate, weight_dtype)
    return {"time_s": up["time_s"] + down["time_s"], "gate_up": up, "down": down}


def is_finite_pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0
