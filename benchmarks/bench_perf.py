"""Benchmark: moetrace near the limit, side by side with the plain alternative (issue #14).

One expert_load Parquet file of ``steps x 58 layers x 256 experts`` (full: 2,000 steps,
29,696,000 rows; columns step, layer, expert, tokens; Poisson counts around a log-normal
popularity per layer) is made once; then, in one run on the same machine:

1. ``moetrace ingest FILE --ranks 32``: wall time and peak RSS of the whole process tree,
   next to a plain DuckDB ``COPY (SELECT * FROM read_parquet(FILE)) TO x.parquet``;
2. ``moetrace skew --by step`` (every layer_skew column, written to Parquet), next to the
   one-line DuckDB imbalance query over the same file (max/mean of the contiguous rank
   sums per (step, layer));
3. replay's store read: count rows per second into the dense ``[T, L, E]`` array (best of 3
   calls in one process, the first call printed too);
4. CLI start-up: ``moetrace --help`` and ``moetrace runs STORE`` (best of 3);
5. ``moetrace synth`` at fleet shape (58 layers x 2,000 steps, 512 tokens per step);
6. fleet-hour layer_skew: ``benchmarks/bench_fleet.py``'s ingest and layer_skew stages on
   5% of the hour (3,600 of 72,000 steps), extrapolated (the whole hour:
   ``python benchmarks/bench_fleet.py --size full``).

Every figure is printed with the goal of the issue, the ratio to the plain alternative
where there is one, and the figure moetrace had before this work (``BEFORE``: measured on
2026-11-30 on the same 2-core machine, from the issue's table). Each stage runs in its own
process; peak RSS is the largest sum over the process tree, sampled every 20 ms. The
machine is shared: the load average at the start and end is printed with the results.

    python benchmarks/bench_perf.py --size full
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import heavy_lock, main, result  # noqa: E402

SIZES = {
    "small": dict(steps=50, layers=4, experts=256, ranks=32, synth_layers=4, synth_steps=50, synth_tokens=512),
    "full": dict(steps=2000, layers=58, experts=256, ranks=32, synth_layers=58, synth_steps=2000, synth_tokens=512),
}
#: moetrace before this work, full size (issue #14's table, 2026-11-30, same machine)
BEFORE = {
    "ingest_s": 45.0, "ingest_peak_mib": 8.4 * 1024 / 1.073741824, "skew_s": 21.3, "read_rows_s": 5.4e6,
    "startup_s": 2.0, "synth_s": 500.0, "fleet_layer_skew_s": 592.0,
}
GOALS = {"ingest": 3.0, "ingest_peak_mib": 1024.0, "skew": 3.0, "read_rows_s": 50e6, "startup_s": 0.5,
         "fleet_speedup": 10.0, "synth_s": 60.0}


def _goal(ok: bool, text: str) -> str:
    return f"goal {text}: {'MET' if ok else 'MISSED'}"


def goal_table(rows: list[dict], size: str = "full") -> str:
    """Every goal of issue #14 on one line each: measured, the baseline beside it, the ratio,
    the goal and whether it is met (printed on stderr by :func:`run`)."""
    out = ["", f"issue #14 goals (same file, same machine, same run; size {size}"
               + ("" if size == "full" else ": the goals are set for --size full") + "):",
           f"{'what':<34} {'measured':>14} {'baseline':>14} {'ratio':>8}  goal"]
    for r in rows:
        if "goal " not in r.get("notes", ""):
            continue
        base = "" if r.get("baseline_value") is None else f"{r['baseline_value']:.4g}"
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        goal = r["notes"][r["notes"].index("goal "):].split(";")[0]
        out.append(f"{r['metric']:<34} {r['value']:>10.4g} {r['unit']:<3} {base:>14} {ratio:>8}  {goal}")
    return "\n".join(out)
REPO = Path(__file__).resolve().parent.parent


def make_file(path: Path, steps: int, layers: int, experts: int, seed: int = 0) -> int:
    """The benchmark's expert_load file, written 100 steps at a time (rows ordered by step)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    w = np.exp(0.6 * rng.standard_normal((layers, experts)))
    lam = 32 * 128 * 8 * (w / w.sum(axis=1, keepdims=True))
    layer_col = np.repeat(np.arange(layers, dtype=np.int64), experts)
    expert_col = np.tile(np.arange(experts, dtype=np.int64), layers)
    rows = 0
    with pq.ParquetWriter(path, pa.schema([("step", pa.int64()), ("layer", pa.int64()), ("expert", pa.int64()),
                                           ("tokens", pa.int64())])) as wr:
        for s0 in range(0, steps, 100):
            n = min(100, steps - s0)
            wr.write_table(pa.table({
                "step": np.repeat(np.arange(s0, s0 + n, dtype=np.int64), layers * experts),
                "layer": np.tile(layer_col, n), "expert": np.tile(expert_col, n),
                "tokens": rng.poisson(lam[None], size=(n, layers, experts)).astype(np.int64).ravel()}))
            rows += n * layers * experts
    return rows


