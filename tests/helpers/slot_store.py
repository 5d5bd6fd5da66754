"""A store of 8 experts on 12 slots (4 redundant), 4 ranks x 3 slots, 2 nodes (conftest's ``slot_store``)."""
import numpy as np
import pyarrow as pa

from moetrace.run import Store

from . import run_row

RECORDED = np.array([[0, 1, 2, 0, 3, 4, 5, 1, 6, 7, 0, 3],
                     [7, 6, 5, 4, 3, 2, 1, 0, 7, 7, 2, 5]])

HIDDEN, DTYPE = 16, 2


def store_files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and "duckdb" not in p.name)


def build_slot_store(tmp_path):
    """8 experts on 12 slots (4 redundant), 4 ranks x 3 slots, 2 nodes; load per slot."""
    rng = np.random.default_rng(1)
    T, L, S = 6, 2, 12
    tok = rng.integers(0, 50, (T, L, S))
    tok[0, 0, 5] = 0
    rows = {"step": [], "layer": [], "expert": [], "slot": [], "src_rank": [], "tokens": []}
    for t in range(T):
        for li in range(L):
            for s in range(S):
                rows["step"].append(t); rows["layer"].append(li); rows["expert"].append(int(RECORDED[li, s]))
                rows["slot"].append(s); rows["src_rank"].append(None); rows["tokens"].append(int(tok[t, li, s]))
    placement = {"plan_id": ["recorded"] * (L * S), "layer": np.repeat(np.arange(L), S).tolist(),
                 "slot": np.tile(np.arange(S), L).tolist(), "rank": np.tile(np.arange(S) // 3, L).tolist(),
                 "node": np.tile(np.arange(S) // 6, L).tolist(), "expert": RECORDED.ravel().tolist()}
    run = run_row(source_sha256="x" * 64, num_layers=L, num_experts=8, top_k=2, hidden=HIDDEN,
                  dtype_bytes=DTYPE, expert_bytes=1000, num_ranks=4, ranks_per_node=2, num_slots=S,
                  num_groups=1)
    st = Store(tmp_path / "st", create=True)
    st.write_run(run, {"expert_load": pa.table(rows, schema=pa.schema([
        ("step", pa.int64()), ("layer", pa.int32()), ("expert", pa.int32()), ("slot", pa.int32()),
        ("src_rank", pa.int32()), ("tokens", pa.int64())])), "placement": placement}, run_id="slots")
    return tmp_path / "st", tok
