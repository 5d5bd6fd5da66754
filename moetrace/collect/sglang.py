"""SGLang expert-distribution dumps.

Formats (docs/reference/formats.md, "SGLang expert-distribution dumps"):

- ``stat`` / ``stat_approx``: ``{rank, logical_count [buffer, L, E], ...}`` from rank 0; a
  ring buffer dumped whole. Trailing all-zero rows are unfilled and dropped; a full
  buffer may be rotated (its write position is not in the dump) and the run says so.
- ``per_pass``: one file per rank ``{records: [{forward_pass_id, rank, gatherer_key,
  global_physical_count [L, P]}], last_physical_to_logical_map [L, P]}``. Counts are per
  physical slot and per source rank; slots are mapped to logical experts through the map,
  which is also written to ``placement`` as plan ``recorded``.
- ``per_token``: as ``per_pass`` plus ``topk_ids_of_layer [L, T, K]`` (physical ids, -1
  padded) and ``forward_mode`` (SGLang's ``ForwardMode`` IntEnum) per record: the routing
  table, and one ``steps`` row per (pass, rank); an IDLE pass is a dummy step.
- Legacy CSV ``expert_distribution_rank{r}_timestamp{t}.csv`` (``layer_id,expert_id,count``).
- JSON ``{"logical_count": [L][E]}`` (or ``[N][L][E]``): aggregate counts, the
  ``--init-expert-location`` input format.

``.pt`` files are read with ``torch.load(weights_only=True)`` only (:mod:`._torchload`).
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..domain.hashing import sha256_files
from ..domain.ranks import UNKNOWN_RPN_NOTE
from ..errors import InputError
from ..safety import check_regular_file
from . import Collector, RunData, register
from ._torchload import check_counts, load_pt, looks_like_pt, to_numpy

# SGLang ForwardMode (python/sglang/srt/model_executor/forward_batch_info.py), IntEnum with
# auto() from 1. Values 1..6 are stable across 0.4-0.5; 7+ changed between releases
# (DUMMY_FIRST in 0.4; PREBUILT, SPLIT_PREFILL, DLLM_EXTEND later) and map to 'unknown'.
FORWARD_MODE = {1: "EXTEND", 2: "DECODE", 3: "MIXED", 4: "IDLE", 5: "TARGET_VERIFY", 6: "DRAFT_EXTEND"}
FORWARD_PHASE = {1: "prefill", 2: "decode", 3: "mixed", 4: "idle", 5: "decode", 6: "prefill"}
IDLE_MODE = 4

_CSV_HEADER = ("layer_id", "expert_id", "count")
_CSV_NAME = re.compile(r"expert_distribution_rank(\d+)_timestamp([\d.]+)\.csv$")
_PT_RANK = re.compile(r"expert_distribution_recorder_([\d.]+)_(\d+)\.pt$")


# ----------------------------------------------------------------------------- sniffing
def _kind(path: Path, head: bytes) -> str | None:
    name = path.name.lower()
    if looks_like_pt(head):
        if b"global_physical_count" in head or b"topk_ids_of_layer" in head or (
                b"records" in head and name.startswith("expert_distribution_recorder")):
            return "per_pass"
        if b"logical_count" in head:
            return "stat"
        return None
    if name.endswith(".json"):
        h = head.lstrip()
        if h.startswith(b"{") and b'"logical_count"' in h[:200]:
            return "json"
        return None
    if name.endswith(".csv"):
        first = head.split(b"\n", 1)[0].decode("utf-8", "replace").strip().lower()
        if tuple(c.strip().strip('"') for c in first.split(",")) == _CSV_HEADER:
            return "csv"
    return None


def _sniff(path: Path, head: bytes) -> bool:
    return _kind(path, head) is not None


# ----------------------------------------------------------------------------- helpers
def _load_rows(tokens: np.ndarray) -> tuple[np.ndarray, ...]:
    """Nonzero entries of a [steps, L, E] count array as (step, layer, expert, tokens)."""
    s, l, e = np.nonzero(tokens)
    return s, l, e, tokens[s, l, e]


def _load_table(step, layer, expert, tokens, slot=None, src_rank=None) -> pa.Table:
    n = len(step)
    return pa.table({
        "step": np.asarray(step, np.int64), "layer": np.asarray(layer, np.int32),
        "expert": np.asarray(expert, np.int32),
        "slot": pa.nulls(n, pa.int32()) if slot is None else pa.array(np.asarray(slot, np.int32)),
        "src_rank": pa.nulls(n, pa.int32()) if src_rank is None else pa.array(np.asarray(src_rank, np.int32)),
        "tokens": np.asarray(tokens, np.int64)})


_check_counts = check_counts


def _run(source: str, sha: str, L: int, E: int, approx: list[str], meta: dict, options: dict, **kw) -> dict:
    run = {
        "source": source, "source_sha256": sha, "time_base": "none",
        "num_layers": options.get("num_layers") or L, "num_experts": options.get("num_experts") or E,
        "top_k": options.get("top_k"), "num_ranks": options.get("num_ranks"),
        "ranks_per_node": options.get("ranks_per_node"), "num_slots": E,
        "num_groups": options.get("num_groups"),
        "approximations": json.dumps(approx) if approx else None,
        "meta_json": json.dumps(meta),
    }
    for k, v in kw.items():
        if v is not None:
            run[k] = v
    return run


# ----------------------------------------------------------------------------- stat
def _stat_run(path: Path, options: dict) -> RunData:
    obj = load_pt(path)
    if not isinstance(obj, dict) or "logical_count" not in obj:
        raise InputError(path, "not an SGLang stat dump: expected a dict with 'logical_count'")
    lc = _check_counts(to_numpy(obj["logical_count"], path, "logical_count"), path, "logical_count")
    approx = []
    if lc.ndim == 2:
        lc = lc[None]
        approx.append("aggregate logical_count over the recording: one pseudo-step (step 0)")
    if lc.ndim != 3:
        raise InputError(path, f"logical_count: expected [buffer, layers, experts], got shape {tuple(lc.shape)}")
    if 0 in lc.shape:
        raise InputError(path, f"logical_count has shape {list(lc.shape)}: no layers or experts (nothing recorded)")
    filled = lc.reshape(lc.shape[0], -1).sum(axis=1) > 0
    if not filled.any():
        raise InputError(path, "logical_count holds only zeros (nothing was recorded)")
    last = int(np.nonzero(filled)[0][-1])
    dropped = lc.shape[0] - 1 - last
    rows = lc[: last + 1]
    if dropped:
        approx.append(f"stat ring buffer: {dropped} unfilled trailing rows dropped; rows are passes in recording "
                      "order, forward_pass_ids not recorded (steps numbered from 0)")
    elif lc.shape[0] > 1:
        approx.append("stat ring buffer was full: its write position is not in the dump, so the rows may be "
                      "rotated (the oldest pass is not necessarily step 0); forward_pass_ids not recorded")
    idle = int((~filled[: last + 1]).sum())
    if idle:
        approx.append(f"{idle} all-zero rows inside the recorded range kept as passes with no load")
    s, l, e, t = _load_rows(rows)
    load = _load_table(s, l, e, t)
    meta = {"format": "sglang_stat", "rank": obj.get("rank") if isinstance(obj.get("rank"), int) else None,
            "buffer_rows": int(lc.shape[0]), "filled_rows": int(last + 1)}
    util = obj.get("average_utilization_rate_over_window")
    if isinstance(util, (int, float)):
        meta["average_utilization_rate_over_window"] = float(util)
    run = _run(path.name, sha256_files([path]), lc.shape[1], lc.shape[2], approx, meta, options,
               collector="sglang")
    return RunData(run=run, tables={"expert_load": load}, run_id_hint=path.stem, files=[str(path)])


# ----------------------------------------------------------------------------- JSON
def _json_counts(arr: np.ndarray, path: Path, first: int, ndim: int) -> np.ndarray:
    """One batch of logical_count rows as int64 (integers, finite, non-negative, at most
    MAX_COUNT); an error names the index in the whole array."""
    from .checks import MAX_COUNT

    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise InputError(path, "logical_count holds non-integer counts")
    elif arr.dtype.kind not in "iu":
        raise InputError(path, "logical_count must be a rectangular [layers][experts] or [N][layers][experts] "
                               "array of integers")
    for bad, what in ((arr < 0, "a negative count"), (arr > MAX_COUNT, "a count beyond 2^40 (sums must stay exact)")):
        if arr.size and bad.any():
            idx = [int(i) for i in np.argwhere(bad)[0]]
            v = arr[tuple(idx)]
            idx[0] += first
            raise InputError(path, f"logical_count holds {what}: {int(v)}", f"index {idx}")
    return arr.astype(np.int64, copy=False)


def _json_run(path: Path, options: dict) -> RunData:
    """The logical_count JSON, read twice in bounded memory (collect/_json_stream.py):
    a first pass checks every value and finds the shape, the zero layers and the highest
    ids; the store's write streams the rows of the second."""
    from ..streams import Rereadable
    from ._json_stream import array_batches

    check_regular_file(path)
    what = "[layers][experts] or [N][layers][experts]"

    def batches():
        n = 0
        for ndim, arr in array_batches(path, "logical_count", what):
            yield ndim, n, _json_counts(arr, path, n, ndim)
            n += arr.shape[0]

    ndim, rows, layer_tot, expert_tot = None, 0, None, None
    inner = None
    for ndim, first, arr in batches():
        inner = arr.shape[1:]
        rows = first + arr.shape[0]
        if 0 in arr.shape:
            continue
        if ndim == 3:
            s = arr.sum(axis=(0, 2))
            layer_tot = s if layer_tot is None else layer_tot + s
            e = arr.sum(axis=(0, 1))
        else:
            layer_tot = arr.sum(axis=1) if layer_tot is None else np.concatenate([layer_tot, arr.sum(axis=1)])
            e = arr.sum(axis=0)
        expert_tot = e if expert_tot is None else expert_tot + e
    shape = [rows, *inner]
    if 0 in shape:
        raise InputError(path, f"logical_count has shape {shape}: no layers or experts (nothing recorded)")
    L, E = shape[-2], shape[-1]
    # the bounds validate_run checks on a whole table, checked here (the rows are streamed)
    for col, tot, opt in (("layer", layer_tot, "num_layers"), ("expert", expert_tot, "num_experts")):
        upper = options.get(opt)
        nz = np.flatnonzero(tot)
        if upper and nz.size and nz[-1] >= int(upper):
            raise InputError(path, f"expert_load.{col} = {int(nz[-1])} is outside the run's shape (0..{int(upper) - 1})")
    approx = []
    if ndim == 2:
        approx.append("aggregate logical_count (SGLang --init-expert-location JSON): the whole recording is one "
                      "pseudo-step (step 0); per-pass variation is not in the source")
    else:
        approx.append("logical_count [N, layers, experts]: each of the N rows is taken as one step")
    dense = [int(i) for i in np.flatnonzero(layer_tot == 0)]
    if dense:
        approx.append(f"layers with no routed tokens (dense or unrecorded): {_ranges(dense)}")

    def stream():
        for nd, first, arr in batches():
            if nd == 2:
                l, e = np.nonzero(arr)
                yield _load_table(np.zeros(len(l), np.int64), l + first, e, arr[l, e])
            else:
                s, l, e, t = _load_rows(arr)
                yield _load_table(s + first, l, e, t)

    meta = {"format": "sglang_logical_count_json", "zero_layers": dense}
    run = _run(path.name, sha256_files([path]), L, E, approx, meta, options, collector="sglang")
    return RunData(run=run, tables={"expert_load": Rereadable(stream)}, run_id_hint=path.stem, files=[str(path)])


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


