"""Benchmark: a fleet-size run in bounded memory.

full: 320 expert-parallel ranks, 58 MoE layers, 256 experts (+64 redundant slots: one
slot per rank, DeepSeek-V3 on 320 GPUs), one hour at 20 steps per second = 72,000 steps:
58 × 256 × 72,000 = 1,069,056,000 expert_load rows. Run it under the heavy-job lock
(it takes the lock itself when run alone):

    python benchmarks/bench_fleet.py --size full
    python benchmarks/bench_fleet.py --size full --fraction 0.1   # 7,200 steps, extrapolated
    python benchmarks/bench_fleet.py --size medium   # the full shape, 2,400 steps (profiling, before/after)
    python benchmarks/bench_fleet.py --size full --span day --fraction 0.0002 --engine spark
        # a fleet-day's shape, 346 steps measured, the first report on Spark, extrapolated to the day

Stages, each in a fresh process so its peak RSS is its own:

1. **generate + ingest**: the counts are generated chunk by chunk (``chunk_steps`` steps at
   a time: Poisson counts around B·k·p, log-normal popularity per layer, B = 128 tokens
   per rank per step) and streamed through ``Store.write_run`` as an iterator of Arrow
   tables in the dense layout (``expert_counts``: one list of 256 counts per step and
   layer; the ``expert_load`` view shows them as rows): one transaction, never the whole
   table in memory. Rows arrive ordered by step, so every Parquet row group covers a
   narrow step range and its min/max statistics let step-range reads skip the rest. A recorded placement (the 64 hottest
   experts of each layer replicated on slots 256..319) goes in the same transaction.
2. **layer_skew**: every column of the view over the whole run, written to Parquet in
   batches of ``skew_batch_steps`` steps (one query over the whole run does not fit: the
   view's per-(step, layer) lists do not spill), DuckDB capped at ``memory_limit``.
3. **replay**: ``moetrace replay --policy eplb`` fitted on the first steps and replayed
   over every step (the engine reads the store in step chunks), ``--no-rank-rows``.
4. **report**: ``moetrace report --quiet`` as a user runs it (its per-(step, layer) views
   are computed in step batches by ``moetrace.analyze.materialize_layer_skew``, then
   stored in the store: ``moetrace.analyze.cache``); not counted in "all stages".
5. **report (cache reused)**: the same command again: the stored per-(step, layer) results
   are read instead of the expert_load rows. ``uptime``'s load averages are printed beside
   both report stages (the machine is shared: the load says how far to trust the times).

With ``--fraction f`` (or ``MOETRACE_FLEET_FRACTION``) only ``f × 72,000`` steps are
generated; every time is then also given extrapolated linearly to the full run, and the
result notes say so (EXTRAPOLATED). ``--span day`` makes the fraction a share of a fleet-day (24 hours, 1,728,000
steps) and extrapolates to it; ``--engine spark`` computes the first report's analysis on Spark
(``moetrace report --engine spark``, local JVM start included). The report stage is also given as
a ratio to the layer_skew stage (goal: at most 2x), with the load average: judged only below
load 1.5. ``--size medium`` (2,400 steps of the full shape) is extrapolated the
same way, linearly to the fleet-hour's 72,000 steps. All data lives in a temporary folder under /tmp, deleted at the end.
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import heavy_lock, peak_rss_mib, result  # noqa: E402

SIZES = {
    "small": dict(ranks=32, ranks_per_node=8, layers=4, experts=256, redundant=32, steps=240, chunk_steps=80,
                  fit_steps=80, duck_memory="1GB", skew_batch_steps=100),
    # the full shape over 2,400 steps (1/30 of the hour): a profile / before-after size
    "medium": dict(ranks=320, ranks_per_node=8, layers=58, experts=256, redundant=64, steps=2400, chunk_steps=200,
                   fit_steps=400, duck_memory="2GB", skew_batch_steps=400),
    "full": dict(ranks=320, ranks_per_node=8, layers=58, experts=256, redundant=64, steps=72_000, chunk_steps=200,
                 fit_steps=1000, duck_memory="4GB", skew_batch_steps=1000),
}
TOP_K = 8
#: the first report's goal, as a multiple of the layer_skew stage, judged on a quiet machine only
REPORT_GOAL, QUIET_LOAD = 2.0, 1.5
TOKENS_PER_RANK = 128
SIGMA = 0.6
THREADS = 2


# ----------------------------------------------------------------------------- data
def _popularity(cfg: dict) -> np.ndarray:
    rng = np.random.default_rng(12345)
    w = np.exp(SIGMA * rng.standard_normal((cfg["layers"], cfg["experts"])))
    return w / w.sum(axis=1, keepdims=True)


def _placement(cfg: dict, p: np.ndarray):
    """Recorded plan: expert e on slot e, the `redundant` hottest experts once more."""
    import pyarrow as pa

    L, E, R = cfg["layers"], cfg["experts"], cfg["ranks"]
    S = E + cfg["redundant"]
    spr = S // R
    slots = np.arange(S)
    rows = {k: [] for k in ("plan_id", "layer", "slot", "rank", "node", "expert")}
    for layer in range(L):
        hot = np.argsort(-p[layer], kind="stable")[: cfg["redundant"]]
        expert = np.concatenate([np.arange(E), hot])
        rank = slots // spr
        rows["plan_id"] += ["recorded"] * S
        rows["layer"] += [layer] * S
        rows["slot"] += slots.tolist()
        rows["rank"] += rank.tolist()
        rows["node"] += (rank // cfg["ranks_per_node"]).tolist()
        rows["expert"] += expert.tolist()
    return pa.table(rows)


def _chunks(cfg: dict, steps: int, p: np.ndarray, timing: dict):
    """expert_counts rows (the dense layout: one list of E counts per step and layer),
    ``chunk_steps`` steps at a time; the expert_load view shows them as E rows each."""
    from moetrace.storage.dense import grid_table

    rng = np.random.default_rng(0)
    L, E, n_step = cfg["layers"], cfg["experts"], cfg["chunk_steps"]
    lam = (cfg["ranks"] * TOKENS_PER_RANK * TOP_K) * p          # [L, E] mean tokens per expert
    for s0 in range(0, steps, n_step):
        t0 = time.perf_counter()
        n = min(n_step, steps - s0)
        tbl = grid_table(np.arange(s0, s0 + n), np.arange(L), rng.poisson(lam[None], size=(n, L, E)).astype(np.int64))
        timing["generate_s"] += time.perf_counter() - t0
        yield tbl


# ----------------------------------------------------------------------------- stages
class _RssSampler:
    """Samples this process's resident memory twice a second: shows whether a stage's
    memory plateaus (bounded) or keeps growing with the number of steps."""

    def __init__(self):
        import threading

        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page / 2 ** 20
            self.samples.append((time.perf_counter() - self._t0, rss))
            self._stop.wait(0.5)

    def quartiles(self) -> list[float]:
        """Highest RSS (MiB) seen in each quarter of the stage's duration."""
        self._stop.set()
        self._thread.join()
        if not self.samples:
            return []
        end = self.samples[-1][0] or 1.0
        out = []
        for k in range(4):
            part = [r for t, r in self.samples if k * end / 4 <= t <= (k + 1) * end / 4]
            out.append(round(max(part), 1) if part else float("nan"))
        return out


