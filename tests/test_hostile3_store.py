"""Hostile stores, round 3: what a store folder holds cannot hang a reader, send it
outside the store, or make it allocate past what it reads (docs/hardening.md, "Hostile
stores, round 3").

Each family's cases are generated here (every kind of non-regular entry at every place a
reader lists; every runs value past its range): a store is copied from one small seeded
template, damaged, and every command that reads it runs in ONE fresh child process per
case (:func:`run_cli`), which must end each command in exit 2 and one line naming the
damaged path, stay under 1 GiB (the child's VmHWM) and finish within the timeout (a FIFO
opened by a reader would hang it), while the whole test folder (store, inputs, a fake
HOME) stays byte for byte as it was, except the report folder a command was asked to
write. This file: families 4 (special files, too many entries) and 12 (store integrity:
symlinked folders, the marker). tests/test_hostile3_store_contents.py: family 5;
tests/test_hostile3_store_txn.py: families 6, 9 and 10."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO

GIB = 1 << 30

#: runs each argv list (JSON on argv[1]) through moetrace's main in this one process and
#: prints, as JSON, [[exit code, stderr, stdout], ...] and the process's peak RSS (VmHWM)
_DRIVER = r"""
import contextlib, io, json, sys
from moetrace.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    out.append([code, err.getvalue(), std.getvalue()])
hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))
print(json.dumps({"results": out, "peak": int(hwm.split()[1]) * 1024}))
"""


def run_cli(argvs: list[list[str]], cwd: Path, env: dict | None = None, timeout: float = 90) -> tuple[list, int]:
    """([(exit code, stderr, stdout)] per argv, peak RSS in bytes) of the commands run in
    one fresh child (a hang is subprocess.TimeoutExpired: the test fails)."""
    e = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(cwd / "home"),
             **(env or {}))
    p = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([[str(a) for a in v] for v in argvs])],
                       cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout.splitlines()[-1])
    return doc["results"], doc["peak"]


def one_line(res, *needles: str) -> str:
    """Exit 2 and exactly one line on stderr, ``moetrace: error: ...``, naming every needle."""
    code, err, _ = res
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moetrace: error:"), (code, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def tree_hash(root: Path, skip: str | None = None) -> str:
    """conftest's tree_hash for folders that hold special files: sha256 over every path
    (links not followed), each regular file's bytes, each link's target and each other
    entry's type (reading a planted FIFO would hang the test), ``skip`` (a command's asked
    output folder, directly under ``root``) left out."""
    import hashlib
    import stat

    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        rel_dir = os.path.relpath(dirpath, root)
        if skip and (rel_dir == skip or rel_dir.startswith(skip + os.sep)):
            continue
        dirnames.sort()
        h.update(f"D:{rel_dir}\n".encode())
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            p = os.path.join(dirpath, name)
            mode = os.lstat(p).st_mode
            h.update(f"F:{os.path.relpath(p, root)}:{stat.S_IFMT(mode)}\n".encode())
            if stat.S_ISREG(mode):
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
            elif stat.S_ISLNK(mode):
                h.update(os.readlink(p).encode())
    return h.hexdigest()


@pytest.fixture(scope="session")
def seeded(tmp_path_factory) -> Path:
    """A store with one run (4 expert_load rows, shape known) and a plan: copy it, never
    change it."""
    from moetrace.collect import ingest
    from moetrace.storage.store import Store

    root = tmp_path_factory.mktemp("hostile3")
    src = root / "seed.csv"
    src.write_text("step,layer,expert,tokens\n0,0,0,3\n0,0,1,5\n0,0,2,0\n0,0,3,0\n1,0,0,2\n1,0,1,2\n1,0,2,2\n1,0,3,2\n")
    st = root / "store"
    ingest(Store(st, create=True), [src], options={"num_ranks": 2, "top_k": 1})
    return st


def fresh(seeded: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a copy of the seeded store, a CSV to ingest) in ``tmp_path``, with a fake HOME."""
    st = tmp_path / "st"
    shutil.copytree(seeded, st, symlinks=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "in").mkdir()
    b = tmp_path / "in" / "b.csv"
    b.write_text("step,layer,expert,tokens\n0,0,0,1\n0,0,1,1\n0,0,2,1\n0,0,3,1\n")
    return st, b