def _tree_rss(proc) -> int:
    import psutil

    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(cmd: list[str], cwd=None, timeout: float | None = None) -> dict:
    """Run ``cmd``; wall seconds, peak RSS (MiB) of its process tree, exit code, output tail."""
    import psutil

    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    ps = psutil.Process(p.pid)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(ps))
            done.wait(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        timed_out = True
    secs = time.perf_counter() - t0
    done.set()
    th.join()
    return {"seconds": secs, "peak_mib": peak[0] / 2 ** 20, "rc": p.returncode, "timed_out": timed_out,
            "out": (out or "")[-2000:], "err": (err or "")[-2000:]}


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "moetrace", *args]


def _ok(m: dict, what: str) -> dict:
    if m["rc"] != 0 and not m["timed_out"]:
        raise RuntimeError(f"{what} failed (exit {m['rc']}): {m['err'][-1500:]}")
    return m


READ_CODE = """
import sys, time, json
sys.path.insert(0, {repo!r})
import pyarrow.parquet  # imported before the clock starts: read speed, not start-up
from moetrace.storage.store import Store
from moetrace.storage.dense import read_counts
st = Store({store!r})
secs = []
for _ in range(3):
    t0 = time.perf_counter()
    steps, layers, counts = read_counts(st, 'load')
    secs.append(time.perf_counter() - t0)
print(json.dumps({{"read_s": min(secs), "first_s": secs[0], "cells": int(counts.size), "total": int(counts.sum())}}))
"""


#: share of the fleet hour (72,000 steps) whose layer_skew is timed at full size
FLEET_FRACTION = 0.05


def _fleet_layer_skew(size: str, tmp: Path) -> dict:
    """bench_fleet's ingest and layer_skew stages on FLEET_FRACTION of the full run (all
    of the small one); seconds extrapolated linearly to the whole run."""
    from benchmarks import bench_fleet as bf

    cfg = bf.SIZES[size]
    f = FLEET_FRACTION if size == "full" else 1.0
    steps = max(cfg["chunk_steps"], int(round(cfg["steps"] * f)))
    (tmp / "fleet_spill").mkdir()
    ing = bf._in_process(bf._stage_ingest, str(tmp / "fleet"), cfg, steps)
    skew = bf._in_process(bf._stage_layer_skew, str(tmp / "fleet"), cfg, steps, str(tmp / "fleet_spill"))
    share = steps / cfg["steps"]
    return {"steps": steps, "rows": ing["rows"], "seconds": skew["seconds"], "full_s": skew["seconds"] / share,
            "cpu_s": skew["cpu_s"], "full_cpu_s": skew["cpu_s"] / share, "peak_mib": skew["peak_mib"], "share": share}


