from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import settings

from .helpers import MODULE_FIXTURES, REPO, require_spark
from .helpers.forked_ranks import forked_ranks as _forked_ranks

# ------------------------------------------------------------------- pytest-xdist workers
# The README's command runs the suite on 3 workers (``-n 3 --dist loadgroup``) on a 2-core
# machine: two would leave a quarter of the cores idle while tests wait on the subprocesses
# they start. Each worker is at most one core's worth of work: its polars, BLAS/OpenMP (torch)
# and DuckDB thread pools are capped at one thread, so the workers do not fight over the
# cores (an earlier two-worker run, uncapped, used 16.5 min of CPU where one took 13). Set
# before polars or torch is imported (they read these once); the subprocesses a test starts
# inherit them. DuckDB reads no environment variable of its own: a Store's connections take
# their thread count from MOETRACE_DUCKDB_THREADS.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    for _var in ("POLARS_MAX_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                 "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS",
                 "MOETRACE_DUCKDB_THREADS"):
        os.environ.setdefault(_var, "1")

# Tables and prose fit the terminal's width; the tests read them at the 120 columns the docs
# show, whatever terminal (or none) the suite runs under.
os.environ["COLUMNS"] = "120"

#: fixtures several modules take, and the xdist group of those modules' tests (with their
#: module-scoped ones): one worker builds the fixture once. two_runs_template: a session
#: fixture of this conftest; forked_ranks (tests/helpers/forked_ranks.py): the reference-run
#: ranks' forkserver, which imports torch, torch._dynamo and pandas once per worker process
#: (~5 s of CPU), whichever module starts it first
SHARED_FIXTURE_GROUPS = {"two_runs_template": "shared:two_runs", "forked_ranks": "shared:forked_ranks"}

#: the seconds a test counts for when ordering the work units, until this checkout's pytest
#: cache has its measured duration (``DURATIONS_KEY``): a test marked ``slow`` (the house
#: rule: more than a few seconds) and any other
SLOW_SECONDS, DEFAULT_SECONDS = 5.0, 0.3
DURATIONS_KEY = "moetrace/durations"
GROUPS_FILE = "xdist-groups.json"


def pytest_configure(config):
    # the order of the work units is ours (longest first, pytest_collection_modifyitems), not
    # xdist's default for --dist loadgroup (the groups with the most tests first)
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):   # the controller (or a serial run): once per run
        _compile_sources()
        global _DURATIONS
        _DURATIONS = {}


#: seconds per test id this run (the controller's, or a serial run's)
_DURATIONS: dict[str, float] | None = None
_GROUPS_DIR = pytest.StashKey[str]()


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


