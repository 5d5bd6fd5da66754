"""Dense and long-format stores of the same run (the dense layout compared with the rows)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from moetrace.run import Store
from moetrace.storage import dense

from . import run_row


def _run(E, R, L, **kw):
    run = run_row(source="t", source_sha256=f"t-{np.random.default_rng().integers(1 << 60)}", collector="t",
                  num_layers=L, num_experts=E, num_ranks=R, top_k=2)
    run.update(kw)
    return run


def _long(counts, steps, layers):
    T, L, E = counts.shape
    return pa.table({"step": np.repeat(steps, L * E).astype(np.int64),
                     "layer": np.tile(np.repeat(layers, E), T).astype(np.int32),
                     "expert": np.tile(np.arange(E), T * L).astype(np.int32),
                     "slot": pa.nulls(T * L * E, pa.int32()), "src_rank": pa.nulls(T * L * E, pa.int32()),
                     "tokens": counts.reshape(-1).astype(np.int64)})


def _stores(tmp_path, counts, steps, layers, run, extra=None):
    long_st = Store(tmp_path / "long", create=True)
    long_st.write_run(dict(run), {"expert_load": _long(counts, steps, layers), **(extra or {})}, run_id="r")
    dense_st = Store(tmp_path / "dense", create=True)
    dense_st.write_run(dict(run), {"expert_counts": [dense.grid_table(steps, layers, counts)], **(extra or {})},
                       run_id="r")
    assert not dense_st.has_files("expert_load") and dense_st.has_files("expert_counts")
    return long_st, dense_st
