"""Routed experts as the serving APIs return them, for :mod:`.routing_wide`: SGLang
``/generate`` responses (``meta_info.routed_experts``, base64 int32), vLLM completions
(``choices[i].routed_experts``, base64 ``.npy``), saved requests with the lists inline, and
vLLM ``routed_experts`` arrays saved with ``np.save`` (one ``.npy`` per request). Each
returned sequence is one step."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import InputError
from ._compressed import open_text, plain_head, plain_name

_RESP = re.compile(rb'"routed_experts"\s*:\s*"')   # a serving-API response: base64 routed experts
_LISTED = re.compile(rb'"routed_experts"\s*:\s*\[\s*\[\s*\[')   # a saved request: [tokens][layers][k] lists


def _npy_header(raw: bytes):
    import io

    bio = io.BytesIO(raw)
    version = np.lib.format.read_magic(bio)
    shape, _, dtype = (np.lib.format.read_array_header_1_0(bio) if version == (1, 0)
                       else np.lib.format.read_array_header_2_0(bio))
    return shape, dtype


# ----------------------------------------------------------------------------- serving-API responses
def _is_responses(path: Path) -> bool:
    from . import head

    if not plain_name(path).endswith((".jsonl", ".ndjson", ".json")):
        return False
    h = plain_head(path, head(path, 65536))
    return bool(_RESP.search(h) or _LISTED.search(h))


def _responses(path: Path, options: dict, approx: set[str]) -> pa.Table:
    """SGLang ``/generate`` responses (``meta_info.routed_experts``: base64 int32
    ``[tokens, layers, k]``) or vLLM completion responses (``choices[i].routed_experts``:
    base64 ``.npy``), one JSON document per line (a list of them = a batch): one step per
    returned sequence, token = position in it."""
    from ..safety import json_loads

    seqs = []
    with open_text(path) as f:
        text = f.read()
    docs = ([(1, json_loads(path, text))] if plain_name(path).endswith(".json") else
            [(i, json_loads(path, line, f"line {i}")) for i, line in enumerate(text.splitlines(), 1) if line.strip()])
    for i, doc in docs:
        for j, item in enumerate(doc if isinstance(doc, list) else [doc]):
            where = f"line {i}" + (f" item {j}" if isinstance(doc, list) else "")
            if not isinstance(item, dict):
                raise InputError(path, "expected a JSON object (a serving-API response)", where)
            if item.get("routed_experts") is not None:          # a saved per-request record
                seqs.append(_decode(path, item["routed_experts"], f"{where} routed_experts", options, None))
            elif isinstance(item.get("choices") or item.get("outputs"), list):   # vLLM completion / RequestOutput
                for c, ch in enumerate(item.get("choices") or item["outputs"]):
                    s = ch.get("routed_experts") if isinstance(ch, dict) else None
                    if s is not None:
                        seqs.append(_decode(path, s, f"{where} choices[{c}]", options, None))
            elif isinstance(item.get("meta_info"), dict) and item["meta_info"].get("routed_experts") is not None:
                mi = item["meta_info"]
                n = None
                if isinstance(mi.get("prompt_tokens"), int) and isinstance(mi.get("completion_tokens"), int):
                    n = mi["prompt_tokens"] + mi["completion_tokens"] - 1
                seqs.append(_decode(path, mi["routed_experts"], f"{where} meta_info", options, n))
    if not seqs:
        raise InputError(path, "no routed_experts in any response (was the server started with "
                               "--enable-return-routed-experts and the request sent with return_routed_experts?)")
    shapes = {a.shape[1:] for a in seqs}
    if len(shapes) > 1:
        raise InputError(path, f"responses disagree on [layers, top_k]: {sorted(shapes)}")
    L, K = shapes.pop()
    flat = np.concatenate([a.reshape(-1) for a in seqs]).astype(np.int32)
    experts = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(pa.array(flat), K), L)
    approx.add("serving-API responses: each returned sequence is one step (a request, not a forward pass); token = "
               "position in the sequence (prompt and output, the last sampled token has no routing)")
    return pa.table({"step": np.repeat(np.arange(len(seqs)), [a.shape[0] for a in seqs]),
                     "token": np.concatenate([np.arange(a.shape[0]) for a in seqs]), "routed_experts": experts})


def _decode(path: Path, s, where: str, options: dict, tokens: int | None) -> np.ndarray:
    """[tokens, layers, k] int array of one base64 routed_experts field."""
    import base64
    import binascii
    import io

    from ..safety import check_array_elements

    if isinstance(s, list):                      # saved from CompletionOutput.routed_experts.tolist()
        return _routed_array(path, s, where)
    if not isinstance(s, str):
        raise InputError(path, "routed_experts is not a base64 string or a [tokens][layers][top_k] list", where)
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(path, "routed_experts is not valid base64", where) from None
    if raw[:6] == b"\x93NUMPY":                 # vLLM: .npy bytes, shape and dtype in the header
        bio = io.BytesIO(raw)
        try:
            version = np.lib.format.read_magic(bio)
            shape, _, dtype = (np.lib.format.read_array_header_1_0(bio) if version == (1, 0)
                               else np.lib.format.read_array_header_2_0(bio))
        except ValueError as e:
            raise InputError(path, f"routed_experts .npy header: {e}", where) from None
        if len(shape) != 3 or dtype.kind not in "iu":
            raise InputError(path, f"routed_experts .npy is {dtype} {list(shape)}, expected integer [tokens, layers, "
                                   "top_k]", where)
        check_array_elements(path, shape, "routed_experts")
        try:
            return np.load(io.BytesIO(raw), allow_pickle=False).astype(np.int64)
        except ValueError as e:
            raise InputError(path, f"routed_experts .npy: {e}", where) from None
    if len(raw) % 4:                             # SGLang: raw little-endian int32 [tokens, layers, k]
        raise InputError(path, f"routed_experts holds {len(raw)} bytes, not whole int32 values", where)
    a = np.frombuffer(raw, "<i4").astype(np.int64)
    k = options.get("top_k")
    if not k:
        raise InputError(path, "SGLang routed_experts carry no shape: give --top-k (and the responses' "
                               "prompt_tokens / completion_tokens, or --layers = the model's num_hidden_layers)", where)
    k = int(k)
    if tokens is None and options.get("num_layers"):
        tokens = a.size // (k * int(options["num_layers"]))
    if not tokens or a.size % (tokens * k):
        raise InputError(path, f"{a.size} expert ids do not split into {tokens} tokens x layers x top_k {k}", where)
    return a.reshape(tokens, a.size // (tokens * k), k)


def _routed_array(path: Path, v, where: str | None) -> np.ndarray:
    """A [tokens, layers, top_k] integer array from JSON lists (no booleans, no fractions,
    rectangular), as vLLM's ``CompletionOutput.routed_experts`` holds it."""
    from ..safety import check_array_elements

    try:
        a = np.array(v)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is None or a.dtype == object or a.ndim != 3:
        got = list(a.shape) if a is not None and a.dtype != object else "ragged or out of range"
        raise InputError(path, f"routed_experts has shape {got}, expected integer [tokens, layers, top_k]", where)
    check_array_elements(path, a.shape, "routed_experts")
    if a.size and a.dtype.kind not in "iu":
        raise InputError(path, f"routed_experts must hold integer expert ids, got {a.dtype}", where)
    return a.astype(np.int64)


