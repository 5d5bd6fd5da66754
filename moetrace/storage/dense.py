"""The dense expert-count layout and its readers.

``expert_counts`` (schemas/expert_counts.json) stores one row per (run, step, layer) with
the tokens of every logical expert as one list (index = expert id). It holds exactly the
rows a complete ``expert_load`` would hold (every expert of the layer present, no slot,
no source rank), in 1/E of the rows: 116,000 rows instead of 29.7M for 2,000 steps x 58
layers x 256 experts. Why this layout (measured alternatives): docs/explanation/fleet-scale.md.

- ``expert_load`` stays the contract everyone queries: the store defines it as the long
  rows plus ``expert_counts`` unnested (:func:`expert_load_views`), so every SQL query
  over ``expert_load`` sees the same rows whichever layout a run was written in.
- The metric views (``storage/sql``) read ``expert_counts`` directly with list functions
  (no unnest) and the long rows as before.
- :func:`read_counts` reads a run's counts as one contiguous ``[T, L, E]`` array (dense
  runs: Parquet list values straight into numpy; long runs: one SQL scan and a bincount).
- :func:`dense_table` / :func:`dense_chunks` turn complete long rows into dense rows.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # imported by the functions that use them: the views need neither (start-up time)
    import numpy as np
    import pyarrow as pa

EXPERT_LOAD_COLUMNS = ("run_id", "step", "layer", "expert", "slot", "src_rank", "tokens")


def expert_load_views(long_view_sql: str) -> list[str]:
    """Given the store's view of the long ``expert_load`` Parquet rows, the statements that
    rename it ``expert_load_long`` and define ``expert_load`` as those rows plus the dense
    ``expert_counts`` rows unnested (same columns and types, expert = list index)."""
    long_sql, n = re.subn(r'^CREATE OR REPLACE VIEW\s+"?expert_load"?\s+AS',
                          "CREATE OR REPLACE VIEW expert_load_long AS", long_view_sql.strip())
    if n != 1:
        raise ValueError("unexpected expert_load view statement")
    union = ("CREATE OR REPLACE VIEW expert_load AS "
             "SELECT run_id, step, layer, expert, slot, src_rank, tokens FROM expert_load_long "
             "UNION ALL "
             "SELECT run_id, step, layer, CAST(generate_subscripts(tokens, 1) - 1 AS INTEGER) AS expert, "
             "CAST(NULL AS INTEGER) AS slot, CAST(NULL AS INTEGER) AS src_rank, unnest(tokens) AS tokens "
             "FROM expert_counts")
    return [long_sql, union]


def numpy_ints(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A null-free integer Arrow column as numpy, from its buffers (zero-copy for one chunk).
    ``to_numpy`` would do the same, but pyarrow imports pandas the first time it is called
    (a third of a second of every ``moetrace ingest``)."""
    import numpy as np
    import pyarrow as pa

    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = []
    for a in chunks:
        if not pa.types.is_integer(a.type) or a.null_count:
            raise TypeError(f"expected a null-free integer column, got {a.type}")
        dt = np.dtype(str(a.type))                 # int8..int64, uint8..uint64
        parts.append(np.frombuffer(a.buffers()[1], dtype=dt, count=len(a), offset=a.offset * dt.itemsize))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


_np = numpy_ints


# ----------------------------------------------------------------------------- writing
def arrow_ints(values: np.ndarray, dtype=None) -> pa.Array:
    """A null-free numpy integer array as an Arrow array over the same buffer (``pa.array``
    would do the same, but pyarrow imports pandas the first time it is called: a third of
    a second of every ``moetrace ingest``). ``dtype`` defaults to int64."""
    import numpy as np
    import pyarrow as pa

    a = np.ascontiguousarray(values, dtype=np.int64 if dtype is None else dtype)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [None, pa.py_buffer(a)])


def _list_array(values: np.ndarray, width: int) -> pa.ListArray:
    import numpy as np
    import pyarrow as pa

    n = values.size // width if width else 0
    offsets = arrow_ints(np.arange(0, n * width + 1, width, dtype=np.int32), np.int32)
    return pa.ListArray.from_arrays(offsets, arrow_ints(values))


def dense_table(steps: np.ndarray, layers: np.ndarray, counts: np.ndarray) -> pa.Table:
    """expert_counts rows from ``counts [n, E]`` of (steps[i], layers[i]) (no run_id), with
    each row's counts also sorted descending (``tokens_desc``)."""
    import numpy as np
    import pyarrow as pa

    counts = np.asarray(counts, np.int64)
    E = counts.shape[1] if counts.ndim == 2 else 0
    desc = np.sort(counts, axis=1)[:, ::-1] if counts.size else counts
    return pa.table({"step": arrow_ints(steps), "layer": arrow_ints(layers, np.int32),
                     "tokens": _list_array(counts.reshape(-1), E), "tokens_desc": _list_array(desc.reshape(-1), E)})


