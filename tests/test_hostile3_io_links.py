"""Outputs never written through a link (moetrace/output.py, AtomicOutput).

Generated cases: every writer (``sql -o`` CSV and Parquet, ``runs -o``, ``plan --export``
in each format, ``report`` files, ``replay --chrome-trace``) x every planted link (at the
output's name, pointing at a file outside, at a store file, at nothing, at a folder; and
at the temporary names older versions used). A link at the output name is refused (one
line naming it, exit 2, the link and its target unchanged, the store unchanged); a link
planted anywhere else is never followed (the victim unchanged, the output a regular file
beside it)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers import module_fixture, tree_hash
from .helpers.bounded_cli import run_cases, synth_store


@module_fixture
def world(tmp_path_factory):
    return synth_store(tmp_path_factory.mktemp("links"))


WRITERS = {
    "sql_csv": (["sql", "st", "SELECT 1 AS a", "-o", "{out}"], "out.csv"),
    "sql_parquet": (["sql", "st", "SELECT 1 AS a", "-o", "{out}"], "out.parquet"),
    "runs_csv": (["runs", "st", "-o", "{out}"], "out.csv"),
    "plan_sglang": (["plan", "st", "--policy", "greedy", "--no-store", "--export", "{out}"], "out.json"),
    "plan_trtllm": (["plan", "st", "--policy", "greedy", "--no-store", "--export", "{out}",
                     "--export-format", "trtllm"], "out.yaml"),
}
TARGETS = ("outside_file", "store_file", "dangling", "folder")


def _victim(world: Path, kind: str, case: str) -> Path:
    if kind == "outside_file":
        v = world / f"victim_{case}.txt"
        v.write_text("precious\n")
        return v
    if kind == "store_file":
        return world / "st" / "moetrace-store.json"
    if kind == "dangling":
        return world / f"nothing_{case}"
    d = world / f"dir_{case}"
    d.mkdir(exist_ok=True)
    return d


def _snapshot(p: Path):
    if p.is_dir():
        return tree_hash(p)
    return p.read_bytes() if p.exists() else None


def test_link_at_the_output_name_is_refused(world, tmp_path):
    cases, checks = [], []
    for wname, (args, name) in WRITERS.items():
        for kind in TARGETS:
            case = f"{wname}_{kind}"
            out = world / f"{case}_{name}"
            victim = _victim(world, kind, case)
            out.symlink_to(victim)
            cases.append({"args": [a.replace("{out}", out.name) for a in args], "cwd": world})
            checks.append((case, out, victim, _snapshot(victim)))
    store_before = tree_hash(world / "st")
    listing = sorted(os.listdir(world))
    for (case, out, victim, before), res in zip(checks, run_cases(cases, tmp_path, timeout=60)):
        line = res.refused(out.name)
        assert "symbolic link" in line or case.endswith("folder") and "directory" in line, line
        assert out.is_symlink() and os.readlink(out) == str(victim), case
        assert _snapshot(victim) == before, case
    assert tree_hash(world / "st") == store_before
    assert sorted(os.listdir(world)) == listing   # no temporary file left beside the outputs


@pytest.mark.parametrize("wname", sorted(WRITERS))
def test_links_planted_at_temporary_names_are_not_followed(world, tmp_path, wname):
    args, name = WRITERS[wname]
    d = world / f"tmpnames_{wname}"
    d.mkdir()
    out = d / name
    victim = world / f"victim_tmp_{wname}.txt"
    victim.write_text("precious\n")
    # the names a writer could guess: the old fixed temporary name and common variants
    for planted in (f".{name}.moetrace-tmp", f"{name}.tmp", f".{name}.tmp", f"{name}~"):
        (d / planted).symlink_to(victim)
    store_before = tree_hash(world / "st")
    res, = run_cases([{"args": [a.replace("{out}", str(out)) for a in args], "cwd": world}], tmp_path)
    assert res.rc == 0, res.stderr
    assert victim.read_text() == "precious\n"
    assert out.is_file() and not out.is_symlink() and out.stat().st_size > 0
    assert tree_hash(world / "st") == store_before
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [name, f".{name}.moetrace-tmp", f"{name}.tmp", f".{name}.tmp", f"{name}~"])


def test_report_files_are_not_written_through_links(world, tmp_path):
    """report writes report.md, report.html and PNGs into --out-dir: each a link to a
    victim is refused by name or replaced, never followed."""
    rep = world / "rep"
    rep.mkdir()
    victim = world / "victim_report.txt"
    victim.write_text("precious\n")
    (rep / "report.md").symlink_to(victim)
    res, = run_cases([{"args": ["report", "st", "--out-dir", "rep", "--quiet"], "cwd": world}], tmp_path,
                     timeout=180)
    res.refused("report.md", "symbolic link")
    assert victim.read_text() == "precious\n"
    assert (rep / "report.md").is_symlink()


def test_atomic_output_unit(tmp_path):
    """The temporary file lives in a private folder (mode 0700) and is created O_EXCL:
    a second open of it fails rather than reusing what is there."""
    from moetrace.output import AtomicOutput

    with AtomicOutput(tmp_path / "x.csv") as out:
        assert (os.stat(out.tmp.parent).st_mode & 0o777) == 0o700
        with out.open("wb") as f:
            f.write(b"a\n1\n")
        with pytest.raises(FileExistsError):
            out.open("wb")
    assert (tmp_path / "x.csv").read_bytes() == b"a\n1\n"
    assert os.listdir(tmp_path) == ["x.csv"]
    with pytest.raises(RuntimeError):
        with AtomicOutput(tmp_path / "y.csv") as out:
            out.open().close()
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["x.csv"]
