"""Run every benchmark and write the results table.

    python benchmarks/run_all.py                       # every bench_*.py at small size (CI)
    python benchmarks/run_all.py --size full           # the figures quoted in the docs (heavy: takes
                                                       # moetrace-heavy.lock in the temp folder for the whole run)
    python benchmarks/run_all.py --size full --only fleet --only layer_skew

Each ``benchmarks/bench_<name>.py`` exposes ``run(size) -> list[dict]`` (see
``benchmarks/common.py``). Each one runs in its own process (a crash or a timeout in one
does not stop the others; its peak memory is its own) and its rows land in
``<out>/results.json`` and ``<out>/results.md`` (default ``benchmarks/results/``): every
figure with its unit and, where the benchmark measured one, the baseline it was compared
with (pandas, HolisticTraceAnalysis, a plain-Python loop, ...) and the ratio (how many
times better than the baseline; > 1 means moetrace wins). Running a subset with --only
updates those benchmarks' entries and keeps the others, each entry saying at which size
and when it ran. A benchmark whose input is absent here raises ``benchmarks.common.Skipped``
and is listed as skipped with the reason. Exit code 1 when a benchmark failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.common import heavy_lock  # noqa: E402

# What the issues ask each benchmark to be compared with (shown next to the results).
TARGETS = {
    "layer_skew": "layer_skew over 58 x 256 x 20,000 steps vs pandas (ratio); within 24 GiB",
    "replay": "replay 58 x 256 x 10,000 steps in a few seconds on 2 cores; vs a per-token Python loop (ratio)",
    "eplb": "vectorized rebalance_experts vs a pure-Python implementation of the same algorithm (ratio; "
            "outputs equal)",
    "ingest_kineto": "ingest >= 1 GB of multi-rank Kineto traces >= 10x faster than HolisticTraceAnalysis; "
                     "peak memory < 2x the uncompressed input",
    "fleet": "320 ranks x 58 layers x 72,000 steps (~1e9 rows): ingest, layer_skew, one replay within 24 GiB",
    "sweep_cluster": "replay sweep on a LocalCluster of 2 workers vs one process (speedup; rows equal)",
}

RUNNER = """
import json, resource, sys, time, importlib
sys.path.insert(0, {repo!r})
mod = importlib.import_module({module!r})  # a real module name: spawned workers can import it again
from benchmarks.common import Skipped
t0 = time.perf_counter()
try:
    rows, skipped = mod.run({size!r}), None
except Skipped as e:
    rows, skipped = [], str(e)
wall = time.perf_counter() - t0
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
with open({out!r}, "w") as f:
    json.dump({{"rows": rows, "skipped": skipped, "wall_s": wall, "peak_rss_mib": peak / 1024.0}}, f)
