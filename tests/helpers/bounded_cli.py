"""The CLI run on hostile input with its cost measured: each case in its own forked child
of one fresh interpreter (one start-up for many cases), with a wall-clock timeout and the
child's own peak resident memory (``wait4``'s ``ru_maxrss``), what the hostile-input tests
assert: one line, exit 2, under 1 GiB, no hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import REPO

GiB = 1 << 30

_DRIVER = r"""
import json, os, resource, signal, sys, time, traceback
sys.path.insert(0, sys.argv[1])
import moetrace.cli
cases = json.load(sys.stdin)
res = []
for i, c in enumerate(cases):
    o, e = os.path.join(c["tmp"], f"out{i}"), os.path.join(c["tmp"], f"err{i}")
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            # a safety net only (a regression must not take the shared machine's memory)
            resource.setrlimit(resource.RLIMIT_AS, (c["as_limit"], c["as_limit"]))
            os.chdir(c["cwd"])
            for fd, p in ((1, o), (2, e)):
                f = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(f, fd)
                os.close(f)
            n = os.open(os.devnull, os.O_RDONLY)
            os.dup2(n, 0)
            os.environ.update(c["env"])
            moetrace.cli.main(c["args"])
            code = 0
        except SystemExit as ex:
            code = ex.code if isinstance(ex.code, int) else (0 if ex.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 70
        try:
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)
    deadline, hung = time.monotonic() + c["timeout"], False
    while True:
        wpid, status, ru = os.wait4(pid, os.WNOHANG)
        if wpid:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            wpid, status, ru = os.wait4(pid, 0)
            hung = True
            break
        time.sleep(0.005)
    res.append({"rc": os.waitstatus_to_exitcode(status), "maxrss": ru.ru_maxrss * 1024, "hung": hung,
                "stdout": open(o, errors="replace").read(), "stderr": open(e, errors="replace").read()})
json.dump(res, sys.stdout)
"""


@dataclass
class Outcome:
    args: list[str]
    rc: int
    maxrss: int
    hung: bool
    stdout: str
    stderr: str

    def refused(self, *needles: str, rss: int = GiB) -> str:
        """Exit 2, one line ``moetrace: error: ...`` naming every needle, no hang, peak RSS
        under ``rss``; returns the line."""
        assert not self.hung, f"{self.args}: ran past the timeout"
        assert self.maxrss < rss, f"{self.args}: peak RSS {self.maxrss >> 20} MiB"
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        assert self.rc == 2 and len(lines) == 1 and lines[0].startswith("moetrace: error:"), \
            (self.args, self.rc, self.stderr[-2000:])
        for n in needles:
            assert n in lines[0], (n, lines[0])
        assert all(ch == "\t" or ch >= " " for ch in lines[0]), repr(lines[0])   # no raw control character
        return lines[0]


def run_cases(cases: list[dict], tmp: Path, timeout: float = 60, as_limit: int = 12 * GiB) -> list[Outcome]:
    """Run each case (``{"args": [...], "cwd": ..., "env": {...}}``) in a forked child;
    returns their outcomes in order."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    payload = [{"args": [str(a) for a in c["args"]], "cwd": str(c.get("cwd", tmp)), "env": c.get("env", {}),
                "tmp": str(tmp), "timeout": c.get("timeout", timeout), "as_limit": as_limit} for c in cases]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    total = sum(p["timeout"] for p in payload) + 60
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(REPO)], input=json.dumps(payload), capture_output=True,
                       text=True, env=env, timeout=total)
    assert r.returncode == 0, r.stderr[-3000:]
    return [Outcome(c["args"], **o) for c, o in zip(payload, json.loads(r.stdout))]


def synth_store(root: Path, name: str = "st") -> Path:
    """A small synthetic store ``root/name`` (2 ranks, 8 experts) made by the CLI in this
    process; returns ``root``, the folder the cases run in."""
    from . import run_cli

    old = os.getcwd()
    os.chdir(root)
    try:
        r = run_cli("synth", name, "--steps", "4", "--layers", "2", "--experts", "8", "--ranks", "2",
                    "--ranks-per-node", "2", catch_exceptions=True)
    finally:
        os.chdir(old)
    assert r.exit_code == 0, r.output
    return root
