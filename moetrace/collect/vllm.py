"""vLLM EPLB expert load (physical-slot counts).

vLLM's EPLB state counts tokens per physical slot: ``expert_load_pass`` int32
``[layers, physical]`` for the current pass and the ring ``expert_load_window
[window, layers, physical]``. vLLM does not dump them itself; users save them from the
EPLB state (see docs/engines.md) as:

- a ``.pt`` (``torch.save``) or ``.npz`` dict with any of ``expert_load_pass``,
  ``expert_load_window``, optional ``physical_to_logical_map [layers, physical]`` and
  ``expert_load_window_step`` (the ring's next write position, as in ``EplbState``:
  restores the ring order; leading all-zero rows are then unfilled and dropped);
- a bare ``.npy`` array whose name contains ``expert_load`` (2-D: one pass, 3-D: window).

Without a map, vLLM's initial map is assumed: ``range(E)`` then ``i % E`` for the
redundant slots (``--experts`` gives E; default: no redundant slots). ``--dp-size N``
divides the counts by N: under the naive all-to-all every DP rank sees every token.
Per-rank files of one dump (each rank counts the tokens it dispatched) become one run,
summed, with ``--set sum_ranks=true``; otherwise each file is a run.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..domain.hashing import sha256_files
from ..domain.ranks import UNKNOWN_RPN_NOTE, node_of, ranks_per_node_or_all
from ..errors import InputError
from ..safety import SHAPE_MAX, check_npy_headers, check_regular_file, checked_int
from . import Collector, RunData, register
from ._torchload import check_counts, load_pt, looks_like_pt, to_numpy

KEYS = ("expert_load_pass", "expert_load_window")


def _sniff(path: Path, head: bytes) -> bool:
    name = path.name.lower()
    if looks_like_pt(head):
        return any(k.encode() in head for k in KEYS)
    if name.endswith(".npz") and head[:4] == b"PK\x03\x04":
        return any(k.encode() in head for k in KEYS)
    if name.endswith(".npy") and head[:6] == b"\x93NUMPY":
        return "expert_load" in name
    return False


def initial_map(num_layers: int, num_slots: int, num_experts: int) -> np.ndarray:
    """vLLM's initial physical-to-logical map: slot i holds expert i % E."""
    return np.tile(np.arange(num_slots) % num_experts, (num_layers, 1))


def _read(path: Path) -> dict:
    name = path.name.lower()
    if name.endswith((".npy", ".npz")):
        check_regular_file(path)
        shapes = check_npy_headers(path)  # shapes and dtypes checked before numpy allocates anything
        for what, shape in shapes.items():   # layers, slots: the shape bound, before the rows are built
            for d in shape[1:] if len(shape) > 2 else shape:
                checked_int(d, 0, SHAPE_MAX, path, f"of {what} shape {list(shape)}", "a dimension")
    if name.endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as e:
            raise InputError(path, f"cannot read .npy: {e}") from None
        return {"expert_load_pass" if arr.ndim == 2 else "expert_load_window": arr}
    if name.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise InputError(path, f"cannot read .npz (truncated or pickled objects): {e}") from None
    obj = load_pt(path)
    if not isinstance(obj, dict):
        raise InputError(path, f"expected a dict of tensors, got {type(obj).__name__}")
    return obj


def _counts(arr, path: Path, what: str, ndim: int) -> np.ndarray:
    return check_counts(to_numpy(arr, path, what, ndim=ndim), path, what)