# ----------------------------------------------------------------------------- legacy CSV
def _csv_run(paths: list[Path], options: dict) -> RunData:
    import polars as pl

    frames = []
    for _i, p in enumerate(sorted(paths)):
        m = _CSV_NAME.search(p.name)
        rank = int(m.group(1)) if m else None
        try:
            with open(p, "rb") as fh:  # a handle: polars reads a path as a pattern (rank[0].csv reads rank0.csv)
                df = pl.read_csv(fh, schema_overrides={"layer_id": pl.Int64, "expert_id": pl.Int64,
                                                       "count": pl.Float64})
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(p, f"cannot parse CSV: {msg}") from None
        if df.height == 0:
            raise InputError(p, "file holds no rows")
        for c in _CSV_HEADER:
            if df[c].null_count():
                raise InputError(p, f"column {c!r} is empty", f"row {int(df[c].is_null().arg_max()) + 2}")
        cnt = df["count"].to_numpy()
        bad = (cnt < 0) | (cnt != np.round(cnt))
        if bad.any():
            j = int(np.argmax(bad))
            raise InputError(p, f"count {cnt[j]} is not a non-negative integer", f"row {j + 2}")
        if (df["layer_id"] < 0).any() or (df["expert_id"] < 0).any():
            raise InputError(p, "negative layer_id or expert_id")
        frames.append(df.with_columns(pl.lit(rank, pl.Int64).alias("src_rank")))
    df = pl.concat(frames)
    rows_in = df.height
    df = df.group_by(["layer_id", "expert_id", "src_rank"]).agg(pl.col("count").sum())
    dup = rows_in - df.height
    df = df.filter(pl.col("count") > 0).sort(["layer_id", "expert_id", "src_rank"])
    ranks = sorted({r for r in df["src_rank"].to_list() if r is not None})
    L, E = int(df["layer_id"].max()) + 1, int(df["expert_id"].max()) + 1
    approx = ["legacy SGLang CSV: aggregate counts over the recording, one pseudo-step (step 0)"]
    if dup:   # the writer emits one row per (layer, expert); repeats are summed, and said
        approx.append(f"{dup} repeated (layer_id, expert_id) row(s) of one rank's CSV were summed")
    if not options.get("num_layers"):
        approx.append("num_layers inferred from the highest layer_id")
    if not options.get("num_experts"):
        approx.append("num_experts inferred from the highest expert_id")
    if any(_CSV_NAME.search(p.name) is None for p in paths):
        approx.append("source rank unknown for files not named expert_distribution_rank{r}_timestamp{t}.csv")
    load = _load_table(np.zeros(df.height), df["layer_id"].to_numpy(), df["expert_id"].to_numpy(),
                       df["count"].to_numpy(),
                       src_rank=None if not ranks else df["src_rank"].to_numpy())
    if ranks and df["src_rank"].null_count():
        load = load.set_column(4, "src_rank", pa.array(df["src_rank"].to_list(), pa.int32()))
    meta = {"format": "sglang_legacy_csv", "ranks": ranks}
    run = _run(",".join(p.name for p in sorted(paths)), sha256_files(sorted(paths)), L, E, approx, meta, options,
               collector="sglang", num_ranks=options.get("num_ranks") or (max(ranks) + 1 if ranks else None))
    return RunData(run=run, tables={"expert_load": load}, run_id_hint=sorted(paths)[0].stem, files=[str(p) for p in paths])


