"""PyTorch profiler (Kineto) Chrome-trace JSON, plain or ``.gz``: one file, or a folder
of per-rank files (one run).

Reading: the document is decoded with msgspec into a list of raw event slices, then in
batches into small typed records holding only the fields moetrace uses, and from there
into columns; the full JSON is never held as Python dicts. ``ts`` is kept as its decimal
text and converted to integer ns exactly (both conventions: integer absolute-epoch µs, or
fractional µs relative to ``baseTimeNanoseconds``).

Rank: ``distributedInfo.rank``, else the file name (``rank-3``, ``rank3_trace``,
``-TP-0-DP-1-PP-0-EP-5`` -> EP rank, ``-rank-N``), else the file's order in the folder
(said in ``runs.approximations``). Device and stream: a kernel's ``args.device`` /
``args.stream``, else its ``pid`` / ``tid``.
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

from ..domain.kernels import Classifier
from ..errors import InputError
from ..safety import limit, limit_error
from . import Collector, RunData, register
from ._chrome_json import parse_file, rank_from_name
from ._polars import pl
from ._profile import (
    CPU_SCHEMA,
    GPU_SCHEMA,
    LAUNCH_SCHEMA,
    RankEvents,
    build,
    frame,
    rank_part,
    run_data,
)


def _is_kineto(path: Path, head: bytes) -> bool:
    name = path.name.lower()
    if not (name.endswith(".json") or name.endswith(".json.gz") or name.endswith(".pt.trace.json")
            or name.endswith(".trace.json.gz")):
        return False
    if head[:2] == b"\x1f\x8b":
        try:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            head = d.decompress(head, 8192)
        except zlib.error:
            return name.endswith((".trace.json.gz", ".pt.trace.json.gz"))
    text = head.decode("utf-8", "replace")
    return ("traceEvents" in text or "schemaVersion" in text or "deviceProperties" in text
            or ('"ph"' in text and '"ts"' in text))


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    """Files of one folder are the ranks of one run when their ranks differ (from
    ``distributedInfo.rank`` or the file name); otherwise every file is its own run."""
    total = sum(p.stat().st_size for p in paths)
    progress = bool(options.get("progress")) or total > 64 * 2**20
    paths = sorted(paths)
    jobs = _jobs(options, paths, total)
    parts: dict = {}
    if jobs > 1:
        frames = _parse_parallel(paths, progress, jobs, Classifier(options.get("kernel_rules"), options.get("num_experts")), parts)
    else:
        frames = [_parse_frames(p, progress) for p in paths]
    parsed = [(p, info, RankEvents(rank=-1, gpu=g, launch=l, cpu=c, source=p.name, part=parts.get(i)))
              for i, (p, (info, g, l, c)) in enumerate(zip(paths, frames))]
    del frames
    groups: dict[Path, list] = {}
    for item in parsed:
        groups.setdefault(item[0].parent, []).append(item)
    runs = []
    for _, items in sorted(groups.items()):
        if len(items) > 1 and not _one_run(items):
            runs.extend([it] for it in items)
        else:
            runs.append(items)
    return [_collect_run(items, options) for items in runs]


#: inputs at least this large (and of two files or more) are parsed by several processes
#: unless ``--set jobs=1``
PARALLEL_BYTES = 256 * 2**20


def _jobs(options: dict, paths: list[Path], total: int) -> int:
    """Processes to parse rank files with: option ``jobs`` (``--set jobs=N``; ``auto`` = one
    per CPU, at most 4). Default: ``auto`` for inputs of :data:`PARALLEL_BYTES` or more,
    else 1 (starting a worker costs about 0.3 s)."""
    j = options.get("jobs")
    if j is None:
        j = "auto" if total >= PARALLEL_BYTES else 1
    if j == "auto":
        j = min(os.cpu_count() or 1, 4)
    try:
        j = int(j)
    except (TypeError, ValueError):
        raise InputError(None, f"--set jobs={j!r}: expected a number or 'auto'") from None
    if not 1 <= j <= 1024:
        raise InputError(None, f"--set jobs={j}: parsing processes must be within 1..1024 (or 'auto')")
    return max(1, min(j, len(paths)))


def _parse_parallel(paths: list[Path], progress: bool, jobs: int, classifier: Classifier, parts: dict) -> list:
    """Parse files with this process and ``jobs - 1`` workers, each claiming the next file
    when it is free: this process from the first file on (it starts at once, its imports
    done), the workers from the last file back (after their start-up). While the last
    workers finish, this process labels and classifies its own ranks (``parts``, by file
    index: :func:`rank_part` of ranks with device activity)."""
    import multiprocessing as mp

    # not fork: polars' thread pool in this process could deadlock a forked child
    ctx = mp.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")
    ends = ctx.Array("q", [0, len(paths)])  # [next from the front, one past the next from the back]
    out: list = [None] * len(paths)
    ex = _worker_pool(ctx, jobs - 1, ends)
    try:
        futs = [ex.submit(_worker_loop, paths, progress) for _ in range(jobs - 1)]
        while (i := _claim(ends, from_back=False)) is not None:
            out[i] = _parse_frames(paths[i], progress)
        for i, fr in enumerate(out):
            if fr is not None and fr[1].height:
                parts[i] = rank_part(RankEvents(rank=-1, gpu=fr[1], launch=fr[2], cpu=fr[3]), classifier)
        for f in futs:
            for i, res in f.result():
                if res[0] == "error":
                    raise InputError(*res[1:])
                out[i] = res[1]
    finally:
        with ends.get_lock():
            ends[0] = ends[1]  # (on error) nothing left to claim: workers stop after their file
        ex.shutdown(wait=True, cancel_futures=True)
    return out


_ENDS = None  # a worker's handle on the parent's claim counters


def _worker_pool(ctx, workers: int, ends):
    """The parsing workers: each gets the claim counters and this process's resource limits
    (``--set max_*=N``, ``MOETRACE_MAX_*`` or the defaults, resolved here: a forkserver
    child does not see this process's ``--set`` nor an environment changed after it started)."""
    from concurrent.futures import ProcessPoolExecutor

    from ..safety import resolved_limits

    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                               initargs=(ends, resolved_limits()))