def _one(path: Path, options: dict) -> RunData:
    d = _read(path)
    if not any(k in d for k in KEYS):
        raise InputError(path, f"no {' or '.join(KEYS)} in the file (keys: {', '.join(map(str, d))})")
    approx: list[str] = []
    meta: dict = {"format": "vllm_expert_load", "keys": sorted(map(str, d))}
    if "expert_load_window" in d:
        win = _counts(d["expert_load_window"], path, "expert_load_window", 3)
        W = win.shape[0]
        if 0 in win.shape:
            raise InputError(path, f"expert_load_window has shape {list(win.shape)}: nothing recorded")
        step_done = d.get("expert_load_window_step")
        if step_done is not None:
            # EplbState.expert_load_window_step is the next write position in the ring: the
            # oldest row once it has wrapped; rows before it are unfilled (zero) until then
            sd = to_numpy(step_done, path, "expert_load_window_step").reshape(-1)
            if sd.size != 1 or sd.dtype.kind not in "iu" or not 0 <= int(sd[0]) < 2**62:
                raise InputError(path, f"expert_load_window_step must be one non-negative integer, got "
                                       f"{sd.size} value(s) of dtype {sd.dtype}")
            start = int(sd[0]) % W
            win = np.concatenate([win[start:], win[:start]])
            meta["window_rotated_by"] = start
            filled = win.reshape(W, -1).sum(axis=1) > 0
            lead = int(np.argmax(filled)) if filled.any() else W
            if lead:
                win = win[lead:]
                approx.append(f"{lead} leading all-zero window rows taken as unfilled and dropped")
            if not len(win):
                raise InputError(path, "expert_load_window holds only zeros (nothing recorded)")
        else:
            approx.append("expert_load_window without expert_load_window_step: ring order unknown, rows taken in "
                          "array order (step = row); zero rows kept")
        data = win
        meta["table"] = "window"
        if "expert_load_pass" in d:
            meta["pass_ignored"] = True
            approx.append("expert_load_pass ignored: the window holds the recorded passes")
    else:
        data = _counts(d["expert_load_pass"], path, "expert_load_pass", 2)[None]
        if 0 in data.shape:
            raise InputError(path, f"expert_load_pass has shape {list(data.shape[1:])}: nothing recorded")
        meta["table"] = "pass"
        approx.append("a single expert_load_pass: one step (step 0)")
    _, L, P = data.shape
    E = options.get("num_experts")
    if "physical_to_logical_map" in d:
        p2l = to_numpy(d["physical_to_logical_map"], path, "physical_to_logical_map", ndim=2)
        if p2l.dtype.kind not in "iu":
            raise InputError(path, f"physical_to_logical_map has dtype {p2l.dtype}, expected integers")
        p2l = p2l.astype(np.int64)
        if p2l.shape != (L, P):
            raise InputError(path, f"load shape [{L}, {P}] (layers, physical) disagrees with physical_to_logical_map "
                                   f"shape {list(p2l.shape)}")
        if p2l.min() < 0:
            raise InputError(path, "physical_to_logical_map holds a negative expert id")
        E = int(E or p2l.max() + 1)
        if p2l.max() >= E:
            raise InputError(path, f"physical_to_logical_map holds expert {p2l.max()} >= --experts {E}")
    else:
        E = int(E or P)
        if E > P:
            raise InputError(path, f"--experts {E} is larger than the {P} physical slots")
        p2l = initial_map(L, P, E)
        approx.append(f"no physical_to_logical_map in the file: vLLM's initial map assumed (slot i holds expert "
                      f"i % {E}; {P - E} redundant slots)")
    dp = int(options.get("dp_size") or 1)
    if dp > 1:
        if np.any(data % dp):
            idx = list(np.argwhere(data % dp)[0])
            raise InputError(path, f"--dp-size {dp}: count {data[tuple(idx)]} is not divisible by {dp} (was this "
                                   "load recorded under the naive all-to-all?)", f"index {idx}")
        data = data // dp
        approx.append(f"counts divided by dp_size={dp} (naive all-to-all: every DP rank recorded every token)")
        meta["dp_size"] = dp
    s, l, p = np.nonzero(data)
    load = pa.table({"step": s.astype(np.int64), "layer": l.astype(np.int32), "expert": p2l[l, p].astype(np.int32),
                     "slot": p.astype(np.int32), "src_rank": pa.nulls(len(s), pa.int32()),
                     "tokens": data[s, l, p].astype(np.int64)})
    tables = {"expert_load": load}
    R = options.get("num_ranks")
    if R:
        R = int(R)
        if P % R:
            raise InputError(path, f"{P} physical slots do not split evenly over --ranks {R}")
        rpn = ranks_per_node_or_all(options.get("ranks_per_node"), R)
        slot_p = np.tile(np.arange(P), L)
        rank_p = slot_p // (P // R)
        tables["placement"] = pa.table({
            "plan_id": pa.array(["recorded"] * (L * P)), "layer": np.repeat(np.arange(L), P).astype(np.int32),
            "slot": slot_p.astype(np.int32), "rank": rank_p.astype(np.int32),
            "node": node_of(rank_p, rpn).astype(np.int32), "expert": p2l.ravel().astype(np.int32)})
        if not options.get("ranks_per_node"):
            approx.append(UNKNOWN_RPN_NOTE)
    else:
        approx.append("--ranks not given: no recorded placement written (slots are kept in expert_load)")
    run = {
        "source": path.name, "source_sha256": sha256_files([path]), "collector": "vllm", "time_base": "none",
        "num_layers": options.get("num_layers") or L, "num_experts": E, "top_k": options.get("top_k"),
        "num_ranks": R, "ranks_per_node": options.get("ranks_per_node") or R, "num_slots": P,
        "num_groups": options.get("num_groups"),
        "approximations": json.dumps(approx) if approx else None, "meta_json": json.dumps(meta),
    }
    return RunData(run=run, tables=tables, run_id_hint=path.stem, files=[str(path)])


def _sum_ranks(paths: list[Path], options: dict) -> RunData:
    """One run from per-rank files (each rank counts the tokens it dispatched): summed."""
    import polars as pl

    parts = [_one(p, options) for p in paths]
    shapes = {(rd.run["num_layers"], rd.run["num_slots"]) for rd in parts}
    if len(shapes) > 1:
        raise InputError(paths[0], f"per-rank files disagree on [layers, slots]: {sorted(shapes)}")
    loads = [pl.from_arrow(rd.tables["expert_load"]) for rd in parts]
    maps = [pl.from_arrow(rd.tables["expert_load"]).select("layer", "slot", "expert").unique() for rd in parts]
    joined = pl.concat(maps).unique()
    if joined.select("layer", "slot").is_duplicated().any():
        raise InputError(paths[0], "per-rank files hold different physical_to_logical_map (a rearrangement between "
                                   "the dumps?): ingest them separately")
    load = (pl.concat(loads).group_by(["step", "layer", "expert", "slot"]).agg(pl.col("tokens").sum())
            .with_columns(pl.lit(None, pl.Int32).alias("src_rank"))
            .select(["step", "layer", "expert", "slot", "src_rank", "tokens"]).sort(["step", "layer", "slot"]))
    rd = parts[0]
    rd.tables["expert_load"] = load
    approx = json.loads(rd.run["approximations"] or "[]")
    approx.append(f"{len(paths)} per-rank files summed (each rank counted the tokens it dispatched)")
    rd.run.update(source=",".join(p.name for p in paths), source_sha256=sha256_files(paths),
                  approximations=json.dumps(approx))
    rd.files = [str(p) for p in paths]
    return rd


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    if options.get("sum_ranks") and len(paths) > 1:
        return [_sum_ranks(sorted(paths), options)]
    return [_one(p, options) for p in sorted(paths)]


register(Collector("vllm", "vLLM EPLB expert load per physical slot (.pt / .npz dict, or .npy named *expert_load*)",
                   _sniff, _collect, priority=20))
