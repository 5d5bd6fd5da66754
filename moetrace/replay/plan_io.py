"""Plans in the store (``placement`` table) and in files.

Files: SGLang ``--init-expert-location`` JSON (``{"physical_to_logical_map": [layers][slots]}``,
one row per model layer, dense layers included), and EPLB-style JSON (``phy2log``,
``log2phy``, ``logcnt`` plus the shape). Both read back; a SGLang file holding only
``logical_count`` is planned with EPLB, as SGLang itself does.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import InputError
from .eplb import rebalance_experts
from .planners import Plan

FORMATS = ("sglang", "eplb")


def plan_table(plan: Plan, plan_id: str) -> pa.Table:
    L, S = plan.phy2log.shape
    rank = np.tile(plan.slot_rank, L)
    return pa.table({"plan_id": pa.array([plan_id] * (L * S), pa.string()),
                     "layer": np.repeat(plan.layers, S).astype(np.int32),
                     "slot": np.tile(np.arange(S), L).astype(np.int32),
                     "rank": rank.astype(np.int32), "node": (rank // plan.ranks_per_node).astype(np.int32),
                     "expert": plan.phy2log.ravel().astype(np.int32)})


def plan_ids(store, run_id: str) -> list[str]:
    if not store.has_files("placement"):
        return []
    return store.sql("SELECT DISTINCT plan_id FROM placement WHERE run_id = ? ORDER BY plan_id", [run_id])["plan_id"].to_list()


def save_plan(store, run_id: str, plan: Plan, plan_id: str, fit: tuple[int, int, int] | None = None,
              start_plan_id: str | None = None) -> int:
    """Append ``plan`` to the run's placement table as ``plan_id`` (which must be new), and
    its metadata row to ``plans``: ``fit = (first step, end step exclusive, steps)`` of the
    load it was fitted on (None: fitted elsewhere, e.g. imported)."""
    if plan_id in plan_ids(store, run_id):
        raise InputError(None, f"run {run_id!r} already has a plan {plan_id!r}; choose another --plan-id")
    plan.plan_id = plan_id
    fs, fe, fn = fit if fit is not None else (None, None, None)
    meta = pa.table({"plan_id": [plan_id], "policy": [plan.policy or "unknown"],
                     "start_plan_id": pa.array([start_plan_id], pa.string()),
                     "fit_start": pa.array([fs], pa.int64()), "fit_end": pa.array([fe], pa.int64()),
                     "fit_steps": pa.array([fn], pa.int64()), "created_at_ns": [time.time_ns()],
                     "params_json": [json.dumps(plan.params, sort_keys=True, default=str)]})
    return store.append(run_id, {"placement": plan_table(plan, plan_id), "plans": meta})["placement"]


def plan_meta(store, run_id: str, plan_id: str) -> dict | None:
    """The ``plans`` row of a stored plan, or None (plans stored before the table existed)."""
    if not store.has_files("plans"):
        return None
    df = store.sql("SELECT * FROM plans WHERE run_id = ? AND plan_id = ? ORDER BY created_at_ns DESC LIMIT 1",
                   [run_id, plan_id])
    return df.row(0, named=True) if df.height else None


def fit_notes(meta: dict | None, steps: np.ndarray, plan_id: str) -> list[str]:
    """What a replay over ``steps`` should say about where the stored plan was fitted."""
    if plan_id == "recorded":
        return []
    if meta is None:
        return [f"plan {plan_id!r} has no stored fit window (stored by an older moetrace): whether it was fitted "
                "on the steps it is judged on is unknown"]
    if meta["fit_start"] is None:
        return [f"plan {plan_id!r} was imported ({meta['policy']}): on which steps it was fitted is unknown"]
    lo, hi = int(meta["fit_start"]), int(meta["fit_end"])
    inside = int(((steps >= lo) & (steps < hi)).sum())
    if inside == 0:
        return [f"plan fitted on steps [{lo}, {hi}), none of the {steps.size} judged steps: out-of-sample"]
    if inside == steps.size:
        return ["plan fitted on the same steps it is judged on (in-sample; use moetrace plan --fit-window for "
                "out-of-sample)"]
    return [f"plan fitted on {inside} steps in [{lo}, {hi}); the replay judges all {steps.size} steps, those included"]


def export_plan(plan: Plan, path: str | Path, fmt: str = "sglang") -> Path:
    path = Path(path)
    if fmt == "sglang":
        n = int(plan.layers.max()) + 1
        rows = np.tile(np.arange(plan.num_slots) % plan.num_experts, (n, 1))
        rows[plan.layers] = plan.phy2log
        doc = {"physical_to_logical_map": rows.tolist()}
    elif fmt == "eplb":
        cnt = plan.logcnt()
        maxc = int(cnt.max())
        log2phy = np.full((plan.num_layers, plan.num_experts, maxc), -1, np.int64)
        for li in range(plan.num_layers):
            seen = np.zeros(plan.num_experts, np.int64)
            for s, e in enumerate(plan.phy2log[li]):
                log2phy[li, e, seen[e]] = s
                seen[e] += 1
        doc = {"phy2log": plan.phy2log.tolist(), "log2phy": log2phy.tolist(), "logcnt": cnt.tolist(),
               "layers": plan.layers.tolist(), "num_experts": plan.num_experts, "num_ranks": plan.num_ranks,
               "ranks_per_node": plan.ranks_per_node, "policy": plan.policy, "params": plan.params}
    else:
        raise InputError(None, f"unknown plan file format {fmt!r} (choose from {', '.join(FORMATS)})")
    try:
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    except OSError as e:
        raise InputError(path, f"cannot write: {e.strerror}") from None
    return path


def import_plan(path: str | Path, num_experts: int, num_ranks: int, ranks_per_node: int,
                layers: np.ndarray | None = None, num_groups: int = 1) -> Plan:
    """Read a plan file (SGLang or EPLB-style JSON). Rows are taken for ``layers`` (row
    index = layer id in a SGLang map covering every model layer)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(path, f"cannot read plan JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InputError(path, "expected a JSON object with physical_to_logical_map, phy2log or logical_count")

    def arr(key):
        try:
            a = np.asarray(doc[key], dtype=np.int64)
        except (ValueError, TypeError):
            raise InputError(path, f"{key} is not a rectangular integer array") from None
        if a.ndim != 2:
            raise InputError(path, f"{key} must be [layers, slots], got shape {a.shape}")
        return a

    if "phy2log" in doc:
        p2l = arr("phy2log")
        file_layers = np.asarray(doc.get("layers", range(p2l.shape[0])), np.int64)
        num_experts = int(doc.get("num_experts", num_experts))
        num_ranks = int(doc.get("num_ranks", num_ranks))
        ranks_per_node = int(doc.get("ranks_per_node", ranks_per_node))
        policy = f"file:{doc.get('policy', 'eplb-json')}"
    elif "physical_to_logical_map" in doc:
        p2l = arr("physical_to_logical_map")
        file_layers = np.arange(p2l.shape[0])
        policy = "file:sglang"
    elif "logical_count" in doc:
        lc = np.asarray(doc["logical_count"], dtype=np.float64)
        if lc.ndim == 3:
            lc = lc.sum(axis=0)
        if lc.ndim != 2:
            raise InputError(path, f"logical_count must be [layers, experts], got {lc.shape}")
        file_layers = np.arange(lc.shape[0])
        try:
            p2l, _, _ = rebalance_experts(lc, max(lc.shape[1], num_experts), num_groups,
                                          max(1, num_ranks // ranks_per_node), num_ranks)
        except ValueError as e:
            raise InputError(path, f"cannot plan logical_count: {e}") from None
        policy = "file:logical_count+eplb"
    else:
        raise InputError(path, "no physical_to_logical_map, phy2log or logical_count key")
    if layers is not None:
        missing = [int(l) for l in layers if l not in set(file_layers.tolist())]
        if missing:
            raise InputError(path, f"no rows for layers {missing[:5]} (the file covers {file_layers.size} layers)")
        idx = [int(np.flatnonzero(file_layers == l)[0]) for l in layers]
        p2l, file_layers = p2l[idx], np.asarray(layers, np.int64)
    if p2l.shape[1] % num_ranks:
        raise InputError(path, f"{p2l.shape[1]} slots per layer do not divide over {num_ranks} ranks; pass --ranks")
    try:
        return Plan(p2l, num_experts, num_ranks, ranks_per_node, layers=file_layers, policy=policy)
    except ValueError as e:
        raise InputError(path, str(e)) from None
