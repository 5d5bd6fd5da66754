"""The output folder of ``moetrace refrun`` (the CPU expert-parallel reference run): one run.

A folder holding ``moetrace-refrun.json`` is claimed whole: the routing
(``routing_rank{r}.parquet``, canonical routing columns), the tokens each rank received
per (source rank, slot) (``received_rank{r}.parquet``: the measured load, written to
``expert_load`` with slot and source rank, checked against the routing), the step
boundaries (``steps_rank{r}.parquet``: a rank with no tokens is a dummy step), the
recorded placement, the per-rank timings of the timed passes (``timing_rank{r}.parquet``,
summarized per (step, layer, rank) by the median and its spread into ``cell_times``, the
noise level into ``runs.meta_json``; folders written before timing existed have none), and
the per-rank profiler traces (``rank{r}_trace.json.gz``) through the Kineto collector,
merged into the same run.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..domain.hashing import sha256_files
from ..errors import InputError
from ..formats.refrun import MANIFEST, summarize_timing
from . import Collector, RunData, register
from ._polars import pl


def _sniff(path: Path, head: bytes) -> bool:
    return (path.parent / MANIFEST).is_file()


def _read_parquet(p: Path) -> pl.DataFrame:
    try:
        with open(p, "rb") as fh:  # a handle: polars reads a path as a pattern (a folder run[1] reads run1)
            return pl.read_parquet(fh)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # polars panics (pyo3 PanicException, a BaseException) on some corrupt files
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(p, f"cannot read Parquet: {msg}") from None


def _collect_folder(folder: Path, files: list[Path], options: dict) -> RunData:
    man_path = folder / MANIFEST
    try:
        man = json.loads(man_path.read_text())
        cfg = man["config"]
        phy2log = np.asarray(man["phy2log"], np.int64)
        R, E, K, L = int(cfg["ranks"]), int(cfg["experts"]), int(cfg["top_k"]), int(cfg["layers"])
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError) as e:
        raise InputError(man_path, f"not a moetrace refrun manifest: {type(e).__name__}: {str(e)[:100]}") from None
    # shape sanity before any R-sized work (0, negative, 10^9 ranks would exhaust memory)
    from .checks import check_shape

    check_shape({"num_ranks": R, "num_experts": E, "top_k": K, "num_layers": L}, man_path, "run")
    if phy2log.ndim != 2 or R > 3 * len(files) or phy2log.shape[1] < R:
        raise InputError(man_path, f"manifest declares {R} ranks but the folder holds {len(files)} files and "
                                   f"phy2log has shape {list(phy2log.shape)}")
    P = phy2log.shape[1]
    spr = P // R
    need = [f"{kind}_rank{r}.parquet" for kind in ("routing", "received", "steps") for r in range(R)]
    missing = [n for n in need if not (folder / n).is_file()]
    if missing:
        raise InputError(folder, f"refrun output is incomplete: missing {', '.join(missing)}")
    routing = pl.concat([_read_parquet(folder / f"routing_rank{r}.parquet") for r in range(R)])
    received = pl.concat([_read_parquet(folder / f"received_rank{r}.parquet") for r in range(R)])
    steps = pl.concat([_read_parquet(folder / f"steps_rank{r}.parquet") for r in range(R)])
    # the measured load must be the routing's, slot by slot (conservation of the dispatch)
    from_routing = (routing.group_by(["step", "layer", "src_rank", "slot"]).agg(pl.len().alias("n"))
                    .with_columns(pl.col("n").cast(pl.Int64)))
    cmp = from_routing.join(received.select(["step", "layer", "src_rank", "slot", "tokens"]),
                            on=["step", "layer", "src_rank", "slot"], how="full", coalesce=True)
    bad = cmp.filter(pl.col("n").fill_null(0) != pl.col("tokens").fill_null(0))
    if bad.height:
        r = bad.row(0, named=True)
        raise InputError(folder, f"received tokens disagree with the routing at step {r['step']}, layer {r['layer']}, "
                                 f"slot {r['slot']}, source rank {r['src_rank']}: {r['tokens']} vs {r['n']}")
    p2l = pl.DataFrame({"layer": np.repeat(np.arange(L), P).astype(np.int32),
                        "slot": np.tile(np.arange(P), L).astype(np.int32),
                        "expert": phy2log.ravel().astype(np.int32)})
    load = (received.join(p2l, on=["layer", "slot"], how="left")
            .select(["step", "layer", "expert", "slot", "src_rank", "tokens"]).sort(["step", "layer", "slot", "src_rank"]))
    prefill = int(cfg.get("prefill_tokens") or 0)
    steps_t = steps.with_columns(
        pl.when(pl.col("num_tokens") == 0).then(pl.lit("idle"))
        .when((pl.col("step") == 0) & pl.lit(prefill > 0)).then(pl.lit("prefill"))
        .otherwise(pl.lit("decode")).alias("phase"),
        (pl.col("num_tokens") == 0).alias("is_dummy"), pl.lit(False).alias("inferred"),
    ).select(["step", "rank", "phase", "num_tokens", "is_dummy", "start_ns", "end_ns", "inferred"]).sort(["step", "rank"])
    slot_p = np.tile(np.arange(P), L)
    placement = pa.table({"plan_id": pa.array(["recorded"] * (L * P)), "layer": np.repeat(np.arange(L), P).astype(np.int32),
                          "slot": slot_p.astype(np.int32), "rank": (slot_p // spr).astype(np.int32),
                          "node": np.zeros(L * P, np.int32), "expert": phy2log.ravel().astype(np.int32)})
    tables: dict = {"routing": routing, "expert_load": load, "steps": steps_t, "placement": placement}
    approx: list[str] = []
    meta: dict = {"format": "refrun", "config": cfg, "replica_choice": man.get("replica_choice"),
                  "wall_s": man.get("wall_s"), "torch": man.get("torch"), "hardware": man.get("hardware")}
    if man.get("injected_delay"):   # what the injected delay really held (the OS wakes a sleeper late)
        meta["injected_delay"] = man["injected_delay"]
    timing_files = [folder / f"timing_rank{r}.parquet" for r in range(R)]
    if all(p.is_file() for p in timing_files):

        timing = pl.concat([_read_parquet(p) for p in timing_files])
        need_cols = {"pass", "step", "layer", "rank", "dispatch_start_ns", "expert_start_ns", "expert_end_ns",
                     "combine_end_ns"}
        if not need_cols <= set(timing.columns):
            raise InputError(timing_files[0], f"timing file lacks {', '.join(sorted(need_cols - set(timing.columns)))}")
        bad_t = timing.filter((pl.col("expert_end_ns") < pl.col("expert_start_ns"))
                              | (pl.col("expert_start_ns") < pl.col("dispatch_start_ns"))
                              | (pl.col("combine_end_ns") < pl.col("expert_end_ns")))
        if bad_t.height:
            r = bad_t.row(0, named=True)
            raise InputError(folder / f"timing_rank{r['rank']}.parquet",
                             f"timestamps out of order at pass {r['pass']}, step {r['step']}, layer {r['layer']}")
        cells, noise = summarize_timing(timing)
        tables["cell_times"] = cells
        meta["noise"] = {**(man.get("noise") or {}), **noise}
    elif any(p.is_file() for p in timing_files):
        raise InputError(folder, "refrun output is incomplete: some timing_rank*.parquet files are missing")
    else:
        approx.append("no timing files in the folder (written before refrun timed its passes): no cell_times")
    traces = sorted(p for p in files if p.name.endswith((".json.gz", ".json")) and p.name != MANIFEST)
    time_base = "epoch"
    if traces:
        from . import registry

        kin = registry().get("kineto")
        if kin is None:
            approx.append("profiler traces present but this moetrace has no Kineto collector: spans not ingested")
        else:
            rds = kin.collect(traces, {k: v for k, v in options.items() if k not in ("num_layers", "num_experts")})
            for rd in rds:
                for name, t in rd.tables.items():
                    if name == "steps":
                        meta["profiler_steps_dropped"] = True  # the run's own step records are exact
                        continue
                    tables[name] = t
                kapprox = json.loads(rd.run.get("approximations") or "[]")
                approx.extend(a for a in kapprox if a not in approx)
                if rd.run.get("time_base") not in (None, "epoch"):
                    time_base = rd.run["time_base"]
                    approx.append(f"profiler time base is {time_base!r}, step records are epoch ns")
            meta["traces"] = [p.name for p in traces]
    else:
        approx.append("no profiler traces in the folder (refrun --no-profile): no spans")
    all_files = sorted(files + [man_path] if man_path not in files else files)
    H, FF = int(cfg["hidden"]), int(cfg["ffn"])
    run = {
        "source": f"{folder.name}/ (refrun, {R} ranks)", "source_sha256": sha256_files(all_files),
        "collector": "refrun", "time_base": time_base,
        "num_layers": L, "num_experts": E, "top_k": K, "hidden": H, "num_groups": 1,
        "expert_bytes": 3 * H * FF * 4, "num_ranks": R, "ranks_per_node": R, "num_slots": P,
        "dtype_bytes": 4, "approximations": json.dumps(approx) if approx else None, "meta_json": json.dumps(meta),
    }
    return RunData(run=run, tables=tables, run_id_hint=folder.name, files=[str(p) for p in all_files])


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    groups: dict[Path, list[Path]] = {}
    for p in paths:
        groups.setdefault(p.parent, []).append(p)
    return [_collect_folder(folder, sorted(fs), options) for folder, fs in sorted(groups.items())]


register(Collector("refrun", "moetrace refrun output folder (CPU expert-parallel reference run): routing, measured "
                             "load, steps, placement and per-rank profiler traces as one run", _sniff, _collect,
                   priority=1))
