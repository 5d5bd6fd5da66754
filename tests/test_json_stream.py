"""The bounded-memory JSON array reader (moetrace/collect/_json_stream.py) and the SGLang
logical_count ingest that uses it: batches equal the whole-file parse, at block sizes
small enough that every element boundary falls somewhere awkward; malformed files are
refused with a position; memory stays bounded by the block, not the file."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from moetrace.collect import _json_stream as js
from moetrace.collect import ingest
from moetrace.errors import InputError
from moetrace.storage.store import Store

WHAT = "[layers][experts] or [N][layers][experts]"


def ragged_dump(a: np.ndarray, rng) -> str:
    """``a`` as JSON with irregular whitespace and newlines between the numbers."""
    def enc(x):
        if np.ndim(x) == 0:
            return str(int(x))
        seps = [rng.choice([",", ", ", ",\n", " ,\t"]) for _ in range(len(x) - 1)]
        inner = "".join(enc(v) + (seps[i] if i < len(seps) else "") for i, v in enumerate(x))
        return "[" + rng.choice(["", " ", "\n"]) + inner + rng.choice(["", " \n"]) + "]"
    return enc(a)


OTHER_BEFORE = '"note": "brackets ] [ and braces } { and \\"quotes\\" inside", "nested": {"a": [1, {"b": "]"}], "c": null}'
OTHER_AFTER = '"rank": 0, "average_utilization_rate_over_window": 0.75, "flags": [true, false]'


def read_all(path, block):
    old = js.BLOCK
    js.BLOCK = block
    try:
        out = list(js.array_batches(path, "logical_count", WHAT))
    finally:
        js.BLOCK = old
    return out


@pytest.mark.parametrize("block", [64, 257, 4096])
@pytest.mark.parametrize("ndim", [2, 3])
def test_batches_equal_the_whole_parse(tmp_path, block, ndim):
    rng = np.random.default_rng(block + ndim)
    a = rng.integers(0, 10**6, size=(23, 3, 5) if ndim == 3 else (41, 7))
    f = tmp_path / "lc.json"
    f.write_text("{" + OTHER_BEFORE + ',\n "logical_count": ' + ragged_dump(a, rng) + ",\n" + OTHER_AFTER + "}\n")
    assert np.array_equal(np.asarray(json.loads(f.read_text())["logical_count"]), a)   # the file is valid JSON
    got = read_all(f, block)
    assert {nd for nd, _ in got} == {ndim}
    assert len(got) > 1 or block == 4096
    assert np.array_equal(np.concatenate([b for _, b in got]), a)


@pytest.mark.parametrize("text,words", [
    ('{"logical_count": [[1, 2], [3, 4],]}', "trailing comma"),
    ('{"logical_count": [[1, 2], [3, 4]], }', "invalid JSON"),
    ('{"logical_count": [[1, 2], [3, 4, 5]]}', "rectangular"),
    ('{"logical_count": [[[1, 2], [3, 4]], [[1, 2], [3]]]}', "rectangular"),
    ('{"logical_count": [[1, 2], [3, "4"]]}', "rectangular"),
    ('{"logical_count": [[1, 2], [3, true]]}', "rectangular"),
    ('{"logical_count": [[1, 2], 3]}', "rectangular"),
    ('{"logical_count": [1, 2]}', "rectangular"),
    ('{"logical_count": 7}', "rectangular"),
    ('{"logical_count": [[1, 2], [3 4]]}', "invalid JSON"),
    ('{"logical_count": [[1, 2], [3, 04]]}', "invalid JSON"),
    ('{"logical_count": [[1, NaN], [3, 4]]}', "invalid JSON"),
    ('{"logical_count": [[1, 2], [3, 4]]', "end of file"),
    ('{"logical_count": [[1, 2], [3, 4', "end of file"),
    ('{"logical_count": [[1, 2]], "logical_count": [[3]]}', "appears twice"),
    ('{"logical_count": [[1, 2]]} {}', "extra data"),
    ('{"counts": [[1, 2]]}', "expected a JSON object with 'logical_count'"),
    ('[[1, 2]]', "expected a JSON object"),
    ('{"x": [1, 2, }, "logical_count": [[1]]}', "invalid JSON"),
    ('{"x": "unterminated, "logical_count": [[1]]}', "invalid JSON"),
    ('{"logical_count": ' + "[" * 1000 + "]" * 1000 + "}", "nested too deeply"),
])
def test_malformed_files_are_refused(tmp_path, text, words):
    f = tmp_path / "bad.json"
    f.write_text(text)
    for block in (8, 1 << 20):
        with pytest.raises(InputError) as e:
            read_all(f, block)
        assert words in str(e.value), (block, str(e.value))
        assert e.value.position and e.value.position.startswith("line ")


def test_error_position_is_the_line_and_column(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{\n  "logical_count": [\n    [1, 2],\n    [3, 4 x]\n  ]\n}\n')
    with pytest.raises(InputError) as e:
        read_all(f, 16)
    assert e.value.position.startswith("line 4"), e.value.position


def _peak_reading(path) -> tuple[int, int]:
    """(elements, peak traced bytes) reading ``path`` batch by batch, 16 KiB blocks."""
    old, js.BLOCK = js.BLOCK, 16 << 10
    tracemalloc.start()
    try:
        rows = sum(b.shape[0] for _, b in js.array_batches(path, "logical_count", WHAT))   # one batch at a time
        return rows, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        js.BLOCK = old


def test_memory_is_bounded_by_the_block_not_the_file(tmp_path):
    rng = np.random.default_rng(0)
    peaks, sizes = [], []
    for n in (20, 100):
        f = tmp_path / f"big{n}.json"
        with open(f, "w") as fh:
            fh.write('{"logical_count": [')
            for i in range(n):
                fh.write(("," if i else "") + json.dumps(rng.integers(0, 10**5, size=(8, 256)).tolist()))
            fh.write("]}")
        rows, peak = _peak_reading(f)
        assert rows == n
        peaks.append(peak)
        sizes.append(f.stat().st_size)
    assert sizes[1] > 4.5 * sizes[0]
    assert peaks[1] < 1.25 * peaks[0] + (64 << 10), (peaks, sizes)   # 5x the file, the same memory
    assert peaks[1] < sizes[1] / 3                  # and well under the file (json.loads holds ~6x it)


def test_ingest_streams_a_3d_dump_to_the_store(tmp_path, monkeypatch):
    monkeypatch.setattr(js, "BLOCK", 512)
    rng = np.random.default_rng(3)
    a = rng.integers(0, 50, size=(30, 4, 6))
    a[:, 1] = 0                                       # a dense layer
    a[a < 10] = 0                                     # zeros are not rows
    f = tmp_path / "lc.json"
    f.write_text(json.dumps({"rank": 0, "logical_count": a.tolist(), "note": "x"}))
    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, [f], format="sglang")[0].run_id
    run = st.run_row(rid)
    assert (run["num_layers"], run["num_experts"]) == (4, 6)
    assert "layers with no routed tokens (dense or unrecorded): 1" in run["approximations"]
    got = st.sql("SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = ?", [rid])
    back = np.zeros_like(a)
    back[got["step"].to_numpy(), got["layer"].to_numpy(), got["expert"].to_numpy()] = got["tokens"].to_numpy()
    assert np.array_equal(back, a) and got.height == np.count_nonzero(a)


def test_ingest_refuses_a_negative_count_with_its_index(tmp_path, monkeypatch):
    monkeypatch.setattr(js, "BLOCK", 64)
    a = np.ones((12, 2, 3), int)
    a[9, 1, 2] = -5
    f = tmp_path / "lc.json"
    f.write_text(json.dumps({"logical_count": a.tolist()}))
    st = Store(tmp_path / "st", create=True)
    with pytest.raises(InputError) as e:
        ingest(st, [f], format="sglang")
    assert "negative count: -5" in str(e.value) and e.value.position == "index [9, 1, 2]"
    assert st.run_ids() == []