def the_file(st: Path, table: str | None = None) -> Path:
    """A data file of ``table`` (default: of the run's load, dense or long)."""
    return next(f for t in ([table] if table else ["expert_counts", "expert_load"])
                for f in sorted((st / t).glob("run_id=*/*.parquet")))


def readers(st: Path, b: Path, report: bool = True) -> list[list[str]]:
    """Every command that reads the store, and a writer (ingest) that reads it first."""
    out = [["runs", st], ["sql", st, "SELECT count(*) FROM expert_load"], ["skew", st], ["ingest", st, b]]
    return out + ([["report", st, "--out-dir", st.parent / "out" / "rep"]] if report else [])


def assert_refused(st: Path, b: Path, tmp_path: Path, needle: str, report: bool = True, env: dict | None = None,
                   check_needle: str | None = None) -> None:
    """Every reader and ``check`` exit 2 naming ``needle``; under 1 GiB, no hang, nothing changed."""
    before = tree_hash(tmp_path, "out")
    cmds = readers(st, b, report) + [["check", st, "--quick"], ["check", st]]
    res, peak = run_cli(cmds, tmp_path, env)
    for argv, r in zip(cmds, res):
        if argv[0] == "check":
            assert r[0] == 2 and (check_needle or needle) in r[2], (argv, r)
            assert all(ln.count(": ") >= 1 for ln in r[2].splitlines())
        else:
            assert r[0] == 2, (argv, r)
            one_line(r, needle)
    assert peak < GIB, f"peak RSS {peak / 2**20:.0f} MiB"
    assert tree_hash(tmp_path, "out") == before


# ----------------------------------------------------------------------------- family 4
def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(p.parent)   # a socket's path must be short: bound by its name in its folder
    try:
        s.bind(p.name)
    finally:
        os.chdir(here)
        s.close()


def _link_dev_zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _link_outside(p: Path) -> None:
    p.symlink_to(p.parents[3] / "outside.parquet")   # a copy of the file, outside the store


def _folder(p: Path) -> None:
    p.mkdir()


def _char_device(p: Path) -> None:
    try:
        os.mknod(p, 0o600 | 0o020000, os.makedev(1, 5))   # /dev/zero's numbers
    except PermissionError:
        pytest.skip("mknod needs root")


SPECIAL = [_fifo, _socket, _link_dev_zero, _link_outside, _folder, _char_device]


@pytest.mark.parametrize("where", ["replaces the load", "beside the load", "replaces runs"])
@pytest.mark.parametrize("make", SPECIAL, ids=lambda f: f.__name__.strip("_"))
def test_special_file_in_a_store_is_one_line_never_opened(make, where, seeded, tmp_path):
    st, b = fresh(seeded, tmp_path)
    f = the_file(st, "runs" if "runs" in where else None)
    shutil.copy(f, tmp_path / "outside.parquet")
    if where.startswith("replaces"):
        f.unlink()
    else:
        f = f.parent / "part-0123456789ab.parquet"
    make(f)
    # report only once per kind: its start-up is the slowest; the walk is the same
    assert_refused(st, b, tmp_path, str(f), report=where == "beside the load")


@pytest.mark.parametrize("limit,make", [("max_store_partitions", "empty partitions"),
                                        ("max_store_files", "files in one partition"),
                                        ("max_store_files", "junk beside the files")])
