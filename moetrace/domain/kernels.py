"""The one kernel classifier: maps a GPU kernel (or a host collective op) to a span kind.

Every profiler collector (Kineto, Nsight) calls :func:`classify` here and nowhere else
decides what a kernel is. The decisions live in a pattern table, ``kernel_rules.csv``
beside this module, with the columns::

    kind,pattern,collective,comment

Rules are tried in order; the first whose ``pattern`` (a Python regular expression,
searched in the *normalized* name) matches, and whose ``collective`` (a regular
expression matched against the normalized collective of the linked CPU op, or empty for
"any") matches, gives the kind. A user extends the table with ``--kernel-rules FILE``
(same columns, CSV or a JSON list of objects); user rules are tried before the built-in
ones, so they can also override them.

Kinds: ``dispatch``, ``combine``, ``a2a_other`` (notify, barrier of the all-to-all
library), ``expert_gemm``, ``attention``, ``compute_other``, ``memcpy``, ``memset``,
``comm_other`` (collectives that are not an all-to-all). A rule may also say ``a2a``: an
all-to-all whose direction the kernel name does not tell (NCCL SendRecv, a host
``gloo:all_to_all``); the collector resolves it to dispatch or combine from annotations
or from the order of all-to-alls (and marks it inferred).

Names are normalized first, so Nsight's and Kineto's demanglings match the same rule:
a leading ``void`` is dropped, ``(bool)1`` becomes ``true``, ``(unsigned long)4096``
becomes ``4096ul`` and so on, and runs of white space collapse.
"""
from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import InputError

KINDS = ("dispatch", "combine", "a2a_other", "expert_gemm", "attention", "compute_other",
         "memcpy", "memset", "comm_other", "idle")
#: kinds a rule may give (``a2a`` is resolved to dispatch/combine by the collector)
RULE_KINDS = frozenset(KINDS) | {"a2a"}
A2A_KINDS = ("dispatch", "combine", "a2a_other")
COMPUTE_KINDS = ("expert_gemm", "attention", "compute_other")
#: backends whose host-side collective ops name a collective (``nccl:all_to_all``,
#: ``c10d::alltoall_base_``, ``gloo:all_to_all``): the one list of collective prefixes
COLLECTIVE_BACKENDS = ("nccl", "gloo", "c10d", "mpi", "ucc", "xccl", "hccl", "rccl")
COLLECTIVE_OP_PREFIXES = tuple(f"{b}:" for b in COLLECTIVE_BACKENDS)   # str.startswith form
COLLECTIVE_OP_RE = re.compile(r"^(?:" + "|".join(COLLECTIVE_BACKENDS) + r"):+\w", re.I)

RULES_FILE = Path(__file__).resolve().parent / "kernel_rules.csv"

_CASTS = [
    (re.compile(r"\(bool\)1\b"), "true"),
    (re.compile(r"\(bool\)0\b"), "false"),
    (re.compile(r"\(unsigned long long\)(-?\d+)"), r"\1ull"),
    (re.compile(r"\(unsigned long\)(-?\d+)"), r"\1ul"),
    (re.compile(r"\(long long\)(-?\d+)"), r"\1ll"),
    (re.compile(r"\(long\)(-?\d+)"), r"\1l"),
    (re.compile(r"\(unsigned int\)(-?\d+)"), r"\1u"),
    (re.compile(r"\((?:int|short|char|unsigned short|unsigned char|signed char)\)(-?\d+)"), r"\1"),
]
_WS = re.compile(r"\s+")


@lru_cache(maxsize=1 << 16)
def normalize_name(name: str) -> str:
    """One spelling for a kernel name whatever profiler demangled it."""
    s = _WS.sub(" ", name).strip()
    if s.startswith("void "):
        s = s[5:]
    if "(" in s and ")" in s:
        for pat, rep in _CASTS:
            s = pat.sub(rep, s)
    return s


def demangle_all(names) -> dict[str, str]:
    """Itanium-mangled names (``_Z...``, as ROCm traces write them) demangled in one
    ``c++filt`` call when that tool exists; names it cannot demangle stay as they are."""
    import shutil
    import subprocess

    todo = sorted({n for n in names if n and n.startswith("_Z") and "\n" not in n})
    exe = shutil.which("c++filt")
    if not todo or exe is None:
        return {}
    try:
        res = subprocess.run([exe], input="\n".join(todo) + "\n", capture_output=True, text=True, timeout=60,
                             check=True)
    except (OSError, subprocess.SubprocessError):
        return {}
    outs = res.stdout.split("\n")
    return {m: d for m, d in zip(todo, outs) if d and d != m}


