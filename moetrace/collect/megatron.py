"""Megatron-LM routing traces and expert-load dumps.

Read from NVIDIA/Megatron-LM at d98e8a64 (2026-08-22):

- **Router trace** (``megatron/core/transformer/moe/router_trace.py``, ``RouterTracer``,
  on with ``--moe-routing-trace-path``): one JSONL file per rank,
  ``router_trace_rank{rank}.jsonl``, one record per (step, block, layer) router call:
  ``{"step", "stage": "pre_dispatch", "block": "decoder"|"mtp", "layer", "rank",
  "num_tokens", "topk", "top_indices": [[e, ...] x num_tokens]}``, MTP records with an
  extra ``mtp_idx``, optional sidecar offsets (``hs_offset``, ``logit_offset`` ...; the
  ``.bin`` sidecars are not read). ``layer`` is the index in the module name
  (``decoder.layers.<n>``). Read into ``routing`` (token = position within the records
  of one (step, layer, rank), in file order; src_rank = rank) and its exact
  ``expert_load`` aggregate. MTP records are skipped (counted): their layer numbers
  collide with decoder layers.
- **Tokens per expert** (``megatron/training/activation_logging.py``
  ``ActivationLogger.save_tpe``, on with ``save_tokens_per_expert_interval``):
  ``tokens_per_expert/rank{rank}.jsonl``, records ``{"iter", "block", "layer", "tpe":
  [[tokens per local expert] per micro-batch]}`` (the grouped GEMM's splits). Read into
  ``expert_load``: step = iter, tokens summed over micro-batches, expert = rank *
  E_local + local index (Megatron shards experts in contiguous blocks per EP rank);
  the file's rank is taken as the EP rank (``--set ep_size=N``: EP rank = rank % N, and
  files of one EP rank are summed: data-parallel replicas see different tokens).
- **Expert-load array** ``loads[layers, forwards, experts]`` (``.npy`` named ``loads``,
  or the key ``loads`` in an ``.npz`` / ``.safetensors``): Megatron at d98e8a64 writes
  no such file (the layout users described for it, accepted as given): step =
  forward index, tokens per (layer, expert).

Pipeline parallelism: both writers take ``layer`` from the module name
``decoder.layers.<n>`` (``router_trace.py`` at 059f0f5c, ``activation_logging.py`` at
191d70cf), and a pipeline stage builds only its own layers, numbered from 0
(``TransformerBlock``; the global number is ``get_transformer_layer_offset`` + n + 1), so
files of different stages share layer numbers. ``--set pp_size=P`` maps them: a file's
rank (the record's ``rank``, the tokens-per-expert file's name; both
``torch.distributed`` ranks) is in stage ``rank // (world / P)`` (the default rank order
``tp-cp-ep-dp-pp`` of ``parallel_state.initialize_model_parallel`` at 00caa53a: the
pipeline rank varies slowest; another ``order`` is not read), world = ``--set
world_size=N`` or the highest rank + 1; stage s holds ``--set pp_layers=a,b,...`` layers
(uneven first / last stages, ``--pipeline-model-parallel-layout``) or ``--layers / P``
each, and its layer n is the model's layer offset(s) + n. With ``--layers L`` and no
``pp_size``, layers that stop short of L are refused (the files are one stage's, or
stages collide). Virtual pipeline stages (several model chunks per rank, each numbered
from 0) cannot be told apart in these files.

Every file given together is one run. A bad JSON line, a record whose lists disagree
with ``num_tokens`` / ``topk``, a negative or huge expert id or count is refused with
its line.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..domain.hashing import sha256_files
from ..errors import InputError
from . import Collector, RunData, _arrays, head, register, source_label
from .checks import MAX_COUNT

_TRACE_KEYS = ("top_indices", "num_tokens", "topk")
_TPE_KEYS = ("tpe", "layer")
SOURCE = "NVIDIA/Megatron-LM d98e8a64"
MAX_EXPERT = 1 << 20


def _first_record(h: bytes) -> dict | None:
    from ._jsonl_meta import is_meta

    for line in h.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            return None          # a cut line at the end of the head, or not JSON
        if isinstance(obj, dict) and not is_meta(obj):
            return obj
    return None


def _kind(path: Path, h: bytes) -> str | None:
    name = path.name.lower()
    if name.endswith((".jsonl", ".ndjson")):
        obj = _first_record(h)
        if obj is None:
            return None
        if all(k in obj for k in _TRACE_KEYS):
            return "trace"
        if all(k in obj for k in _TPE_KEYS) and ("iter" in obj or "step" in obj):
            return "tpe"
        return None
    k = _arrays.kind(path, h)
    if k and any(n == "loads" or n.endswith("_loads") or n.startswith("loads_") for n in _arrays.names(path, h)):
        return "loads"
    return None


def _sniff(path: Path, h: bytes) -> bool:
    return _kind(path, h) is not None


def _records(path: Path, meta: list):
    """(line number, record) of a JSONL file, metadata records set aside (lines and keys
    bounded as they are read: ``_json_stream.jsonl_objects``)."""
    from ._json_stream import jsonl_objects
    from ._jsonl_meta import is_meta

    for i, obj in jsonl_objects(path):
        if is_meta(obj):
            meta.append((i, obj))
            continue
        yield i, obj


def _int(obj: dict, key: str, path: Path, i: int, upper: int = 1 << 62) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(path, f"{key!r} must be an integer, got {json.dumps(v)[:40]}", f"line {i}")
    if not 0 <= v < upper:
        raise InputError(path, f"{key!r} = {str(v)[:30]} is outside 0..{upper - 1}", f"line {i}")
    return v


def _int_array(v, path: Path, i: int, what: str, shape: tuple | None, upper: int) -> np.ndarray:
    """A JSON list of lists of integers as int64, checked: rectangular, integers (no
    booleans, no fractions), 0..upper-1."""
    try:
        a = np.array(v)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is None or a.dtype == object or (shape is not None and a.shape != shape) or (shape is None and a.ndim != 2):
        got = list(a.shape) if a is not None and a.dtype != object else "ragged or out of range"
        raise InputError(path, f"{what} has shape {got}, expected "
                               f"{list(shape) if shape else '[micro-batches, local experts]'}", f"line {i}")
    if a.size and a.dtype.kind not in "iu":
        raise InputError(path, f"{what} must hold integers, got {'booleans' if a.dtype.kind == 'b' else a.dtype}",
                         f"line {i}")
    if a.size and (a.min() < 0 or a.max() >= upper):
        bad = a.min() if a.min() < 0 else a.max()
        raise InputError(path, f"{what} holds {bad}, outside 0..{upper - 1}", f"line {i}")
    return a.astype(np.int64)


class _Stages:
    """Pipeline stages of ``--set pp_size=P``: a rank's stage and its first global layer."""

    def __init__(self, options: dict, ranks: list[int], where: Path):
        self.pp = int(options["pp_size"])
        self.world_given = bool(options.get("world_size"))
        world = int(options.get("world_size") or max(ranks) + 1)
        if world % self.pp:
            raise InputError(where, f"pp_size={self.pp} does not divide the world of {world} ranks "
                                    f"({'--set world_size' if options.get('world_size') else 'highest rank + 1'}): "
                                    "pass --set world_size=N (all ranks of the job)")
        self.per_stage = world // self.pp
        if options.get("pp_layers"):
            try:
                self.counts = [int(x) for x in str(options["pp_layers"]).split(",")]
            except ValueError:
                raise InputError(None, f"--set pp_layers={options['pp_layers']!r}: expected layers per stage, "
                                       "e.g. 6,8,8,6") from None
            if len(self.counts) != self.pp or min(self.counts) < 0:
                raise InputError(None, f"--set pp_layers lists {len(self.counts)} stages, pp_size is {self.pp}")
        elif options.get("num_layers") and int(options["num_layers"]) % self.pp == 0:
            self.counts = [int(options["num_layers"]) // self.pp] * self.pp
        else:
            raise InputError(where, f"pp_size={self.pp} needs the layers of each stage: pass --layers L (a multiple "
                                    "of pp_size: even stages) or --set pp_layers=a,b,... (one count per stage)")
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    def global_layer(self, rank: int, layer: int, path: Path, where: str) -> int:
        s = rank // self.per_stage
        if s >= self.pp:
            raise InputError(path, f"rank {rank} is beyond {self.pp} stages x {self.per_stage} ranks: pass --set "
                                   "world_size=N", where)
        if layer >= self.counts[s]:
            raise InputError(path, f"layer {layer} of rank {rank} (pipeline stage {s}) is beyond that stage's "
                                   f"{self.counts[s]} layers: pass --set pp_layers=a,b,... (layers of each stage)",
                             where)
        return int(self.offsets[s]) + layer

    def note(self) -> str:
        return (f"layers mapped from pipeline-stage numbering: pp_size={self.pp}, {self.per_stage} ranks per stage "
                f"(stage = rank // {self.per_stage}, Megatron's default rank order tp-cp-ep-dp-pp), stage offsets "
                f"{self.offsets.tolist()}" + ("" if self.world_given else
                                              "; world = highest rank + 1 (--set world_size=N when files are missing)"))


def _stages(options: dict, ranks: list[int], where: Path) -> _Stages | None:
    return _Stages(options, ranks, where) if options.get("pp_size") and int(options["pp_size"]) > 1 else None


def _check_short(layers: np.ndarray, options: dict, paths: list[Path]) -> None:
    """Without pp_size, layers that stop short of ``--layers`` are pipeline-stage numbers."""
    L = options.get("num_layers")
    if L and not options.get("pp_size") and layers.size and int(layers.max()) + 1 < int(L):
        names = ", ".join(p.name for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise InputError(paths[0].parent if len(paths) > 1 else paths[0],
                         f"layers 0..{int(layers.max())} in {names} but the model has {L} layers: Megatron numbers "
                         "layers within a pipeline stage (decoder.layers.<n>); pass --set pp_size=P (and --set "
                         "pp_layers=a,b,... for uneven stages)")


def _trace(paths: list[Path], options: dict, approx: list, metas: dict) -> dict:
    cols = {c: [] for c in ("step", "layer", "token", "src_rank", "choice", "expert")}
    offset: dict[tuple[int, int, int], int] = {}
    mtp = 0
    k_seen = set()
    upper = int(options.get("num_experts") or MAX_EXPERT)
    for path in paths:
        meta: list = []
        for i, rec in _records(path, meta):
            if not all(k in rec for k in _TRACE_KEYS):
                raise InputError(path, f"not a router-trace record (needs {', '.join(_TRACE_KEYS)}, step, layer, rank)",
                                 f"line {i}")
            if rec.get("block", "decoder") != "decoder" or "mtp_idx" in rec:
                mtp += 1
                continue
            step, layer, rank = (_int(rec, k, path, i) for k in ("step", "layer", "rank"))
            n, k = _int(rec, "num_tokens", path, i), _int(rec, "topk", path, i, 1 << 10)
            if n == 0:
                continue
            idx = _int_array(rec["top_indices"], path, i, "top_indices", (n, k), upper)
            if k > 1:
                s = np.sort(idx, axis=1)
                dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
                if dup.any():
                    t = int(np.argmax(dup))
                    raise InputError(path, f"token {t} of top_indices names an expert twice", f"line {i}")
            key = (step, layer, rank)
            base = offset.get(key, 0)
            offset[key] = base + n
            cols["step"].append(np.full(n * k, step, np.int64))
            cols["layer"].append(np.full(n * k, layer, np.int64))
            cols["token"].append(np.repeat(np.arange(base, base + n, dtype=np.int64), k))
            cols["src_rank"].append(np.full(n * k, rank, np.int64))
            cols["choice"].append(np.tile(np.arange(k, dtype=np.int64), n))
            cols["expert"].append(idx.ravel())
            k_seen.add(k)
        metas[path] = meta
    if not cols["expert"]:
        raise InputError(paths[0], "no decoder router-trace record with tokens" + (f" ({mtp} MTP records)" if mtp else ""))
    out = {c: np.concatenate(v) for c, v in cols.items()}
    out["layer"] = _map_layers(out["layer"], out["src_rank"], options, paths, approx)
    if mtp:
        approx.append(f"{mtp} MTP router-trace records skipped (their layer numbers collide with decoder layers)")
    approx.append("Megatron router trace: token = position within the records of one (step, layer, rank) in file "
                  "order (a step's micro-batches continue each other); step = the tracer's step")
    if len(k_seen) > 1:
        approx.append(f"records differ in topk: {sorted(k_seen)}")
    out["k"] = max(k_seen)
    return out


def _map_layers(layer: np.ndarray, rank: np.ndarray, options: dict, paths: list[Path], approx: list) -> np.ndarray:
    """Global layer numbers of (stage-local layer, rank) pairs under ``pp_size``."""
    st = _stages(options, np.unique(rank).tolist(), paths[0])
    if st is None:
        _check_short(layer, options, paths)
        approx.append("Megatron layer = the module's decoder.layers.<n>: the model's layer when there is one "
                      "pipeline stage (--set pp_size=P maps stage numbering)")
        return layer
    pairs, inv = np.unique(np.stack([rank, layer], axis=1), axis=0, return_inverse=True)
    path_of = {}
    for p in paths:   # the file a rank came from, for the message
        r = _arrays.rank_in(p.stem)
        if r is not None:
            path_of.setdefault(r, p)
    glob = np.array([st.global_layer(int(r), int(li), path_of.get(int(r), paths[0]), f"rank {int(r)}")
                     for r, li in pairs], np.int64)
    approx.append(st.note())
    return glob[inv.ravel()]


def _tpe(paths: list[Path], options: dict, approx: list, metas: dict) -> dict:
    ep = options.get("ep_size")
    ep = int(ep) if ep not in (None, "") else None
    acc: dict[tuple[int, int, int], np.ndarray] = {}
    el = set()
    mtp = 0
    file_ranks = [_arrays.rank_in(p.stem) for p in paths]
    stages = _stages(options, [r for r in file_ranks if r is not None] or [0], paths[0])
    for path in paths:
        r = _arrays.rank_in(path.stem)
        if r is None:
            raise InputError(path, "a tokens-per-expert file is named rank{r}.jsonl (the rank is needed for the expert "
                                   "ids)")
        er = r % ep if ep else r
        meta: list = []
        for i, rec in _records(path, meta):
            if rec.get("block", "decoder") != "decoder" or "mtp_idx" in rec:
                mtp += 1
                continue
            step = _int(rec, "iter" if "iter" in rec else "step", path, i)
            layer = _int(rec, "layer", path, i)
            tpe = rec.get("tpe")
            if not isinstance(tpe, list) or not tpe:
                raise InputError(path, "'tpe' must be a non-empty list of per-micro-batch lists", f"line {i}")
            a = _int_array(tpe, path, i, "tpe", None, MAX_COUNT + 1)
            if a.ndim != 2:
                raise InputError(path, f"tpe has shape {list(a.shape)}, expected [micro-batches, local experts]",
                                 f"line {i}")
            el.add(a.shape[1])
            if stages is not None:
                layer = stages.global_layer(r, layer, path, f"line {i}")
            key = (step, layer, er)
            acc[key] = acc.get(key, 0) + a.sum(axis=0)
        metas[path] = meta
    if not acc:
        raise InputError(paths[0], "no decoder tokens-per-expert record")
    if len(el) > 1:
        raise InputError(paths[0], f"tokens-per-expert lists of different lengths {sorted(el)} (local experts differ)")
    E_local = el.pop()
    step, layer, expert, tokens = [], [], [], []
    for (s, li, r), v in sorted(acc.items()):
        step.append(np.full(E_local, s, np.int64))
        layer.append(np.full(E_local, li, np.int64))
        expert.append(r * E_local + np.arange(E_local, dtype=np.int64))
        tokens.append(np.asarray(v, np.int64))
    if stages is None:
        _check_short(np.array([li for _, li, _ in acc], np.int64), options, paths)
    else:
        approx.append(stages.note())
    if mtp:
        approx.append(f"{mtp} MTP tokens-per-expert records skipped")
    approx.append(f"Megatron tokens per expert: expert = EP rank * {E_local} + local index (contiguous expert blocks); "
                  + (f"EP rank = file rank % {ep}, files of one EP rank summed" if ep else
                     "the file's rank taken as the EP rank (--set ep_size=N otherwise)")
                  + "; tokens summed over a step's micro-batches")
    return {"step": np.concatenate(step), "layer": np.concatenate(layer), "expert": np.concatenate(expert),
            "tokens": np.concatenate(tokens), "ranks": max(r for _, _, r in acc) + 1, "E_local": E_local}


def _loads(paths: list[Path], approx: list) -> dict:
    if len(paths) > 1:
        raise InputError(paths[1], "one loads[layers, forwards, experts] array per run: ingest them separately")
    path = paths[0]
    arrays = _arrays.read(path)
    key = next(n for n in arrays if n == "loads" or n.endswith("_loads") or n.startswith("loads_"))
    a = _arrays.counts(np.asarray(arrays[key]), path, f"{key!r}")
    if a.ndim != 3:
        raise InputError(path, f"{key!r} has shape {list(a.shape)}, expected [layers, forwards, experts]")
    L, F, E = a.shape
    li, fi, ei = np.meshgrid(np.arange(L), np.arange(F), np.arange(E), indexing="ij")
    approx.append("loads[layers, forwards, experts]: step = forward index (a layout Megatron-LM itself does not write "
                  "at d98e8a64; accepted as given)")
    others = sorted(set(arrays) - {key})
    if others:
        approx.append(f"arrays not read: {', '.join(others[:5])}")
    return {"step": fi.ravel().astype(np.int64), "layer": li.ravel().astype(np.int64),
            "expert": ei.ravel().astype(np.int64), "tokens": a.ravel(), "E": E}


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    from ._jsonl_meta import keep_meta

    paths = sorted(paths)
    kinds = {p: _kind(p, head(p, 65536)) for p in paths}
    ks = set(kinds.values())
    if None in ks:
        bad = next(p for p, k in kinds.items() if k is None)
        raise InputError(bad, "not a Megatron router trace (top_indices), tokens-per-expert (tpe) JSONL or loads array")
    if len(ks) > 1:
        raise InputError(paths[0], f"Megatron files of different kinds ({', '.join(sorted(ks))}): ingest them "
                                   "separately")
    kind = ks.pop()
    approx: list[str] = []
    metas: dict = {}
    tables = {}
    R = options.get("num_ranks")
    k = options.get("top_k")
    if kind == "trace":
        d = _trace(paths, options, approx, metas)
        E = int(options.get("num_experts") or d["expert"].max() + 1)
        n = d["expert"].size
        tables["routing"] = pa.table({
            "step": d["step"], "layer": d["layer"].astype(np.int32), "token": d["token"],
            "src_rank": d["src_rank"].astype(np.int32), "choice": d["choice"].astype(np.int8),
            "expert": d["expert"].astype(np.int32), "slot": pa.nulls(n, pa.int32()), "gate": pa.nulls(n, pa.float32())})
        key = (d["step"], d["layer"], d["expert"])
        step, layer, expert, tokens = _aggregate(*key)
        k = k or d["k"]
        if R is None:
            R = None   # trace ranks are data/expert ranks of the tracer, not necessarily the EP size
    elif kind == "tpe":
        d = _tpe(paths, options, approx, metas)
        step, layer, expert, tokens = d["step"], d["layer"], d["expert"], d["tokens"]
        E = d["ranks"] * d["E_local"]
        if options.get("num_experts") and int(options["num_experts"]) != E:
            raise InputError(paths[0], f"--experts {options['num_experts']} but the files cover {d['ranks']} EP ranks x "
                                       f"{d['E_local']} local experts = {E}")
        R = R or d["ranks"]
    else:
        d = _loads(paths, approx)
        step, layer, expert, tokens = d["step"], d["layer"], d["expert"], d["tokens"]
        E = int(options.get("num_experts") or d["E"])
        if E != d["E"]:
            raise InputError(paths[0], f"--experts {E} but the loads array has {d['E']} experts")
    tables["expert_load"] = pa.table({
        "step": step, "layer": layer.astype(np.int32), "expert": expert.astype(np.int32),
        "slot": pa.nulls(step.size, pa.int32()), "src_rank": pa.nulls(step.size, pa.int32()),
        "tokens": tokens.astype(np.int64)})
    if not options.get("num_layers"):
        approx.append("num_layers inferred from the highest layer id")
    if kind == "trace" and not options.get("num_experts"):
        approx.append("num_experts inferred from the highest expert id")
    L = int(options.get("num_layers") or layer.max() + 1)
    run = {"source": source_label(paths),
           "source_sha256": sha256_files(paths), "collector": "megatron", "time_base": "none",
           "num_layers": L, "num_experts": E, "top_k": k, "num_ranks": R,
           "ranks_per_node": options.get("ranks_per_node"), "num_slots": options.get("num_slots") or E,
           "num_groups": options.get("num_groups"), "approximations": json.dumps(approx),
           "meta_json": json.dumps({"format": f"megatron_{kind}", "source": SOURCE, "files": len(paths)})}
    hint = paths[0].parent.name if len(paths) > 1 else re.sub(r"\W", "_", paths[0].name.split(".")[0])
    rd = RunData(run=run, tables=tables, run_id_hint=hint, files=[str(p) for p in paths])
    for p, m in metas.items():
        keep_meta(rd, p, m)
    return [rd]


def _aggregate(step: np.ndarray, layer: np.ndarray, expert: np.ndarray):
    """Exact counts per (step, layer, expert) of routing rows."""
    keys = np.stack([step, layer, expert], axis=1)
    u, c = np.unique(keys, axis=0, return_counts=True)
    return u[:, 0], u[:, 1], u[:, 2], c.astype(np.int64)


register(Collector("megatron", "Megatron-LM router traces (router_trace_rank{r}.jsonl), tokens-per-expert JSONL and "
                               "loads[layers, forwards, experts] arrays", _sniff, _collect, priority=17,
                   options=("ep_size", "pp_size", "pp_layers", "world_size")))
