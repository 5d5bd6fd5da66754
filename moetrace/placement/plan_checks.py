"""Checks of values read from input files that are shared by several readers: integer
arrays range-checked before numpy converts them, and plan files whose parts must agree.
Imports only errors / safety and numpy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError
from ..safety import INT64, _range_name, excerpt


def _first_bad(value, lo: int, hi: int, where: str):
    """(index path, value) of the first element of nested lists outside lo..hi or not an int."""
    stack: list[tuple[tuple[int, ...], Any]] = [((), value)]
    while stack:
        idx, v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(((*idx, i), x) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
            return idx, v
    return None


def int_array(path, value, key: str, lo: int = INT64[0], hi: int = INT64[1], ndim: int | None = None) -> np.ndarray:
    """``value`` (nested lists of ints) as an int64 array whose every element is within
    ``lo..hi``; an element past int64 is named with its index before numpy converts it."""
    try:
        a = np.asarray(value, dtype=np.int64)
        ok = True
    except OverflowError:
        ok = False
    except (ValueError, TypeError):
        raise InputError(path, f"{key} is not a rectangular integer array") from None
    if ok and a.size and lo <= int(a.min()) and int(a.max()) <= hi and \
            not _has_non_int(value):
        bad = None
    else:
        bad = _first_bad(value, lo, hi, key)
    if bad is not None:
        idx, v = bad
        shown = excerpt(repr(v), 40)
        raise InputError(path, f"{key}{''.join(f'[{i}]' for i in idx)} = {shown} is outside "
                               f"{_range_name(lo, hi)}" if isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                         else f"{key}{''.join(f'[{i}]' for i in idx)} = {shown} is not an integer")
    if ndim is not None and a.ndim != ndim:
        raise InputError(path, f"{key} must have {ndim} dimensions, got shape {a.shape}")
    return a


def _has_non_int(value) -> bool:
    """True when nested lists hold floats / bools (numpy would convert 1.5 or True silently)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            return True
    return False


def counts_array(path, value, key: str) -> np.ndarray:
    """A logical_count-style array: finite, non-negative numbers (float64)."""
    try:
        a = np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        raise InputError(path, f"{key} is not a rectangular numeric array") from None
    if a.size and not np.isfinite(a).all():
        i = np.argwhere(~np.isfinite(a))[0]
        raise InputError(path, f"{key}{list(map(int, i))} is {a[tuple(i)]}, expected a finite count")
    if a.size and a.min() < 0:
        i = np.argwhere(a < 0)[0]
        raise InputError(path, f"{key}{list(map(int, i))} is negative ({a[tuple(i)]:g}): a count of tokens cannot be")
    if a.size and a.max() > 2.0**53:
        raise InputError(path, f"{key} holds a count above 2^53, beyond exact float64 integers")
    return a


def check_eplb_agrees(path, doc: dict, p2l: np.ndarray) -> None:
    """An EPLB-style plan file's ``log2phy [L, E, maxcnt]`` and ``logcnt [L, E]``, when
    present, must say the same as its ``phy2log [L, slots]``: slot s is listed under expert
    phy2log[l, s] and nowhere else, and logcnt counts the slots of each expert."""
    L, S = p2l.shape
    E = int(p2l.max()) + 1 if p2l.size else 0
    cnt = np.zeros((L, max(E, 1)), np.int64)
    for l in range(L):
        np.add.at(cnt[l], p2l[l], 1)
    if "logcnt" in doc:
        lc = int_array(path, doc["logcnt"], "logcnt", 0, S, ndim=2)
        if lc.shape[0] != L or lc.shape[1] < E:
            raise InputError(path, f"logcnt has shape {lc.shape}, phy2log has {L} layers and experts 0..{E - 1}")
        full = np.zeros_like(lc)
        full[:, :E] = cnt[:, :E]
        diff = np.argwhere(lc != full)
        if diff.size:
            l, e = map(int, diff[0])
            raise InputError(path, f"logcnt[{l}][{e}] = {int(lc[l, e])} but phy2log places expert {e} in "
                                   f"{int(full[l, e])} slots of layer {l} (the file contradicts itself)")
    if "log2phy" in doc:
        l2p = int_array(path, doc["log2phy"], "log2phy", -1, S - 1, ndim=3)
        if l2p.shape[0] != L or l2p.shape[1] < E:
            raise InputError(path, f"log2phy has shape {l2p.shape}, phy2log has {L} layers and experts 0..{E - 1}")
        for l in range(L):
            seen = np.zeros(S, np.int64)
            for e in range(l2p.shape[1]):
                for s in l2p[l, e]:
                    if s < 0:
                        continue
                    if p2l[l, s] != e:
                        raise InputError(path, f"log2phy[{l}][{e}] lists slot {int(s)}, which phy2log gives to expert "
                                               f"{int(p2l[l, s])} (the file contradicts itself)")
                    seen[s] += 1
            if (seen != 1).any():
                s = int(np.flatnonzero(seen != 1)[0])
                raise InputError(path, f"log2phy of layer {l} lists slot {s} {int(seen[s])} times, phy2log once "
                                       "(the file contradicts itself)")
