import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.errors import SchemaError
from moetrace.run import Store
from moetrace.storage import schema

from .helpers import run_row

TABLES = ["runs", "expert_load", "routing", "steps", "spans", "kernel_names", "placement"]


def test_every_canonical_table_has_a_contract_with_documented_columns():
    d = schema.schema_dir()
    for t in TABLES:
        doc = json.loads((d / f"{t}.json").read_text())
        assert doc["table"] == t and doc["schema_version"]
        names = [c["name"] for c in doc["columns"]]
        assert names[0] == "run_id" and len(set(names)) == len(names)
        for c in doc["columns"]:
            assert set(c) >= {"name", "type", "nullable", "unit", "description"}
            assert c["description"], f"{t}.{c['name']} has no meaning"


def test_arrow_schema_types_and_nullability():
    s = schema.arrow_schema("expert_load")
    assert s.field("tokens").type == pa.int64() and not s.field("tokens").nullable
    assert s.field("slot").type == pa.int32() and s.field("slot").nullable
    assert s.metadata[b"moetrace.schema_version"] == schema.get("expert_load").version.encode()


def _load_rows(**over):
    cols = {"run_id": ["r"], "step": [0], "layer": [0], "expert": [1], "slot": [None], "src_rank": [None],
            "tokens": [5]}
    cols.update(over)
    return pa.table(cols)


def test_missing_column_names_table_and_column():
    t = _load_rows().drop_columns(["tokens"])
    with pytest.raises(SchemaError) as e:
        schema.conform("expert_load", t)
    assert "expert_load" in str(e.value) and "tokens" in str(e.value)


def test_wrong_type_names_column():
    with pytest.raises(SchemaError) as e:
        schema.conform("expert_load", _load_rows(tokens=["five"]))
    assert "'tokens'" in str(e.value) and "expert_load" in str(e.value)


def test_null_in_non_nullable_column_is_refused():
    with pytest.raises(SchemaError, match="layer"):
        schema.conform("expert_load", _load_rows(layer=pa.array([None], pa.int64())))


def test_integer_overflow_is_refused_not_wrapped():
    with pytest.raises(SchemaError, match="layer"):
        schema.conform("expert_load", _load_rows(layer=[2**40]))


def test_written_parquet_carries_schema_version(tmp_path):
    st = Store(tmp_path / "st", create=True)
    res = st.write_run(run_row(source="t", source_sha256="x"),
                       {"expert_load": _load_rows().drop_columns(["run_id"])})
    files = list((tmp_path / "st" / "expert_load" / f"run_id={res.run_id}").glob("part-*.parquet"))
    assert len(files) == 1
    meta = pq.read_schema(files[0]).metadata
    assert meta[b"moetrace.schema_version"].decode() == schema.get("expert_load").version
    assert meta[b"moetrace.table"] == b"expert_load"
    # the partition column lives in the folder name, not in the file
    assert "run_id" not in pq.read_schema(files[0]).names
