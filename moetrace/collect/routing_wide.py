"""Per-token routing in wide form: a row per token with a list column of chosen experts.

The shape serving APIs return (vLLM's and SGLang's returned routed experts, token ×
layer × top_k) and public routing datasets publish (one file per layer, a row per token
with ``indices list<int16>[k]`` and ``scores list<float16>[k]``). Parquet, JSONL or Arrow
IPC (``.arrow`` / ``.feather`` / ``.ipc``). Columns:

- experts: a list column named one of :data:`EXPERT_COLS`. ``list<int>[k]`` is one layer's
  choices; ``list<list<int>>`` ``[layers][k]`` is every layer of the model at once (the
  serving-API shape; the outer index is the layer, and a layer whose rows are all zeros
  is taken as dense / not captured and dropped, said in the run). ``-1`` entries are
  padding and dropped (counted); other negatives, nulls and a token naming one expert
  twice are refused with the row.
- gates (optional): a list column named one of :data:`GATE_COLS`, same lengths.
- layer: a ``layer`` (or ``layer_id``) column, else the file name (``layer_7.parquet``,
  ``layer-07``, ``layers.7``, ``l7_...``), else refused; not both for nested lists.
- step: a ``step`` column; else, in a per-token log with a ``token_idx`` column (vLLM
  route-logging patches: req_id, token_idx, layer), a step starts wherever token_idx does
  not grow within a layer's rows (said); else ``--set tokens_per_step=N`` cuts the rows
  into steps of N tokens in file order; else the whole file is one pseudo-step (said).
- token: a ``token`` column, else ``token_idx``, else the row order within (step, layer)
  (said);
  src_rank: a ``src_rank`` / ``rank`` / ``dp_rank`` column when present.

Serving-API responses saved as JSON lines are read directly: SGLang ``/generate``
(``meta_info.routed_experts``, base64 int32 ``[prompt + completion - 1, num_hidden_layers,
top_k]``; give ``--top-k``) and vLLM completions (``choices[i].routed_experts``, base64
``.npy``). Each returned sequence is one step.

All files given together are one run (one file per layer, or shards of one layer whose
rows continue each other in name order). The ``routing`` table gets (token, choice,
expert, gate) and ``expert_load`` its exact aggregate per (step, layer, expert).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..domain.hashing import sha256_files
from ..errors import InputError
from . import Collector, RunData, register, source_label
from ._compressed import is_gzip, plain_head, plain_name, read_plain
from ._routing_responses import (
    _is_responses,
    _npy_header,
    _npy_requests,
    _responses,
)
from .sglang import _ranges

EXPERT_COLS = ("indices", "experts", "expert_ids", "topk_ids", "topk_indices", "routed_experts", "selected_experts")
GATE_COLS = ("scores", "gates", "gate", "weights", "topk_weights", "routing_weights", "probs")
RANK_COLS = ("src_rank", "rank", "dp_rank")
#: a request id column (counted and said)
REQUEST_COLS = ("req_id", "request_id", "rid")
#: a token's index within its forward pass, where there is no token column
TOKEN_COLS = ("token_idx", "token_index")
_LAYER_NAME = re.compile(r"(?:^|[^a-z])(?:layers?|l)[_\-.]?(\d+)(?:[^0-9]|$)", re.I)
_ARROW_EXT = (".arrow", ".feather", ".ipc")
_PQ_MAGIC = b"PAR1"
_IPC_MAGIC = b"ARROW1"


# ----------------------------------------------------------------------------- sniffing
def _schema(path: Path, head: bytes) -> pa.Schema | None:
    name = plain_name(path)
    try:
        if name.endswith(".parquet") and head[:4] == _PQ_MAGIC:
            import pyarrow.parquet as pq

            from ..safety import arrow_path

            return pq.read_schema(arrow_path(path))
        if name.endswith(_ARROW_EXT) and head[:6] == _IPC_MAGIC:
            import pyarrow.ipc as ipc

            with pa.memory_map(str(path)) as f:
                return ipc.open_file(f).schema
        if name.endswith((".jsonl", ".ndjson")):
            from ._jsonl_meta import is_meta

            head = plain_head(path, head)

            obj = None
            for line in head.split(b"\n")[:-1] or head.split(b"\n"):   # the first record that is not metadata
                if line.strip():
                    obj = json.loads(line)
                    if not is_meta(obj):
                        break
            if isinstance(obj, dict) and not is_meta(obj):
                return pa.schema([(k, pa.list_(pa.int64()) if isinstance(v, list) else pa.null())
                                  for k, v in obj.items()])
    except Exception:
        return None
    return None


def _expert_col(schema: pa.Schema) -> str | None:
    for name in EXPERT_COLS:
        if name in schema.names:
            t = schema.field(name).type
            if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
                return name
    return None


def _is_routed_npy(path: Path, head: bytes) -> bool:
    """A vLLM ``CompletionOutput.routed_experts`` array saved with ``np.save``: a ``.npy``
    whose name says ``routed`` and whose header declares an integer [tokens, layers, top_k]."""
    if not (path.name.lower().endswith(".npy") and head[:6] == b"\x93NUMPY" and "routed" in path.name.lower()):
        return False
    try:
        shape, dtype = _npy_header(head)
    except ValueError:
        return False
    return len(shape) == 3 and dtype.kind in "iu"


def _sniff(path: Path, head: bytes) -> bool:
    if plain_name(path).endswith((".jsonl", ".ndjson", ".json")) and _is_responses(path):
        return True
    if _is_routed_npy(path, head):
        return True
    s = _schema(path, head)
    return s is not None and _expert_col(s) is not None


# ----------------------------------------------------------------------------- reading
def _read(path: Path, meta: list | None = None) -> pa.Table:
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            from ..safety import arrow_path, check_parquet

            check_parquet(path, whole=True)   # read whole: the file's decoded size bounded
            return pq.read_table(arrow_path(path))
        if name.endswith(_ARROW_EXT):
            import pyarrow.ipc as ipc

            with pa.memory_map(str(path)) as f:
                return ipc.open_file(f).read_all()
        return _read_jsonl(path, meta)
    except InputError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # arrow parse errors (pyo3 / arrow panics derive from BaseException)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(path, f"cannot parse: {msg}") from None


def _read_jsonl(path: Path, meta: list | None = None) -> pa.Table:
    """JSON lines through Arrow's reader (nested lists kept as lists; a type that changes
    between lines, bad syntax or too deep nesting is one error naming the row).
    Metadata records (``{"type": "meta", ...}``) are taken out first and appended to
    ``meta`` as (line, record)."""
    import io

    import pyarrow.json as pj

    from ..safety import check_whole_input
    from ._jsonl_meta import is_meta

    if is_gzip(path):
        data = read_plain(path)          # inflated within the inflation limits
        check_whole_input(path, len(data))
        src: Path | io.BytesIO = io.BytesIO(data)
    else:
        check_whole_input(path)          # read whole
        src = path
        with open(path, "rb") as f:
            data = f.read()
    opts = pj.ReadOptions(block_size=max(1 << 20, min(len(data) + 1, 256 << 20)))
    if b"meta" in data or b"header" in data or b"config" in data:
        keep, found = [], []
        for i, line in enumerate(data.splitlines(keepends=True), 1):
            obj = None
            if line.lstrip().startswith(b"{") and (b'"type"' in line or b'"kind"' in line or b'"record_type"' in line):
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
            if obj is not None and is_meta(obj):
                found.append((i, obj))
            else:
                keep.append(line)
        if found:
            if meta is not None:
                meta.extend(found)
            src = io.BytesIO(b"".join(keep))
    del data
    try:
        t = pj.read_json(src, read_options=opts)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        m = re.search(r"\s*in row (\d+)$", text)
        where = f"row {int(m.group(1)) + 1}" if m else None
        raise InputError(path, text[:m.start()] if m else text, where) from None
    if t.num_rows == 0:
        raise InputError(path, "file holds no rows")
    return t


def _int_column(t: pa.Table, name: str, path: Path) -> np.ndarray:
    col = t.column(name)
    if col.null_count:
        raise InputError(path, f"column {name!r} is empty", f"row {pc.index(pc.is_null(col), True).as_py() + 1}")
    if not (pa.types.is_integer(col.type)):
        raise InputError(path, f"column {name!r} must hold integers, got {col.type}")
    arr = col.to_numpy().astype(np.int64)
    if arr.size and arr.min() < 0:
        raise InputError(path, f"column {name!r} holds a negative value {arr.min()}", f"row {int(np.argmin(arr)) + 1}")
    return arr


def _flatten(col: pa.ChunkedArray, path: Path, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a list column; nulls refused."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count:
        raise InputError(path, f"column {what!r} has an empty (null) list", f"row {pc.index(pc.is_null(arr), True).as_py() + 1}")
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    vals = pc.list_flatten(arr)
    if vals.null_count:
        parent = pc.list_parent_indices(arr).to_numpy()
        i = pc.index(pc.is_null(vals), True).as_py()
        raise InputError(path, f"column {what!r} holds a null entry", f"row {int(parent[i]) + 1}")
    return vals, lengths


def _layer_from_name(path: Path) -> int | None:
    m = _LAYER_NAME.search(path.stem)
    return int(m.group(1)) if m else None


def _one_file(path: Path, options: dict, approx: set[str]) -> dict:
    """Canonical routing columns (numpy) of one file."""
    meta: list = []
    d = _from_table(path, _responses(path, options, approx) if _is_responses(path) else _read(path, meta), approx)
    d["meta"] = meta
    return d


def _from_table(path: Path, t: pa.Table, approx: set[str]) -> dict:
    if t.num_rows == 0:
        raise InputError(path, "file holds no rows")
    ecol = _expert_col(t.schema)
    if ecol is None:
        raise InputError(path, f"no list column of experts (one of {', '.join(EXPERT_COLS)}; found "
                               f"{', '.join(t.column_names)})")
    etype = t.schema.field(ecol).type
    vt = etype.value_type
    nested = pa.types.is_list(vt) or pa.types.is_large_list(vt) or pa.types.is_fixed_size_list(vt)
    n = t.num_rows
    gcol = next((g for g in GATE_COLS if g in t.column_names and g != ecol), None)
    # per-row layer (flat) or per-(row, layer) (nested)
    if nested:
        if "layer" in t.column_names or "layer_id" in t.column_names:
            raise InputError(path, f"{ecol!r} is a list of per-layer lists and the file also has a layer column: "
                                   "give one or the other")
        outer, L_per_row = _flatten(t.column(ecol), path, ecol)
        if len(set(L_per_row.tolist())) != 1:
            raise InputError(path, f"rows of {ecol!r} cover different numbers of layers: {sorted(set(L_per_row.tolist()))[:5]}")
        L = int(L_per_row[0])
        row_of = np.repeat(np.arange(n), L)
        layer_of = np.tile(np.arange(L), n)
        choices = outer
        g_outer = None
        if gcol:
            g_outer, gl = _flatten(t.column(gcol), path, gcol)
            if not np.array_equal(gl, L_per_row):
                raise InputError(path, f"{gcol!r} and {ecol!r} cover different numbers of layers")
    else:
        if "layer" in t.column_names or "layer_id" in t.column_names:
            layer_rows = _int_column(t, "layer" if "layer" in t.column_names else "layer_id", path)
        else:
            li = _layer_from_name(path)
            if li is None:
                raise InputError(path, "no layer column and no layer number in the file name (e.g. layer_7.parquet)")
            layer_rows = np.full(n, li, np.int64)
            approx.add("layer taken from the file name")
        row_of, layer_of = np.arange(n), layer_rows
        choices = t.column(ecol).combine_chunks()
        g_outer = t.column(gcol).combine_chunks() if gcol else None
    vals, k_of = _flatten(choices, path, ecol)
    if not pa.types.is_integer(vals.type):
        raise InputError(path, f"column {ecol!r} must hold integer expert ids, got {vals.type}")
    ex = vals.to_numpy(zero_copy_only=False).astype(np.int64)
    gate = None
    if gcol:
        gv, gk = _flatten(g_outer, path, gcol)
        if not np.array_equal(gk, k_of):
            bad = int(np.argmax(gk != k_of))
            raise InputError(path, f"{gcol!r} and {ecol!r} lists differ in length", f"row {int(row_of[bad]) + 1}")
        if not (pa.types.is_floating(gv.type) or pa.types.is_integer(gv.type)):
            raise InputError(path, f"column {gcol!r} must hold numbers, got {gv.type}")
        gate = gv.cast(pa.float32()).to_numpy(zero_copy_only=False)
        if not np.all(np.isfinite(gate)):
            i = int(np.argmax(~np.isfinite(gate)))
            raise InputError(path, f"column {gcol!r} holds a non-finite gate {gate[i]}",
                             f"row {int(row_of[np.searchsorted(np.cumsum(k_of), i, side='right')]) + 1}")
    # entry -> (list index within the file's lists, position in the list)
    lst = np.repeat(np.arange(k_of.size), k_of)
    pos = np.arange(ex.size) - np.repeat(np.cumsum(k_of) - k_of, k_of)
    if ex.size and ex.min() < -1:
        i = int(np.argmin(ex))
        raise InputError(path, f"expert id {ex[i]} is negative", f"row {int(row_of[lst[i]]) + 1}")
    pad = ex == -1
    if pad.any():
        approx.add("-1 entries in the expert lists taken as padding and dropped")
    if nested:  # drop layers whose every entry is 0 (dense or uncaptured in the engine's buffer)
        nonzero = np.bincount(layer_of[lst], weights=(ex != 0), minlength=int(layer_of.max()) + 1)
        zero_layers = np.flatnonzero(nonzero == 0).tolist()
        if zero_layers:
            approx.add(f"layers {_ranges(zero_layers)} hold only expert 0 in every token: taken as dense / not "
                       "captured and dropped")
            pad |= np.isin(layer_of[lst], zero_layers)
    keep = ~pad
    ex, lst, pos = ex[keep], lst[keep], pos[keep]
    gate = gate[keep] if gate is not None else None
    # a token names k distinct experts: sort each list's entries (lists are contiguous), compare neighbours
    order = np.lexsort((ex, lst))
    same = (lst[order][1:] == lst[order][:-1]) & (ex[order][1:] == ex[order][:-1])
    if same.any():
        i = order[int(np.argmax(same)) + 1]
        raise InputError(path, f"a token names expert {ex[i]} twice", f"row {int(row_of[lst[i]]) + 1}")
    del order, same
    rows = row_of[lst]
    out = {"row": rows, "layer": layer_of[lst], "expert": ex, "choice": pos, "gate": gate,
           "k": int(k_of.max()) if k_of.size else 0}
    for c in ("step", "token"):
        out[c] = _int_column(t, c, path)[rows] if c in t.column_names else None
    if out["token"] is None:
        tcol = next((c for c in TOKEN_COLS if c in t.column_names), None)
        if tcol is not None:
            out["token"] = _steps_from_token_index(t, tcol, path, out, approx)
    rc = next((c for c in RANK_COLS if c in t.column_names), None)
    out["src_rank"] = _int_column(t, rc, path)[rows] if rc else None
    out["nrows"] = n
    return out


def _steps_from_token_index(t: pa.Table, tcol: str, path: Path, out: dict, approx: set[str]) -> np.ndarray:
    """Tokens (per entry) from a per-request log's token index; without a step column, the
    steps too: a step (one forward pass) starts wherever, in one layer's rows in file
    order, the token index does not grow (the logger counts tokens within a pass: vLLM
    route-logging patches write req_id, token_idx, layer per token)."""
    tok_rows = _int_column(t, tcol, path)
    req = next((c for c in REQUEST_COLS if c in t.column_names), None)
    nreq = len(pc.unique(t.column(req))) if req is not None else None
    if out["step"] is None:
        layer_rows = np.zeros(t.num_rows, np.int64)
        lc = next((c for c in ("layer", "layer_id") if c in t.column_names), None)
        if lc is not None:
            layer_rows = _int_column(t, lc, path)
        step_rows = np.zeros(t.num_rows, np.int64)
        for lay in np.unique(layer_rows):
            idx = np.flatnonzero(layer_rows == lay)
            tk = tok_rows[idx]
            new = np.ones(idx.size, bool)
            new[1:] = tk[1:] <= tk[:-1]
            step_rows[idx] = np.cumsum(new) - 1
        out["step"] = step_rows[out["row"]]
        approx.add(f"no step column: a step starts wherever {tcol} does not grow (one forward pass per run of "
                   f"growing {tcol}, per layer in file order)" + (f"; {nreq} request(s) ({req})" if nreq else ""))
    return tok_rows[out["row"]]


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    paths = sorted(paths)
    approx: set[str] = set()
    npys = [p for p in paths if p.name.lower().endswith(".npy")]
    if npys:        # vLLM routed_experts arrays, one per request: one table, steps numbered across files
        if len(npys) != len(paths):
            raise InputError(paths[0], "routed_experts .npy files and other files given together: ingest them "
                                       "separately")
        d = _from_table(npys[0], _npy_requests(npys, approx), approx)
        d["meta"] = []
        parts = [(npys[0], d)]
    else:
        parts = [(p, _one_file(p, options, approx)) for p in paths]
    has = {c: {d[c] is not None for _, d in parts} for c in ("step", "token", "src_rank")}
    for c, v in has.items():
        if len(v) > 1:
            raise InputError(paths[0], f"some files have a {c!r} column and others not: ingest them separately")
    tps = options.get("tokens_per_step")
    offset: dict[int, int] = {}   # rows already seen per layer (shards of one layer continue each other)
    cols = {c: [] for c in ("step", "layer", "token", "src_rank", "choice", "expert", "gate")}
    k = 0
    for _path, d in parts:
        layers = np.unique(d["layer"])
        row = d["row"].copy()
        if d["token"] is None:   # row order, continued across shards of one layer
            base = {int(l): offset.get(int(l), 0) for l in layers}
            lut = np.zeros(int(layers.max()) + 1 if layers.size else 1, np.int64)
            lut[layers] = [base[int(l)] for l in layers]
            row = row + lut[d["layer"]]
            for l in layers:
                offset[int(l)] = base[int(l)] + d["nrows"]
        if d["step"] is not None:
            step = d["step"]
        elif tps:
            step = row // int(tps)
        else:
            step = np.zeros(row.size, np.int64)
        token = d["token"] if d["token"] is not None else (row % int(tps) if tps and d["step"] is None else row)
        cols["step"].append(step), cols["layer"].append(d["layer"]), cols["token"].append(token)
        cols["src_rank"].append(d["src_rank"]), cols["choice"].append(d["choice"]), cols["expert"].append(d["expert"])
        cols["gate"].append(d["gate"])
        k = max(k, d["k"])
    if not has["step"].pop():
        approx.add(f"no step column: steps are consecutive blocks of {int(tps)} tokens in file order" if tps else
                   "no step column: the whole input is one pseudo-step (step 0); --set tokens_per_step=N cuts it "
                   "into steps")
    token_col = has["token"].pop()
    if not token_col:
        approx.add("no token column: token = row order within the step and layer")
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
    step, layer, token, choice, expert = (cat(cols[c]) for c in ("step", "layer", "token", "choice", "expert"))
    if not expert.size:
        raise InputError(paths[0], "no expert choices left (every entry was padding)")
    if token_col:   # one row per (step, layer, token, choice); row-order tokens are unique by construction
        order = np.lexsort((choice, token, layer, step))
        dup = np.ones(order.size - 1, bool)
        for c in (step, layer, token, choice):
            dup &= c[order][1:] == c[order][:-1]
        if dup.any():
            i = order[int(np.argmax(dup)) + 1]
            raise InputError(paths[0], f"token {token[i]} of step {step[i]}, layer {layer[i]} appears twice (two "
                                       "files for one layer with a token column, or repeated rows)")
        del order, dup
    src = cat(cols["src_rank"]) if has["src_rank"].pop() else None
    gates = cols["gate"]
    gate = cat(gates) if all(g is not None for g in gates) else None
    if any(g is not None for g in gates) and gate is None:
        approx.add("gate scores present in some files only: gates dropped")
    n = expert.size
    routing = pa.table({"step": step, "layer": layer.astype(np.int32), "token": token,
                        "src_rank": pa.nulls(n, pa.int32()) if src is None else pa.array(src.astype(np.int32)),
                        "choice": choice.astype(np.int8), "expert": expert.astype(np.int32),
                        "slot": pa.nulls(n, pa.int32()),
                        "gate": pa.nulls(n, pa.float32()) if gate is None else pa.array(gate, pa.float32())})
    # exact aggregate per (step, layer, expert)
    E = int(options.get("num_experts") or expert.max() + 1)
    L = int(options.get("num_layers") or layer.max() + 1)
    s0 = step.min()
    flat = (step - s0) * (L * E) + layer * E + expert
    span = int(flat.max()) + 1
    if span <= max(1 << 24, 4 * flat.size):    # dense enough: count by index
        c = np.bincount(flat, minlength=span)
        u = np.flatnonzero(c)
        c = c[u]
    else:
        u, c = np.unique(flat, return_counts=True)
    del flat
    load = pa.table({"step": u // (L * E) + s0, "layer": ((u // E) % L).astype(np.int32),
                     "expert": (u % E).astype(np.int32), "slot": pa.nulls(u.size, pa.int32()),
                     "src_rank": pa.nulls(u.size, pa.int32()), "tokens": c.astype(np.int64)})
    # the same tokens pass every layer: tokens per (step, layer) should agree within a step
    # a token's entries are contiguous: a new token starts where (step, layer, token) changes
    start = np.ones(step.size, bool)
    start[1:] = (step[1:] != step[:-1]) | (layer[1:] != layer[:-1]) | (token[1:] != token[:-1])
    steps_sorted, si = np.unique(step[start], return_inverse=True)
    ul, li = np.unique(layer[start], return_inverse=True)
    pairs, cnt = np.unique(si.astype(np.int64) * ul.size + li, return_counts=True)   # sorted by step
    ps = pairs // ul.size
    first = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
    spread = np.maximum.reduceat(cnt, first) != np.minimum.reduceat(cnt, first)
    uneven = steps_sorted[ps[first][spread]].tolist()
    if uneven:
        approx.add(f"{len(uneven)} steps have different token counts in different layers (first: step {uneven[0]})")
    if not options.get("num_experts"):
        approx.add("num_experts inferred from the highest expert id")
    if not options.get("num_layers"):
        approx.add("num_layers inferred from the highest layer id")
    ks = sorted(approx)
    run = {"source": source_label(paths),
           "source_sha256": sha256_files(paths), "collector": "routing_wide", "time_base": "none",
           "num_layers": L, "num_experts": E, "top_k": options.get("top_k") or k,
           "num_ranks": options.get("num_ranks"), "ranks_per_node": options.get("ranks_per_node"),
           "num_slots": options.get("num_slots") or E, "num_groups": options.get("num_groups"),
           "approximations": json.dumps(ks) if ks else None,
           "meta_json": json.dumps({"format": "routing_wide", "files": len(paths), "top_k_seen": k,
                                    "layers": sorted(set(layer.tolist()))})}
    hint = paths[0].parent.name if len(paths) > 1 else paths[0].name.split(".")[0]
    from ._jsonl_meta import keep_meta

    rd = RunData(run=run, tables={"routing": routing, "expert_load": load}, run_id_hint=hint,
                 files=[str(p) for p in paths])
    for p, d in parts:
        keep_meta(rd, p, d["meta"])
    return [rd]


register(Collector("routing_wide", "per-token routing, a row per token with a list column of experts (indices / "
                                   "topk_ids / routed_experts ...; optional scores), Parquet, JSONL or Arrow",
                   _sniff, _collect, priority=40,
                   options=("tokens_per_step",)))
