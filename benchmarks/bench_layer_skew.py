"""Benchmark: the layer_skew view over a large expert_load, against pandas.

full: 58 layers × 256 experts × 20,000 steps (296,960,000 expert_load rows), the shape of
a DeepSeek-V3 run of 20k forward passes. Run it under the heavy-job lock:

    python benchmarks/bench_layer_skew.py --size full

What it does:
1. generates the store in a temporary folder under /tmp (deleted afterwards), streaming
   expert_load in chunks of steps (never the whole table in memory). Counts are Poisson
   draws around B·k·p per expert with log-normal popularity (sigma 0.6), B = 4096 tokens
   per step, top-8: the same scale as routed counts, without the cost of sampling 300M
   top-k choices;
2. in a fresh process, materializes every column of layer_skew over the whole table with
   DuckDB (memory_limit 8GB, 2 threads) and reports rows/s and that process's peak RSS;
3. builds the whole report (every installed section, analysis views cached for the run)
   and reports its time and peak RSS;
4. in fresh processes, computes the same figures (imbalance, straggler, gini, cv, top-5%,
   hottest expert) with pandas, and with DuckDB, on a subset of steps (pandas cannot hold
   300M rows plus group-by state in this machine's memory), and reports both rows/s; the
   pandas figure for the full table is extrapolated per row from the subset (said in the
   result notes). The two results are cross-checked on the subset.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import main, peak_rss_mib, result  # noqa: E402

SIZES = {
    "small": dict(layers=4, experts=256, steps=200, ranks=32, subset_steps=200, chunk_steps=100),
    "full": dict(layers=58, experts=256, steps=20_000, ranks=32, subset_steps=500, chunk_steps=200),
}
TOP_K = 8
TOKENS_PER_STEP = 4096
SIGMA = 0.6
DUCK_MEMORY = "8GB"
DUCK_THREADS = 2


# ----------------------------------------------------------------------------- data
def _chunks(layers, experts, steps, chunk_steps, seed=0):
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    w = np.exp(SIGMA * rng.standard_normal((layers, experts)))
    lam = (TOKENS_PER_STEP * TOP_K) * w / w.sum(axis=1, keepdims=True)      # [L, E]
    layer_col = np.repeat(np.arange(layers, dtype=np.int32), experts)
    expert_col = np.tile(np.arange(experts, dtype=np.int32), layers)
    for s0 in range(0, steps, chunk_steps):
        n = min(chunk_steps, steps - s0)
        tok = rng.poisson(lam[None, :, :], size=(n, layers, experts)).astype(np.int64).ravel()
        m = n * layers * experts
        yield pa.table({
            "step": np.repeat(np.arange(s0, s0 + n, dtype=np.int64), layers * experts),
            "layer": np.tile(layer_col, n), "expert": np.tile(expert_col, n),
            "slot": pa.nulls(m, pa.int32()), "src_rank": pa.nulls(m, pa.int32()), "tokens": tok})


def _generate(path: str, cfg: dict, q):
    from moetrace.run import Store

    t0 = time.perf_counter()
    st = Store(path, create=True)
    run = {"source": "bench", "collector": "bench", "time_base": "none", "source_sha256": "bench",
           "num_layers": cfg["layers"], "num_experts": cfg["experts"], "top_k": TOP_K, "num_ranks": cfg["ranks"],
           "num_slots": cfg["experts"]}
    res = st.write_run(run, {"expert_load": _chunks(cfg["layers"], cfg["experts"], cfg["steps"], cfg["chunk_steps"])},
                       run_id="bench")
    q.put({"rows": res.rows["expert_load"], "seconds": time.perf_counter() - t0, "peak_mib": peak_rss_mib()})


# ----------------------------------------------------------------------------- duckdb
LAYER_SKEW_COLUMNS = ("max_rank_tokens, mean_rank_tokens, imbalance, efficiency, straggler_rank, gini, cv, "
                      "top5pct_share, hottest_expert, hottest_share")


def _duck(path: str, max_step: int | None, q):
    from moetrace.run import Store

    st = Store(path)
    con = st.connect(threads=DUCK_THREADS, memory_limit=DUCK_MEMORY)
    con.execute("SET enable_progress_bar = false")
    where = f"WHERE step < {int(max_step)}" if max_step is not None else ""
    if max_step is not None:   # restrict the base view so the whole pipeline sees the subset
        glob = st.table_glob("expert_load").replace("'", "''")
        con.execute(f"CREATE OR REPLACE VIEW expert_load AS SELECT * FROM read_parquet('{glob}', "
                    f"hive_partitioning=true, hive_types={{'run_id': VARCHAR}}) {where}")
    t0 = time.perf_counter()
    con.execute(f"CREATE TEMP TABLE out AS SELECT step, layer, {LAYER_SKEW_COLUMNS} FROM layer_skew")
    secs = time.perf_counter() - t0
    n_in = con.execute("SELECT count(*) FROM expert_load").fetchone()[0]
    out = con.execute("SELECT step, layer, imbalance, straggler_rank, gini, cv, top5pct_share, hottest_expert "
                      "FROM out ORDER BY step, layer").fetchnumpy()
    q.put({"rows": n_in, "seconds": secs, "peak_mib": peak_rss_mib(), "out_rows": len(out["step"]),
           "sample": {k: np.asarray(v)[:2000].tolist() for k, v in out.items()}})


# ----------------------------------------------------------------------------- pandas
def _pandas(path: str, max_step: int, E: int, R: int, q):
    """The same metrics as layer_skew, written the way a pandas user would."""
    import pandas as pd
    import pyarrow.dataset as ds

    t0 = time.perf_counter()
    d = ds.dataset(str(Path(path) / "expert_load"), format="parquet", partitioning="hive")
    df = d.to_table(filter=ds.field("step") < max_step, columns=["step", "layer", "expert", "tokens"]).to_pandas()
    n_in = len(df)
    et = df.groupby(["step", "layer", "expert"], as_index=False, sort=False)["tokens"].sum()
    et["rank"] = et["expert"] * R // E
    rk = et.groupby(["step", "layer", "rank"], as_index=False)["tokens"].sum()
    g = rk.groupby(["step", "layer"])
    total = g["tokens"].sum()
    mx = g["tokens"].max()
    strag = rk.loc[g["tokens"].idxmax(), ["step", "layer", "rank"]].set_index(["step", "layer"])["rank"]
    et = et.sort_values(["step", "layer", "tokens", "expert"], ascending=[True, True, True, False])
    ge = et.groupby(["step", "layer"])
    n = ge["tokens"].transform("size")
    et["w"] = ge.cumcount() + 1 + (E - n)           # ascending rank among all E experts (absent = 0)
    et["wx"] = et["w"] * et["tokens"]
    et["x2"] = et["tokens"].astype(float) ** 2
    ge = et.groupby(["step", "layer"])
    S = ge["tokens"].sum().astype(float)
    gini = 2 * ge["wx"].sum() / (E * S) - (E + 1) / E
    mean = S / E
    cv = np.sqrt(np.maximum(ge["x2"].sum() / E - mean ** 2, 0)) / mean
    n_top = max(1, int(np.ceil(0.05 * E)))
    top = ge.tail(n_top).groupby(["step", "layer"])["tokens"].sum() / S
    hottest = ge.tail(1).set_index(["step", "layer"])["expert"]
    res = pd.DataFrame({"imbalance": mx / (total / R), "straggler_rank": strag, "gini": gini, "cv": cv,
                        "top5pct_share": top, "hottest_expert": hottest}).reset_index().sort_values(["step", "layer"])
    secs = time.perf_counter() - t0
    q.put({"rows": n_in, "seconds": secs, "peak_mib": peak_rss_mib(), "out_rows": len(res),
           "sample": {k: res[k].to_numpy()[:2000].tolist() for k in res.columns}})


def _report(path: str, q):
    """The whole report (every section installed) on the same store, views cached per run."""
    from moetrace.report.build import build_report
    from moetrace.run import Store

    st = Store(path)
    st._con = st.connect(threads=DUCK_THREADS, memory_limit=DUCK_MEMORY)
    st._con.execute("SET enable_progress_bar = false")
    t0 = time.perf_counter()
    rep = build_report(st, "bench", Path(path).parent / "report")
    q.put({"seconds": time.perf_counter() - t0, "peak_mib": peak_rss_mib(), "sections": [s.key for s in rep.sections],
           "figures": len(rep.figures)})


#: what the small size's stage processes are forked with (a forkserver imports them once): the
#: store, DuckDB, pandas and the report, which each stage's fresh interpreter imported otherwise
#: (most of a small stage's time)
STAGE_PRELOAD = ["numpy", "pyarrow.parquet", "pyarrow.dataset", "duckdb", "polars", "pandas", "moetrace.run",
                 "moetrace.report.build", "matplotlib.pyplot", "benchmarks.bench_layer_skew"]


def _in_process(fn, *args, method: str = "spawn"):
    """``fn(*args, q)`` in a fresh process (its peak RSS its own); what it puts on ``q``.
    ``method`` "forkserver" (the small size): forked from a server that imported
    :data:`STAGE_PRELOAD` once."""
    if method == "forkserver":
        mp.set_forkserver_preload(STAGE_PRELOAD)
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=(*args, q))
    p.start()
    out = q.get()
    p.join()
    if p.exitcode:
        raise RuntimeError(f"{fn.__name__} failed with exit code {p.exitcode}")
    return out


def run(size: str = "small") -> list[dict]:
    cfg = SIZES[size]
    tmp = Path(tempfile.mkdtemp(prefix="moetrace-bench-skew-", dir="/tmp"))
    try:
        store = str(tmp / "st")
        # small: each stage forked from a forkserver with the imports done; full: spawned
        method = "forkserver" if size == "small" else "spawn"
        gen = _in_process(_generate, store, cfg, method=method)
        full = _in_process(_duck, store, None, method=method)
        sub = min(cfg["subset_steps"], cfg["steps"])
        # the subset is the whole table at small size: the same query, not run twice
        duck_sub = full if sub >= cfg["steps"] else _in_process(_duck, store, sub, method=method)
        pd_sub = _in_process(_pandas, store, sub, cfg["experts"], cfg["ranks"], method=method)
        rep = _in_process(_report, store, method=method)
        disk = sum(f.stat().st_size for f in (tmp / "st").rglob("*.parquet"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # cross-check the subset (same rows, two implementations)
    a, b = duck_sub["sample"], pd_sub["sample"]
    for k in ("imbalance", "gini", "cv", "top5pct_share"):
        if not np.allclose(a[k], b[k], rtol=1e-9):
            raise AssertionError(f"duckdb and pandas disagree on {k}")
    for k in ("straggler_rank", "hottest_expert"):
        if list(a[k]) != list(b[k]):
            raise AssertionError(f"duckdb and pandas disagree on {k}")
    shape = f"{cfg['layers']} layers x {cfg['experts']} experts x {cfg['steps']} steps"
    d_rate = full["rows"] / full["seconds"]
    ds_rate = duck_sub["rows"] / duck_sub["seconds"]
    p_rate = pd_sub["rows"] / pd_sub["seconds"]
    extrap = full["rows"] / p_rate
    name = "layer_skew"
    return [
        result(name, "expert_load rows", full["rows"], "rows", notes=f"{shape}; parquet {disk / 2**20:.0f} MiB; "
               f"generated in {gen['seconds']:.0f} s (peak {gen['peak_mib']:.0f} MiB)"),
        result(name, "duckdb full: time", full["seconds"], "s", baseline="pandas (extrapolated per row)",
               baseline_value=extrap, ratio=extrap / full["seconds"],
               notes=f"{full['out_rows']} (step, layer) rows; threads {DUCK_THREADS}, memory_limit {DUCK_MEMORY}; "
                     f"pandas time extrapolated from {pd_sub['rows']} rows"),
        result(name, "duckdb full: rows/s", d_rate, "rows/s", baseline="pandas on subset", baseline_value=p_rate,
               ratio=d_rate / p_rate),
        result(name, "duckdb full: peak RSS", full["peak_mib"], "MiB", notes="process running the query"),
        result(name, "subset: duckdb rows/s", ds_rate, "rows/s", baseline="pandas", baseline_value=p_rate,
               ratio=ds_rate / p_rate, notes=f"first {sub} steps, {duck_sub['rows']} rows; results cross-checked"),
        result(name, "subset: duckdb peak RSS", duck_sub["peak_mib"], "MiB", baseline="pandas",
               baseline_value=pd_sub["peak_mib"], ratio=pd_sub["peak_mib"] / duck_sub["peak_mib"]),
        result(name, "moetrace report: time", rep["seconds"], "s",
               notes=f"whole table; sections {', '.join(rep['sections'])}; {rep['figures']} PNGs"),
        result(name, "moetrace report: peak RSS", rep["peak_mib"], "MiB"),
    ]


if __name__ == "__main__":
    main(run)
