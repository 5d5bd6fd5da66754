"""Pickle loading bounded in time as well as in objects (moetrace/safety_pickle.py).

Python hashes an integer modulo 2^61-1: keys k*(2^61-1) all collide, and building a dict
(or set) of them is quadratic (150k keys took over 60 s). Generated cases: dicts, sets,
frozensets and tuple keys of colliding integers, positive and negative, in a Flight
Recorder pickle and in the ``data.pkl`` of a ``.pt`` (torch's ``weights_only`` loader
builds dicts the same way), at sizes where loading would take from seconds to tens of seconds.
Each is refused in one line naming the file, exit 2, under 1 GiB, within seconds, no
store created. A real dump's wide integers (nanosecond timestamps) are still read."""
from __future__ import annotations

import os
import pickle
import time

import pytest

from moetrace.errors import InputError
from moetrace.safety_pickle import MAX_WIDE_INTS, check_hash_flooding, load_plain

from .helpers.bounded_cli import run_cases

P = (1 << 61) - 1


def _keys(n: int, sign: int = 1) -> list[int]:
    return [sign * k * P for k in range(1, n + 1)]


SHAPES = ("dict", "set", "frozenset", "tuple_keys", "list_of_dicts")


def _build(shape: str, n: int, sign: int):
    # built without the quadratic cost: each value made by pickle opcodes, not by Python
    # (a Python dict of these keys would take as long to build here as in the loader)
    ks = _keys(n, sign)
    if shape in ("dict", "tuple_keys"):
        items = [((k,) if shape == "tuple_keys" else k, 0) for k in ks]
        return _PairsAsDict(items)
    if shape == "list_of_dicts":
        return [_PairsAsDict([(k, 0) for k in ks[i:i + 2000]]) for i in range(0, n, 2000)]
    return _ListAsSet(ks, frozen=shape == "frozenset")


class _PairsAsDict:
    """Pickles as a dict of ``items`` (EMPTY_DICT + SETITEMS), without building one."""

    def __init__(self, items):
        self.items = items

    def __reduce__(self):   # pickled through a custom pickler below, never loaded as this
        raise NotImplementedError


class _ListAsSet:
    def __init__(self, ks, frozen):
        self.ks, self.frozen = ks, frozen


class _Writer(pickle._Pickler):   # the Python pickler: its dispatch table is extensible
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_pairs(self, obj):
        self.write(pickle.EMPTY_DICT)
        self.memoize(obj)
        self._batch_setitems(iter(obj.items))

    def _save_set(self, obj):
        if obj.frozen:
            self.write(pickle.MARK)
            for k in obj.ks:
                self.save(k)
            self.write(pickle.FROZENSET)
            return
        self.write(pickle.EMPTY_SET)
        self.memoize(obj)
        for i in range(0, len(obj.ks), 1000):
            self.write(pickle.MARK)
            for k in obj.ks[i:i + 1000]:
                self.save(k)
            self.write(pickle.ADDITEMS)

    dispatch[_PairsAsDict] = _save_pairs
    dispatch[_ListAsSet] = _save_set


def _dumps(value, protocol: int) -> bytes:
    import io

    buf = io.BytesIO()
    _Writer(buf, protocol=protocol).dump(value)
    return buf.getvalue()


CASES = [(shape, n, sign) for shape in SHAPES for n in (20_000, 60_000) for sign in (1, -1)
         if not (shape == "list_of_dicts" and n == 20_000)]


def test_colliding_keys_refused_fast_in_flight_recorder_dumps(tmp_path):
    cases, names = [], []
    for shape, n, sign in CASES:
        name = f"nccl_trace_rank_0_{shape}_{n}_{'neg' if sign < 0 else 'pos'}"
        d = tmp_path / name
        d.mkdir()
        head = {"version": "2.4", "pg_config": {}, "entries": [], "junk": _build(shape, n, sign)}
        (d / name).write_bytes(_dumps(head, 4))
        cases.append({"args": ["ingest", d / "st", d / name, "--format", "flight_recorder"], "cwd": d, "timeout": 30})
        names.append((d, name))
    t0 = time.monotonic()
    for (d, name), res in zip(names, run_cases(cases, tmp_path / "run")):
        res.refused(name, "2^61")
        assert os.listdir(d) == [name]
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("shape", ["dict", "set", "tuple_keys"])
def test_colliding_keys_refused_fast_in_pt(tmp_path, shape):
    """The .pt route (torch.load(weights_only=True)): data.pkl checked before torch reads it."""
    torch = pytest.importorskip("torch")
    p = tmp_path / "expert_distribution_recorder_0.pt"
    torch.save({"logical_count": torch.zeros(2, 2, 4, dtype=torch.int64)}, p)
    # rewrite data.pkl inside the archive with the colliding value beside the counts
    import zipfile

    with zipfile.ZipFile(p) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    pkl = next(k for k in members if k.endswith("data.pkl"))
    flood = _dumps(_build(shape, 60_000, 1), 2)
    members[pkl] = flood
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        for k, v in members.items():
            z.writestr(k, v)
    res, = run_cases([{"args": ["ingest", tmp_path / "st", p, "--format", "sglang"], "cwd": tmp_path,
                       "timeout": 30}], tmp_path / "run")
    res.refused(p.name, "2^61")


def test_a_few_wide_integers_are_read(tmp_path):
    """Up to MAX_WIDE_INTS integers beyond 2^61 (and any number of timestamps below it)
    load as before: the check refuses floods, not values."""
    value = {"ts": [1_764_547_260_000_000_000 + i for i in range(50_000)], "wide": _keys(MAX_WIDE_INTS)}
    data = pickle.dumps(value, protocol=2)
    check_hash_flooding(data, "x")
    assert load_plain(tmp_path / "x", data) == value


def test_bytes_that_only_look_like_wide_integers(tmp_path):
    """A string full of the byte patterns the fast search looks for is counted exactly
    (opcodes listed) and read."""
    s = (b"\x8a\x09" * 5000).decode("latin-1")
    data = pickle.dumps({"s": s}, protocol=2)
    check_hash_flooding(data, "x")
    assert load_plain(tmp_path / "x", data) == {"s": s}


def test_container_items_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_MAX_CONTAINER_ITEMS", "100")
    data = pickle.dumps({i: i for i in range(101)}, protocol=2)
    with pytest.raises(InputError, match="max_container_items"):
        load_plain(tmp_path / "x", data)
