"""The one kernel classifier: maps a GPU kernel (or a host collective op) to a span kind.

Every profiler collector (Kineto, Nsight) calls :func:`classify` here and nowhere else
decides what a kernel is. The decisions live in a pattern table, ``kernel_rules.csv``
beside this module, with the columns::

    kind,match,pattern,context,stream,collective,comment

Each rule belongs to one family, named in its ``match`` column (empty: ``name``):

* ``name``: ``pattern`` (a Python regular expression) is searched in the kernel's
  *base name* (:func:`base_name`: the normalized name without template arguments and
  parameter list, so ``finalizeKernelVecLoad<..., cutlass::bfloat16_t>`` is not a CUTLASS
  GEMM; a generic launcher such as ``cutlass::device_kernel<X>`` keeps ``X``); user rules
  (``--kernel-rules``) are searched in the whole normalized name;
* ``context``: ``context`` is searched in the names of the CPU ranges the kernel was
  launched under (Kineto ``cpu_op`` / ``user_annotation``, Nsight NVTX ranges on the
  launching thread; see :mod:`moetrace.collect._launch_context`), innermost first;
  ``pattern``, when given, must match the kernel name as well;
* ``stream``: ``stream`` must match the kernel's stream id (decimal text, whole match).

Any column given (``pattern``, ``context``, ``stream``, ``collective``: a regular
expression matched against the normalized collective of the linked CPU op) must match.
The order, first match wins (:data:`RULE_ORDER`):

1. the profiler's category: ``gpu_memcpy`` / ``gpu_memset`` are memcpy / memset;
2. user rules (``--kernel-rules FILE``, same columns, CSV or a JSON list of objects), in
   file order, whatever their family: they can override everything below;
3. built-in ``name`` rules, in file order: a known library's kernel is what its name says
   wherever it was launched (a DeepEP dispatch under a ``moe_forward`` range is a dispatch);
4. built-in ``context`` rules: kernels no name rule knows (``nvjet*``, cuBLAS, CUTLASS
   GEMMs) take the kind of the MoE range they were launched under: a GEMM under a router
   or gate range is the gate (``moe_other``), top-k / softmax / permute / gather /
   scatter / finalize kernels under any MoE range are ``moe_other``, and only then is a
   GEMM under an MoE or expert range an ``expert_gemm``;
5. shape: a kernel the context rules made an ``expert_gemm`` whose GEMM's output width N
   equals the number of experts (``Classifier(num_experts=E)``, from ``--experts`` or
   ``--model-config``; N from the shapes of the op it was launched under, recorded with
   ``record_shapes=True``) is the router's gate GEMM, ``moe_other``, even with no router
   range around it. (An expert GEMM whose own width happens to equal E would be taken
   for the gate: the experts' widths are the hidden and intermediate sizes, which in
   real models differ from E.)
6. built-in ``stream`` rules (none ship: stream ids are not portable);
7. default: ``compute_other``.

:meth:`Classifier.classify_how` also says which step decided (``classified_by``:
``category``, ``user``, ``name``, ``context``, ``shape``, ``stream``, ``default``).

Kinds: ``dispatch``, ``combine``, ``a2a_other`` (notify, barrier of the all-to-all
library), ``expert_gemm``, ``moe_other`` (the MoE layer's other work: the router's gate
GEMM, top-k / softmax, permute / unpermute, gather / scatter, finalize), ``attention``,
``compute_other``, ``memcpy``, ``memset``,
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

KINDS = ("dispatch", "combine", "a2a_other", "expert_gemm", "moe_other", "attention", "compute_other",
         "memcpy", "memset", "comm_other", "idle")
#: kinds a rule may give (``a2a`` is resolved to dispatch/combine by the collector)
RULE_KINDS = frozenset(KINDS) | {"a2a"}
A2A_KINDS = ("dispatch", "combine", "a2a_other")
COMPUTE_KINDS = ("expert_gemm", "moe_other", "attention", "compute_other")
#: backends whose host-side collective ops name a collective (``nccl:all_to_all``,
#: ``c10d::alltoall_base_``, ``gloo:all_to_all``): the one list of collective prefixes
COLLECTIVE_BACKENDS = ("nccl", "gloo", "c10d", "mpi", "ucc", "xccl", "hccl", "rccl")
COLLECTIVE_OP_PREFIXES = tuple(f"{b}:" for b in COLLECTIVE_BACKENDS)   # str.startswith form
COLLECTIVE_OP_RE = re.compile(r"^(?:" + "|".join(COLLECTIVE_BACKENDS) + r"):+\w", re.I)

RULES_FILE = Path(__file__).resolve().parent / "kernel_rules.csv"

#: names of CPU ranges that mark MoE work: router / gate, experts, fused MoE ops, dispatch /
#: combine. A trace with such ranges but no expert GEMM kernel is reported, never a silent 0.
MOE_RANGE_RE = re.compile(r"(?i)moe|experts?(?:[^a-z]|$)|router|(?:^|[^a-z])(?:dispatch|combine)(?:[^a-z]|$)")

#: kernel names of MoE plumbing (routing, sorting, permutation): a trace launching these is
#: an MoE trace even without annotations
MOE_KERNEL_RE = re.compile(
    r"(?i)topk_softmax|topkGating|grouped_topk|moe_align|count_and_sort_expert|moe_sum|moe_permute|"
    r"moe_unpermute|expand_input_rows|finalize_moe|fused_topk|routing\w*kernel|moe_fused_gate")

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


#: generic launcher templates whose kernel is their template argument
#: (``cutlass::device_kernel<flash::FlashAttnBwd<...>>``, ``cutlass::Kernel<MoeFCGemm<...>>``,
#: ``ck_tile::kentry<...>``): their own name says nothing, so a rule reads all of it
_LAUNCHER_RE = re.compile(r"(?:^|::)(?:device_kernel|Kernel2?|kentry|kernel_entry)$")
_ANON = "(anonymous namespace)"


@lru_cache(maxsize=1 << 16)
def base_name(norm: str) -> str:
    """A normalized kernel name without its template arguments and parameter list:
    ``moe::dev::finalize::finalizeKernelVecLoad<..., cutlass::bfloat16_t, ...>(Params)`` ->
    ``moe::dev::finalize::finalizeKernelVecLoad``, the name rules' subject (a type named in
    a template argument is not what the kernel does). A launcher template
    (:data:`_LAUNCHER_RE`) keeps its arguments (the kernel it launches), less its
    parameter list; a name whose brackets do not balance stays whole."""
    out: list[str] = []
    depth = 0
    i, n = 0, len(norm)
    cut = None   # where the launcher's template arguments start
    while i < n:
        c = norm[i]
        if depth == 0 and norm.startswith(_ANON, i):
            out.append(_ANON)
            i += len(_ANON)
            continue
        if c == "<":
            if depth == 0 and not norm.startswith("<<", i) and _LAUNCHER_RE.search("".join(out).rstrip()):
                cut = i
            depth += 1
        elif c == ">":
            depth -= 1
            if depth < 0:
                return norm
            if depth == 0 and cut is not None:
                return norm[:i + 1]
        elif c == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(c)
        i += 1
    if depth != 0:
        return norm
    return "".join(out).strip() or norm


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


MATCHES = ("name", "context", "stream")
#: what decides, in order (first match wins); also the values of ``classified_by``
RULE_ORDER = ("category", "user", "name", "context", "shape", "stream", "default")


@dataclass(frozen=True)
class Rule:
    kind: str
    pattern: re.Pattern | None
    collective: re.Pattern | None
    comment: str = ""
    source: str = "built-in"
    match: str = "name"
    context: re.Pattern | None = None
    stream: re.Pattern | None = None

    def matches(self, norm: str, coll: str, context: tuple[str, ...], stream: str | None,
                base: str | None = None) -> bool:
        # built-in rules read the kernel's own (base) name; a user rule reads the whole name
        subject = norm if self.source != "built-in" or base is None else base
        if self.pattern is not None and not self.pattern.search(subject):
            return False
        if self.collective is not None and not self.collective.search(coll):
            return False
        if self.context is not None and not any(self.context.search(c) for c in context):
            return False
        if self.stream is not None and (stream is None or not self.stream.fullmatch(stream)):
            return False
        return True


def _parse_rules(rows: list[dict], source: str) -> list[Rule]:
    out = []
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise InputError(source, "each kernel rule must be an object with kind and pattern", f"rule {i}")
        kind = str(row.get("kind") or "").strip()
        pat = str(row.get("pattern") or "")
        match = str(row.get("match") or "").strip() or "name"
        if kind not in RULE_KINDS:
            raise InputError(source, f"unknown kind {kind!r} (known: {', '.join(sorted(RULE_KINDS))})", f"rule {i}")
        if match not in MATCHES:
            raise InputError(source, f"unknown match {match!r} (known: {', '.join(MATCHES)})", f"rule {i}")
        ctx = str(row.get("context") or "").strip()
        stream = str(row.get("stream") or "").strip()
        need = {"name": pat, "context": ctx, "stream": stream}[match]
        if not need:
            raise InputError(source, "empty pattern" if match == "name" else f"a {match} rule needs a {match} column",
                             f"rule {i}")
        try:
            rx = re.compile(pat) if pat else None
            coll = str(row.get("collective") or "").strip()
            crx = re.compile(coll) if coll else None
            ctx_rx = re.compile(ctx) if ctx else None
            st_rx = re.compile(stream) if stream else None
        except re.error as e:
            raise InputError(source, f"bad regular expression: {e}", f"rule {i}") from None
        out.append(Rule(kind, rx, crx, str(row.get("comment") or ""), source, match, ctx_rx, st_rx))
    return out


def read_rules_file(path: str | Path) -> list[Rule]:
    """Rules from a CSV (kind,pattern[,match,context,stream,collective,comment]) or JSON list file."""
    from ..safety import check_regular_file

    p = Path(path)
    check_regular_file(p)   # /dev/zero or a FIFO would never end
    if p.is_file() and p.stat().st_size > (16 << 20):
        raise InputError(p, f"kernel rules file of {p.stat().st_size} bytes; a rules file is at most 16 MiB")
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
            raise InputError(p, "kernel rules CSV needs a header with kind,pattern[,match,context,stream,collective,comment]")
        rows = [{(k or "").strip(): v for k, v in r.items()} for r in reader
                if any((v or "").strip() for v in r.values())]
    return _parse_rules(rows, str(p))


@lru_cache(maxsize=1)
def builtin_rules() -> tuple[Rule, ...]:
    return tuple(read_rules_file(RULES_FILE))


class Classifier:
    """Rules (user first, then built-in name, context and stream rules: :data:`RULE_ORDER`)
    with a cache per (name, collective, category, context, stream)."""

    def __init__(self, extra_rules: str | Path | None = None, num_experts: int | None = None):
        #: experts per layer: a GEMM of this output width inside an MoE range is the gate
        self.num_experts = int(num_experts) if num_experts else None
        user = read_rules_file(extra_rules) if extra_rules else []
        builtin = list(builtin_rules())
        fam = {m: [r for r in builtin if r.match == m] for m in MATCHES}
        #: (rule, classified_by) in the order they are tried
        self.ordered: list[tuple[Rule, str]] = ([(r, "user") for r in user]
                                                + [(r, m) for m in MATCHES for r in fam[m]])
        self.rules: list[Rule] = [r for r, _ in self.ordered]
        #: whether any rule looks at launch context / the stream (else those stay out of the cache key)
        self.uses_context = any(r.context is not None for r in self.rules)
        self.uses_stream = any(r.stream is not None for r in self.rules)
        self.context_patterns: tuple[re.Pattern, ...] = tuple(r.context for r in self.rules if r.context is not None)
        self._cache: dict[tuple, tuple[str, str]] = {}

    def classify(self, name: str, collective: str | None = None, category: str | None = None) -> str:
        """Kind of a kernel ``name``. ``collective`` is the linked CPU op or the kernel's
        ``Collective name`` arg (any spelling); ``category`` the profiler's event category
        (``gpu_memcpy``/``gpu_memset`` decide memcpy/memset whatever the name)."""
        return self.classify_how(name, collective, category)[0]

    def classify_how(self, name: str, collective: str | None = None, category: str | None = None,
                     context: tuple[str, ...] = (), stream: int | str | None = None,
                     gemm_n: int | None = None) -> tuple[str, str]:
        """(kind, classified_by) of a kernel; ``context``: the names of the CPU ranges it
        was launched under (innermost first), ``stream`` its stream id, ``gemm_n`` the
        output width of the GEMM op it was launched under (None: unknown)."""
        ctx = context if self.uses_context else ()
        st = (None if stream is None else str(stream)) if self.uses_stream else None
        gate = self.num_experts is not None and gemm_n == self.num_experts
        key = (name, collective, category, ctx, st, gate)
        k = self._cache.get(key)
        if k is None:
            k = self._classify(name, collective, category, ctx, st)
            if gate and k == ("expert_gemm", "context"):
                k = ("moe_other", "shape")
            self._cache[key] = k
        return k

    def _classify(self, name: str, collective: str | None, category: str | None, context: tuple[str, ...],
                  stream: str | None) -> tuple[str, str]:
        cat = (category or "").lower()
        if "memcpy" in cat:
            return "memcpy", "category"
        if "memset" in cat:
            return "memset", "category"
        norm = normalize_name(name)
        base = base_name(norm)
        coll = normalize_collective(collective) or ""
        for r, by in self.ordered:
            if r.matches(norm, coll, context, stream, base):
                return r.kind, by
        return "compute_other", "default"


_DEFAULT: Classifier | None = None


def classify(name: str, collective: str | None = None, category: str | None = None) -> str:
    """Classify with the built-in rules only (see :class:`Classifier` for user rules)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Classifier()
    return _DEFAULT.classify(name, collective, category)