def _worker_init(ends, limits: dict | None = None) -> None:
    global _ENDS
    _ENDS = ends
    if limits is not None:
        from ..safety import set_overrides

        set_overrides(limits)


def _claim(ends, from_back: bool) -> int | None:
    with ends.get_lock():
        lo, hi = ends[0], ends[1]
        if lo >= hi:
            return None
        if from_back:
            ends[1] = hi - 1
            return hi - 1
        ends[0] = lo + 1
        return lo


def _worker_loop(paths: list[Path], progress: bool) -> list:
    """In a worker: parse files claimed from the back until none is left (or one is bad)."""
    done = []
    while (i := _claim(_ENDS, from_back=True)) is not None:
        done.append((i, _parse_frames_worker(paths[i], progress)))
        if done[-1][1][0] == "error":
            break
    return done


def _parse_frames_worker(path: Path, progress: bool):
    """_parse_frames in a worker; an InputError comes back as its fields (it does not
    pickle)."""
    try:
        return "ok", _parse_frames(path, progress)
    except InputError as e:
        return "error", e.file, e.message, e.position


def _parse_frames(path: Path, progress: bool):
    info, gpu, launch, cpu = parse_file(path, progress=progress)
    # the process group of each event (column pg_arg); a trace whose distributedInfo.pg_config
    # lists one group has no other: its collectives without a group are in that one (said)
    only = info["pg_names"][0] if len(info["pg_names"]) == 1 else None
    info["pg_filled"] = only is not None and (None in gpu["pg_arg"] or None in cpu["pg_arg"])
    pg = {k: pl.Series("pg_arg", d["pg_arg"], pl.Utf8) for k, d in (("gpu", gpu), ("cpu", cpu))}
    if only is not None:
        pg = {k: v.fill_null(only) for k, v in pg.items()}
    out = (info, frame(gpu, GPU_SCHEMA).with_columns(pg["gpu"]), frame(launch, LAUNCH_SCHEMA),
           frame(cpu, CPU_SCHEMA).with_columns(pg["cpu"], pl.Series("gemm_n", cpu["gemm_n"], pl.Int64)))
    cap = limit("max_name_bytes")
    for f in out[1:]:
        if "name" in f.columns and f.height:
            longest = f["name"].str.len_bytes().max()
            if longest is not None and longest > cap:
                raise limit_error(path, "max_name_bytes", f"an event name of {longest} bytes")
    return out


def _rank_of(p: Path, info: dict) -> int | None:
    return info["rank"] if info["rank"] is not None else rank_from_name(p.name, p)


def _one_run(items: list) -> bool:
    ranks = [_rank_of(p, info) for p, info, _ in items]
    worlds = {info["world_size"] for _, info, _ in items if info["world_size"]}
    if any(w == 1 for w in worlds) or len(worlds) > 1:
        return False
    if all(r is None for r in ranks):
        return True  # no rank anywhere: a folder of per-rank files, numbered by order
    return None not in ranks and len(set(ranks)) == len(ranks)


def _collect_run(items: list, options: dict) -> RunData:
    paths = [p for p, _, _ in items]
    classifier = Classifier(options.get("kernel_rules"), options.get("num_experts"))
    ranks: list[RankEvents] = []
    bases, time_bases, world = set(), set(), set()
    seen: dict[int, str] = {}
    for i, (p, info, ev) in enumerate(items):
        rank, inferred = info["rank"], False
        if rank is None:
            fr = rank_from_name(p.name, p)
            rank, inferred = (fr, True) if fr is not None else (i, True)
        if rank in seen:
            raise InputError(p, f"rank {rank} appears twice (also in {seen[rank]})")
        seen[rank] = p.name
        time_bases.add(info["time_base"])
        bases.add(info["base_ns"])
        if info["world_size"]:
            world.add(info["world_size"])
        ev.rank, ev.rank_inferred = rank, inferred
        ranks.append(ev)
    if len(time_bases) > 1:
        raise InputError(paths[0], "files mix absolute (epoch) and relative timestamps; they cannot form one run")
    tables, approx, meta = build(ranks, classifier)
    filled = sorted({info["pg_names"][0] for _, info, _ in items if info.get("pg_filled")})
    if filled:
        approx.append(f"process group of collectives without one in the trace taken from distributedInfo.pg_config, "
                      f"which lists one group ({', '.join(filled)})")
    meta.update({"format": "kineto", "world_size": sorted(world), "files": [p.name for p in paths]})
    # sha256 over the files' own sha256s (each taken while the file was read anyway)
    from ..domain.hashing import sha256_text  # (not at import: parsing workers need no store)

    sha = sha256_text("".join(info["sha256"] for _, info, _ in items)) if len(items) > 1 else items[0][1]["sha256"]
    return run_data(paths, sha, time_bases.pop() if time_bases else "none", options.get("num_ranks") or len(ranks),
                    options, approx, meta, tables)


register(Collector("kineto", "PyTorch profiler (Kineto) Chrome-trace JSON, plain or .gz; a folder of per-rank files "
                             "is one run", _is_kineto, _collect, priority=20))