def _npy_requests(paths: list[Path], approx: set[str]) -> pa.Table:
    """vLLM routed_experts arrays saved with np.save, one file per request: step = the
    file's position in name order, token = position in the sequence."""
    from ..safety import check_npy_headers, check_regular_file

    seqs = []
    for p in paths:
        check_regular_file(p)
        check_npy_headers(p)
        from . import head

        try:
            shape, dtype = _npy_header(head(p, 4096))
        except ValueError as e:
            raise InputError(p, f"malformed .npy header: {e}") from None
        if len(shape) != 3 or dtype.kind not in "iu":
            raise InputError(p, f"routed_experts .npy is {dtype} {list(shape)}, expected integer [tokens, layers, top_k]")
        try:
            seqs.append(np.load(p, allow_pickle=False).astype(np.int64))
        except ValueError as e:
            raise InputError(p, f"cannot read .npy: {e}") from None
    shapes = {a.shape[1:] for a in seqs}
    if len(shapes) > 1:
        raise InputError(paths[0], f"requests disagree on [layers, top_k]: {sorted(shapes)}")
    L, K = shapes.pop()
    flat = np.concatenate([a.reshape(-1) for a in seqs])
    experts = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(pa.array(flat), K), L)
    approx.add("vLLM routed_experts arrays: each file is one request (step = its position in name order, a request, "
               "not a forward pass); token = position in the sequence")
    return pa.table({"step": np.repeat(np.arange(len(seqs)), [a.shape[0] for a in seqs]),
                     "token": np.concatenate([np.arange(a.shape[0]) for a in seqs]), "routed_experts": experts})


