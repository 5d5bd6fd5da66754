"""TensorRT-LLM (PyTorch backend) expert statistics, with its EPLB config as the placement.

Statistics (``tensorrt_llm/_torch/expert_statistic.py``; on when the environment has
``EXPERT_STATISTIC_ITER_RANGE=start-stop``, written at iteration ``stop`` to
``EXPERT_STATISTIC_PATH``): a folder with

- ``meta_info.json`` (rank 0): ``{"num_experts": E, "num_experts_per_token": k}``;
- ``rank{r}.safetensors``, one per EP rank: one integer tensor ``[E]`` per key
  ``"{iter}_{layer}"`` = ``torch.bincount`` of the expert choices of the tokens rank r
  routed in that iteration and layer (logical experts; model layer ids).

The folder is one run: ``expert_load`` per (step = iter, layer, expert, src_rank = r), the
number of ranks = the number of rank files (they must be ``rank0`` .. ``rank{R-1}``), and
the iterations must be contiguous with every layer in every iteration (the missing ones
are named otherwise), as TensorRT-LLM's own loader requires. Each rank's count of one
(iter, layer) is its tokens × k, so it must divide by k; ``steps`` gets one row per (iter,
rank) with ``num_tokens`` = count / k (inferred, and said), a rank with none being a dummy
step. ``rank{r}_raw.safetensors`` files (raw token choices) are not read.

The EPLB config YAML (``moe_config.load_balancer``: ``num_slots``,
``layer_updates_per_iter``, ``initial_global_assignments``; see :mod:`moetrace.placement.plan_files`)
given alongside the folder becomes the run's recorded placement: slots in consecutive
blocks per EP rank. With ``layer_updates_per_iter`` > 0 TensorRT-LLM moves experts online,
so the initial assignment is only where the run started (and the run says so).

Files are read with ``safetensors.numpy`` (no torch, no pickle) and ``yaml.safe_load``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..domain.hashing import sha256_files
from ..domain.ranks import UNKNOWN_RPN_NOTE, node_of, ranks_per_node_or_all
from ..errors import InputError
from ..placement.plan_files import looks_like_trtllm_yaml, read_trtllm_yaml
from ..safety import INT64, SHAPE_MAX, checked_int, excerpt, json_loads, limit, limit_error
from . import Collector, RunData, register
from .sglang import _ranges

_RANK = re.compile(r"^rank(\d+)\.safetensors$")
_KEY = re.compile(r"^(\d+)_(\d+)$")
META = "meta_info.json"
MAX_HEADER = 100 << 20   # safetensors header bytes we agree to parse


def _sniff(path: Path, head: bytes) -> bool:
    name = path.name
    if _RANK.match(name):
        return len(head) > 8 and head[8:9] == b"{"
    if name == META:
        return b'"num_experts_per_token"' in head
    if name.lower().endswith((".yaml", ".yml")):
        return looks_like_trtllm_yaml(head)
    return False


def _meta(path: Path) -> tuple[int, int]:
    try:
        doc = json_loads(path, path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(path, "not UTF-8 text") from None
    vals = []
    for key in ("num_experts", "num_experts_per_token"):
        v = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(path, f"{key} must be a positive integer, got {v!r}")
        vals.append(v)
    E, k = vals
    if k > E:
        raise InputError(path, f"num_experts_per_token {k} > num_experts {E}")
    return E, k


def _rank_counts(path: Path, E: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys ``[n, 2]`` (iter, layer) and counts ``int64 [n, E]`` of one rank file, every
    tensor's shape and dtype checked from the header before it is read."""
    from safetensors import SafetensorError, safe_open

    with open(path, "rb") as f:
        raw = f.read(8)
    if len(raw) < 8 or int.from_bytes(raw, "little") > MAX_HEADER:
        raise InputError(path, "not a safetensors file (bad or oversized header length)", "byte 0")
    keys, rows = [], []
    try:
        with safe_open(str(path), framework="np") as f:
            names = list(f.keys())
            if len(names) * E > limit("max_array_elements"):   # bounded before any tensor is read
                raise limit_error(path, "max_array_elements", f"{len(names)} tensors of {E} counts")
            for key in names:
                m = _KEY.match(key)
                if not m:
                    raise InputError(path, f"tensor key {excerpt(key, 60)!r} is not '{{iter}}_{{layer}}'")
                it = checked_int(m.group(1), 0, INT64[1], path, f"of key {excerpt(key, 40)!r}", "iteration")
                lay = checked_int(m.group(2), 0, SHAPE_MAX - 1, path, f"of key {excerpt(key, 40)!r}", "layer")
                shape = f.get_slice(key).get_shape()
                if list(shape) != [E]:
                    raise InputError(path, f"tensor {key!r} has shape {list(shape)}, expected [{E}] "
                                           f"(num_experts in {META})")
                t = f.get_tensor(key)
                if t.dtype.kind not in "iu":
                    raise InputError(path, f"tensor {key!r} has dtype {t.dtype}, expected integer counts")
                keys.append((it, lay))
                rows.append(t)
    except InputError:
        raise
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(path, f"cannot read safetensors: {msg}") from None
    if not rows:
        raise InputError(path, "holds no tensors")
    mat = np.stack(rows).astype(np.int64)
    if mat.min() < 0:
        i, e = np.argwhere(mat < 0)[0]
        raise InputError(path, f"tensor {'%d_%d' % keys[i]!r} holds a negative count {int(mat[i, e])}", f"expert {int(e)}")
    return np.asarray(keys, np.int64).reshape(-1, 2), mat


