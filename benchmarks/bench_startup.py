"""Benchmark: start-up of ``moetrace runs STORE`` and ``moetrace skew STORE`` on a tiny store
(the goal: under 0.3 s on a quiet machine), beside ``python -c pass``.

Each command is run 5 times (wall time: best and median) and once under
``python -X importtime`` (the heaviest imports it pulls in, cumulative microseconds).
``--before CHECKOUT`` times a second checkout of moetrace (its folder on ``PYTHONPATH``) in
the same run, so a before/after comparison sees the same machine load. The load average and
the CPU count are printed; the 0.3 s goal is judged only on a quiet machine (load below 1.5
on 2 cores), otherwise "not judged".

    python benchmarks/bench_startup.py [--before OTHER_CHECKOUT]
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOAL_S, QUIET_LOAD, QUIET_CPUS, REPS = 0.3, 1.5, 2, 5


def _env(checkout: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(checkout)
    return env


def _run(cmd: list[str], env: dict, extra: list[str] = ()) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *extra, *cmd], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{cmd} failed (exit {p.returncode}): {p.stderr[-800:]}")
    return dt, p.stderr


def top_imports(cmd: list[str], env: dict, n: int = 6) -> list[tuple[str, int]]:
    """The third-party packages with the largest import time (cumulative us of the package's
    first import, wherever it happened), from ``-X importtime``."""
    _, err = _run(cmd, env, ["-X", "importtime"])
    out: dict[str, int] = {}
    for line in err.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$", line)
        if m and "." not in m.group(2) and not m.group(2).startswith("_") and m.group(2) != "moetrace":
            out[m.group(2)] = max(out.get(m.group(2), 0), int(m.group(1)))
    return sorted(out.items(), key=lambda kv: -kv[1])[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="another moetrace checkout to time in the same run")
    args = ap.parse_args()
    cpus = os.cpu_count()
    load0 = os.getloadavg()[0]
    checkouts = ([("before", args.before.resolve())] if args.before else []) + [("after", REPO)]
    tmp = Path(tempfile.mkdtemp(prefix="moetrace-startup-"))
    try:
        tiny = tmp / "tiny"
        _run(["-m", "moetrace", "synth", str(tiny), "--layers", "2", "--steps", "3", "--tokens-per-step", "64",
              "--experts", "16", "--top-k", "2", "--ranks", "4", "--ranks-per-node", "4"], _env(REPO))
        bare = min(_run(["-c", "pass"], _env(REPO))[0] for _ in range(REPS))
        rows = []
        for name in ("runs", "skew"):
            for label, co in checkouts:
                cmd = ["-m", "moetrace", name, str(tiny)]
                env = _env(co)
                ts = [_run(cmd, env)[0] for _ in range(REPS)]
                rows.append((name, label, min(ts), statistics.median(ts), top_imports(cmd, env)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()[0]
    quiet = max(load0, load1) < QUIET_LOAD and cpus == QUIET_CPUS
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now}; load average {load0:.2f} at start, {load1:.2f} at end, {cpus} CPUs: "
          + ("quiet, goal judged" if quiet else "not quiet: goal not judged"))
    print(f"python -c pass: {bare:.3f} s (best of {REPS})")
    for name, label, best, med, imps in rows:
        verdict = ("MET" if best < GOAL_S else "MISSED") if quiet else "not judged"
        print(f"moetrace {name:<4} [{label:<6}] best {best:.3f} s, median {med:.3f} s of {REPS}; "
              f"goal < {GOAL_S} s: {verdict}")
        print("    imports (cumulative ms): " + ", ".join(f"{k} {v / 1000:.0f}" for k, v in imps))


def run(size: str) -> list[dict]:
    """Best-of-N wall time of `moetrace runs` and `moetrace skew` on a tiny store beside a bare
    `python -c pass` (the interpreter's own start), with the load average in the notes."""
    from benchmarks.common import result

    reps = 2 if size == "small" else REPS
    tmp = Path(tempfile.mkdtemp(prefix="moetrace-startup-"))
    try:
        tiny = tmp / "tiny"
        env = _env(REPO)
        _run(["-m", "moetrace", "synth", str(tiny), "--layers", "2", "--steps", "3", "--tokens-per-step", "64",
              "--experts", "16", "--top-k", "2", "--ranks", "4", "--ranks-per-node", "4"], env)
        bare = min(_run(["-c", "pass"], env)[0] for _ in range(reps))
        out = []
        for name in ("runs", "skew"):
            best = min(_run(["-m", "moetrace", name, str(tiny)], env)[0] for _ in range(reps))
            load, cpus = os.getloadavg()[0], os.cpu_count()
            quiet = load < QUIET_LOAD and cpus == QUIET_CPUS
            verdict = ("MET" if best < GOAL_S else "MISSED") if quiet else "not judged"
            out.append(result("startup", f"moetrace {name} on a tiny store (best of {reps})", best, "s",
                              "python -c pass", bare, bare / best,
                              f"goal < {GOAL_S} s: {verdict}; load {load:.2f}, {cpus} CPUs"))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