def _stage_ingest(store: str, cfg: dict, steps: int, q) -> None:
    from moetrace.run import Store

    p = _popularity(cfg)
    timing = {"generate_s": 0.0}
    sampler = _RssSampler()
    t0 = time.perf_counter()
    st = Store(store, create=True)
    run = {"source": "bench_fleet", "collector": "bench", "time_base": "none", "source_sha256": f"fleet-{steps}",
           "num_layers": cfg["layers"], "num_experts": cfg["experts"], "top_k": TOP_K, "num_ranks": cfg["ranks"],
           "ranks_per_node": cfg["ranks_per_node"], "num_slots": cfg["experts"] + cfg["redundant"],
           "num_groups": 8, "hidden": 7168, "dtype_bytes": 2, "expert_bytes": 3 * 7168 * 2048,
           "approximations": json.dumps(["benchmark data: Poisson counts around a fixed log-normal popularity"])}
    res = st.write_run(run, {"expert_counts": _chunks(cfg, steps, p, timing), "placement": _placement(cfg, p)},
                       run_id="fleet")
    secs = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in (Path(store) / "expert_counts").rglob("*.parquet"))
    q.put({"rows": res.rows["expert_counts"] * cfg["experts"], "seconds": secs, "generate_s": timing["generate_s"],
           "peak_mib": peak_rss_mib(), "disk_bytes": disk, "rss_quartiles": sampler.quartiles()})


