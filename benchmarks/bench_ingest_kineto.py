"""Ingest speed and peak memory of the Kineto collector, side by side with
HolisticTraceAnalysis loading the same folder.

The input is built from DeepSeek's real trace (../shared/data/deepseek_ep64_train_rank0.json.gz):
its events are replicated over ranks and steps (each copy time-shifted, with fresh
correlation ids and ``ProfilerStep#N`` renumbered) and written as one plain JSON file per
rank into a temporary folder (never into the repository). ``small``: 4 ranks x 2 steps
(about 25 MB); ``full``: 8 ranks x 48 steps (about 1.06 GB; run it under
a flock on moetrace-heavy.lock in the temp folder).

moetrace is timed on ``moetrace ingest FOLDER --store TMP`` (parse, classify, write
Parquet) in a fresh process, with its default (for an input this large: the process
itself plus parsing workers, one per CPU up to 4) and with ``--set jobs=1``; HTA on ``TraceAnalysis(trace_dir=FOLDER)`` in a fresh process
of its own environment (``MOETRACE_HTA_PYTHON``, default .hta-venv/bin/python; HTA
parses ranks with a process pool). Peak memory is the largest resident set of each
process tree (the process and all its descendants, summed; sampled every 50 ms),
compared with the uncompressed input size.

    python benchmarks/bench_ingest_kineto.py --size small
    python benchmarks/bench_ingest_kineto.py --size full
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Skipped, main, result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO.parent / "shared" / "data" / "deepseek_ep64_train_rank0.json.gz"
SIZES = {"small": (4, 2), "full": (8, 48)}
HTA_PYTHON = os.environ.get("MOETRACE_HTA_PYTHON", ".hta-venv/bin/python")

_MEASURE = r"""
import json, os, resource, sys, threading, time

