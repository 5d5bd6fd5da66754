from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------- pytest-xdist workers
# The README's command runs the suite on 3 workers (``-n 3 --dist loadgroup``) on a 2-core
# machine: two would leave a quarter of the cores idle while tests wait on the subprocesses
# they start. Each worker is at most one core's worth of work: its polars, BLAS/OpenMP (torch) and
# DuckDB thread pools are capped at one thread, so the workers do not fight over the
# cores (an earlier two-worker run, uncapped, used 16.5 min of CPU where one took 13). Set before polars or
# torch is imported (they read these once); the subprocesses a test starts inherit them.
# DuckDB reads no environment variable: its in-process connections get ``threads=1``
# (``_duckdb_one_thread``, also for moetrace.storage.engine's connections through ``_duckdb``); the CLI subprocesses keep DuckDB's default.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    for _var in ("POLARS_MAX_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                 "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ.setdefault(_var, "1")


def _duckdb_one_thread() -> None:
    import duckdb

    real = duckdb.connect
    if getattr(real, "_moetrace_one_thread", False):
        return

    def connect(database=":memory:", read_only=False, config=None, **kw):
        config = dict(config or {})
        config.setdefault("threads", 1)
        return real(database, read_only, config, **kw)

    connect._moetrace_one_thread = True
    duckdb.connect = connect
    # moetrace.storage.engine connects through the C extension the package re-exports
    import _duckdb

    _duckdb.connect = connect
    duckdb.execute("SET threads=1")   # the module-level connection (duckdb.sql, duckdb.execute)


if XDIST_WORKER:
    _duckdb_one_thread()

#: approximate seconds of the slowest tests (``--durations``, 2-core machine): the workers
#: are handed the longest work units first, so the two finish together instead of one
#: running a 3-minute unit alone at the end. Keys are node-id prefixes; the rest count
#: DEFAULT_SECONDS. Rough is enough: only the order of the heaviest units matters.
HEAVY_SECONDS = {
    "tests/test_spark_cli.py": 25.0,           # the Spark tests: one group, one JVM (~3 min)
    "tests/test_spark_views.py": 10.0,
    "tests/test_store_spark.py": 20.0,
    "tests/test_benchmarks_small.py::test_every_benchmark_is_listed_and_run_all_succeeds": 95.0,
    "tests/test_benchmarks_small.py::test_run_all_only": 3.0,
    "tests/test_calibrate.py::test_fidelity_matrix_small": 4.0,     # forked ranks (was 40 s)
    "tests/test_calibrate.py": 2.0,
    "tests/test_report_truth.py::test_tables_fit_a_1400px_window": 5.0,   # one Chromium for all pages
    "tests/test_report_truth.py": 1.5,
    "tests/test_store_atomic.py::test_sigkill_at_every_rename": 8.0,
    "tests/test_store_atomic.py": 2.5,
    "tests/test_whatif.py::test_two_micro_batch_refrun": 15.0,
    "tests/test_refrun.py": 4.0,
    "tests/test_waits.py::test_injected_delay": 8.0,
    "tests/test_analysis_materialize.py::test_batched_views": 5.0,
    "tests/test_analysis_cache.py": 2.5,
    "tests/test_hostile_families.py::test_refused_with_one_line[nsys_generated_huge": 7.0,
    "tests/test_hostile_families.py::test_tiny_files_stay_under_a_gib[nsys_generated_huge": 1.5,
    "tests/test_report.py": 2.0,
    "tests/test_txn_append.py::test_killed_between_any_two_renames": 2.5,
    "tests/test_dense.py": 1.5,
    "tests/test_sql_sandbox.py": 1.5,
    "tests/test_fidelity_cpu_basis.py": 5.0,
}
DEFAULT_SECONDS = 0.3


def _seconds(nodeid: str) -> float:
    best = ""
    for key in HEAVY_SECONDS:
        if nodeid.startswith(key) and len(key) > len(best):
            best = key
    return HEAVY_SECONDS[best] if best else DEFAULT_SECONDS