LAYER_SKEW_COLUMNS = ("step, layer, max_rank_tokens, mean_rank_tokens, imbalance, efficiency, straggler_rank, gini, cv, "
                      "top5pct_share, hottest_expert, hottest_share, assignments, num_ranks, placement_source")


def _cpu_s() -> float:
    """CPU seconds of this process, every thread (DuckDB's too): on a shared machine it moves
    far less with the load than the wall time."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _stage_layer_skew(store: str, cfg: dict, steps: int, spill: str, q) -> None:
    """layer_skew in step-range batches: the view's per-(step, layer) lists and sorts do not
    spill, so one query over a billion rows runs out of any fixed memory_limit (measured:
    7,200 steps at 6 GB fail); the step filter is pushed through the view's GROUP BYs and
    Parquet row-group statistics skip the other steps, so each batch reads only its rows."""
    from moetrace.run import Store

    st = Store(store)
    con = st.connect(threads=THREADS, memory_limit=cfg["duck_memory"])
    con.execute(f"SET temp_directory='{spill}'")
    con.execute("SET preserve_insertion_order=false")
    outdir = Path(spill).parent / "layer_skew"
    outdir.mkdir()
    sampler = _RssSampler()
    t0 = time.perf_counter()
    c0 = _cpu_s()
    if os.environ.get("MOETRACE_FLEET_NO_MATERIALIZE") != "1":
        # run_shape and layer_placement aggregate the whole expert_load (max expert id, slot
        # presence per layer) and carry no step filter: computed once, not once per batch,
        # or every batch rescans the whole run and the stage grows quadratically
        # (and dense_rank_map, the per-layer rank lookup of the dense rows, built from them)
        for v in ("run_shape", "layer_placement", "dense_rank_map"):
            con.execute(f"CREATE TEMP TABLE _m_{v} AS SELECT * FROM {v}")
            con.execute(f"CREATE OR REPLACE VIEW {v} AS SELECT * FROM _m_{v}")
    b = cfg["skew_batch_steps"]
    for k, s0 in enumerate(range(0, steps, b)):
        con.execute(f"COPY (SELECT {LAYER_SKEW_COLUMNS} FROM layer_skew WHERE step >= {s0} AND step < {s0 + b}) "
                    f"TO '{outdir / f'part-{k:05d}.parquet'}' (FORMAT parquet)")
    secs = time.perf_counter() - t0
    cpu = _cpu_s() - c0
    s = con.execute(f"SELECT count(*), avg(imbalance), max(imbalance), avg(gini), count(DISTINCT placement_source) "
                    f"FROM read_parquet('{outdir}/*.parquet')").fetchone()
    q.put({"seconds": secs, "cpu_s": cpu, "peak_mib": peak_rss_mib(), "out_rows": s[0], "mean_imbalance": s[1],
           "max_imbalance": s[2], "mean_gini": s[3], "placement_sources": s[4], "batch_steps": b,
           "rss_quartiles": sampler.quartiles()})


def _stage_replay(store: str, cfg: dict, q) -> None:
    from moetrace.cli import cli

    args = ["replay", store, "--policy", "eplb", "--fit-steps", f"0:{cfg['fit_steps']}", "--no-rank-rows", "--json"]
    buf = io.StringIO()
    sampler = _RssSampler()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        cli.main(args=args, standalone_mode=False)
    secs = time.perf_counter() - t0
    text = buf.getvalue()
    summary = json.loads(text[text.index("{"):])
    q.put({"seconds": secs, "peak_mib": peak_rss_mib(), "summary": summary, "args": " ".join(args[2:]),
           "rss_quartiles": sampler.quartiles()})


def _load1(line: str) -> float:
    """The 1-minute load average of an :func:`_uptime` line (inf when unknown)."""
    try:
        return float(line.split("load average ")[1].split(",")[0])
    except (IndexError, ValueError):
        return float("inf")


def _uptime() -> str:
    """The 1, 5 and 15-minute load averages, as ``uptime`` prints them."""
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def _stage_report(store: str, outdir: str, engine: str, q) -> None:
    """`moetrace report --quiet`: the user-facing command, whose per-(step, layer) views are
    computed in step batches (moetrace.analyze.materialize_layer_skew) and stored, or read
    from the store when a fresh copy is stored (moetrace.analyze.cache)."""
    from moetrace.cli import cli

    args = ["report", store, "--quiet", "--out-dir", outdir] + (["--engine", "spark"] if engine == "spark" else [])
    load0 = _uptime()
    sampler = _RssSampler()
    t0 = time.perf_counter()
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        cli.main(args=args, standalone_mode=False)
    secs = time.perf_counter() - t0
    pngs = len(list(Path(outdir).glob("*.png")))
    failed = (Path(outdir) / "report.md").read_text().count("(section failed)")
    from moetrace.run import Store

    st = Store(store)   # the stored analysis's own compute time (its header), the rest is drawing
    got = st.rows("SELECT compute_s FROM analysis_cache ORDER BY created_at_ns DESC LIMIT 1", []).rows
    st.close()
    q.put({"analysis_s": float(got[0][0]) if got else float("nan"), "seconds": secs, "peak_mib": peak_rss_mib(), "pngs": pngs, "failed": failed,
           "rss_quartiles": sampler.quartiles(), "load_before": load0, "load_after": _uptime(),
           "stderr": err.getvalue().strip().splitlines()[-1:] or [""],
           "md": (Path(outdir) / "report.md").read_text()})


#: what the small size's stage processes are forked with (a forkserver imports them once): the
#: store, DuckDB, polars, the command line and the report, which each stage imports otherwise
STAGE_PRELOAD = ["numpy", "pyarrow.parquet", "duckdb", "polars", "moetrace.run", "moetrace.cli",
                 "moetrace.report.build", "matplotlib.pyplot", "benchmarks.bench_fleet"]


def _in_process(fn, *args, method: str = "spawn"):
    """``fn(*args, q)`` in a fresh process (its peak RSS its own); what it puts on ``q``.
    ``method`` "forkserver": forked from a server that imported :data:`STAGE_PRELOAD` once
    (the small size: the stages are tiny, a fresh interpreter's imports were most of them)."""
    if method == "forkserver":
        mp.set_forkserver_preload(STAGE_PRELOAD)
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=(*args, q))
    p.start()
    while True:
        try:
            out = q.get(timeout=5)
            break
        except Exception:
            if not p.is_alive():
                raise RuntimeError(f"{fn.__name__} died with exit code {p.exitcode}") from None
    p.join()
    return out