def _tree_rss():  # resident bytes of this process and all its descendants (shared pages counted twice)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{{pid}}/statm") as f:
                total += int(f.read().split()[1])
            for tid in os.listdir(f"/proc/{{pid}}/task"):
                with open(f"/proc/{{pid}}/task/{{tid}}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
        except (OSError, ValueError, IndexError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE")

_peak, _done = [0], threading.Event()
def _sample():
    while not _done.is_set():
        _peak[0] = max(_peak[0], _tree_rss())
        _done.wait(0.05)
threading.Thread(target=_sample, daemon=True).start()
t0 = time.perf_counter()
{body}
dt = time.perf_counter() - t0
_done.set()
self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("BENCH " + json.dumps({{"seconds": dt, "peak_self_mib": self_kb / 1024,
                            "peak_tree_mib": max(_peak[0] / 2**20, self_kb / 1024)}}))
"""


def build_folder(out: Path, ranks: int, steps: int) -> int:
    """Write ranks x steps copies of the source trace; returns total bytes written."""
    doc = json.loads(gzip.open(SOURCE).read())
    events = doc.pop("traceEvents")
    xs = [e for e in events if e.get("ph") != "M"]
    meta = [e for e in events if e.get("ph") == "M"]
    t_min = min(e["ts"] for e in xs if "ts" in e)
    t_max = max(e["ts"] + e.get("dur", 0) for e in xs if "ts" in e)
    period = int(t_max - t_min) + 1000
    total = 0
    for r in range(ranks):
        path = out / f"rank-{r}.json"
        with open(path, "w") as f:
            head = dict(doc)
            head["distributedInfo"] = {"backend": "nccl", "rank": r, "world_size": ranks}
            f.write(json.dumps(head)[:-1] + ', "traceEvents": [\n')
            f.write(",\n".join(json.dumps(e) for e in meta))
            for k in range(steps):
                shift = k * period + r * 13
                cshift = k * 1_000_000
                parts = []
                for e in xs:
                    e2 = dict(e)
                    if "ts" in e2:
                        e2["ts"] = e2["ts"] + shift
                    if e2.get("name", "").startswith("ProfilerStep#"):
                        e2["name"] = f"ProfilerStep#{k + 1}"
                    a = e2.get("args")
                    if a and ("correlation" in a or "External id" in a):
                        a = dict(a)
                        for key in ("correlation", "External id"):
                            if key in a:
                                a[key] = a[key] + cshift
                        e2["args"] = a
                    if e2.get("ph") in ("s", "f") and "id" in e2:
                        e2["id"] = e2["id"] + cshift
                    parts.append(json.dumps(e2))
                f.write(",\n" + ",\n".join(parts))
            f.write("\n]}\n")
        total += path.stat().st_size
        print(f"  wrote {path.name}: {path.stat().st_size / 1e6:.0f} MB", file=sys.stderr, flush=True)
    return total


def _measure(python: str, body: str, timeout: float = 3600) -> dict:
    code = _MEASURE.format(body=body)
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout)
    for line in res.stdout.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[6:])
    raise RuntimeError(f"{python} failed (rc {res.returncode}): {res.stderr[-2000:]}")


def run(size: str) -> list[dict]:
    if not SOURCE.exists():
        raise Skipped(f"its source trace {SOURCE} is absent (../shared/data is not in a fresh clone)")
    ranks, steps = SIZES[size]
    tmp = Path(tempfile.mkdtemp(prefix="moetrace-bench-kineto-", dir="/tmp"))
    try:
        folder = tmp / "traces"
        folder.mkdir()
        nbytes = build_folder(folder, ranks, steps)
        mb = nbytes / 1e6
        def ours_with(jobs) -> dict:
            store = tmp / f"store-{jobs}"
            opts = {} if jobs is None else {"jobs": jobs}
            return _measure(sys.executable, f"""
from moetrace.collect import ingest
from moetrace.storage.store import Store
res = ingest(Store({str(store)!r}, create=True), [{str(folder)!r}], options={opts!r})
assert res and not res[0].skipped
""")

        # the default: this process plus workers (inputs of 256 MiB or more), else one process
        ours = ours_with(None)
        our_peak = ours["peak_tree_mib"]
        one = ours_with(1)
        one_peak = one["peak_tree_mib"]
        rows = [
            result("ingest_kineto", "throughput", mb / ours["seconds"], "MB/s",
                   notes=f"{ranks} ranks x {steps} steps, {mb:.0f} MB JSON, {ours['seconds']:.1f} s (default: "
                         f"{'this process + workers' if mb >= 256 * 2**20 / 1e6 else 'one process'})"),
            result("ingest_kineto", "peak_memory_over_input", our_peak * 2**20 / nbytes, "x input",
                   notes=f"peak RSS {our_peak:.0f} MiB (all processes together, sampled every 50 ms) for {mb:.0f} MB "
                         f"input (target < 2x)"),
            result("ingest_kineto", "throughput_jobs1", mb / one["seconds"], "MB/s",
                   notes=f"--set jobs=1 (one process): {one['seconds']:.1f} s, peak {one_peak:.0f} MiB"),
        ]
        if Path(HTA_PYTHON).exists():
            try:
                hta = _measure(HTA_PYTHON, f"""
import logging
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
TraceAnalysis(trace_dir={str(folder)!r})
""")
                hta_peak = hta["peak_tree_mib"]
                rows.append(result("ingest_kineto", "seconds", ours["seconds"], "s", baseline="HTA 0.5 TraceAnalysis",
                                   baseline_value=hta["seconds"], ratio=hta["seconds"] / ours["seconds"],
                                   notes="wall time, both with their default processes (HTA: a pool over ranks)"))
                rows.append(result("ingest_kineto", "seconds_jobs1", one["seconds"], "s",
                                   baseline="HTA 0.5 TraceAnalysis", baseline_value=hta["seconds"],
                                   ratio=hta["seconds"] / one["seconds"],
                                   notes="moetrace in one process (--set jobs=1), HTA with its pool"))
                rows.append(result("ingest_kineto", "peak_memory", our_peak, "MiB", baseline="HTA 0.5 TraceAnalysis",
                                   baseline_value=hta_peak, ratio=hta_peak / our_peak,
                                   notes="both: all processes together (RSS summed, sampled every 50 ms)"))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                rows.append(result("ingest_kineto", "seconds", ours["seconds"], "s", baseline="HTA 0.5 TraceAnalysis",
                                   notes=f"HTA failed: {str(e)[-300:]}"))
        else:
            rows.append(result("ingest_kineto", "seconds", ours["seconds"], "s",
                               notes=f"HTA not installed at {HTA_PYTHON} (python3 -m venv .hta-venv && "
                                     ".hta-venv/bin/pip install holistictraceanalysis)"))
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(run)