def _placement(cfg, path: Path, R: int, rpn: int, layers: list[int], E: int) -> pa.Table:
    S = cfg.num_slots
    if S % R:
        raise InputError(path, f"num_slots {S} does not split into consecutive blocks over the {R} EP ranks "
                               "(rank files) of the statistics")
    have = set(cfg.layers.tolist())
    missing = [l for l in layers if l not in have]
    if missing:
        raise InputError(path, f"initial_global_assignments has no row for layers {_ranges(missing)} of the "
                               "statistics")
    for l, row in zip(cfg.layers, cfg.phy2log):
        lost = sorted(set(range(E)) - set(row.tolist()))
        if lost:
            raise InputError(path, f"initial_global_assignments[{int(l)}] places no slot for experts "
                                   f"{_ranges(lost[:20])}")
    keep = np.isin(cfg.layers, layers)
    L = int(keep.sum())
    slot = np.tile(np.arange(S), L)
    rank = slot // (S // R)
    return pa.table({"plan_id": pa.array(["recorded"] * (L * S)),
                     "layer": np.repeat(cfg.layers[keep], S).astype(np.int32), "slot": slot.astype(np.int32),
                     "rank": rank.astype(np.int32), "node": node_of(rank, rpn).astype(np.int32),
                     "expert": cfg.phy2log[keep].ravel().astype(np.int32)})


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    paths = sorted(set(paths))   # a folder and a file inside it, both named
    metas = [p for p in paths if p.name == META]
    ranks = [p for p in paths if _RANK.match(p.name)]
    yamls = [p for p in paths if p.name.lower().endswith((".yaml", ".yml"))]
    if not ranks:
        raise InputError(yamls[0] if yamls else paths[0],
                         "no rank{r}.safetensors statistics to ingest (a TensorRT-LLM EPLB config alone holds no "
                         "load: read it with `moetrace plan --import`)")
    folders = sorted({p.parent for p in ranks})
    if len(folders) > 1:
        raise InputError(folders[1], f"rank files from more than one statistics folder ({folders[0]}, {folders[1]}): "
                                     "ingest each folder separately")
    folder = folders[0]
    meta = next((m for m in metas if m.parent == folder), None)
    if meta is None:
        meta = folder / META
        if not meta.is_file():
            raise InputError(folder, f"no {META} beside the rank files (TensorRT-LLM rank 0 writes it)")
    if len(yamls) > 1:
        raise InputError(yamls[1], f"more than one EPLB config given ({yamls[0].name}, {yamls[1].name})")
    E, k = _meta(meta)
    by_rank = {int(_RANK.match(p.name).group(1)): p for p in ranks}
    R = len(by_rank)
    gaps = sorted(set(range(R)) - set(by_rank))
    if gaps or len(ranks) != R:
        raise InputError(folder, f"rank files must be rank0..rank{R - 1}.safetensors; missing ranks "
                                 f"{_ranges(gaps) or '(duplicate names)'} (found {', '.join(sorted(p.name for p in ranks))})")
    if options.get("num_ranks") and int(options["num_ranks"]) != R:
        raise InputError(folder, f"--ranks {options['num_ranks']} but the folder holds {R} rank files")
    counts = {r: _rank_counts(by_rank[r], E) for r in range(R)}
    keys = set().union(*(map(tuple, kk.tolist()) for kk, _ in counts.values()))
    iters = sorted({i for i, _ in keys})
    layers = sorted({l for _, l in keys})
    if iters[-1] - iters[0] + 1 != len(iters):   # name the gaps without enumerating the span
        gaps = [(a + 1, b - 1) for a, b in zip(iters, iters[1:]) if b > a + 1]
        desc = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps[:5]) + (" ..." if len(gaps) > 5 else "")
        raise InputError(folder, f"iterations are not contiguous: {desc} missing between {iters[0]} and {iters[-1]}")
    n_holes = len(iters) * len(layers) - len(keys)   # counted, not listed: 20,000 keys can span 10^8 pairs
    if n_holes:
        per_iter: dict[int, set] = {}
        for i, l in keys:
            per_iter.setdefault(i, set()).add(l)
        first = next(i for i in iters if len(per_iter[i]) < len(layers))
        lay = next(l for l in layers if l not in per_iter[first])
        raise InputError(folder, f"{n_holes} (iteration, layer) pairs have no counts on any rank, first "
                                 f"iteration {first} layer {lay}")
    approx = []
    lidx = {l: j for j, l in enumerate(layers)}
    # tokens[r, iteration, layer] = counted choices / k; -1 where the rank file has no key
    tokens = np.full((R, len(iters), len(layers)), -1, np.int64)
    parts = []
    for r in range(R):
        kk, mat = counts[r]
        total = mat.sum(axis=1)
        bad = np.flatnonzero(total % k)
        if bad.size:
            i, l = kk[bad[0]]
            raise InputError(by_rank[r], f"counts of iteration {i} layer {l} sum to {total[bad[0]]}, not a multiple "
                                         f"of num_experts_per_token {k}", f"key '{i}_{l}'")
        tokens[r, kk[:, 0] - iters[0], [lidx[int(l)] for l in kk[:, 1]]] = total // k
        nz_row, nz_e = np.nonzero(mat)
        parts.append((kk[nz_row, 0], kk[nz_row, 1].astype(np.int32), nz_e.astype(np.int32),
                      np.full(nz_row.size, r, np.int32), mat[nz_row, nz_e]))
        del mat, nz_row, nz_e
        counts[r] = None   # free as we go
    absent = int((tokens < 0).sum())
    tokens[tokens < 0] = 0
    per_step = tokens.max(axis=2)
    uneven_mask = tokens.min(axis=2) != per_step
    uneven = [(int(r), iters[int(i)]) for r, i in np.argwhere(uneven_mask)]
    if not uneven:
        approx.append(f"steps.num_tokens inferred as each rank's counted expert choices / top_k ({k}); steps have "
                      "no phase or time in TensorRT-LLM statistics (a rank with no tokens is an idle, dummy step)")
    if absent:
        approx.append(f"{absent} (rank, iteration, layer) keys absent from the rank files, taken as no tokens")
    if uneven:
        r, i = uneven[0]
        approx.append(f"{len(uneven)} (rank, iteration) pairs count different tokens in different layers (first: rank "
                      f"{r}, iteration {i}; a layer visited twice?): no steps table (tokens per step unknown)")
    step, layer, expert, src, tok = (np.concatenate([p[j] for p in parts]) for j in range(5))
    parts = None
    load = pa.table({"step": step, "layer": layer, "expert": expert, "slot": pa.nulls(step.size, pa.int32()),
                     "src_rank": src, "tokens": tok})
    del step, layer, expert, src, tok
    nt = per_step.T.reshape(-1)                 # (iteration, rank) order
    steps = pa.table({"step": np.repeat(np.asarray(iters, np.int64), R), "rank": np.tile(np.arange(R), len(iters)).astype(np.int32),
                      "phase": pa.array(np.where(nt == 0, "idle", "unknown").tolist(), pa.string()),
                      "num_tokens": nt, "is_dummy": nt == 0, "start_ns": pa.nulls(nt.size, pa.int64()),
                      "end_ns": pa.nulls(nt.size, pa.int64()), "inferred": np.ones(nt.size, bool)})
    tables = {"expert_load": load} if uneven else {"expert_load": load, "steps": steps}
    rpn = ranks_per_node_or_all(options.get("ranks_per_node"), R)
    num_slots = E
    meta_json = {"format": "trtllm_expert_statistic", "ep_size": R, "iter_start": iters[0], "iter_stop": iters[-1] + 1,
                 "layers": layers, "num_experts_per_token": k}
    files = [meta] + [by_rank[r] for r in range(R)]
    if yamls:
        cfg = read_trtllm_yaml(yamls[0], E)
        meta_json.update(eplb_config=yamls[0].name, layer_updates_per_iter=cfg.layer_updates_per_iter,
                         num_slots=cfg.num_slots)
        if cfg.layers.size:
            tables["placement"] = _placement(cfg, yamls[0], R, rpn, layers, E)
            num_slots = cfg.num_slots
            if cfg.layer_updates_per_iter:
                approx.append(f"EPLB config has layer_updates_per_iter={cfg.layer_updates_per_iter}: TensorRT-LLM "
                              "moved experts online, the recorded placement is only the initial assignment")
        else:
            approx.append("EPLB config has no initial_global_assignments (online balancing): no recorded placement; "
                          "contiguous placement assumed")
        files.append(yamls[0])
    else:
        approx.append("no EPLB config given: TensorRT-LLM's default placement (expert e on rank e // (E / ep)) is "
                      "the contiguous one assumed by the metrics")
    if not options.get("ranks_per_node"):
        approx.append(UNKNOWN_RPN_NOTE)
    if not options.get("num_layers"):
        approx.append(f"num_layers = highest layer id + 1 ({layers[-1] + 1}); layers {_ranges(layers)} hold counts")
    run = {"source": folder.name + "/" + (f" + {yamls[0].name}" if yamls else ""),
           "source_sha256": sha256_files(files), "collector": "trtllm", "time_base": "none",
           "num_layers": options.get("num_layers") or layers[-1] + 1, "num_experts": E, "top_k": k,
           "num_ranks": R, "ranks_per_node": rpn, "num_slots": num_slots, "num_groups": options.get("num_groups"),
           "approximations": json.dumps(approx), "meta_json": json.dumps(meta_json)}
    return [RunData(run=run, tables=tables, run_id_hint=folder.name, files=[str(p) for p in files])]


register(Collector("trtllm", "TensorRT-LLM expert statistics folder (meta_info.json + rank{r}.safetensors), "
                             "optionally with its EPLB config YAML as the recorded placement",
                   _sniff, _collect, priority=15))
