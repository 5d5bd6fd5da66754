"""What launched each GPU kernel: the chain of CPU ranges around its launch.

Pure functions from events to context, shared by the profiler collectors:

* Kineto: a kernel's ``correlation`` (External id) names its launching runtime call
  (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``hipModuleLaunchKernel``, a graph launch);
  the ``cpu_op`` / ``user_annotation`` ranges on that call's (pid, tid) that contain the
  call's timestamp are the kernel's context.
* Nsight SQLite: ``CUPTI_ACTIVITY_KIND_KERNEL.correlationId`` -> the
  ``CUPTI_ACTIVITY_KIND_RUNTIME`` row (globalTid, start) -> the ``NVTX_EVENTS`` ranges on
  that globalTid containing the launch.

Only ranges whose name some rule could look at are kept (:func:`context_ranges`): the
names a context rule matches, and the MoE-range names of :data:`MOE_RANGE_RE` (for the
"no expert GEMM found" check). A chain is innermost first. A kernel with no launch record
has no context (its thread is unknown).
"""
from __future__ import annotations

import re
from functools import lru_cache

from ..domain.kernels import MOE_RANGE_RE, builtin_rules
from ._polars import pl

#: category a collector gives a CPU op it kept only as launch context (not a collective, not
#: an annotation): the step / layer / phase labelling of :mod:`._profile` ignores these
CONTEXT_CAT = "context_op"

@lru_cache(maxsize=1)
def _builtin_keep() -> re.Pattern:
    """One pattern for every range name a built-in context rule or the MoE check reads."""
    pats = [r.context.pattern for r in builtin_rules() if r.context is not None] + [MOE_RANGE_RE.pattern]
    # (a superset filter: case-insensitive throughout, each pattern's own flags dropped)
    return re.compile("|".join(f"(?:{p.removeprefix('(?i)')})" for p in pats), re.I)


_KEEP: dict[str, bool] = {}


def keep_cpu_op(name) -> bool:
    """Whether a CPU op of this name is kept as launch context (cached per name: a
    trace repeats a few thousand op names millions of times)."""
    k = _KEEP.get(name)
    if k is None:
        k = type(name) is str and _builtin_keep().search(name) is not None
        if len(_KEEP) < 1 << 16:
            _KEEP[name] = k
    return k


def context_ranges(cpu: pl.DataFrame, patterns=()) -> pl.DataFrame:
    """The CPU ranges (columns name, pid, tid, start_ns, end_ns) that are launch context:
    those whose name matches a built-in context rule, ``patterns`` (the classifier's,
    user rules included) or :data:`MOE_RANGE_RE`. ``ProfilerStep#N`` never is."""
    if cpu.height == 0:
        return cpu.select("name", "pid", "tid", "start_ns", "end_ns")
    names = cpu["name"].unique().to_list()
    extra = [p for p in patterns if p is not None]
    keep = [n for n in names if n and not n.startswith("ProfilerStep#")
            and (_builtin_keep().search(n) or any(p.search(n) for p in extra))]
    return (cpu.filter(pl.col("name").is_in(keep) & (pl.col("end_ns") >= pl.col("start_ns")))
            .select("name", pl.col("pid").cast(pl.Int64), pl.col("tid").cast(pl.Int64), "start_ns", "end_ns"))


def _parents(ranges: pl.DataFrame) -> tuple[list[int], list[int]]:
    """Per range (in the given order: sorted by pid, tid, start, -end) the index of the
    innermost range of the same thread containing it (-1: none), and its chain id; also
    fills :func:`chains`. A sweep with a stack per thread."""
    parent = [-1] * ranges.height
    stack: list[int] = []
    key_prev = None
    rows = ranges.select("pid", "tid", "start_ns", "end_ns").rows()
    for i, (pid, tid, s, e) in enumerate(rows):
        if (pid, tid) != key_prev:
            stack, key_prev = [], (pid, tid)
        while stack and rows[stack[-1]][3] < s:   # ended before this one starts
            stack.pop()
        for j in reversed(stack):                  # innermost open range that holds it whole
            if rows[j][3] >= e:
                parent[i] = j
                break
        stack.append(i)
    return parent, [r[3] for r in rows]


def launch_context(points: pl.DataFrame, ranges: pl.DataFrame) -> tuple[pl.Series, list[tuple[str, ...]]]:
    """For each point (columns pid, tid, t: the launch of a kernel; null pid/tid: none
    known) the id of its context chain, null when no kept range contains it; and the
    chains, indexed by id, each a tuple of range names, innermost first.

    Interval containment on the same (pid, tid): the innermost range with
    ``start <= t <= end``, then that range's enclosing ranges."""
    n = points.height
    if n == 0 or ranges.height == 0:
        return pl.Series("_ctx", [None] * n, pl.Int32), []
    r = ranges.sort(["pid", "tid", "start_ns", "end_ns"], descending=[False, False, False, True])
    parent, ends = _parents(r)
    names = r["name"].to_list()
    chain_of: list[int] = [0] * r.height
    chains: dict[tuple[str, ...], int] = {}
    full: list[tuple[str, ...]] = [()] * r.height
    for i in range(r.height):   # parents come before children in this order
        p = parent[i]
        full[i] = (names[i],) + (full[p] if p >= 0 else ())
        chain_of[i] = chains.setdefault(full[i], len(chains))
    idx = r.select(pl.col("pid"), pl.col("tid"), pl.col("start_ns").alias("t"),
                   pl.int_range(pl.len(), dtype=pl.Int64).alias("_ri"))
    pts = points.select(pl.int_range(pl.len(), dtype=pl.Int64).alias("_pi"), pl.col("pid").cast(pl.Int64),
                        pl.col("tid").cast(pl.Int64), pl.col("t").cast(pl.Int64))
    # the latest-starting range of the thread that starts at or before t (ties: the innermost)
    j = pts.sort("t").join_asof(idx.sort("t"), on="t", by=["pid", "tid"], strategy="backward",
                                check_sortedness=False)
    end_s = pl.Series("e", ends, pl.Int64)
    chain_s = pl.Series("c", chain_of, pl.Int32)
    safe = j["_ri"].fill_null(0)
    j = j.with_columns(end_s.gather(safe).alias("_end"), chain_s.gather(safe).alias("_c"))
    inside = pl.col("_ri").is_not_null() & (pl.col("_end") >= pl.col("t"))
    j = j.with_columns(pl.when(inside).then(pl.col("_c")).otherwise(None).alias("_ctx"))
    # the latest-starting range ended before t: climb to the ranges enclosing it (few kernels)
    climb = j.filter(pl.col("_ri").is_not_null() & (pl.col("_end") < pl.col("t")))
    fixed = {}
    for row, t, x in zip(climb["_pi"].to_list(), climb["t"].to_list(), climb["_ri"].to_list()):
        while x >= 0 and ends[x] < t:
            x = parent[x]
        if x >= 0:
            fixed[row] = chain_of[x]
    j = j.sort("_pi")
    ctx = j["_ctx"]
    if fixed:
        ctx = ctx.scatter(list(fixed), list(fixed.values()))
    return ctx.alias("_ctx"), list(chains)


def moe_context_names(chains: list[tuple[str, ...]]) -> list[str | None]:
    """Per chain, its innermost range that marks MoE work (:data:`MOE_RANGE_RE`), else None."""
    return [next((c for c in ch if MOE_RANGE_RE.search(c)), None) for ch in chains]