# ----------------------------------------------------------------------------- entry point
def run(size: str = "small", fraction: float | None = None, engine: str = "duckdb", span: str = "hour") -> list[dict]:
    cfg = SIZES[size]
    hours = 24 if span == "day" else 1        # a fleet-day: 24 hours of the run's shape
    if fraction is None:
        fraction = float(os.environ.get("MOETRACE_FLEET_FRACTION", "1"))
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    steps = max(cfg["chunk_steps"], int(round(cfg["steps"] * hours * fraction)))
    f = steps / (cfg["steps"] * hours)
    # a fraction shorter than the fitting window: fit on its first half (the replay prints its args)
    cfg = dict(cfg, fit_steps=min(cfg["fit_steps"], max(1, steps // 2)))
    full_rows = cfg["layers"] * cfg["experts"] * cfg["steps"] * hours
    # the heavy-job lock for what is heavy (medium's 2,400 steps and more), not a small fraction
    with heavy_lock("full" if steps >= SIZES["medium"]["steps"] else "small"):
        tmp = Path(tempfile.mkdtemp(prefix="moetrace-bench-fleet-", dir="/tmp"))
        try:
            store = str(tmp / "st")
            (tmp / "spill").mkdir()
            # small: each stage forked from a forkserver with the imports done; medium and full: spawned
            method = "forkserver" if size == "small" else "spawn"
            t_all = time.perf_counter()
            ing = _in_process(_stage_ingest, store, cfg, steps, method=method)
            skew = _in_process(_stage_layer_skew, store, cfg, steps, str(tmp / "spill"), method=method)
            rep = _in_process(_stage_replay, store, cfg, method=method)
            total = time.perf_counter() - t_all
            report = _in_process(_stage_report, store, str(tmp / "report"), engine, method=method)
            cache_bytes = sum(f.stat().st_size for d in Path(store).glob("cache_*") for f in d.rglob("*.parquet")) \
                + sum(f.stat().st_size for f in (Path(store) / "analysis_cache").rglob("*.parquet"))
            reused = _in_process(_stage_report, store, str(tmp / "report2"), "duckdb", method=method)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = ing["rows"]
    shape = (f"{cfg['ranks']} ranks, {cfg['layers']} layers x {cfg['experts']} experts (+{cfg['redundant']} "
             f"redundant), {steps} steps")
    part = "" if f == 1 else f" (measured on {f:.3g} of the {cfg['steps'] * hours}-step {span})"

    # --fraction, and --size medium (the full shape): linear in steps to the fleet-hour (--span day: the day)
    hour = (SIZES["full"]["steps"] if size != "small" else cfg["steps"]) * hours
    to_hour = hour / steps

    def extra(secs):
        if to_hour == 1:
            return ""
        return (f"; EXTRAPOLATED linearly (not measured) to the fleet-{span}'s {hour:,} steps "
                f"({cfg['layers'] * cfg['experts'] * hour:,} rows): {secs * to_hour:,.0f} s")

    load_now = os.getloadavg()[0]
    ratio = report["seconds"] / skew["seconds"] if skew["seconds"] else float("nan")
    judged = ("not judged" if max(load_now, _load1(report["load_before"])) >= QUIET_LOAD
              else ("MET" if ratio <= REPORT_GOAL else "MISSED"))

    def q4(stage):
        return " / ".join("-" if v != v else f"{v:,.0f}" for v in stage.get("rss_quartiles", []))

    b = "fleet"
    peak = max(ing["peak_mib"], skew["peak_mib"], rep["peak_mib"])
    s = rep["summary"]
    out = [
        result(b, "expert_load rows", rows, "rows", notes=f"{shape}{part}; full run = {full_rows:,} rows"),
        result(b, "ingest: wall time", ing["seconds"], "s",
               notes=f"generate + stream through Store.write_run; generation alone {ing['generate_s']:.1f} s"
                     f"{extra(ing['seconds'])}"),
        result(b, "ingest: rows/s", rows / ing["seconds"], "rows/s",
               notes=f"store only (minus generation): {rows / max(ing['seconds'] - ing['generate_s'], 1e-9):,.0f} rows/s"),
        result(b, "ingest: peak RSS", ing["peak_mib"], "MiB",
               notes=f"process generating and writing; max RSS per quarter of the stage {q4(ing)} MiB"),
        result(b, "store size on disk", ing["disk_bytes"] / 2 ** 20, "MiB",
               notes=f"{ing['disk_bytes'] / rows:.2f} bytes/row (zstd Parquet)"),
        result(b, "layer_skew: wall time", skew["seconds"], "s",
               notes=f"{skew['out_rows']:,} (step, layer) rows, every column, in batches of {skew['batch_steps']} "
                     f"steps; DuckDB {THREADS} threads, memory_limit {cfg['duck_memory']}, temp under /tmp"
                     f"{extra(skew['seconds'])}"),
        result(b, "layer_skew: CPU time", skew["cpu_s"], "s",
               notes=f"user + system seconds of the stage's process, DuckDB's {THREADS} threads included (less "
                     f"sensitive to other jobs than the wall time){extra(skew['cpu_s'])}"),
        result(b, "layer_skew: rows/s", rows / skew["seconds"], "rows/s",
               notes=f"mean imbalance {skew['mean_imbalance']:.3f}, max {skew['max_imbalance']:.3f}"),
        result(b, "layer_skew: peak RSS", skew["peak_mib"], "MiB", notes=f"max RSS per quarter {q4(skew)} MiB"),
        result(b, "replay: wall time", rep["seconds"], "s",
               notes=f"moetrace replay {rep['args']}{extra(rep['seconds'])}"),
        result(b, "replay: steps/s", steps / rep["seconds"], "steps/s",
               notes=f"{s.get('num_steps')} steps x {s.get('num_layers')} layers; predicted mean imbalance "
                     f"{s.get('mean_imbalance', float('nan')):.3f}" if isinstance(s.get('mean_imbalance'), (int, float))
               else f"{s.get('num_steps')} steps x {s.get('num_layers')} layers"),
        result(b, "replay: peak RSS", rep["peak_mib"], "MiB", notes=f"max RSS per quarter {q4(rep)} MiB"),
        result(b, "all stages: wall time", total, "s", notes=f"ingest + layer_skew + replay; peak RSS of any "
                                                            f"stage {peak:,.0f} MiB{extra(total)}"),
        result(b, "report: wall time", report["seconds"], "s",
               notes=f"moetrace report --quiet (run after the replay: includes the stored-replay section); "
                     f"{report['pngs']} PNGs, {report['failed']} sections failed{extra(report['seconds'])}; "
                     f"{report['load_before']} before, {report['load_after']} after; stderr: {report['stderr'][0]!r}"),
        result(b, "report: peak RSS", report["peak_mib"], "MiB", notes=f"max RSS per quarter {q4(report)} MiB"),
        result(b, "report / layer_skew", ratio, "x",
               notes=f"first report ({engine}) over the layer_skew stage, same rows; goal <= {REPORT_GOAL:g}x: "
                     f"{judged} (judged only below load {QUIET_LOAD}: {report['load_before']} before the report, "
                     f"load {load_now:.2f} now, {os.cpu_count()} CPUs)"
                     + ("; the report's time includes starting Spark (local JVM)" if engine == "spark" else "")),
        result(b, "report analysis / layer_skew", report["analysis_s"] / skew["seconds"], "x",
               notes=f"the first report's per-(step, layer) analysis alone ({report['analysis_s']:.1f} s, from the "
                     f"stored header's compute_s; the rest of the report is drawing) over the layer_skew stage; "
                     f"{judged.split(' ')[0] if judged == 'not judged' else 'judged by the whole report above'}"
                     f"{'' if judged != 'not judged' else ' judged'} (load as above){extra(report['analysis_s'])}"),
        result(b, "report (cache reused): wall time", reused["seconds"], "s",
               notes=f"the same command again, reading the {cache_bytes / 2 ** 20:,.1f} MiB of stored per-(step, "
                     f"layer) results; {reused['pngs']} PNGs, {reused['failed']} sections failed, report.md "
                     f"{'identical' if reused['md'] == report['md'] else 'DIFFERS'}{extra(reused['seconds'])}; "
                     f"{reused['load_before']} before, {reused['load_after']} after (first report: "
                     f"{report['load_before']} before, {report['load_after']} after; {os.cpu_count()} CPUs); "
                     f"stderr: {reused['stderr'][0]!r}"),
        result(b, "report (cache reused): peak RSS", reused["peak_mib"], "MiB",
               notes=f"max RSS per quarter {q4(reused)} MiB"),
    ]
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--fraction", type=float, default=None, help="run this share of the steps and extrapolate")
    ap.add_argument("--engine", choices=["duckdb", "spark"], default="duckdb",
                    help="the first report's engine (moetrace report --engine)")
    ap.add_argument("--span", choices=["hour", "day"], default="hour",
                    help="the run --fraction is a share of, and times are extrapolated to: a fleet-hour or a fleet-day")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = run(args.size, args.fraction, args.engine, args.span)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(f"{r['metric']:<34} {r['value']:>16,.1f} {r['unit']:<7} {r['notes']}")


if __name__ == "__main__":
    main()