def run(size: str = "small") -> list[dict]:
    cfg = SIZES[size]
    b = "perf"
    load0 = os.getloadavg()[0]
    with heavy_lock(size):
        tmp = Path(tempfile.mkdtemp(prefix="moetrace-bench-perf-", dir="/tmp"))
        try:
            f = tmp / "load.parquet"
            rows = make_file(f, cfg["steps"], cfg["layers"], cfg["experts"])
            mb = f.stat().st_size / 1e6
            # 1. ingest vs a plain DuckDB COPY of the same file
            copy = _ok(measure(_py(f"import duckdb; c = duckdb.connect(); c.execute('SET enable_progress_bar=false'); c.execute(\"COPY (SELECT * FROM read_parquet('{f}')) "
                                   f"TO '{tmp / 'copy.parquet'}' (FORMAT parquet, COMPRESSION zstd)\")")), "duckdb COPY")
            ing = _ok(measure(_cli("ingest", str(f), "--store", str(tmp / "st"), "--ranks", str(cfg["ranks"]),
                                   "--run-id", "load")), "moetrace ingest")
            # 2. skew (every column) vs the one-line DuckDB imbalance query
            epr = cfg["experts"] // cfg["ranks"]
            one = (f"SELECT step, layer, max(t) / avg(t) AS imbalance FROM (SELECT step, layer, expert // {epr} AS rank, "
                   f"sum(tokens) AS t FROM read_parquet('{f}') GROUP BY ALL) GROUP BY ALL")
            duck_skew = _ok(measure(_py(f"import duckdb; c = duckdb.connect(); c.execute('SET enable_progress_bar=false'); c.execute(\"COPY ({one}) TO "
                                        f"'{tmp / 'one.parquet'}' (FORMAT parquet)\")")), "duckdb imbalance")
            skew = _ok(measure(_cli("skew", str(tmp / "st"), "--by", "step", "-o", str(tmp / "skew.parquet"))),
                       "moetrace skew")
            # 3. replay's store read
            rd = _ok(measure(_py(READ_CODE.format(repo=str(REPO), store=str(tmp / "st")))), "store read")
            rdj = json.loads(rd["out"].strip().splitlines()[-1])
            # 4. start-up
            helps = [measure(_cli("--help"))["seconds"] for _ in range(3)]
            runs = [_ok(measure(_cli("runs", str(tmp / "st"))), "moetrace runs")["seconds"] for _ in range(3)]
            # 5. synth at fleet shape
            syn = measure(_cli("synth", str(tmp / "syn"), "--layers", str(cfg["synth_layers"]), "--steps",
                               str(cfg["synth_steps"]), "--tokens-per-step", str(cfg["synth_tokens"])),
                          timeout=600 if size == "full" else 300)
            _ok(syn, "moetrace synth")
            # 6. fleet-hour layer_skew (bench_fleet's stages on a share of the run, extrapolated)
            fleet = _fleet_layer_skew(size, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()[0]
    full = size == "full"
    machine = f"load average {load0:.1f} at start, {load1:.1f} at end (2 cores shared)"

    def before(key, fmt):
        return f"; before this work (full size, 2026-11-30): {fmt.format(BEFORE[key])}" if full else ""

    read_rate = rows / rdj["read_s"]
    syn_note = (f"{cfg['synth_layers']} layers x {cfg['synth_steps']} steps x {cfg['synth_tokens']} tokens/step"
                + (" -- TIMED OUT" if syn["timed_out"] else ""))
    ing_x = ing["seconds"] / copy["seconds"]
    skew_x = skew["seconds"] / duck_skew["seconds"]
    fleet_x = BEFORE["fleet_layer_skew_s"] / fleet["full_s"] if full else None
    rows_out = [
        result(b, "input rows", rows, "rows", notes=f"{cfg['steps']} steps x {cfg['layers']} layers x "
                                                    f"{cfg['experts']} experts, {mb:.1f} MB Parquet; {machine}"),
        result(b, "ingest: wall time", ing["seconds"], "s", "duckdb COPY to zstd Parquet", copy["seconds"], ing_x,
               notes=f"{_goal(ing_x <= GOALS['ingest'], 'ingest within %.0fx the COPY' % GOALS['ingest'])}; "
                     f"ratio = moetrace / COPY{before('ingest_s', '{:.0f} s')}"),
        result(b, "ingest: peak RSS (tree)", ing["peak_mib"], "MiB", "duckdb COPY peak RSS", copy["peak_mib"],
               ing["peak_mib"] / copy["peak_mib"],
               notes=f"{_goal(ing['peak_mib'] < GOALS['ingest_peak_mib'], 'peak RSS < %.0f MiB at any size' % GOALS['ingest_peak_mib'])}; "
                     f"ratio = moetrace / COPY{before('ingest_peak_mib', '{:.0f} MiB')}"),
        result(b, "skew --by step: wall time", skew["seconds"], "s", "duckdb one-line imbalance query",
               duck_skew["seconds"], skew_x,
               notes=f"{_goal(skew_x <= GOALS['skew'], 'skew within %.0fx the one-line query' % GOALS['skew'])}; "
                     f"every layer_skew column to Parquet; peak {skew['peak_mib']:.0f} MiB; ratio = moetrace / "
                     f"one-liner{before('skew_s', '{:.1f} s')}"),
        result(b, "replay store read: rows/s", read_rate, "rows/s", "goal 50M rows/s", GOALS["read_rows_s"],
               read_rate / GOALS["read_rows_s"],
               notes=f"{_goal(read_rate >= GOALS['read_rows_s'], '>= 50M count rows/s')}; {rows:,} count rows into "
                     f"[T, L, E] in {rdj['read_s']:.2f} s, best of 3 in one process (first call {rdj['first_s']:.2f} s; "
                     f"moetrace.storage.dense.read_counts){before('read_rows_s', '{:.3g} rows/s')}"),
        result(b, "start-up: moetrace --help", min(helps), "s", "goal 0.5 s", GOALS["startup_s"],
               min(helps) / GOALS["startup_s"],
               notes=f"{_goal(min(helps) < GOALS['startup_s'], '< 0.5 s')}; best of 3{before('startup_s', '~{:.0f} s')}"),
        result(b, "start-up: moetrace runs", min(runs), "s", "goal 0.5 s", GOALS["startup_s"],
               min(runs) / GOALS["startup_s"],
               notes=f"{_goal(min(runs) < GOALS['startup_s'], '< 0.5 s')}; best of 3{before('startup_s', '~{:.0f} s')}"),
        result(b, "fleet layer_skew: wall time", fleet["full_s"], "s",
               "before this work (2026-11-30)" if full else None, BEFORE["fleet_layer_skew_s"] if full else None,
               fleet_x,
               notes=(f"{_goal(fleet_x >= GOALS['fleet_speedup'], '>= 10x faster than 592 s')}; " if full else
                      "the goal (>= 10x faster than 592 s) is for the full size; ")
                     + f"{fleet['rows']:,} rows ({fleet['steps']:,} steps, "
                     f"{fleet['share']:.3g} of the fleet hour) in {fleet['seconds']:.1f} s"
                     + (", extrapolated to the 1.07B-row hour" if fleet["share"] < 1 else "")
                     + f"; CPU {fleet['cpu_s']:.1f} s ({fleet['full_cpu_s']:.0f} s for the hour: "
                     f"{fleet['full_cpu_s'] / 2:.0f} s on 2 idle cores)"
                     + f"; peak {fleet['peak_mib']:.0f} MiB (benchmarks/bench_fleet.py stages)"),
        result(b, "synth: wall time", syn["seconds"], "s",
               "before this work (2026-11-30)" if full else None, BEFORE["synth_s"] if full else None,
               BEFORE["synth_s"] / syn["seconds"] if full else None,
               notes=(f"{_goal(syn['seconds'] < GOALS['synth_s'] and not syn['timed_out'], 'seconds, not minutes (< 60 s)')}; "
                      if full else "") + f"{syn_note}; peak {syn['peak_mib']:.0f} MiB"
                     + (f"; before this work: did not finish in {BEFORE['synth_s']:.0f} s (ratio is a lower bound)"
                        if full else "")),
    ]
    print(goal_table(rows_out, size), file=sys.stderr)
    return rows_out


if __name__ == "__main__":
    main(run)