def grid_table(step_ids: np.ndarray, layer_ids: np.ndarray, counts: np.ndarray) -> pa.Table:
    """expert_counts rows of a full grid ``counts [T, L, E]`` (steps x layers, step-major)."""
    import numpy as np

    T, L, E = counts.shape
    return dense_table(np.repeat(np.asarray(step_ids, np.int64), L), np.tile(np.asarray(layer_ids, np.int32), T),
                       counts.reshape(T * L, E))


class NotDense(Exception):
    """Long rows that cannot be stored densely (a gap, a slot, a source rank, an order)."""


class Densifier:
    """Turns long expert_load chunks (``step, layer, expert, tokens``, optional all-null
    ``slot``/``src_rank``) into expert_counts rows, chunk by chunk: the rows must come
    ordered by (step, layer), every expert 0..E-1 once per (step, layer), in expert order;
    a (step, layer) may straddle two chunks. :meth:`feed` raises :class:`NotDense` on the
    first chunk that breaks this (the caller keeps the long rows instead)."""

    def __init__(self, num_experts: int, build: bool = True, check: bool = True):
        self.E = int(num_experts)
        self.build = build                  # False: check the order only, return nothing
        self.check = check                  # False: the rows were checked already (a second pass
        self._carry: pa.Table | None = None  # over the same file); ``expert`` is not read
        self._last_key: int | None = None

    def feed(self, c: pa.Table) -> pa.Table | None:
        import numpy as np
        import pyarrow as pa

        E = self.E
        if not self.check:
            c = c.select(["step", "layer", "tokens"])
            if self._carry is not None and self._carry.num_rows:
                c = pa.concat_tables([self._carry, c.cast(self._carry.schema)])
            full = (c.num_rows // E) * E
            self._carry = c.slice(full)
            if not full or not self.build:
                return None
            body = c.slice(0, full)
            return dense_table(_np(body.column("step"))[::E], _np(body.column("layer"))[::E],
                               _np(body.column("tokens")).reshape(-1, E))
        for col in ("slot", "src_rank"):
            if col in c.column_names and c.column(col).null_count != c.num_rows:
                raise NotDense(f"{col} is set")
        c = c.select(["step", "layer", "expert", "tokens"])
        if self._carry is not None and self._carry.num_rows:
            c = pa.concat_tables([self._carry, c.cast(self._carry.schema)])
        full = (c.num_rows // E) * E
        self._carry = c.slice(full)
        if not full:
            return None
        body = c.slice(0, full)
        step = _np(body.column("step")).reshape(-1, E)
        layer = _np(body.column("layer")).reshape(-1, E)
        expert = _np(body.column("expert")).reshape(-1, E)
        if not ((expert == np.arange(E)).all() and (step == step[:, :1]).all() and (layer == layer[:, :1]).all()):
            raise NotDense("rows are not complete (step, layer) groups in expert order")
        key = step[:, 0].astype(np.int64) * (1 << 32) + layer[:, 0].astype(np.int64)
        if (np.diff(key) <= 0).any() or (self._last_key is not None and key[0] <= self._last_key):
            raise NotDense("(step, layer) groups are not in increasing order")
        self._last_key = int(key[-1])
        if not self.build:
            return None
        return dense_table(step[:, 0], layer[:, 0], _np(body.column("tokens")).reshape(-1, E))

    def finish(self) -> None:
        if self._carry is not None and self._carry.num_rows:
            raise NotDense("the last (step, layer) group is incomplete")


def dense_chunks(chunks: Iterable[pa.Table], num_experts: int) -> Iterator[pa.Table]:
    """expert_counts rows from long expert_load chunks (see :class:`Densifier`)."""
    d = Densifier(num_experts)
    for c in chunks:
        out = d.feed(c)
        if out is not None:
            yield out
    d.finish()


# ----------------------------------------------------------------------------- reading
def run_files(store, table: str, run_id: str) -> list[Path]:
    """The Parquet files of ``table`` in the partition of ``run_id``, in name order."""
    from .files import walk

    return walk(Path(store.path), [table]).paths(table, run_id)


def row_group_steps(pf) -> list[tuple[int, int] | None]:
    """(lowest, highest step) of each row group of the Parquet file ``pf``, from its
    statistics (None for a group without them): no data is read."""
    idx = pf.schema_arrow.get_field_index("step")
    out: list[tuple[int, int] | None] = []
    for g in range(pf.metadata.num_row_groups):
        st = pf.metadata.row_group(g).column(idx).statistics
        out.append((int(st.min), int(st.max)) if st is not None and st.has_min_max else None)
    return out


def _row_groups(pf, lo, hi) -> list[int]:
    """Row groups of ``pf`` that may hold steps in [lo, hi] (by their min/max statistics)."""
    if lo is None and hi is None:
        return list(range(pf.metadata.num_row_groups))
    return [g for g, mm in enumerate(row_group_steps(pf))
            if mm is None or ((lo is None or mm[1] >= lo) and (hi is None or mm[0] <= hi))]


def grid_groups(store, run_id: str) -> list[tuple[int, int]] | None:
    """(first, last step) of every row group of a run stored as one dense ``expert_counts``
    file whose row groups hold disjoint, increasing step ranges (what every dense writer
    makes: rows ordered by step); None for any other layout."""
    import pyarrow.parquet as pq

    files = run_files(store, "expert_counts", run_id)
    if len(files) != 1 or run_files(store, "expert_load", run_id):
        return None
    out: list[tuple[int, int]] = []
    for mm in row_group_steps(pq.ParquetFile(files[0])):
        if mm is None or (out and mm[0] <= out[-1][1]):
            return None
        out.append(mm)
    return out


def read_grid_group(pf, g: int, layers: np.ndarray, E: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(step ids [t], counts [t, L, E] int64, a view of the decoded column) of row group ``g``
    of a dense file when it holds whole (step, layer) grids of ``layers`` in order, lists of
    ``E`` counts without nulls (what :func:`read_counts` gives for those steps, without its
    copy); None otherwise. Decoded on the calling thread (Arrow's pool is not asked: a
    caller's own threads fill the cores)."""
    import numpy as np

    t = pf.read_row_group(g, columns=["step", "layer", "tokens"], use_threads=False)
    col = t.column("tokens")
    L, n = layers.size, t.num_rows
    if col.num_chunks != 1 or not n or n % L:
        return None
    a = col.chunk(0)
    try:
        off = numpy_ints(a.offsets)
        vals = numpy_ints(a.values)
        step, layer = numpy_ints(t.column("step")), numpy_ints(t.column("layer"))
    except TypeError:           # nulls, or not integers
        return None
    if a.null_count or off.size != n + 1 or not (np.diff(off) == E).all():
        return None
    s = step[::L]
    if not ((np.diff(s) > 0).all() and np.array_equal(step, np.repeat(s, L))
            and np.array_equal(layer, np.tile(layers, s.size))):
        return None
    return s.astype(np.int64), vals[off[0]:off[-1]].reshape(s.size, L, E)


def read_counts(store, run_id: str, steps: np.ndarray | tuple[int, int] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step ids [T], layer ids [L], counts int64 [T, L, E]) of one run: tokens per logical
    expert, summed over slots and source ranks; a (step, layer) without rows is zero.

    ``steps``: None (every step of the run), an (lo, hi) pair (lo <= step < hi) or an array
    of step ids (the steps returned are those of the run among them). Dense runs are read
    from ``expert_counts`` without SQL (row groups outside the steps are skipped); long
    rows (``expert_load_long``) are added by one SQL scan. E is ``runs.num_experts`` or the
    highest expert seen + 1.
    """
    import numpy as np
    import pyarrow.parquet as pq

    want = None
    lo = hi = None
    if isinstance(steps, tuple):
        lo, hi = int(steps[0]), int(steps[1]) - 1
    elif steps is not None:
        want = np.unique(np.asarray(steps, np.int64))
        if want.size:
            lo, hi = int(want[0]), int(want[-1])
    parts = []                      # (step, layer, values [n, E])
    for f in run_files(store, "expert_counts", run_id):
        pf = pq.ParquetFile(f)
        groups = _row_groups(pf, lo, hi)
        if not groups:
            continue
        # row group by row group into one array: the counts are held once (reading the
        # groups together and combining their chunks held them twice)
        n = sum(pf.metadata.row_group(g).num_rows for g in groups)
        step, layer, vals, pos = np.empty(n, np.int64), np.empty(n, np.int64), None, 0
        for g in groups:
            t = pf.read_row_group(g, columns=["step", "layer", "tokens"])
            for a in t.column("tokens").chunks:
                off = _np(a.offsets)
                width = np.diff(off)
                if not width.size:
                    continue
                if vals is None:
                    vals = np.empty((n, int(width[0])), np.int64)
                if (width != vals.shape[1]).any():
                    raise ValueError(f"{f}: expert_counts lists of different lengths")
                vals[pos:pos + width.size] = _np(a.values)[off[0]:off[-1]].reshape(-1, vals.shape[1])
                pos += width.size
            step[pos - t.num_rows:pos] = _np(t.column("step"))
            layer[pos - t.num_rows:pos] = _np(t.column("layer"))
        if vals is None:
            vals = np.zeros((0, 0), np.int64)
        parts.append((step[:pos], layer[:pos], vals[:pos]))
    long_rows = None
    if run_files(store, "expert_load", run_id):
        q = "SELECT step, layer, expert, tokens FROM expert_load_long WHERE run_id = ?"
        args: list = [run_id]
        if lo is not None:
            q += " AND step >= ?"
            args.append(lo)
        if hi is not None:
            q += " AND step <= ?"
            args.append(hi)
        tbl = store.arrow(q, args)
        if tbl.num_rows:
            long_rows = tbl
    step_all = [p[0] for p in parts] + ([long_rows.column("step").to_numpy()] if long_rows is not None else [])
    layer_all = [p[1] for p in parts] + ([long_rows.column("layer").to_numpy()] if long_rows is not None else [])
    if not step_all:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0, 0), np.int64)
    step_ids = np.unique(np.concatenate(step_all))
    if lo is not None:
        step_ids = step_ids[step_ids >= lo]
    if hi is not None:
        step_ids = step_ids[step_ids <= hi]
    if want is not None:
        step_ids = np.intersect1d(step_ids, want)
    layer_ids = np.unique(np.concatenate(layer_all)).astype(np.int64)
    E = max([p[2].shape[1] for p in parts] + [0])     # a dense list holds runs.num_experts counts
    T, L = step_ids.size, layer_ids.size
    if long_rows is None and len(parts) == 1:
        s, layer, vals = parts[0]
        if vals.shape[0] == T * L and np.array_equal(s, np.repeat(step_ids, L)) \
                and np.array_equal(layer, np.tile(layer_ids, T)):
            return step_ids, layer_ids, vals.reshape(T, L, E)     # the whole grid in order: no copy
        if T and L and vals.shape[0] % L == 0:
            # whole row groups around the steps asked for (a replay chunk rarely ends on a row
            # group's edge): a slice of the grid, not a scatter of every row (3-4x the read)
            ps = s[::L]
            if np.array_equal(layer, np.tile(layer_ids, ps.size)) and np.array_equal(s, np.repeat(ps, L)):
                a = int(np.searchsorted(ps, step_ids[0]))
                if np.array_equal(ps[a:a + T], step_ids):
                    return step_ids, layer_ids, vals[a * L:(a + T) * L].reshape(T, L, E)
    if long_rows is not None:
        E = max(E, int(long_rows.column("expert").to_numpy().max()) + 1)
        ne = store.sql("SELECT max(num_experts) AS e FROM runs WHERE run_id = ?", [run_id])["e"][0]
        if ne:
            E = max(E, int(ne))
    out = np.zeros((T, L, E), np.int64)
    for s, layer, vals in parts:
        if vals.shape[0] == T * L and np.array_equal(s, np.repeat(step_ids, L)) \
                and np.array_equal(layer, np.tile(layer_ids, T)) and vals.shape[1] == E:
            out += vals.reshape(T, L, E)       # the common case: the whole grid, in order
            continue
        ti = np.searchsorted(step_ids, s)
        ok = (ti < T) & (step_ids[np.minimum(ti, T - 1)] == s)
        li = np.searchsorted(layer_ids, layer)
        # one dense row per (step, layer) and run (the writers' rule), so no index repeats
        out[ti[ok], li[ok], :vals.shape[1]] += vals[ok]
    if long_rows is not None:
        s = long_rows.column("step").to_numpy()
        ti = np.searchsorted(step_ids, s)
        ok = (ti < T) & (step_ids[np.minimum(ti, T - 1)] == s)
        li = np.searchsorted(layer_ids, long_rows.column("layer").to_numpy())
        ex = long_rows.column("expert").to_numpy()
        cell = (ti[ok] * L + li[ok]) * E + ex[ok]
        out += np.bincount(cell, weights=long_rows.column("tokens").to_numpy()[ok],
                           minlength=T * L * E).astype(np.int64).reshape(T, L, E)
    return step_ids, layer_ids, out
