"""Interval arithmetic done by hand (union length, overlap), the independent check of exposure."""
from __future__ import annotations


def union(iv):
    """Independent sweep: merged disjoint intervals of a list of (start, end)."""
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(a, b):
    """Length of the intersection of two unions of intervals."""
    tot = 0
    for s1, e1 in union(a):
        for s2, e2 in union(b):
            tot += max(0, min(e1, e2) - max(s1, s2))
    return tot