# ----------------------------------------------------------------------------- per_pass / per_token
def _detail_run(paths: list[Path], options: dict) -> RunData:
    paths = sorted(paths)
    p2l = None
    p2l_file = None
    # (fpid, rank) -> accumulated count [L, P]; routing pieces per (fpid, rank)
    counts: dict[tuple[int, int], np.ndarray] = {}
    modes: dict[tuple[int, int], int | None] = {}
    topk: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    files_of_rank: dict[int, Path] = {}
    has_token = False
    for path in paths:
        obj = load_pt(path)
        if not isinstance(obj, dict) or "records" not in obj:
            raise InputError(path, "not an SGLang per_pass/per_token dump: expected a dict with 'records'")
        if "last_physical_to_logical_map" not in obj:
            raise InputError(path, "dump has no last_physical_to_logical_map")
        m = to_numpy(obj["last_physical_to_logical_map"], path, "last_physical_to_logical_map", ndim=2)
        if m.dtype.kind not in "iu":
            raise InputError(path, f"last_physical_to_logical_map has dtype {m.dtype}, expected integers")
        m = m.astype(np.int64)
        if p2l is None:
            p2l, p2l_file = m, path
        elif m.shape != p2l.shape or not np.array_equal(m, p2l):
            raise InputError(path, f"last_physical_to_logical_map differs from the one in {p2l_file.name} "
                                   "(files from different dumps or a rebalance between them: ingest them separately)")
        records = obj["records"]
        if not isinstance(records, list):
            raise InputError(path, "'records' is not a list")
        fname_rank = _PT_RANK.search(path.name)
        for i, rec in enumerate(records):
            where = f"record {i}"
            if not isinstance(rec, dict):
                raise InputError(path, "record is not a dict", where)
            for k in ("forward_pass_id", "rank"):
                if not isinstance(rec.get(k), int):
                    raise InputError(path, f"record has no integer {k!r}", where)
            fpid, rank = rec["forward_pass_id"], rec["rank"]
            if fname_rank and int(fname_rank.group(2)) != rank:
                raise InputError(path, f"record rank {rank} differs from the rank in the file name", where)
            prev = files_of_rank.setdefault(rank, path)
            if prev != path:
                raise InputError(path, f"rank {rank} also appears in {prev.name} (two dumps of one rank: ingest them "
                                       "separately)", where)
            key = (fpid, rank)
            if "global_physical_count" in rec:
                c = _check_counts(to_numpy(rec["global_physical_count"], path, "global_physical_count", ndim=2),
                                  path, f"{where}: global_physical_count")
                if c.shape != p2l.shape:
                    raise InputError(path, f"global_physical_count shape {tuple(c.shape)} disagrees with "
                                           f"last_physical_to_logical_map shape {tuple(p2l.shape)}", where)
                counts[key] = counts[key] + c if key in counts else c
            if "topk_ids_of_layer" in rec:
                has_token = True
                t = to_numpy(rec["topk_ids_of_layer"], path, "topk_ids_of_layer", ndim=3)
                if t.dtype.kind not in "iu":
                    raise InputError(path, f"topk_ids_of_layer has dtype {t.dtype}, expected integers", where)
                t = t.astype(np.int64)
                if t.shape[0] != p2l.shape[0]:
                    raise InputError(path, f"topk_ids_of_layer has {t.shape[0]} layers, the map has {p2l.shape[0]}",
                                     where)
                if t.size and (t.max() >= p2l.shape[1] or t.min() < -1):
                    bad = t[(t >= p2l.shape[1]) | (t < -1)][0]
                    raise InputError(path, f"topk_ids_of_layer holds physical id {bad} outside 0..{p2l.shape[1] - 1}",
                                     where)
                topk[key].append(t)
            fm = rec.get("forward_mode")
            if fm is not None:
                fm = int(to_numpy(fm, path, "forward_mode").reshape(-1)[0]) if not isinstance(fm, int) else fm
            if key not in modes or modes[key] is None:
                modes[key] = fm
            if key not in counts and key not in topk:
                raise InputError(path, "record has neither global_physical_count nor topk_ids_of_layer", where)
    if p2l is None or not (counts or topk):
        raise InputError(paths[0], "dump holds no records")
    L, P = p2l.shape
    if p2l.min() < 0:
        raise InputError(p2l_file, "last_physical_to_logical_map holds a negative expert id")
    E = int(options.get("num_experts") or p2l.max() + 1)
    ranks = sorted(files_of_rank)
    R = int(options.get("num_ranks") or (max(ranks) + 1))
    approx = ["last_physical_to_logical_map (the map at dump time) is applied to every pass: a rebalance during "
              "the recording would mis-map earlier passes"]
    if P % R:
        raise InputError(p2l_file, f"{P} physical slots do not split evenly over {R} ranks (pass --ranks)")
    spr = P // R
    rpn = options.get("ranks_per_node")
    if not rpn:
        rpn = R
        approx.append(UNKNOWN_RPN_NOTE)
    missing = [r for r in range(R) if r not in files_of_rank]
    if missing:
        approx.append(f"no dump for ranks {_ranges(missing)}: their tokens are missing from the load")
    passes = sorted({k[0] for k in list(counts) + list(topk)})
    step_of = {f: i for i, f in enumerate(passes)}
    by_rank = bool(options.get("src_rank") or options.get("by_src_rank"))
    # ---- routing (per_token)
    routing_parts, load_from_routing = [], {}
    tok_of: dict[tuple[int, int], int] = {}
    if has_token:
        offset: dict[int, int] = defaultdict(int)
        for key in sorted(topk):
            fpid, rank = key
            t = np.concatenate(topk[key], axis=1)  # [L, T, K]
            T = t.shape[1]
            tok_of[key] = T
            base = offset[fpid]
            offset[fpid] += T
            lay, tok, ch = np.nonzero(t >= 0)
            phys = t[lay, tok, ch]
            # choice = position among the non-padded entries of that token
            valid = (t >= 0).astype(np.int64)
            choice = (np.cumsum(valid, axis=2) - 1)[lay, tok, ch]
            routing_parts.append(pa.table({
                "step": np.full(len(lay), step_of[fpid], np.int64), "layer": lay.astype(np.int32),
                "token": (tok + base).astype(np.int64), "src_rank": np.full(len(lay), rank, np.int32),
                "choice": choice.astype(np.int8), "expert": p2l[lay, phys].astype(np.int32),
                "slot": phys.astype(np.int32), "gate": pa.nulls(len(lay), pa.float32())}))
            if key not in counts:
                c = np.zeros((L, P), np.int64)
                np.add.at(c, (lay, phys), 1)
                load_from_routing[key] = c
    all_counts = {**load_from_routing, **counts}
    # ---- expert_load (exact per slot; per source rank on request)
    step_c, lay_c, slot_c, rank_c, tok_c = [], [], [], [], []
    if by_rank:
        for (fpid, rank), c in sorted(all_counts.items()):
            l, s = np.nonzero(c)
            step_c.append(np.full(len(l), step_of[fpid])), lay_c.append(l), slot_c.append(s)
            rank_c.append(np.full(len(l), rank)), tok_c.append(c[l, s])
    else:
        summed: dict[int, np.ndarray] = {}
        for (fpid, _rank), c in all_counts.items():
            summed[fpid] = summed[fpid] + c if fpid in summed else c.copy()
        for fpid in sorted(summed):
            c = summed[fpid]
            l, s = np.nonzero(c)
            step_c.append(np.full(len(l), step_of[fpid])), lay_c.append(l), slot_c.append(s), tok_c.append(c[l, s])
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
    lay_a, slot_a = cat(lay_c), cat(slot_c)
    load = _load_table(cat(step_c), lay_a, p2l[lay_a, slot_a] if len(lay_a) else lay_a, cat(tok_c), slot=slot_a,
                       src_rank=cat(rank_c) if by_rank else None)
    # ---- placement (recorded)
    lay_p = np.repeat(np.arange(L), P)
    slot_p = np.tile(np.arange(P), L)
    rank_p = slot_p // spr
    placement = pa.table({"plan_id": pa.array(["recorded"] * (L * P)), "layer": lay_p.astype(np.int32),
                          "slot": slot_p.astype(np.int32), "rank": rank_p.astype(np.int32),
                          "node": (rank_p // int(rpn)).astype(np.int32), "expert": p2l.ravel().astype(np.int32)})
    # ---- steps: one row per (pass, rank) that recorded it
    top_k = options.get("top_k")
    if top_k is None and routing_parts:
        top_k = max(int(np.max(tp.column("choice").to_numpy())) + 1 for tp in routing_parts if tp.num_rows) \
            if any(tp.num_rows for tp in routing_parts) else None
    st = {"step": [], "rank": [], "phase": [], "num_tokens": [], "is_dummy": [], "start_ns": [], "end_ns": [],
          "inferred": []}
    unknown_modes = set()
    for key in sorted(set(all_counts) | set(modes)):
        fpid, rank = key
        c = all_counts.get(key)
        fm = modes.get(key)
        n = tok_of.get(key)
        if n is None and c is not None and top_k:
            # every MoE layer sees every token k times: exact when the nonzero layers agree
            sums = {int(x) for x in c.sum(axis=1) if x}
            if len(sums) == 1 and next(iter(sums)) % int(top_k) == 0:
                n = next(iter(sums)) // int(top_k)
            elif not sums:
                n = 0
        total = int(c.sum()) if c is not None else (n or 0)
        if fm is not None:
            phase = FORWARD_PHASE.get(fm, "unknown")
            if fm not in FORWARD_PHASE:
                unknown_modes.add(fm)
            dummy = fm == IDLE_MODE or (n == 0)
        else:
            dummy = total == 0
            phase = "idle" if dummy else "unknown"
        st["step"].append(step_of[fpid]), st["rank"].append(rank), st["phase"].append(phase)
        st["num_tokens"].append(n), st["is_dummy"].append(bool(dummy))
        st["start_ns"].append(None), st["end_ns"].append(None), st["inferred"].append(False)
    if unknown_modes:
        approx.append(f"forward_mode values {sorted(unknown_modes)} are version-specific in SGLang: phase 'unknown'")
    if not has_token:
        approx.append("per_pass dump: phase unknown (no forward_mode); a rank with zero count in a pass is taken as "
                      "a dummy (idle) step")
    steps = pa.table({"step": pa.array(st["step"], pa.int64()), "rank": pa.array(st["rank"], pa.int32()),
                      "phase": st["phase"], "num_tokens": pa.array(st["num_tokens"], pa.int64()),
                      "is_dummy": st["is_dummy"], "start_ns": pa.array(st["start_ns"], pa.int64()),
                      "end_ns": pa.array(st["end_ns"], pa.int64()), "inferred": st["inferred"]})
    tables = {"expert_load": load, "placement": placement, "steps": steps}
    if routing_parts:
        tables["routing"] = pa.concat_tables(routing_parts)
    meta = {"format": "sglang_per_token" if has_token else "sglang_per_pass", "ranks": ranks,
            "forward_pass_ids": [passes[0], passes[-1]], "step_is_forward_pass_index": True}
    if passes != list(range(passes[0], passes[0] + len(passes))):
        approx.append("forward_pass_ids are not contiguous: steps number the recorded passes in order")
    run = _run(",".join(p.name for p in paths), sha256_files(paths), L, E, approx, meta, options,
               collector="sglang", num_ranks=R, ranks_per_node=int(rpn), top_k=top_k)
    run["num_slots"] = P
    return RunData(run=run, tables=tables, run_id_hint=paths[0].stem, files=[str(p) for p in paths])


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    from . import head

    groups: dict[str, list[Path]] = defaultdict(list)
    for p in paths:
        k = _kind(p, head(p))
        if k is None:  # forced with --format: decide by content
            h = head(p)
            k = "per_pass" if looks_like_pt(h) else ("json" if p.suffix.lower() == ".json" else "csv")
        groups[k].append(p)
    out = []
    for p in groups.get("stat", []):
        out.append(_stat_run(p, options))
    for p in groups.get("json", []):
        out.append(_json_run(p, options))
    if groups.get("csv"):
        out.append(_csv_run(groups["csv"], options))
    if groups.get("per_pass"):
        out.append(_detail_run(groups["per_pass"], options))
    return out


register(Collector("sglang", "SGLang expert-distribution dumps (stat, per_pass, per_token .pt; legacy CSV; "
                             "logical_count JSON)", _sniff, _collect, priority=20))
