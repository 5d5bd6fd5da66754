"""Store writers started from a forkserver, killed or raced by the atomicity tests."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa

from . import REPO, run_row

# a writer: kills itself with SIGKILL at the N-th os.replace, or after chunk K of expert_load
WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import pyarrow as pa
    from moetrace.storage.store import Store
    from tests.helpers.forked_writers import _chunk, _run, N_CHUNKS
    kill_at_replace, kill_after_chunk = int(sys.argv[2]), int(sys.argv[3])
    real = os.replace
    n = [0]
    def replace(a, b):
        n[0] += 1
        if n[0] == kill_at_replace:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(a, b)
    os.replace = replace
    def chunks():
        for i in range(N_CHUNKS):
            if i == kill_after_chunk:
                os.kill(os.getpid(), signal.SIGKILL)
            yield _chunk(i)
    st = Store(sys.argv[1])
    placement = pa.table({{"plan_id": ["recorded"] * 2, "layer": [0, 0], "slot": [0, 1], "rank": [0, 1],
                          "node": [0, 0], "expert": [0, 1]}})
    st.write_run(_run("new"), {{"expert_load": chunks(), "placement": placement}}, run_id="new")
    print("REPLACES", n[0])
""")


# The same writer, each one a process forked from a server that imported pyarrow and the store
# once (what a fresh interpreter spends most of a writer's time on): every writer is still its
# own process, started from a state with no store opened, that patches its own os.replace and
# SIGKILLs itself; the server reports how it ended (os.waitpid) and what it printed.
# tests/test_txn_append.py forks its SIGKILLed CLI writers (conftest.SIGKILL_AT_REPLACE) the same way.
FORK_SERVER = textwrap.dedent("""
    import importlib, os, sys
    sys.path.insert(0, {repo!r})
    import pyarrow as pa
    from moetrace.storage.store import Store
    import duckdb, polars, moetrace.storage.duck, moetrace.storage.writer, moetrace.storage.views, moetrace.storage.dense
    for name in sys.argv[2].split(","):
        importlib.import_module(name)
    code = compile(sys.argv[1], "<writer>", "exec")
    print("READY", flush=True)
    for line in sys.stdin:
        out, *args = line.rstrip("\\n").split("\\t")
        pid = os.fork()
        if pid == 0:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = ["-c", *args]
            try:
                exec(code, {{"__name__": "__main__"}})
                rc = 0
            except SystemExit as e:   # the CLI's own exit status
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
""")


class _ForkedWriters:
    """``code`` (default: WRITER) run by processes forked from one server that imported
    ``preload`` (module names) first; calling it with the writer's arguments runs one."""

    def __init__(self, tmp: Path, code: str | None = None, preload: tuple[str, ...] = ("tests.helpers.forked_writers",)):
        self.tmp, self.n = tmp, 0
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER.format(repo=str(REPO)),
                                      code if code is not None else WRITER.format(repo=str(REPO)), ",".join(preload)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        assert self.proc.stdout.readline() == "READY\n"

    def __call__(self, *args) -> subprocess.CompletedProcess:
        self.n += 1
        out = self.tmp / f"writer{self.n}.out"
        assert not any("\t" in str(a) or "\n" in str(a) for a in args), args
        self.proc.stdin.write("\t".join(map(str, (out, *args))) + "\n")
        self.proc.stdin.flush()
        rc = int(self.proc.stdout.readline())
        text = out.read_text()
        return subprocess.CompletedProcess(["writer", *map(str, args)], rc, text, text)

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


N_CHUNKS = 4


CHUNK_ROWS = 250


def _chunk(i: int) -> pa.Table:
    n = CHUNK_ROWS
    return pa.table({"step": [i] * n, "layer": [r % 5 for r in range(n)], "expert": [r // 5 for r in range(n)],
                     "slot": pa.nulls(n, pa.int32()), "src_rank": pa.nulls(n, pa.int32()),
                     "tokens": [i * 1000 + r for r in range(n)]})


def _run(sha: str) -> dict:
    return run_row(source="unit", source_sha256=sha, num_layers=5, num_experts=50, top_k=2)