def _group(item, shared_module: dict[str, str]) -> str | None:
    """The xdist group of a test: every test on the shared Spark session in one (one JVM,
    on one worker); a module taking a shared session fixture (:data:`SHARED_FIXTURE_GROUPS`)
    in its group, with its tests of a module-scoped fixture; the tests of a module-scoped
    fixture (``helpers.module_fixture``) in their module's group; else none."""
    names = getattr(item, "fixturenames", ())
    module = item.nodeid.split("::")[0]
    if "spark_session" in names:
        return "spark"
    mod = getattr(item, "module", None)
    module_scoped = mod is not None and any(
        any(getattr(mod, f, None) is fx for fx in MODULE_FIXTURES) for f in names)
    if module in shared_module and (module_scoped or any(f in names for f in SHARED_FIXTURE_GROUPS)):
        return shared_module[module]
    return "module:" + module if module_scoped else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under xdist (``-n 3 --dist loadgroup``), on each worker: the tests' groups
    (:func:`_group`), written for the controller's scheduler (:func:`pytest_xdist_make_scheduler`),
    and the work units ordered longest first by the last measured durations (the pytest
    cache), else by the ``slow`` marks. A plain run keeps pytest's order."""
    if not XDIST_WORKER:
        return
    shared_module = {}     # module -> the group of the shared session fixture its tests take
    for item in items:
        for fx, group in SHARED_FIXTURE_GROUPS.items():
            if fx in getattr(item, "fixturenames", ()):
                shared_module[item.nodeid.split("::")[0]] = group
    groups = {item.nodeid: g for item in items if (g := _group(item, shared_module))}
    groups_dir = config.workerinput.get("moetrace_groups_dir")
    if groups_dir:     # every worker collects the same tests: each writes the same map
        path = Path(groups_dir) / GROUPS_FILE
        tmp = path.with_name(f"{GROUPS_FILE}.{XDIST_WORKER}")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, path)
    cache = getattr(config, "cache", None)
    measured = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    weight: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        u = groups.get(item.nodeid, item.nodeid)
        s = measured.get(item.nodeid)
        if s is None:
            s = SLOW_SECONDS if item.get_closest_marker("slow") else DEFAULT_SECONDS
        weight[u] = weight.get(u, 0.0) + s
        first.setdefault(u, i)
    items.sort(key=lambda it: (-weight[groups.get(it.nodeid, it.nodeid)],
                               first[groups.get(it.nodeid, it.nodeid)]))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """The controller hands each worker the folder for its map of test groups."""
    config = node.config
    if _GROUPS_DIR not in config.stash:
        import tempfile

        config.stash[_GROUPS_DIR] = tempfile.mkdtemp(prefix="moetrace-xdist-")
    node.workerinput["moetrace_groups_dir"] = config.stash[_GROUPS_DIR]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the workers' groups: xdist's own scheduler, given each test
    id with ``@group`` appended (the form its ``xdist_group`` marks produce), read from the
    map the workers wrote at collection. xdist 3.8 writes those ids through an attribute
    pytest >= 9.2 no longer reads, so its marks alone would group nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Grouped(LoadGroupScheduling):
        def add_node_collection(self, node, collection):
            path = Path(config.stash.get(_GROUPS_DIR, "")) / GROUPS_FILE
            groups = json.loads(path.read_text()) if path.is_file() else {}
            super().add_node_collection(node, [
                nid + "@" + groups[nid] if nid in groups and not nid.endswith("@" + groups[nid])
                else nid for nid in collection])

    return Grouped(config, log)


def pytest_runtest_logreport(report):
    """The controller (or a serial run) adds up each test's setup, call and teardown time."""
    if _DURATIONS is not None:
        _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    """The durations measured, for the next run's order (kept for tests not run this time)."""
    config = session.config
    cache = getattr(config, "cache", None)
    if _DURATIONS and cache is not None:
        cache.set(DURATIONS_KEY, {**cache.get(DURATIONS_KEY, {}),
                                  **{k: round(v, 3) for k, v in _DURATIONS.items()}})
    groups_dir = config.stash.get(_GROUPS_DIR, None)
    if groups_dir:
        import shutil

        shutil.rmtree(groups_dir, ignore_errors=True)


# Property tests: derandomized (a fixed seed per test) so a failure reproduces, in CI and by
# default; HYPOTHESIS_PROFILE=random explores new examples on every run (docs/hardening.md).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("random", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def two_runs_template(tmp_path_factory):
    """test_analysis_materialize's and test_analysis_cache's two runs (tests/helpers/two_runs.py):
    (path, run ids). Read-only: a test opens its own Store on it or copies it."""
    from .helpers.two_runs import build

    path = tmp_path_factory.mktemp("two-runs") / "st"
    return path, build(path)


@pytest.fixture(scope="session")
def two_runs_live(two_runs_template):
    """{run id: {view: rows}}: the plain views of the two runs, computed once."""
    from .helpers.two_runs import live_views

    return live_views(*two_runs_template)


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def cli():
    from moetrace.cli import cli as group

    group.load_all()   # commands are imported on demand; tests walk cli.commands
    return group


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


@pytest.fixture(scope="module")
def forked_ranks():
    """Reference-run ranks forked from a forkserver with torch imported (tests/helpers/forked_ranks.py)."""
    with _forked_ranks():
        yield


@pytest.fixture()
def slot_store(tmp_path):
    """(store path, tokens[step, layer, slot]): 8 experts on 12 slots (4 redundant), 4 ranks
    x 3 slots, 2 nodes, 2 layers, 6 steps (tests/helpers/slot_store.py)."""
    from .helpers.slot_store import build_slot_store

    return build_slot_store(tmp_path)
