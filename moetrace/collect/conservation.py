"""Conservation checks run on every collected run before it is written.

Three laws a well-formed trace obeys:

1. **Token conservation**: per (step, layer) the ``expert_load`` tokens sum to the step's
   tokens × ``top_k``, wherever the source gives the step's tokens (``steps.num_tokens``
   summed over ranks, or the run's constant ``tokens_per_step``) and ``top_k``. Layers
   whose load is zero over the whole run are dense (not MoE) layers and are skipped.
2. **Routing aggregates to load**: when both ``routing`` and ``expert_load`` are present,
   counting routing rows per (step, layer, expert) gives exactly the ``expert_load``
   tokens summed over slots and source ranks.
3. **Time runs forward**: every span and every timed step ends at or after it starts.

A run that breaks one is refused with an :class:`InputError` giving the numbers (first
offending key, expected and found, how many keys differ). With ``--allow-inconsistent``
(``options["allow_inconsistent"]``) it is ingested instead, with ``runs.inconsistent``
set and one statement per broken law appended to ``runs.approximations``.

Tables a collector hands over as one-shot iterators (streamed) cannot be read twice; a
list or tuple of chunks, or a re-readable stream (an iterable whose ``iter()`` starts a
new pass, e.g. the generic collector's file batches), is aggregated chunk by chunk with
exact integer totals, so memory follows the number of (step, layer) keys, not the rows.
A law that could not be checked for that reason is stated in ``runs.approximations``
rather than passed silently. The dense layout (``expert_counts``: one list of expert
counts per step and layer) is checked as the long rows it stands for.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import InputError


class _Violation(Exception):
    def __init__(self, law: str, message: str, position: str | None = None):
        super().__init__(message)
        self.law = law
        self.message = message
        self.position = position


def _file(rd) -> str:
    return ", ".join(rd.files) if rd.files else rd.run.get("source", "<input>")


def _chunks(data) -> Iterator[pa.Table] | None:
    """Arrow chunks of a table, or None when it is a one-shot stream we must not consume."""
    if data is None:
        return None
    if isinstance(data, pa.Table):
        return iter([data])
    if isinstance(data, dict):
        return iter([pa.table(data)])
    if hasattr(data, "to_arrow") and not isinstance(data, (list, tuple)):
        return iter([data.to_arrow()])
    if isinstance(data, (list, tuple)) or iter(data) is not data:     # re-readable: a fresh pass
        return (c if isinstance(c, pa.Table) else pa.table(c) if isinstance(c, dict) else c.to_arrow() for c in data)
    return None


def _unnest_counts(c: pa.Table) -> pa.Table:
    """expert_counts rows as the long (step, layer, expert, tokens) rows they stand for."""
    lists = c.column("tokens").combine_chunks()
    off = lists.offsets.to_numpy()
    width = np.diff(off)
    row = np.repeat(np.arange(c.num_rows), width)
    expert = np.arange(off[-1] - off[0]) - np.repeat(off[:-1] - off[0], width)
    return pa.table({"step": c.column("step").take(pa.array(row)).cast(pa.int64()),
                     "layer": c.column("layer").take(pa.array(row)).cast(pa.int64()),
                     "expert": pa.array(expert, pa.int64()),
                     "tokens": lists.values.slice(off[0], off[-1] - off[0])})


def _load(rd):
    """The run's expert counts as long rows: expert_load as is, expert_counts unnested
    (chunk by chunk), both when both are present; None when there are none. A one-shot
    stream among them makes the whole a one-shot stream (see :func:`_chunks`)."""
    parts = [rd.tables.get("expert_load"), rd.tables.get("expert_counts")]
    if parts[0] is None and parts[1] is None:
        return None
    if any(p is not None and _is_stream(p) for p in parts):
        return iter(())                                      # one-shot: reported as streamed
    return _LoadChunks(parts[0], parts[1])


class _LoadChunks:
    def __init__(self, long, dense):
        self.long, self.dense = long, dense

    def __iter__(self):
        if self.long is not None:
            yield from _chunks(self.long)
        if self.dense is not None:
            for c in _chunks(self.dense):
                if c.num_rows:
                    yield _unnest_counts(c)


def _group_sum(data, keys: list[str], value: str | None) -> pa.Table | None:
    """sum(value) (or count(*) when value is None) per keys, over every chunk."""
    chunks = _chunks(data)
    if chunks is None:
        return None
    parts = []
    for c in chunks:
        if c.num_rows == 0:
            continue
        if value is None:
            c = c.select(keys).append_column("_v", pa.array([1] * c.num_rows, pa.int64()))
        else:
            c = c.select(keys + [value]).rename_columns(keys + ["_v"])
            c = c.set_column(len(keys), "_v", c.column("_v").cast(pa.int64()))
        parts.append(c.group_by(keys).aggregate([("_v", "sum")]))
    if not parts:
        return pa.table({**{k: pa.array([], pa.int64()) for k in keys}, "_v": pa.array([], pa.int64())})
    t = pa.concat_tables(parts, promote_options="permissive")
    if len(parts) > 1:
        t = t.group_by(keys).aggregate([("_v_sum", "sum")]).rename_columns(keys + ["_v_sum"])
    t = t.rename_columns(keys + ["_v"])
    return t.select(keys + ["_v"]).cast(pa.schema([(k, pa.int64()) for k in keys] + [("_v", pa.int64())]))


def _is_stream(data) -> bool:
    return data is not None and _chunks(data) is None


def _check_tokens(rd) -> str | None:
    """Law 1. Returns a 'not checked' note when it could not be checked for a stream."""
    run = rd.run
    k = run.get("top_k")
    load = _load(rd)
    if load is None or not k:
        return None
    steps = rd.tables.get("steps")
    expected = None  # table step -> tokens
    if steps is not None:
        if _is_stream(steps):
            return "token conservation not checked: steps table was streamed"
        st = pa.concat_tables(list(_chunks(steps)))
        if st.num_rows and "num_tokens" in st.column_names:
            st = st.select(["step", "num_tokens"]).append_column(
                "_null", pc.cast(pc.is_null(st.column("num_tokens")), pa.int64()))
            known = st.group_by("step").aggregate([("_null", "sum"), ("num_tokens", "sum")])
            # only steps where every rank recorded its tokens
            full = known.filter(pc.equal(known.column("_null_sum"), 0))
            if full.num_rows:
                expected = pa.table({"step": full.column("step").cast(pa.int64()),
                                     "_want": full.column("num_tokens_sum").cast(pa.int64())})
    if expected is None and run.get("tokens_per_step"):
        expected = "constant"
    if expected is None:
        return None
    got = _group_sum(load, ["step", "layer"], "tokens")
    if got is None:
        return "token conservation not checked: expert_load table was streamed"
    if got.num_rows == 0:
        return None
    per_layer = got.group_by("layer").aggregate([("_v", "sum")])
    moe_layers = per_layer.filter(pc.greater(per_layer.column("_v_sum"), 0)).column("layer")
    got = got.filter(pc.is_in(got.column("layer"), value_set=moe_layers.combine_chunks()))
    if expected == "constant":
        want = pa.array([int(run["tokens_per_step"])] * got.num_rows, pa.int64())
        src = f"tokens_per_step {int(run['tokens_per_step'])}"
        joined = got.append_column("_want", want)
    else:
        joined = got.join(expected, "step", join_type="inner")
        src = None
    if joined.num_rows == 0:
        return None
    want_k = pc.multiply(joined.column("_want"), pa.scalar(int(k), pa.int64()))
    bad = pc.not_equal(joined.column("_v"), want_k)
    n_bad = pc.sum(pc.cast(bad, pa.int64())).as_py() or 0
    if n_bad:
        n_pairs = joined.num_rows
        joined = joined.append_column("_wk", want_k).filter(bad).sort_by([("step", "ascending"), ("layer", "ascending")])
        r = joined.slice(0, 1).to_pylist()[0]
        src = src or f"steps record {r['_want']} tokens"
        raise _Violation(
            "token conservation",
            f"conservation: expert_load tokens at step {r['step']}, layer {r['layer']} sum to {r['_v']}, but {src}"
            f" × top_k {k} = {r['_wk']} (differs by {r['_v'] - r['_wk']:+d}; {n_bad} of {n_pairs}"
            f" (step, layer) pairs differ)",
            f"step {r['step']}, layer {r['layer']}")
    return None


def _check_routing(rd) -> str | None:
    """Law 2."""
    routing, load = rd.tables.get("routing"), _load(rd)
    if routing is None or load is None:
        return None
    keys = ["step", "layer", "expert"]
    r = _group_sum(routing, keys, None)
    e = _group_sum(load, keys, "tokens")
    if r is None or e is None:
        return "routing-to-expert_load conservation not checked: a table was streamed"
    r = r.rename_columns(keys + ["_r"])
    e = e.rename_columns(keys + ["_e"])
    j = e.join(r, keys, join_type="full outer")
    rv = pc.fill_null(j.column("_r"), 0)
    ev = pc.fill_null(j.column("_e"), 0)
    bad = pc.not_equal(rv, ev)
    n_bad = pc.sum(pc.cast(bad, pa.int64())).as_py() or 0
    if n_bad:
        d = pa.table({"step": j.column("step"), "layer": j.column("layer"), "expert": j.column("expert"),
                      "r": rv, "e": ev}).filter(bad)
        d = d.sort_by([("step", "ascending"), ("layer", "ascending"), ("expert", "ascending")])
        x = d.slice(0, 1).to_pylist()[0]
        raise _Violation(
            "routing conservation",
            f"conservation: routing has {x['r']} rows for step {x['step']}, layer {x['layer']}, expert {x['expert']}"
            f" but expert_load records {x['e']} tokens ({n_bad} of {j.num_rows} (step, layer, expert) keys differ)",
            f"step {x['step']}, layer {x['layer']}, expert {x['expert']}")
    return None


def _check_time(rd, table: str) -> str | None:
    """Law 3, for spans and timed steps."""
    data = rd.tables.get(table)
    if data is None:
        return None
    chunks = _chunks(data)
    if chunks is None:
        return f"{table} end >= start not checked: table was streamed"
    offset = 0
    for c in chunks:
        if c.num_rows and "start_ns" in c.column_names and "end_ns" in c.column_names:
            start, end = c.column("start_ns").cast(pa.int64()), c.column("end_ns").cast(pa.int64())
            bad = pc.fill_null(pc.less(end, start), False)
            n_bad = pc.sum(pc.cast(bad, pa.int64())).as_py() or 0
            if n_bad:
                i = pc.index(bad, True).as_py()
                s, e = start[i].as_py(), end[i].as_py()
                row = offset + i + 1  # 1-based, like every other position moetrace reports
                raise _Violation(f"{table} time order",
                                 f"conservation: {table} row {row} ends before it starts (start_ns={s}, "
                                 f"end_ns={e}, {e - s} ns; {n_bad} such rows)", f"{table} row {row}")
        offset += c.num_rows
    return None


def check(rd, options: dict) -> None:
    """Check ``rd`` (a RunData whose non-streamed tables are conformed Arrow tables).

    Raises InputError on the first broken law, unless ``options['allow_inconsistent']``:
    then every broken law is recorded in ``rd.run`` (``inconsistent``, ``approximations``).
    """
    allow = bool(options.get("allow_inconsistent"))
    notes: list[str] = []
    broken: list[_Violation] = []
    for fn in (_check_tokens, _check_routing, lambda r: _check_time(r, "spans"), lambda r: _check_time(r, "steps")):
        try:
            note = fn(rd)
        except _Violation as v:
            if not allow:
                raise InputError(_file(rd), v.message + "; ingest anyway with --allow-inconsistent", v.position) from None
            broken.append(v)
            continue
        if note:
            notes.append(note)
    if not broken and not notes:
        return
    approx = rd.run.get("approximations")
    try:
        items = json.loads(approx) if approx else []
        if not isinstance(items, list):
            items = [str(items)]
    except ValueError:
        items = [str(approx)]
    for v in broken:
        items.append(f"inconsistent ({v.law}), ingested with --allow-inconsistent: {v.message}")
    items.extend(notes)
    rd.run["approximations"] = json.dumps(items, ensure_ascii=False)
    if broken:
        rd.run["inconsistent"] = True