def test_more_entries_than_the_limit_is_one_line_naming_the_limit(limit, make, seeded, tmp_path):
    st, b = fresh(seeded, tmp_path)
    n = 40
    part = the_file(st).parent
    for i in range(n + 1):
        if make == "empty partitions":
            (st / "routing" / f"run_id=r{i}").mkdir(parents=True)
        elif make == "files in one partition":
            os.link(the_file(st), part / f"part-{i:012x}.parquet")
        else:
            (part / f"notes-{i}.txt").write_text("x")
    env = {f"MOETRACE_{limit.upper()}": str(n)}
    assert_refused(st, b, tmp_path, limit, report=make == "empty partitions", env=env)
    # raised, the same store reads (hard links of one run's file: the rows counted again)
    res, _ = run_cli([["runs", st]], tmp_path, {f"MOETRACE_{limit.upper()}": str(10 * n)})
    assert res[0][0] == 0, res


@pytest.mark.slow
def test_report_at_the_partition_limit_is_quick(seeded, tmp_path):
    """The default limit's worth of empty partition folders (10,000): report in well under
    60 s (the audit's 100,000 ran past 60 s; past the limit it is refused at once)."""
    import time

    from moetrace.safety import limit

    st, b = fresh(seeded, tmp_path)
    n = limit("max_store_partitions") - sum(1 for _ in st.glob("*/run_id=*")) - 50   # room for the cache
    for i in range(n):
        (st / "routing" / f"run_id=r{i}").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res, peak = run_cli([["report", st, "--out-dir", tmp_path / "out" / "rep", "--quiet"]], tmp_path)
    assert res[0][0] in (0, 1) and time.monotonic() - t0 < 60, res
    assert peak < GIB


# ----------------------------------------------------------------------------- family 12
def _table_folder_links_out(st: Path) -> Path:
    table = the_file(st).parents[1]
    out = st.parent / "elsewhere"
    shutil.move(str(table), out)
    table.symlink_to(out)
    return table


def _partition_folder_links_out(st: Path) -> Path:
    part = the_file(st).parent
    out = st.parent / "elsewhere"
    shutil.move(str(part), out)
    part.symlink_to(out)
    return part


def _runs_folder_links_out(st: Path) -> Path:
    out = st.parent / "elsewhere"
    shutil.move(str(st / "runs"), out)
    (st / "runs").symlink_to(out)
    return st / "runs"


def _marker_fifo(st: Path) -> Path:
    m = st / "moetrace-store.json"
    m.unlink()
    os.mkfifo(m)
    return m


def _marker_200mb(st: Path) -> Path:
    m = st / "moetrace-store.json"
    doc = m.read_text()
    with open(m, "w") as f:
        f.write(doc.rstrip() + " " * 16)
        f.truncate(200 << 20)   # sparse: 200 MB of NULs after the JSON
    return m


def _marker_format_999(st: Path) -> Path:
    m = st / "moetrace-store.json"
    m.write_text(json.dumps({"moetrace_store_format": 999, "created_by": "9.9.9"}))
    return m


def _marker_links_out(st: Path) -> Path:
    m = st / "moetrace-store.json"
    out = st.parent / "marker.json"
    shutil.move(str(m), out)
    m.symlink_to(out)
    return m


def _marker_folder(st: Path) -> Path:
    m = st / "moetrace-store.json"
    m.unlink()
    m.mkdir()
    return m


def _marker_not_json(st: Path) -> Path:
    m = st / "moetrace-store.json"
    m.write_bytes(b"\xff\xfe{" * 100)
    return m


INTEGRITY = [_table_folder_links_out, _partition_folder_links_out, _runs_folder_links_out, _marker_fifo,
             _marker_200mb, _marker_format_999, _marker_links_out, _marker_folder, _marker_not_json]


@pytest.mark.parametrize("damage", INTEGRITY, ids=lambda f: f.__name__.strip("_"))
def test_store_integrity_is_refused_by_every_reader_and_check(damage, seeded, tmp_path):
    st, b = fresh(seeded, tmp_path)
    bad = damage(st)
    assert_refused(st, b, tmp_path, str(bad), report=damage in (_table_folder_links_out, _marker_fifo))


def test_check_passes_the_seeded_store(seeded, tmp_path):
    st, b = fresh(seeded, tmp_path)
    res, _ = run_cli([["check", st], ["check", st, "--quick"]], tmp_path)
    assert [r[0] for r in res] == [0, 0], res
