"""The output width N of a GEMM-like PyTorch op from the shapes Kineto records with
``record_shapes=True`` (the op's ``args["Input Dims"]``: one list of sizes per input,
``[]`` for a missing or scalar one), so the router's gate GEMM (N = number of experts) can
be told from the experts' GEMMs by shape when no router range encloses it.

Which input holds N follows each op's ATen signature (``aten/src/ATen/native/
native_functions.yaml``): ``linear(input, weight[N, K], bias)``, ``mm(self[M, K],
mat2[K, N])``, ``addmm(self, mat1, mat2[K, N])``, ``bmm(self, mat2[B, K, N])``,
``baddbmm(self, batch1, batch2[B, K, N])``, ``matmul(self, other[..., K, N])``. Only ops
named here are parsed: the other ops' args are never decoded.
"""
from __future__ import annotations

from functools import lru_cache

import msgspec

#: op name -> (which input, which of its dims is N, the fewest dims that input must have)
_OUT_N = {
    "aten::linear": (1, 0, 2),
    "aten::mm": (1, -1, 2),
    "aten::addmm": (2, -1, 2),
    "aten::bmm": (1, -1, 3),
    "aten::baddbmm": (2, -1, 3),
    "aten::matmul": (1, -1, 2),
}
GEMM_OPS = frozenset(_OUT_N)
_DIMS = msgspec.json.Decoder(list[list[int]])


@lru_cache(maxsize=1 << 14)
def gemm_out_n(name: str, dims: bytes) -> int | None:
    """N of op ``name`` from its raw ``Input Dims`` JSON; None when the op is not one of
    :data:`GEMM_OPS` or the dims are not the op's (a malformed arg is never a reason to
    refuse the trace: the kernel is then classified without its shape)."""
    how = _OUT_N.get(name)
    if how is None or not dims:
        return None
    try:
        shapes = _DIMS.decode(dims)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    arg, axis, least = how
    if len(shapes) <= arg or len(shapes[arg]) < least:
        return None
    n = shapes[arg][axis]
    return n if 0 < n < 1 << 31 else None