_COLL_ALIASES = [
    (re.compile(r"all_?to_?allv?|alltoall", re.I), "all_to_all"),
    (re.compile(r"all_?reduce", re.I), "all_reduce"),
    (re.compile(r"reduce_?scatter", re.I), "reduce_scatter"),
    (re.compile(r"all_?gather", re.I), "all_gather"),
    (re.compile(r"broadcast", re.I), "broadcast"),
    (re.compile(r"barrier", re.I), "barrier"),
    (re.compile(r"\bsend\b|:send$|_send$", re.I), "send"),
    (re.compile(r"\brecv\b|:recv$|_recv$", re.I), "recv"),
]


@lru_cache(maxsize=4096)
def normalize_collective(text: str | None) -> str | None:
    """``nccl:all_to_all``, ``c10d::alltoall_base_``, ``all_to_allv`` -> ``all_to_all``."""
    if not text:
        return None
    for pat, canon in _COLL_ALIASES:
        if pat.search(text):
            return canon
    return text.strip().lower() or None


@dataclass(frozen=True)
class Rule:
    kind: str
    pattern: re.Pattern
    collective: re.Pattern | None
    comment: str = ""
    source: str = "built-in"


def _parse_rules(rows: list[dict], source: str) -> list[Rule]:
    out = []
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise InputError(source, "each kernel rule must be an object with kind and pattern", f"rule {i}")
        kind = str(row.get("kind") or "").strip()
        pat = str(row.get("pattern") or "")
        if kind not in RULE_KINDS:
            raise InputError(source, f"unknown kind {kind!r} (known: {', '.join(sorted(RULE_KINDS))})", f"rule {i}")
        if not pat:
            raise InputError(source, "empty pattern", f"rule {i}")
        try:
            rx = re.compile(pat)
            coll = str(row.get("collective") or "").strip()
            crx = re.compile(coll) if coll else None
        except re.error as e:
            raise InputError(source, f"bad regular expression: {e}", f"rule {i}") from None
        out.append(Rule(kind, rx, crx, str(row.get("comment") or ""), source))
    return out


def read_rules_file(path: str | Path) -> list[Rule]:
    """Rules from a CSV (kind,pattern[,collective,comment]) or JSON list file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(p, f"cannot read kernel rules: {e}") from None
    if p.suffix.lower() == ".json" or text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise InputError(p, f"invalid JSON: {e}") from None
        if not isinstance(rows, list):
            raise InputError(p, "kernel rules JSON must be a list of {kind, pattern, collective} objects")
    else:
        reader = csv.DictReader(io.StringIO(text))
        if not reader.fieldnames or not {"kind", "pattern"} <= {f.strip() for f in reader.fieldnames}:
            raise InputError(p, "kernel rules CSV needs a header with kind,pattern[,collective,comment]")
        rows = [{(k or "").strip(): v for k, v in r.items()} for r in reader
                if any((v or "").strip() for v in r.values())]
    return _parse_rules(rows, str(p))


@lru_cache(maxsize=1)
def builtin_rules() -> tuple[Rule, ...]:
    return tuple(read_rules_file(RULES_FILE))


class Classifier:
    """Rules (user first, then built-in) with a cache per (name, collective)."""

    def __init__(self, extra_rules: str | Path | None = None):
        self.rules: list[Rule] = (read_rules_file(extra_rules) if extra_rules else []) + list(builtin_rules())
        self._cache: dict[tuple[str, str | None, str | None], str] = {}

    def classify(self, name: str, collective: str | None = None, category: str | None = None) -> str:
        """Kind of a kernel ``name``. ``collective`` is the linked CPU op or the kernel's
        ``Collective name`` arg (any spelling); ``category`` the profiler's event category
        (``gpu_memcpy``/``gpu_memset`` decide memcpy/memset whatever the name)."""
        key = (name, collective, category)
        k = self._cache.get(key)
        if k is None:
            k = self._classify(name, collective, category)
            self._cache[key] = k
        return k

    def _classify(self, name: str, collective: str | None, category: str | None) -> str:
        cat = (category or "").lower()
        if "memcpy" in cat:
            return "memcpy"
        if "memset" in cat:
            return "memset"
        norm = normalize_name(name)
        coll = normalize_collective(collective) or ""
        for r in self.rules:
            if r.pattern.search(norm) and (r.collective is None or r.collective.search(coll)):
                return r.kind
        return "compute_other"


_DEFAULT: Classifier | None = None


def classify(name: str, collective: str | None = None, category: str | None = None) -> str:
    """Classify with the built-in rules only (see :class:`Classifier` for user rules)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Classifier()
    return _DEFAULT.classify(name, collective, category)
