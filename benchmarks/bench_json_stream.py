"""Peak memory of ingesting an SGLang ``{"logical_count": [N][61][256]}`` JSON dump against
its size: ``moetrace ingest`` (which reads it in bounded memory, collect/_json_stream.py)
beside reading the same file whole (``json.loads`` + ``np.asarray``, what the collector did
before), each in its own process, at two file sizes (small: 1 and 4 MB; full: 50 and
500 MB). The files are generated in a temporary folder and deleted afterwards. Prints the
load average and the CPU count beside the figures (timings on a loaded machine are not
judged; peak memory is what this measures).

    python benchmarks/bench_json_stream.py --size full
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import main, result  # noqa: E402

SIZES = {"small": (1, 4), "full": (50, 500)}          # MB of JSON text
L, E = 61, 256

_PEAK = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
         "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
         "print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")

_WHOLE = ("import json, sys, numpy as np; a = np.asarray(json.loads(open(sys.argv[1]).read())['logical_count']); "
          "print(a.shape)")


def write_dump(path: Path, mb: int, seed: int = 0) -> int:
    """A [N][L][E] logical_count JSON of about ``mb`` MB (dense layers 0-2 zero); returns N."""
    rng = np.random.default_rng(seed)
    n = 0
    with open(path, "w") as f:
        f.write('{"logical_count": [')
        while f.tell() < mb * 1_000_000:
            a = rng.poisson(rng.lognormal(3.0, 0.8, size=(L, E)))
            a[:3] = 0
            f.write(("," if n else "") + json.dumps(a.tolist(), separators=(",", ":")))
            n += 1
        f.write('], "rank": 0}')
    return n


def peak(cmd: list[str]) -> tuple[int, float, float]:
    """(exit code, seconds, peak RSS MiB) of ``cmd`` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True, check=True).stdout
    rc, s, mib = out.split()
    return int(rc), float(s), float(mib)


def run(size: str) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="moetrace-bench-json-"))
    env_note = f"load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    rows = []
    try:
        for mb in SIZES[size]:
            f = tmp / f"dump_{mb}mb.json"
            n = write_dump(f, mb)
            real = f.stat().st_size / 2**20
            rc, s, mib = peak([sys.executable, "-m", "moetrace", "ingest", str(f), "--store", str(tmp / f"st{mb}")])
            if rc:
                raise RuntimeError(f"moetrace ingest failed on {f} (exit {rc})")
            rc2, s2, whole = peak([sys.executable, "-c", _WHOLE, str(f)])
            load = f"load {os.getloadavg()[0]:.2f}"
            rows.append(result("json_stream", f"ingest peak RSS, {real:.0f} MiB file ({n} steps)", mib, "MiB",
                               "whole-file json.loads + np.asarray", whole, whole / mib if mib else None,
                               f"ingest {s:.1f} s, whole read {s2:.1f} s; {load}; {env_note}"))
            shutil.rmtree(tmp / f"st{mb}", ignore_errors=True)
            f.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main(run)
