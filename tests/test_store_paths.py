"""Store paths that DuckDB or Arrow would not take literally.

DuckDB's read_parquet reads ``<store>/<table>/*/*.parquet`` as a pattern even in the
folder part (``a[1]`` matches ``a1``), both DuckDB and Arrow expand a leading ``~`` and
Arrow reads a relative ``file:/x`` as the URI of ``/x``. Each such store path is refused
with one line (exit 2) before anything is read or created, and no other folder's store is
read or changed; a symlink without those characters opens the store they are in.
"""
from __future__ import annotations

import json
import os

import duckdb
import pytest

from moetrace.errors import StoreError
from moetrace.run import Store
from moetrace.storage.paths import GLOB_CHARS

from .helpers import invoke as _cli
from .helpers import one_line_error as _one_line
from .helpers import tree_hash

SYNTH = ["--layers", "2", "--experts", "8", "--top-k", "2", "--ranks", "2", "--ranks-per-node", "2", "--steps", "3",
         "--tokens-per-step", "64"]




def _synth(runner, cli, path, seed: int) -> None:
    res = _cli(runner, cli, "synth", path, *SYNTH, "--seed", seed)
    assert res.exit_code == 0, res.output


def _runs_json(runner, cli, path) -> list[str]:
    res = _cli(runner, cli, "runs", path, "--format", "json")
    assert res.exit_code == 0, res.output
    return sorted(r["run_id"] for r in json.loads(res.output))


@pytest.mark.parametrize("name, neighbour", [("a[1]", "a1"), ("x*y", "xAy"), ("q?", "qZ"), ("b{c}", "b{c}x"),
                                             ("r]", "r]x")])
def test_store_path_with_pattern_characters_is_refused(runner, cli, tmp_path, name, neighbour):
    """A neighbour store the pattern would match is never read nor changed; the folder
    named by the pattern is not created; reads and writes are refused alike."""
    other = tmp_path / neighbour
    if not any(c in neighbour for c in GLOB_CHARS):
        _synth(runner, cli, other, 0)
    before = tree_hash(tmp_path)
    target = tmp_path / name
    found = "".join(c for c in GLOB_CHARS if c in name)
    for args in (("runs", target), ("synth", target, *SYNTH), ("sql", target, "SELECT count(*) FROM expert_load")):
        _one_line(_cli(runner, cli, *args), str(target), repr(found), "file pattern")
    assert not target.exists()
    assert tree_hash(tmp_path) == before
    with pytest.raises(StoreError, match="file pattern"):
        Store(target, create=True)
    assert not target.exists()


def test_existing_store_under_a_pattern_folder_opens_through_a_symlink(runner, cli, tmp_path):
    """``a[1]`` holds run synth-s5, its neighbour ``a1`` holds synth-s0: through a symlink
    the store reads only its own run (views, catalog), never the neighbour's files."""
    _synth(runner, cli, tmp_path / "a1", 0)
    link = tmp_path / "ok"
    (tmp_path / "a[1]").mkdir()
    link.symlink_to(tmp_path / "a[1]", target_is_directory=True)
    _synth(runner, cli, link, 5)
    assert (tmp_path / "a[1]" / "expert_counts" / "run_id=synth-s5").is_dir()
    a1_before = tree_hash(tmp_path / "a1")
    for cmd in ("runs", "skew", "report"):
        _one_line(_cli(runner, cli, cmd, tmp_path / "a[1]"), "file pattern")
    assert _runs_json(runner, cli, link) == ["synth-s5"]
    st = Store(link)
    # every table reads this store's files only: 3 steps x 2 layers of one run
    assert st.sql("SELECT DISTINCT run_id FROM expert_counts")["run_id"].to_list() == ["synth-s5"]
    assert st.sql("SELECT count(*) AS n FROM expert_counts")["n"][0] == 3 * 2
    assert st.sql("SELECT DISTINCT run_id FROM steps")["run_id"].to_list() == ["synth-s5"]
    st.close()
    res = _cli(runner, cli, "catalog", link)
    assert res.exit_code == 0, res.output
    cat = duckdb.connect(str(link / "catalog.duckdb"), read_only=True)
    cat.execute(f"SET file_search_path='{link}'")
    assert cat.execute("SELECT DISTINCT run_id FROM expert_counts").fetchall() == [("synth-s5",)]
    cat.close()
    assert tree_hash(tmp_path / "a1") == a1_before


def test_catalog_refuses_a_full_path_duckdb_would_split(runner, cli, tmp_path):
    """DuckDB's file_search_path is a comma-separated list: the catalog of ``x/a,b`` would
    bind its views to ``x/a``'s files. Reading the store works; its catalog is refused."""
    _synth(runner, cli, tmp_path / "a", 0)
    _synth(runner, cli, tmp_path / "a,b", 5)
    assert _runs_json(runner, cli, tmp_path / "a,b") == ["synth-s5"]
    before = tree_hash(tmp_path)
    _one_line(_cli(runner, cli, "catalog", tmp_path / "a,b"), str(tmp_path / "a,b"), "','", "catalog not written")
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("name, what", [("~/st", "home folder"), ("~st", "home folder"), ("file:/st", "URI"),
                                        ("mem:st", "URI")])
def test_store_path_duckdb_or_arrow_would_expand_is_refused(runner, cli, tmp_path, monkeypatch, name, what):
    """A quoted ``~`` (the shell did not expand it) or a relative ``file:`` path: DuckDB
    and Arrow read and write them elsewhere (``$HOME/st``, ``/st``). Refused, nothing made
    anywhere, the store that the expansion names is untouched."""
    home = tmp_path / "home"
    _synth(runner, cli, home / "st", 0)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    before = tree_hash(tmp_path)
    for args in (("runs", name), ("synth", name, *SYNTH), ("sql", name, "SELECT 1")):
        _one_line(_cli(runner, cli, *args), name, what)
    assert tree_hash(tmp_path) == before and not any(work.iterdir())
    # the same folder given by its full path is an ordinary store
    full = work / name
    _synth(runner, cli, full, 3)
    assert _runs_json(runner, cli, full) == ["synth-s3"]
    assert os.path.isdir(full / "expert_counts" / "run_id=synth-s3")
