from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent

# Property tests: derandomized (a fixed seed per test) so a failure reproduces, in CI and by
# default; HYPOTHESIS_PROFILE=random explores new examples on every run (docs/hardening.md).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("random", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


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


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def cli():
    from moetrace.cli import cli as group

    group.load_all()   # commands are imported on demand; tests walk cli.commands
    return group


def invoke(runner, cli, *args):
    """``cli`` through a click runner with every argument as text, exceptions caught."""
    return runner.invoke(cli, [str(a) for a in args], catch_exceptions=True)


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


@pytest.fixture(scope="session")
def spark_session():
    """One Spark session (one JVM, one SparkContext) for the Spark tests that take it
    (test_spark_views, test_store_spark): a JVM start is tens of seconds on 2 cores.
    ``moetrace.storage.spark.keep_session`` also hands it to any ``--engine spark`` command
    run while it is alive."""
    require_spark()
    from moetrace.storage import spark as ms

    # the tests' stores are tiny: compiling each stage's Java code (whole-stage codegen)
    # and re-planning at run time (AQE) cost more than the queries; the results are the
    # same (both are execution strategies, not semantics)
    sp = ms.session("local[2]", conf={"spark.sql.codegen.wholeStage": "false", "spark.sql.adaptive.enabled": "false"})
    ms.keep_session(sp)
    yield sp
    ms.keep_session(None)
    sp.stop()
