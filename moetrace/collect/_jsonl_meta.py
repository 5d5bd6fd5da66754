"""Metadata records inside routing JSONL files, and which routing formats a file's columns match.

Route-logging patches for vLLM (and Megatron-style tracers) write a header record before
the token rows, e.g. ``{"type": "meta", "model": ..., "num_experts": 256, "top_k": 8}``,
and sometimes more of them later (a new model load, a config change). Such a record is
skipped by the JSONL readers (generic, routing_wide, megatron) and kept in the run:
``runs.approximations`` says how many and where, ``runs.meta_json["jsonl_meta"]`` holds
them (the first :data:`MAX_KEPT`, each cut to :data:`MAX_CHARS` characters of JSON).
"""
from __future__ import annotations

import json
from pathlib import Path

#: values of a record's "type" (or "record_type" / "kind") that mark it as metadata
META_TYPES = frozenset({"meta", "metadata", "header", "config"})
MAX_KEPT = 20
MAX_CHARS = 2000


def is_meta(obj) -> bool:
    """True for a metadata record (a JSON object whose type says so)."""
    if not isinstance(obj, dict):
        return False
    for k in ("type", "record_type", "kind"):
        v = obj.get(k)
        if isinstance(v, str) and v.lower() in META_TYPES:
            return True
    return False


def keep_meta(rd, path: Path, meta: list[tuple[int, dict]]):
    """Record the metadata records ``meta`` ((line, record) pairs) of ``path`` in ``rd``'s
    runs row (approximations and meta_json); returns ``rd``."""
    if not meta:
        return rd
    approx = json.loads(rd.run.get("approximations") or "[]")
    lines = [n for n, _ in meta]
    approx.append(f"{path.name}: {len(meta)} metadata record(s) (\"type\": \"meta\") skipped, kept in "
                  f"runs.meta_json jsonl_meta (line{'s' if len(lines) > 1 else ''} "
                  f"{', '.join(map(str, lines[:5]))}{' ...' if len(lines) > 5 else ''})")
    rd.run["approximations"] = json.dumps(approx)
    m = json.loads(rd.run.get("meta_json") or "{}")
    kept = m.setdefault("jsonl_meta", [])
    for n, obj in meta[:MAX_KEPT]:
        text = json.dumps(obj, sort_keys=True, default=str)
        kept.append({"file": path.name, "line": n,
                     "record": obj if len(text) <= MAX_CHARS else text[:MAX_CHARS] + " ..."})
    rd.run["meta_json"] = json.dumps(m)
    return rd


def routing_formats_matching(cols, expert_cols) -> str:
    """The routing formats whose columns ``cols`` (a set of names) partly match, for an
    error about an unrecognized JSONL; '' when none does. ``expert_cols``: the list-column
    names of the wide form (routing_wide.EXPERT_COLS)."""
    cols = set(cols)
    out = []
    ex = sorted(cols.intersection(expert_cols))
    if ex:
        out.append(f"routing_wide (a list column {ex[0]!r} of chosen experts per token, with a layer column or "
                   "per-layer lists; --format routing_wide)")
    if {"top_indices"} & cols or {"num_tokens", "topk"} <= cols:
        out.append("megatron router trace (step, layer, rank, num_tokens, topk, top_indices; --format megatron)")
    if "tpe" in cols:
        out.append("megatron tokens-per-expert (iter, layer, tpe; --format megatron)")
    if {"token", "expert"} & cols and not ex:
        out.append("generic routing (step, layer, token, expert)")
    if {"expert", "tokens"} & cols:
        out.append("generic expert_load (step, layer, expert, tokens)")
    return "; ".join(out)