"""


def discover(only: list[str] | None = None) -> dict[str, Path]:
    found = {p.stem[len("bench_"):]: p for p in sorted(HERE.glob("bench_*.py"))}
    if only:
        missing = [o for o in only if o not in found]
        if missing:
            raise SystemExit(f"no benchmark named {', '.join(missing)} (have: {', '.join(found)})")
        found = {k: v for k, v in found.items() if k in only}
    return found


def run_one(name: str, path: Path, size: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="moetrace-runall-", dir="/tmp") as d:
        out = Path(d) / "rows.json"
        code = RUNNER.format(repo=str(REPO), module=f"benchmarks.{path.stem}", size=size, out=str(out))
        env = {**os.environ, "MOETRACE_HEAVY_LOCK_HELD": "1" if size == "full" else ""}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                                  cwd=str(REPO), env=env)
        except subprocess.TimeoutExpired:
            return {"benchmark": name, "status": "timeout", "size": size, "wall_s": time.perf_counter() - t0,
                    "error": f"did not finish within {timeout:.0f} s", "results": []}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            return {"benchmark": name, "status": "failed", "size": size, "wall_s": wall,
                    "error": "\n".join(tail), "results": []}
        doc = json.loads(out.read_text())
    if doc.get("skipped"):
        return {"benchmark": name, "status": "skipped", "size": size, "wall_s": wall, "error": doc["skipped"],
                "results": []}
    rows = doc["rows"]
    bad = [r for r in rows if not isinstance(r, dict) or not {"metric", "value", "unit"} <= set(r)]
    if not isinstance(rows, list) or not rows or bad:
        return {"benchmark": name, "status": "failed", "size": size, "wall_s": wall,
                "error": "run() must return a non-empty list of result dicts (benchmarks/common.py: result)",
                "results": []}
    return {"benchmark": name, "status": "ok", "size": size, "wall_s": wall, "peak_rss_mib": doc["peak_rss_mib"],
            "ran_at": time.strftime("%Y-%m-%d %H:%M:%S"), "target": TARGETS.get(name), "results": rows}


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError, ValueError):
        kb = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
        info["memory_gib"] = round(kb / 2 ** 20, 1)
    for mod in ("duckdb", "polars", "pyarrow", "numpy"):
        with contextlib.suppress(Exception):
            info[mod] = __import__(mod).__version__
    return info


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if a >= 1e5:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:,.1f}"
        return f"{v:.3g}"
    return str(v)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = ["# moetrace benchmarks", "",
             f"Written by `benchmarks/run_all.py`. Machine: {m.get('cpus')} CPUs, {m.get('memory_gib')} GiB, "
             f"Python {m.get('python')}, DuckDB {m.get('duckdb')}, polars {m.get('polars')}, "
             f"pyarrow {m.get('pyarrow')}.", "",
             "Ratio = how many times better than the baseline (> 1: moetrace is faster or smaller).", "",
             "| benchmark | size | metric | value | unit | baseline | baseline value | ratio | notes |",
             "|---|---|---|---:|---|---|---:|---:|---|"]
    for b in doc["benchmarks"]:
        if b["status"] != "ok":
            err = b.get("error", "").splitlines()[-1:] or [""]
            lines.append(f"| {b['benchmark']} | {b['size']} | **{b['status'].upper()}** | | | | | | "
                         f"{err[0].replace('|', '/')} |")
            continue
        for r in b["results"]:
            cells = [b["benchmark"], b["size"], r["metric"], _fmt(r["value"]), r["unit"], r.get("baseline") or "",
                     _fmt(r.get("baseline_value")), (_fmt(r["ratio"]) + "x") if r.get("ratio") is not None else "",
                     (r.get("notes") or "").replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets from the issues", ""]
    for b in doc["benchmarks"]:
        if b.get("target") or TARGETS.get(b["benchmark"]):
            lines.append(f"- **{b['benchmark']}** ({b['size']}, ran {b.get('ran_at', '?')}, "
                         f"{_fmt(b.get('wall_s'))} s): {b.get('target') or TARGETS[b['benchmark']]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run every benchmarks/bench_*.py and write results.json / results.md.")
    ap.add_argument("--size", choices=["small", "full"], default="small")
    ap.add_argument("--only", action="append", help="benchmark name (bench_<name>.py); repeatable")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for results.json and results.md")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per benchmark (default 300 small, "
                                                                 "7200 full)")
    args = ap.parse_args(argv)
    timeout = args.timeout or (300.0 if args.size == "small" else 7200.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    benches = discover(args.only)
    previous = {}
    if args.only and (out / "results.json").exists():
        with contextlib.suppress(ValueError, KeyError):
            previous = {b["benchmark"]: b for b in json.loads((out / "results.json").read_text())["benchmarks"]}
    entries = dict(previous)
    with heavy_lock(args.size, announce=True):
        for name, path in benches.items():
            print(f"[{args.size}] {name} ...", file=sys.stderr, flush=True)
            e = run_one(name, path, args.size, timeout)
            entries[name] = e
            print(f"[{args.size}] {name}: {e['status']} in {e['wall_s']:.1f} s"
                  + (f"\n{e['error']}" if e["status"] != "ok" else ""), file=sys.stderr, flush=True)
    doc = {"written_at": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
           "benchmarks": [entries[k] for k in sorted(entries)]}
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
    (out / "results.md").write_text(markdown(doc))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}", file=sys.stderr)
    return 0 if all(entries[k]["status"] in ("ok", "skipped") for k in benches) else 1


if __name__ == "__main__":
    sys.exit(main())