def _module_scoped(item) -> bool:
    """Does the test use a fixture its own module defines at module (or class) scope? Its
    module's tests then go to one worker, so the fixture is built once, not once per worker."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        for d in defs:
            if d.scope in ("module", "class") and getattr(d, "baseid", "").startswith(item.nodeid.split("::")[0]):
                return True
    return False


#: fixtures several modules take, and the xdist group of those modules' tests (with their
#: module-scoped ones): one worker builds the fixture once. two_runs_template: a session
#: fixture of this conftest; forked_ranks (tests/_forked_ranks.py): the reference-run ranks'
#: forkserver, which imports torch, torch._dynamo and pandas once per worker process (~5 s
#: of CPU), whichever module starts it first
SHARED_FIXTURE_GROUPS = {"two_runs_template": "shared:two_runs", "forked_ranks": "shared:forked_ranks"}


def pytest_configure(config):
    # the order of the work units is ours (longest first, pytest_collection_modifyitems), not
    # xdist's default for --dist loadgroup (the groups with the most tests first)
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):   # the controller (or a serial run): once per run
        _compile_sources()


def _compile_sources() -> None:
    """Byte-compile moetrace/ and benchmarks/ into their (git-ignored) ``__pycache__``
    before any test runs. The suite starts over a hundred interpreters (CLI subprocesses,
    the benchmarks, killed writers, reference-run ranks) that import the package; under
    ``PYTHONDONTWRITEBYTECODE`` none of them writes its bytecode, so without this each
    would compile the modules it imports again from source (~0.1-0.5 s of CPU apiece).
    Up-to-date files are skipped (a stat each); a tree that cannot be written is left as
    it is."""
    import compileall

    for d in ("moetrace", "benchmarks"):
        with contextlib.suppress(OSError):
            compileall.compile_dir(REPO / d, quiet=2)


def _group_node_id(item, group: str) -> None:
    """What xdist does with an ``xdist_group`` mark under ``--dist loadgroup``: the group's
    name after an ``@`` in the node id, which its scheduler splits the work units by.
    pytest-xdist 3.8 writes ``item._nodeid``, which pytest >= 9.2 no longer reads (the id
    is ``item._id``), so the groups would silently be ignored: set it here."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:     # pytest < 9.2: xdist's own hook does it
        return
    nid = getattr(item, "_id", None)
    if not isinstance(nid, NodeId) or not nid.names or item.nodeid.endswith("@" + group):
        return
    # 'name[params]@group' as the last name, no params: the id prints the same if rebuilt
    last = nid.names[-1] + (f"[{nid.params}]" if nid.params is not None else "") + "@" + group
    item._id = NodeId(path=nid.path, names=(*nid.names[:-1], last))


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook turns the xdist_group marks into node ids
def pytest_collection_modifyitems(config, items):
    """Under xdist (``-n 3 --dist loadgroup``): every test on the shared Spark session in one
    group (one JVM, on one worker), the modules taking a shared session fixture
    (:data:`SHARED_FIXTURE_GROUPS`) in its group, the tests of a module-scoped fixture in
    their module's group, and the work units ordered longest first. A plain run keeps
    pytest's order."""
    if not XDIST_WORKER:
        return
    shared_module = {}     # module -> the group of the shared session fixture its tests take
    for item in items:
        for fx, group in SHARED_FIXTURE_GROUPS.items():
            if fx in getattr(item, "fixturenames", ()):
                shared_module[item.nodeid.split("::")[0]] = group
    unit_of = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        if "spark_session" in getattr(item, "fixturenames", ()):
            group = "spark"
        elif module in shared_module and (_module_scoped(item) or any(
                fx in getattr(item, "fixturenames", ()) for fx in SHARED_FIXTURE_GROUPS)):
            group = shared_module[module]
        elif _module_scoped(item):
            group = "module:" + module
        else:
            group = None
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            _group_node_id(item, group)
        unit_of[id(item)] = group or item.nodeid
    weight: dict[str, float] = {}
    for item in items:
        u = unit_of[id(item)]
        weight[u] = weight.get(u, 0.0) + _seconds(item.nodeid)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(unit_of[id(item)], i)
    items.sort(key=lambda it: (-weight[unit_of[id(it)]], first[unit_of[id(it)]]))

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


@pytest.fixture(scope="session")
def two_runs_template(tmp_path_factory):
    """test_analysis_materialize's and test_analysis_cache's two runs (tests/_two_runs.py):
    (path, run ids). Read-only: a test opens its own Store on it or copies it."""
    from ._two_runs import build

    path = tmp_path_factory.mktemp("two-runs") / "st"
    return path, build(path)


@pytest.fixture(scope="session")
def two_runs_live(two_runs_template):
    """{run id: {view: rows}}: the plain views of the two runs, computed once."""
    from ._two_runs import live_views

    return live_views(*two_runs_template)


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

    # the tests' stores are tiny: compiling Java code (whole-stage codegen, and the
    # per-expression code of projections and predicates: factoryMode NO_CODEGEN runs them
    # interpreted), re-planning at run time (AQE) and splitting each shuffle in 4 cost more
    # than the queries; so does the JVM's optimizing JIT (C2) in a JVM that lives a few
    # minutes: C1 only. The results are the same (execution strategies, not semantics).
    # The heap: the analysed plans of the nested views stay live (~400 MB), so a small
    # young generation copies them at every collection and the growing old one is
    # collected in full: a young generation of 1 GiB, a 2 GiB start and room for the
    # classes cut the collector's pauses over test_spark_cli.py from 6.8 s (108 pauses,
    # 9 full) to 2.0 s (21, none full), by -Xlog:gc, 2026-12-04.
    sp = ms.session("local[2]", conf={
        "spark.sql.codegen.wholeStage": "false", "spark.sql.adaptive.enabled": "false",
        "spark.sql.codegen.factoryMode": "NO_CODEGEN", "spark.sql.shuffle.partitions": "1",
        "spark.default.parallelism": "1",
        "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xms2g -Xmn1g "
                                        "-XX:MetaspaceSize=256m"})
    ms.keep_session(sp)
    yield sp
    ms.keep_session(None)
    sp.stop()
