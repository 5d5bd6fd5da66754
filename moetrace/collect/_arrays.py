"""Named arrays from ``.npy`` / ``.npz`` / ``.safetensors`` files, bounded before allocation.

``.npy`` and ``.npz`` go through :func:`moetrace.safety.check_npy_headers` (declared shape
and dtype checked, object arrays refused) and ``numpy.load(allow_pickle=False)``;
``.safetensors`` through ``safetensors.safe_open(framework="np")`` after its header length
is bounded and each tensor's declared shape checked against ``max_array_elements``.
Nothing here unpickles anything. The name of a ``.npy`` array is the file's stem.
"""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..safety import check_array_elements, check_npy_headers, check_regular_file
from .checks import MAX_COUNT

MAX_HEADER = 100 << 20   # safetensors header bytes we agree to parse
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
EXTS = (".npy", ".npz", ".safetensors")


def kind(path: Path, head: bytes) -> str | None:
    """'npy', 'npz' or 'safetensors' when the file is one (extension and magic), else None."""
    name = path.name.lower()
    if name.endswith(".npy") and head[:6] == NPY_MAGIC:
        return "npy"
    if name.endswith(".npz") and head[:4] == ZIP_MAGIC:
        return "npz"
    if name.endswith(".safetensors") and len(head) >= 10 and 0 < int.from_bytes(head[:8], "little") <= MAX_HEADER \
            and head[8:9] == b"{":
        return "safetensors"
    return None


def names(path: Path, head: bytes) -> list[str]:
    """The array names a file declares, read from its directory/header only (for sniffing)."""
    k = kind(path, head)
    if k == "npy":
        return [path.stem]
    if k == "npz":
        try:
            with zipfile.ZipFile(path) as z:
                return [n[:-4] for n in z.namelist() if n.endswith(".npy")]
        except (zipfile.BadZipFile, OSError):
            return []
    if k == "safetensors":
        n = int.from_bytes(head[:8], "little")
        try:
            with open(path, "rb") as f:
                f.seek(8)
                doc = json.loads(f.read(min(n, MAX_HEADER)))
            return [key for key in doc if key != "__metadata__"]
        except (OSError, ValueError):
            return []
    return []


def read(path: Path) -> dict[str, np.ndarray]:
    """Every array of the file by name."""
    check_regular_file(path)
    from . import head as _head

    k = kind(path, _head(path, 64))
    if k in ("npy", "npz"):
        check_npy_headers(path)   # shapes and dtypes checked before numpy allocates anything
        try:
            if k == "npy":
                return {path.stem: np.load(path, allow_pickle=False)}
            with np.load(path, allow_pickle=False) as z:
                return {name: z[name] for name in z.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise InputError(path, f"cannot read .{k} (truncated, corrupt or pickled objects): "
                                   f"{str(e).splitlines()[0][:120] if str(e) else type(e).__name__}") from None
    if k == "safetensors":
        from safetensors import SafetensorError, safe_open

        out = {}
        try:
            with safe_open(str(path), framework="np") as f:
                for key in f.keys():
                    check_array_elements(path, f.get_slice(key).get_shape(), f"tensor {key!r}")
                    out[key] = f.get_tensor(key)
        except InputError:
            raise
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(path, f"cannot read safetensors: {msg}") from None
        return out
    raise InputError(path, "not a .npy, .npz or .safetensors file")


def counts(arr: np.ndarray, path: Path, what: str) -> np.ndarray:
    """Integer counts as int64: integer dtype, non-negative, at most checks.MAX_COUNT (else
    one error naming the array and the index of the first bad value)."""
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iu":
        raise InputError(path, f"{what} has dtype {arr.dtype}, expected integer counts")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > np.iinfo(np.int64).max:
        idx = [int(i) for i in np.unravel_index(int(np.argmax(arr)), arr.shape)]
        raise InputError(path, f"{what} holds {int(arr.max())}, beyond the largest count moetrace accepts "
                               f"(2^40 = {MAX_COUNT})", f"index {idx}")
    a = arr.astype(np.int64)
    if a.size and a.min() < 0:
        idx = [int(i) for i in np.argwhere(a < 0)[0]]
        raise InputError(path, f"{what} holds a negative count {int(a[tuple(idx)])}", f"index {idx}")
    if a.size and a.max() > MAX_COUNT:
        idx = [int(i) for i in np.argwhere(a > MAX_COUNT)[0]]
        raise InputError(path, f"{what} holds {int(a[tuple(idx)])}, beyond the largest count moetrace accepts "
                               f"(2^40 = {MAX_COUNT}; sums must stay exact)", f"index {idx}")
    return a


_RANK = re.compile(r"(?:^|[^a-z0-9])(?:rank|ep_rank|ep|r)[_\-.]?(\d+)(?:[^0-9]|$)", re.I)


def rank_in(*texts: str) -> int | None:
    """The rank a key or file name names (``rank3``, ``rank_3``, ``ep_rank-3``), else None."""
    for t in texts:
        m = _RANK.search(t)
        if m:
            return int(m.group(1))
    return None
