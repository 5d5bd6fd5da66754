"""Builders and helpers the test modules share (a package, not a test module: pytest
collects nothing here). Fixtures live in ``tests/conftest.py``; a test module imports
plain helpers from here, never from another test module or from conftest."""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()

#: the module-scoped fixture objects declared with :func:`module_fixture`: conftest sends a
#: module's tests that take one to one xdist worker, so the fixture is built once
MODULE_FIXTURES: list[Any] = []


def module_fixture(func):
    """``@pytest.fixture(scope="module")``, recorded in :data:`MODULE_FIXTURES`."""
    fx = pytest.fixture(scope="module")(func)
    MODULE_FIXTURES.append(fx)
    return fx


def run_row(**fields) -> dict:
    """A ``runs`` row for a hand-made run: the required provenance columns (``source``,
    ``source_sha256``, ``collector``, ``time_base``) with test defaults (a fresh random
    digest), overridden and extended by ``fields``."""
    row = {"source": "test", "source_sha256": uuid.uuid4().hex, "collector": "test", "time_base": "none"}
    row.update(fields)
    return row


def make_store(path, run: dict | None = None, tables: dict | None = None, run_id: str | None = None):
    """A new ``Store`` at ``path``; with ``tables``, one run written in it (``run`` defaults
    to :func:`run_row`) under ``run_id``. Returns the store."""
    from moetrace.run import Store

    st = Store(path, create=True)
    if tables is not None:
        st.write_run(run if run is not None else run_row(), tables, run_id=run_id)
    return st


def shared_data(*parts: str) -> Path:
    """A file under ../shared/data; skips the test (with the reason) when it is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"real trace {p} not available (tests read ../shared/data next to the repository)")
    return p


#: ``python -c SIGKILL_AT_REPLACE.format(repo=...) K moetrace-args...``: the CLI with a real
#: SIGKILL at its K-th ``os.replace`` (a writer killed amid its renames)
SIGKILL_AT_REPLACE = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from moetrace.cli import main
k, real, n = int(sys.argv[1]), os.replace, [0]
def replace(a, b):
    n[0] += 1
    if n[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(a, b)
os.replace = replace
main(sys.argv[2:])
"""


def tree_hash(root: str | os.PathLike) -> str:
    """sha256 over every path (files, folders, hidden ones) and file bytes under root."""
    root = Path(root)
    h = hashlib.sha256()
    if not root.exists():
        return "absent"
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        h.update(f"D:{rel}\n".encode())
        for name in sorted(filenames):
            p = Path(dirpath) / name
            h.update(f"F:{os.path.relpath(p, root)}\n".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def invoke(runner, cli, *args):
    """``cli`` through a click runner with every argument as text, exceptions caught."""
    return runner.invoke(cli, [str(a) for a in args], catch_exceptions=True)


def run_cli(*args, catch_exceptions: bool = False):
    """The ``moetrace`` command group through a fresh click runner, every argument as
    text (the one CLI runner of the test modules that take no ``runner``/``cli`` fixture);
    an exception propagates unless ``catch_exceptions``."""
    from click.testing import CliRunner

    from moetrace.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=catch_exceptions)


def one_line_error(res, *needles: str) -> str:
    """The refusal is exit 2 and one line starting ``moetrace: error:``, naming every needle."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrace: error:"), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _java_ok() -> bool:
    import shutil
    import subprocess

    java = shutil.which("java")
    return bool(java) and subprocess.run([java, "-version"], capture_output=True).returncode == 0


def require_spark():
    """Skip (with the reason) unless pyspark, sqlglot and a Java runtime are here."""
    pytest.importorskip("pyspark", reason="pip install 'moetrace[spark]' for the Spark tests")
    pytest.importorskip("sqlglot", reason="pip install 'moetrace[spark]' for the Spark tests")
    if not _java_ok():
        pytest.skip("no Java runtime (apt-get install default-jre-headless); .ci/run installs one")
