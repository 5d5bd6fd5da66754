"""Safe loading of ``torch.save`` dumps (SGLang and vLLM expert-load files).

Only ``torch.load(path, weights_only=True)`` is ever used: the restricted unpickler
accepts tensors, numbers, strings and plain containers, nothing that runs code. A file
that needs more is refused with an :class:`InputError` naming it. torch is imported
lazily, so moetrace works without it until a ``.pt`` file shows up.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..safety import check_regular_file, check_zip_members
from ..safety_pickle import check_hash_flooding, check_reachable

INSTALL_HINT = ("reading .pt dumps needs the 'torch' extra (torch is not installed): pip install 'moetrace[torch]' "
                "(CPU-only build: pip install torch --index-url https://download.pytorch.org/whl/cpu)")

PT_MAGIC = b"PK\x03\x04"


def import_torch(path: str | Path | None = None):
    """Import torch or raise an InputError that says how to install it."""
    try:
        import torch
    except ImportError:
        raise InputError(path, INSTALL_HINT) from None
    return torch


def looks_like_pt(head: bytes) -> bool:
    """True for a torch zip archive (``torch.save`` since 1.6)."""
    return head[:4] == PT_MAGIC and b"data.pkl" in head[:512]


def load_pt(path: str | Path):
    """``torch.load(path, weights_only=True, map_location='cpu')`` with clear errors."""
    path = Path(path)
    check_regular_file(path)
    torch = import_torch(path)
    with open(path, "rb") as f:
        if f.read(4) == PT_MAGIC:
            check_zip_members(path)  # declared sizes within max_inflate_ratio / max_inflated_bytes
            _check_pickle_member(path)
    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # UnpicklingError, RuntimeError (truncated zip), EOFError, ...
        text = str(e)
        msg = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        if "weights_only" in text.lower() or "Unsupported global" in text or type(e).__name__ == "UnpicklingError":
            g = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            what = f" (it references {g.group(1)})" if g else ""
            raise InputError(path, "refused: the pickle needs more than tensors and plain containers"
                                   f"{what}; moetrace loads .pt files with torch.load(weights_only=True) only") from None
        msg = msg.split(". ")[0]
        raise InputError(path, f"cannot read torch file (truncated or not a torch.save archive): {msg}") from None
    # nested lists shared through the pickle's memo are counted each time they are
    # referenced (what turning them into an array costs): 5.7 KB reached 4.6 GB
    check_reachable(obj, path, opaque=(torch.Tensor,))
    return obj


def _check_pickle_member(path: Path) -> None:
    """The archive's ``data.pkl`` checked for hash flooding before torch unpickles it."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.filename.endswith("data.pkl"):
                    with z.open(info) as m:
                        check_hash_flooding(m.read(), path)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise InputError(path, f"cannot read torch file (truncated or not a torch.save archive): {e}") from None


def to_numpy(obj, path: str | Path, what: str, ndim: int | None = None) -> np.ndarray:
    """A tensor / list / array as an integer-or-float numpy array, with a shape check."""
    try:
        if hasattr(obj, "detach"):
            arr = obj.detach().cpu().numpy()
        else:
            arr = np.asarray(obj)
    except Exception as e:
        raise InputError(path, f"{what}: cannot read as an array ({e})") from None
    if arr.dtype == object:
        raise InputError(path, f"{what}: ragged or non-numeric data")
    if ndim is not None and arr.ndim != ndim:
        raise InputError(path, f"{what}: expected {ndim} dimensions, got shape {tuple(arr.shape)}")
    return arr


def check_counts(arr: np.ndarray, path: str | Path, what: str) -> np.ndarray:
    """Token counts of a dump as int64: integer-valued, finite, non-negative (else an
    InputError naming the file, the array and the index of the first bad value)."""
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise InputError(path, f"{what} holds non-integer counts")
    elif arr.dtype.kind not in "iu":
        raise InputError(path, f"{what} has dtype {arr.dtype}, expected integer counts")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        idx = tuple(int(i) for i in np.argwhere(arr < 0)[0])
        raise InputError(path, f"{what} holds a negative count {arr[idx]}", f"index {list(idx)}")
    return arr
