"""Plans in the store (``placement`` table) and in files.

File formats (:data:`FORMATS`), each written by :func:`export_plan` and read back by
:func:`import_plan`:

- ``sglang``: SGLang ``--init-expert-location`` JSON (``{"physical_to_logical_map":
  [layers][slots]}``, one row per model layer, dense layers included); a file holding
  only ``logical_count`` is planned with EPLB, as SGLang itself does.
- ``eplb``: EPLB-style JSON (``phy2log``, ``log2phy``, ``logcnt`` plus the shape).
- ``trtllm``: TensorRT-LLM's EPLB config YAML, the file ``moe_config.load_balancer``
  names (or the LLM-API YAML holding it inline): ``num_slots``, ``layer_updates_per_iter``
  (0 = static placement), ``initial_global_assignments {layer: [expert per slot]}``; rank
  r holds the consecutive slots ``[r*S/ep, (r+1)*S/ep)``. Layer keys are model layer ids.
  Read with ``yaml.safe_load`` only.
- ``vllm-ascend``: vllm-ascend's expert map JSON (``eplb_config.expert_map_path``):
  ``{"moe_layer_count", "layer_list": [{"layer_id", "device_count", "device_list":
  [{"device_id", "device_expert": [expert per local slot]}]}]}``. ``layer_id`` is the
  MoE-layer index (dense layers not counted): on import the file's layers are matched to
  the run's layers by id, else in order when the counts agree (and the plan says so).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..domain.ranks import node_of
from ..errors import InputError
from ..safety import excerpt
from .eplb import rebalance_experts
from .planners import Plan

FORMATS = ("sglang", "eplb", "trtllm", "vllm-ascend")


def plan_table(plan: Plan, plan_id: str) -> pa.Table:
    L, S = plan.phy2log.shape
    rank = np.tile(plan.slot_rank, L)
    return pa.table({"plan_id": pa.array([plan_id] * (L * S), pa.string()),
                     "layer": np.repeat(plan.layers, S).astype(np.int32),
                     "slot": np.tile(np.arange(S), L).astype(np.int32),
                     "rank": rank.astype(np.int32), "node": node_of(rank, plan.ranks_per_node).astype(np.int32),
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
        return ["plan fitted on the same steps it is judged on (in-sample; use moetrace plan --fit-steps for "
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
    elif fmt == "trtllm":
        return _write(path, trtllm_yaml(plan))
    elif fmt == "vllm-ascend":
        R, per = plan.num_ranks, plan.slots_per_rank
        doc = {"moe_layer_count": plan.num_layers, "layer_list": [
            {"layer_id": i, "device_count": R,
             "device_list": [{"device_id": r, "device_expert": row[r * per:(r + 1) * per].tolist()} for r in range(R)]}
            for i, row in enumerate(plan.phy2log)]}
    else:
        raise InputError(None, f"unknown plan file format {fmt!r} (choose from {', '.join(FORMATS)})")
    return _write(path, json.dumps(doc, separators=(",", ":")) + "\n")


def _write(path: Path, text: str) -> Path:
    from ..output import write_output

    try:
        write_output(path, text, "plan file")
    except OSError as e:
        raise InputError(path, f"cannot write: {e.strerror}") from None
    return path


def trtllm_yaml(plan: Plan, layer_updates_per_iter: int = 0) -> str:
    """TensorRT-LLM EPLB config YAML of ``plan`` (static: ``layer_updates_per_iter`` 0),
    one flow-style list of ``num_slots`` expert ids per model layer."""
    import yaml

    lines = [f"num_slots: {plan.num_slots}", f"layer_updates_per_iter: {int(layer_updates_per_iter)}",
             "initial_global_assignments:"]
    lines += [f"  {int(l)}: [{', '.join(map(str, row.tolist()))}]" for l, row in zip(plan.layers, plan.phy2log)]
    text = "\n".join(lines) + "\n"
    yaml.safe_load(text)  # the file must read back as YAML
    return text


@dataclass
class TrtllmEplbConfig:
    """A TensorRT-LLM ``moe_config.load_balancer`` config: ``layers`` (model layer ids)
    and ``phy2log [layers, num_slots]`` (empty when the config has no initial assignments:
    online balancing decides the placement)."""

    num_slots: int
    layer_updates_per_iter: int
    layers: np.ndarray
    phy2log: np.ndarray


def looks_like_trtllm_yaml(head: bytes) -> bool:
    return any(k in head for k in (b"initial_global_assignments", b"layer_updates_per_iter")) and \
        b"num_slots" in head


def read_trtllm_yaml(path: str | Path, num_experts: int | None = None) -> TrtllmEplbConfig:
    """Read a TensorRT-LLM EPLB config YAML (top level, or under ``moe_config.load_balancer``)
    with ``yaml.safe_load``; every problem is an InputError naming the file."""
    from ..formats.safe_yaml import load as load_yaml

    path = Path(path)
    doc = load_yaml(path)   # aliases counted expanded (max_yaml_nodes) before a value is built
    if isinstance(doc, dict) and isinstance(doc.get("moe_config"), dict):
        doc = doc["moe_config"].get("load_balancer")
        if isinstance(doc, str):
            raise InputError(path, f"moe_config.load_balancer names another file ({excerpt(doc, 80)!r}): give that file")
    if not isinstance(doc, dict) or "num_slots" not in doc:
        raise InputError(path, "not a TensorRT-LLM EPLB config: expected num_slots (and initial_global_assignments) "
                               "at the top level or under moe_config.load_balancer")

    def count(key, v, lo):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InputError(path, f"{key} must be an integer >= {lo}, got {excerpt(repr(v), 40)}")
        return v

    S = count("num_slots", doc["num_slots"], 1)
    U = count("layer_updates_per_iter", doc.get("layer_updates_per_iter", 0), 0)
    ga = doc.get("initial_global_assignments")
    if ga is None:
        return TrtllmEplbConfig(S, U, np.zeros(0, np.int64), np.zeros((0, S), np.int64))
    if not isinstance(ga, dict) or not ga:
        raise InputError(path, "initial_global_assignments must be a mapping {layer: [expert per slot]}")
    layers, rows = [], []
    for key, row in ga.items():
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            layer = key
        elif isinstance(key, str) and key.strip().isdigit():
            layer = int(key)
        else:
            raise InputError(path, f"initial_global_assignments key {excerpt(repr(key), 40)} is not a layer number")
        where = f"initial_global_assignments[{key}]"
        if not isinstance(row, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in row):
            raise InputError(path, f"{where} must be a list of integer expert ids")
        if len(row) != S:
            raise InputError(path, f"{where} has {len(row)} slots, num_slots is {S}")
        if row and min(row) < 0:
            raise InputError(path, f"{where} holds a negative expert id {min(row)}")
        if num_experts is not None and row and max(row) >= num_experts:
            raise InputError(path, f"{where} holds expert {max(row)}, the run has {num_experts} experts")
        layers.append(layer)
        rows.append(row)
    if len(set(layers)) != len(layers):
        raise InputError(path, "initial_global_assignments names a layer twice")
    order = np.argsort(layers, kind="stable")
    return TrtllmEplbConfig(S, U, np.asarray(layers, np.int64)[order], np.asarray(rows, np.int64)[order])


def _read_vllm_ascend(path: Path, doc: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """phy2log, file layer ids, devices of a vllm-ascend expert map document."""
    ll = doc.get("layer_list")
    n = doc.get("moe_layer_count")
    if not isinstance(ll, list) or not ll:
        raise InputError(path, "layer_list must be a non-empty list")
    if isinstance(n, bool) or not isinstance(n, int) or n != len(ll):
        raise InputError(path, f"moe_layer_count {n!r} differs from the {len(ll)} entries of layer_list")
    rows, ids, R = [], [], 0      # R: layer_list[0]'s device count (ll is not empty)
    for i, layer in enumerate(ll):
        where = f"layer_list[{i}]"
        if not isinstance(layer, dict) or not isinstance(layer.get("device_list"), list):
            raise InputError(path, f"{where} has no device_list")
        devs = layer["device_list"]
        lid = layer.get("layer_id", i)
        if isinstance(lid, bool) or not isinstance(lid, int) or lid < 0:
            raise InputError(path, f"{where}.layer_id must be a non-negative integer, got {lid!r}")
        cnt = layer.get("device_count", len(devs))
        if cnt != len(devs):
            raise InputError(path, f"{where}.device_count {cnt!r} differs from the {len(devs)} devices listed")
        R = R if i else len(devs)
        if len(devs) != R or not R:
            raise InputError(path, f"{where} lists {len(devs)} devices, layer_list[0] lists {R}")
        row, per = [], None
        for j, d in enumerate(devs):
            ex = d.get("device_expert") if isinstance(d, dict) else None
            if not isinstance(ex, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in ex):
                raise InputError(path, f"{where}.device_list[{j}].device_expert must be a list of expert ids >= 0")
            if d.get("device_id", j) != j:
                raise InputError(path, f"{where}.device_list[{j}].device_id is {d.get('device_id')!r}, expected {j} "
                                       "(devices in order)")
            per = per if per is not None else len(ex)
            if len(ex) != per or not per:
                raise InputError(path, f"{where}.device_list[{j}] holds {len(ex)} experts, device 0 holds {per} "
                                       "(every device needs the same number of slots)")
            row += ex
        rows.append(row)
        ids.append(lid)
    if len(set(ids)) != len(ids):
        raise InputError(path, "layer_list names a layer_id twice")
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        raise InputError(path, f"layers hold different slot counts: {sorted(widths)}")
    return np.asarray(rows, np.int64), np.asarray(ids, np.int64), R


def import_plan(path: str | Path, num_experts: int, num_ranks: int, ranks_per_node: int,
                layers: np.ndarray | None = None, num_groups: int = 1) -> Plan:
    """Read a plan file in any of :data:`FORMATS` (told apart by content; YAML by suffix
    or content). Rows are taken for ``layers`` (row index = layer id in a SGLang map
    covering every model layer; layer keys in a TensorRT-LLM config; see the module doc
    for vllm-ascend). The vllm-ascend map gives its own device count (``num_ranks``)."""
    from ..safety import check_regular_file

    path = Path(path)
    check_regular_file(path)   # a FIFO or device would hang the read
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml") or looks_like_trtllm_yaml(head) and not head.lstrip().startswith(b"{"):
        cfg = read_trtllm_yaml(path, num_experts)
        if not cfg.layers.size:
            raise InputError(path, "no initial_global_assignments: the placement is left to online balancing "
                                   f"(layer_updates_per_iter {cfg.layer_updates_per_iter}), nothing to import")
        return _finish(path, cfg.phy2log, cfg.layers, layers, num_experts, num_ranks, ranks_per_node,
                       "file:trtllm", {"layer_updates_per_iter": cfg.layer_updates_per_iter})
    from ..safety import json_loads

    try:
        doc = json_loads(path, path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(path, f"cannot read plan JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InputError(path, "expected a JSON object with physical_to_logical_map, phy2log, logical_count or "
                               "layer_list")

    from ..safety import SHAPE_MAX, checked_int
    from .plan_checks import check_eplb_agrees, counts_array, int_array

    def arr(key):
        a = int_array(path, doc[key], key, 0, SHAPE_MAX - 1)   # expert ids, range-checked before int64
        if a.ndim != 2:
            raise InputError(path, f"{key} must be [layers, slots], got shape {a.shape}")
        return a

    if "phy2log" in doc:
        p2l = arr("phy2log")
        check_eplb_agrees(path, doc, p2l)
        file_layers = int_array(path, doc.get("layers", list(range(p2l.shape[0]))), "layers", 0, SHAPE_MAX - 1, ndim=1)
        num_experts = checked_int(doc.get("num_experts", num_experts), 1, SHAPE_MAX, path, "num_experts")
        num_ranks = checked_int(doc.get("num_ranks", num_ranks), 1, SHAPE_MAX, path, "num_ranks")
        ranks_per_node = checked_int(doc.get("ranks_per_node", ranks_per_node), 1, SHAPE_MAX, path, "ranks_per_node")
        policy = f"file:{doc.get('policy', 'eplb-json')}"
    elif "physical_to_logical_map" in doc:
        p2l = arr("physical_to_logical_map")
        if "logical_to_physical_map" in doc:   # SGLang writes both: they must agree
            check_eplb_agrees(path, {"log2phy": doc["logical_to_physical_map"]}, p2l)
        file_layers = np.arange(p2l.shape[0])
        policy = "file:sglang"
    elif "logical_count" in doc:
        lc = counts_array(path, doc["logical_count"], "logical_count")   # finite, >= 0
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
    elif "layer_list" in doc:
        p2l, file_layers, num_ranks = _read_vllm_ascend(path, doc)
        params = {}
        if layers is not None and not set(np.asarray(layers).tolist()) <= set(file_layers.tolist()):
            if len(layers) != file_layers.size:
                raise InputError(path, f"the map covers {file_layers.size} MoE layers, the run has {len(layers)}")
            params["layer_ids_mapped_in_order"] = {int(a): int(b) for a, b in zip(file_layers, layers)}
            file_layers = np.asarray(layers, np.int64)
        return _finish(path, p2l, file_layers, layers, num_experts, num_ranks, ranks_per_node, "file:vllm-ascend",
                       params)
    else:
        raise InputError(path, "no physical_to_logical_map, phy2log, logical_count or layer_list key")
    return _finish(path, p2l, file_layers, layers, num_experts, num_ranks, ranks_per_node, policy, {})


def _finish(path: Path, p2l: np.ndarray, file_layers: np.ndarray, layers, num_experts: int, num_ranks: int,
            ranks_per_node: int, policy: str, params: dict) -> Plan:
    """The rows of a plan file for ``layers`` as a Plan (errors name the file)."""
    if layers is not None:
        missing = [int(l) for l in layers if l not in set(file_layers.tolist())]
        if missing:
            raise InputError(path, f"no rows for layers {missing[:5]} (the file covers {file_layers.size} layers)")
        idx = [int(np.flatnonzero(file_layers == l)[0]) for l in layers]
        p2l, file_layers = p2l[idx], np.asarray(layers, np.int64)
    if p2l.shape[1] % num_ranks:
        raise InputError(path, f"{p2l.shape[1]} slots per layer do not divide over {num_ranks} ranks; pass --ranks")
    try:
        return Plan(p2l, num_experts, num_ranks, ranks_per_node, layers=file_layers, policy=policy, params=params)
    except ValueError as e:
        raise InputError(path, str(e)) from None
