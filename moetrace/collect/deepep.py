"""DeepEP diagnosis counters saved from a run: receive counts per local expert and the
dispatch / combine wait-receive cost matrices.

Source: deepseek-ai/DeepEP at dd758caf (2026-07-14), ``deep_ep/buffers/legacy.py``
(``Buffer.low_latency_dispatch`` / ``low_latency_combine`` docstrings) and
``csrc/kernels/legacy/internode_ll.cu`` (what the kernels write); the counters came in
with 4b67064 (2025-07-30, "diagnosis module", PR 311). The caller passes the tensors and
DeepEP adds into them; nothing is written to disk by DeepEP, so users save them
(``np.save`` / ``np.savez`` / ``safetensors``) under DeepEP's own names:

- ``cumulative_local_expert_recv_stats``: int32 ``[num_local_experts]`` per rank, tokens
  received per local expert, accumulated over calls (``atomicAdd``).
  ``num_recv_tokens_per_expert_list`` (the normal-mode dispatch's per-call list, aligned
  to ``expert_alignment``) and ``packed_recv_count`` / ``recv_count`` (the low-latency
  dispatch's per-call ``[num_local_experts]``) are read the same way.
- ``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats``: int64, one value
  per source rank on each rank (the kernels index the tensor by ``src_rank``; the C++
  side asserts a 1-D ``[num_ranks]`` tensor although the docstring says
  ``[num_ranks, num_ranks]``, which is the matrix DeepEP's test gathers to rank 0:
  row = the rank that waited, column = the source rank it waited for). Values are GPU
  clock cycles (``clock64()``); ``--set clock_ghz=F`` turns them into nanoseconds.

Accumulate vs max: on DeepEP's main branch up to dd758caf each warp's wait is *added*
(``atomicAdd``): the entry is the sum over waiting warps and calls. Commit a0f153f
(2025-12-26, "Use atomicMax instead of atomicAdd", not on main) takes the *maximum*
instead. moetrace assumes the sum (``--set deepep_stat=sum``, the default) and says so;
``--set deepep_stat=max`` records the other reading. Either way the column with the
largest values names the slow source rank (DeepEP's own diagnosis reads the columns).

Accepted layouts (last axis = local experts or source ranks):

- recv counts: ``[E_local]`` (one rank: the rank comes from the key or file name,
  ``rank3``), ``[R, E_local]`` (gathered), ``[L, R, E_local]`` (per MoE layer);
- wait costs: ``[R]`` (one rank, named as above) or ``[R, R]`` (gathered).

A file, or every file given together (one per rank), is one run: ``expert_load`` rows
(step 0, a pseudo-step: the counters are cumulative; expert = slot = rank * E_local +
local index, as DeepEP numbers experts; src_rank empty) and ``deepep_waits`` rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..domain.hashing import sha256_files
from ..errors import InputError
from . import Collector, RunData, _arrays, register, source_label

RECV = ("cumulative_local_expert_recv_stats", "num_recv_tokens_per_expert_list", "packed_recv_count", "recv_count")
WAIT = {"dispatch_wait_recv_cost_stats": "dispatch", "combine_wait_recv_cost_stats": "combine"}
SOURCE = "deepseek-ai/DeepEP dd758caf deep_ep/buffers/legacy.py, csrc/kernels/legacy/internode_ll.cu"


def _name_of(key: str) -> str | None:
    for n in (*WAIT, *RECV):
        if n in key:
            return n
    return None


def _sniff(path: Path, head: bytes) -> bool:
    if _arrays.kind(path, head) is None:
        return False
    return any(_name_of(k) for k in _arrays.names(path, head))


def _clock(options: dict) -> float | None:
    v = options.get("clock_ghz")
    if v in (None, ""):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = -1.0
    if not (0 < f < 100):
        raise InputError(None, f"--set clock_ghz={v!r}: a GPU clock in GHz is needed (e.g. 1.98)")
    return f


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    paths = sorted(paths)
    stat = str(options.get("deepep_stat") or "sum").lower()
    if stat not in ("sum", "max"):
        raise InputError(None, f"--set deepep_stat={options.get('deepep_stat')!r}: sum or max")
    ghz = _clock(options)
    recv: dict[tuple[int, int], tuple[np.ndarray, Path, str]] = {}   # (layer, rank) -> counts [E_local]
    waits: dict[tuple[str, int], tuple[np.ndarray, Path]] = {}      # (phase, rank) -> cycles [R]
    recv_names: set[str] = set()
    ignored: list[str] = []
    for path in paths:
        arrays = _arrays.read(path)
        for key, arr in arrays.items():
            name = _name_of(key)
            if name is None:
                ignored.append(f"{path.name}:{key}")
                continue
            what = f"{key!r}"
            a = _arrays.counts(np.asarray(arr), path, what)
            if a.ndim == 0 or a.ndim > (3 if name in RECV else 2):
                raise InputError(path, f"{what} has shape {list(a.shape)}; expected " +
                                 ("[E_local], [ranks, E_local] or [layers, ranks, E_local]" if name in RECV
                                  else "[ranks] (one rank) or [ranks, ranks] (gathered)"))
            if a.ndim == 1:
                r = _arrays.rank_in(key, path.stem)
                if r is None:
                    raise InputError(path, f"{what} is one rank's [{a.shape[0]}] vector but neither the key nor the "
                                           "file name names the rank (e.g. rank3.npz or key "
                                           f"{name}_rank3)")
                a = a[None, :]
                ranks = [r]
            else:
                ranks = list(range(a.shape[-2]))
            if name in RECV:
                recv_names.add(name)
                a3 = a if a.ndim == 3 else a[None]
                for li in range(a3.shape[0]):
                    for j, r in enumerate(ranks):
                        k = (li, r)
                        if k in recv and recv[k][2] == name:
                            raise InputError(path, f"{what}: rank {r} (layer {li}) is also in {recv[k][1].name}")
                        if k not in recv or RECV.index(name) < RECV.index(recv[k][2]):
                            recv[k] = (a3[li, j], path, name)
            else:
                phase = WAIT[name]
                if a.ndim == 2 and len(ranks) > 1 and a.shape[0] != a.shape[1]:
                    raise InputError(path, f"{what} has shape {list(a.shape)}; a gathered wait matrix is "
                                           "[ranks, ranks]")
                for j, r in enumerate(ranks):
                    if (phase, r) in waits:
                        raise InputError(path, f"{what}: rank {r} is also in {waits[(phase, r)][1].name}")
                    waits[(phase, r)] = (a[j], path)
    if not recv and not waits:
        raise InputError(paths[0], "no DeepEP counter (" + ", ".join((*RECV, *WAIT)) + ") in the file(s)")
    approx = []
    # the rank count: every rank seen, every wait vector's length
    seen = {r for _, r in recv} | {r for _, r in waits}
    lens = {v.shape[0] for v, _ in waits.values()}
    if len(lens) > 1:
        raise InputError(paths[0], f"wait vectors of different lengths {sorted(lens)} (one entry per source rank)")
    R = max(max(seen) + 1, *(lens or {0}))
    if options.get("num_ranks") and int(options["num_ranks"]) != R:
        raise InputError(paths[0], f"--ranks {options['num_ranks']} but the counters cover {R} ranks")
    tables: dict = {}
    E_local = L = None
    if recv:
        el = {v.shape[0] for v, _, _ in recv.values()}
        if len(el) > 1:
            raise InputError(paths[0], f"receive counts of different lengths {sorted(el)} (E_local differs between "
                                       "ranks)")
        E_local = el.pop()
        layers = sorted({li for li, _ in recv})
        L = len(layers)
        missing = sorted({(li, r) for li in layers for r in range(R)} - set(recv))
        if missing:
            raise InputError(paths[0], f"receive counts missing for rank {missing[0][1]} (layer {missing[0][0]}): give "
                                       "every rank's file")
        E = R * E_local
        if options.get("num_experts") and int(options["num_experts"]) != E:
            raise InputError(paths[0], f"--experts {options['num_experts']} but the counters hold {R} ranks x "
                                       f"{E_local} local experts = {E} expert slots")
        step, layer, expert, tokens = [], [], [], []
        for (li, r), (v, _, _) in sorted(recv.items()):
            step.append(np.zeros(E_local, np.int64))
            layer.append(np.full(E_local, li, np.int32))
            expert.append(r * E_local + np.arange(E_local, dtype=np.int32))
            tokens.append(v)
        ex = np.concatenate(expert)
        tables["expert_load"] = pa.table({
            "step": np.concatenate(step), "layer": np.concatenate(layer), "expert": ex, "slot": ex,
            "src_rank": pa.nulls(ex.size, pa.int32()), "tokens": np.concatenate(tokens)})
        used = sorted(recv_names, key=RECV.index)
        approx.append(f"DeepEP receive counts ({used[0]}) are cumulative over the run: one pseudo-step (step 0)"
                      + ("" if L > 1 else ", one layer (the counters do not split layers unless saved per layer)"))
        approx.append(f"expert id = DeepEP's expert slot rank * {E_local} + local index; the logical expert behind a "
                      "redundant slot is not in the counters")
        if "num_recv_tokens_per_expert_list" in used:
            approx.append("num_recv_tokens_per_expert_list counts are aligned up to DeepEP's expert_alignment")
        if len(used) > 1:
            approx.append(f"{used[0]} used; {', '.join(used[1:])} also present and not used")
    if waits:
        ph, rk, src, cyc = [], [], [], []
        for (phase, r), (v, _) in sorted(waits.items()):
            ph += [phase] * R
            rk.append(np.full(R, r, np.int32))
            src.append(np.arange(R, dtype=np.int32))
            cyc.append(v)
        cycles = np.concatenate(cyc)
        tables["deepep_waits"] = pa.table({
            "phase": pa.array(ph, pa.string()), "rank": np.concatenate(rk), "src_rank": np.concatenate(src),
            "cycles": cycles,
            "wait_ns": pa.array(cycles / ghz if ghz else None, pa.float64()) if ghz else pa.nulls(cycles.size,
                                                                                                   pa.float64()),
            "stat": pa.array([stat] * cycles.size, pa.string())})
        approx.append("DeepEP wait-receive costs are GPU clock cycles per (waiting rank, source rank), "
                      + ("summed over waiting warps and calls (atomicAdd, DeepEP main up to dd758caf)" if stat == "sum"
                         else "the maximum over waiting warps and calls (atomicMax, DeepEP a0f153f)")
                      + (f"; wait_ns = cycles / {ghz} GHz" if ghz else "; no --set clock_ghz: wait_ns empty"))
        partial = sorted({p for p, _ in waits if sum(1 for q, _ in waits if q == p) < R})
        if partial:
            approx.append(f"{', '.join(partial)} wait costs cover {sum(1 for q, _ in waits if q == partial[0])} of {R} "
                          "ranks")
    if ignored:
        approx.append(f"{len(ignored)} arrays that are not DeepEP counters were not read ({', '.join(ignored[:5])})")
    run = {"source": source_label(paths),
           "source_sha256": sha256_files(paths), "collector": "deepep", "time_base": "none",
           "num_layers": options.get("num_layers") or L, "num_experts": R * E_local if E_local else
           options.get("num_experts"),
           "top_k": options.get("top_k"), "num_ranks": R, "ranks_per_node": options.get("ranks_per_node"),
           "num_slots": R * E_local if E_local else options.get("num_slots"), "num_groups": options.get("num_groups"),
           "approximations": json.dumps(approx),
           "meta_json": json.dumps({"format": "deepep_counters", "source": SOURCE, "deepep_stat": stat,
                                    "clock_ghz": ghz, "local_experts": E_local,
                                    "arrays": sorted(recv_names | {n for n in WAIT if WAIT[n] in {p for p, _ in waits}})})}
    hint = paths[0].parent.name if len(paths) > 1 else paths[0].name.split(".")[0]
    return [RunData(run=run, tables=tables, run_id_hint=hint, files=[str(p) for p in paths])]


register(Collector("deepep", "DeepEP diagnosis counters saved as .npy/.npz/.safetensors (local-expert receive counts, "
                             "dispatch/combine wait-receive cost matrices)", _sniff, _collect, priority=14,
                   options=("clock_ghz", "deepep_stat")))
