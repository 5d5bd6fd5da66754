"""Collectors: one module per source format, each turning files into canonical tables.

A collector module registers itself with :func:`register` at import time. It knows its
format and nothing about metrics. :func:`ingest` detects the format of every input (or
takes ``format``), runs the collectors, validates every resulting table against the
contract and the run's shape, and only then writes to the store, one transaction per run.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, shown
from ..safety import check_csv_header, check_parquet, check_regular_file, set_overrides


@dataclass
class RunData:
    """What a collector returns for one run: the runs row and its tables."""

    run: dict
    tables: dict[str, object]
    run_id_hint: str = "run"
    files: list[str] = field(default_factory=list)
    #: set when the tables are streams checked while the store writes them (one pass over
    #: the input: a bad row raises InputError from inside the write, whose transaction
    #: leaves the store as it was): the same run read the safe way, every row checked
    #: before anything is written. :func:`ingest` uses it when a run must be checked before
    #: any write (several runs at once) or when the one pass raises :class:`OnePassFailed`.
    two_pass: Callable[[], "RunData"] | None = None


class OnePassFailed(Exception):
    """Raised from a one-pass stream (:attr:`RunData.two_pass`) when the input is not what
    its first, cheap look promised (rows out of the dense order, a footer whose statistics
    disagree with the rows): :func:`ingest` writes that run again the two-pass way."""


@dataclass
class Collector:
    name: str
    description: str
    #: sniff(path, head_bytes) -> True when the file is in this format (cheap: extension,
    #: first bytes). Folders are expanded before sniffing.
    sniff: Callable[[Path, bytes], bool]
    #: collect(paths, options) -> list[RunData]; paths are all files routed to this collector.
    collect: Callable[[list[Path], dict], list[RunData]]
    #: sniff order: lower first (specific formats before generic ones)
    priority: int = 50
    #: option keys this collector reads beyond :data:`OPTIONS` (``ingest --set KEY=VALUE``)
    options: tuple[str, ...] = ()


#: Collector options (``moetrace ingest`` flags and ``--set KEY=VALUE``), each with what it
#: does; a collector reads the ones it needs. Unknown keys are refused (typos are not
#: silently ignored): a new option goes here or in its Collector's ``options``.
OPTIONS: dict[str, str] = {
    "num_layers": "MoE layers of the model (else inferred)",
    "num_experts": "logical experts per layer (else inferred)",
    "top_k": "experts per token",
    "num_ranks": "expert-parallel ranks",
    "ranks_per_node": "ranks per node",
    "num_groups": "expert groups (EPLB)",
    "model_config": "the model's Hugging Face config.json: experts, top-k, expert groups, hidden, expert bytes",
    "num_slots": "physical expert slots per layer",
    "dp_size": "vLLM naive all-to-all: divide the recorded load by the DP size",
    "sum_ranks": "vLLM: sum per-rank dumps of one step into one run",
    "src_rank": "keep a row per source rank (SGLang per-token dumps)",
    "by_src_rank": "split expert_load rows by source rank",
    "year": "server logs without a year: the year of their timestamps",
    "kernel_rules": "extra kernel classification rules file (profiler traces)",
    "jobs": "profiler traces: parsing processes (1: this process only)",
    "progress": "print progress lines on stderr",
    "allow_inconsistent": "ingest runs that fail conservation checks, flagged in runs.inconsistent",
}


def _limit_options() -> dict[str, str]:
    from ..safety import LIMITS

    return {k: f"resource limit: {v.description} (docs/hardening.md)" for k, v in LIMITS.items()}


OPTIONS.update(_limit_options())


_REGISTRY: dict[str, Collector] = {}
_LOADED = False


def source_label(paths: Sequence[Path]) -> str:
    """``runs.source`` of a run read from ``paths``: their names (up to four), else the
    name of the folder they share and how many files (``dumps/ (8 files)``); relative
    paths are resolved first, so files given as ``a.log b.log ...`` name the folder they
    are in rather than an empty one."""
    import os

    if len(paths) <= 4:
        return ",".join(p.name for p in paths)
    try:
        common = Path(os.path.commonpath([str(Path(p).resolve().parent) for p in paths]))
    except ValueError:   # different drives
        common = Path(paths[0]).resolve().parent
    return f"{common.name or common}/ ({len(paths)} files)"


def register(collector: Collector) -> Collector:
    _REGISTRY[collector.name] = collector
    return collector


def registry() -> dict[str, Collector]:
    global _LOADED
    if not _LOADED:
        for mod in pkgutil.iter_modules(__path__):
            if not mod.name.startswith("_"):
                importlib.import_module(f"{__name__}.{mod.name}")
        _LOADED = True
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (kv[1].priority, kv[0])))


def _expand(paths: Sequence[str | Path]) -> list[tuple[Path, bool]]:
    """Files to read, each with whether it came from expanding a folder."""
    from ..storage.paths import STORE_MARKER

    out: list[tuple[Path, bool]] = []
    for p in map(Path, paths):
        if not p.exists():
            raise InputError(p, "no such file or folder")
        real = p.resolve()
        for d in (real, *real.parents):   # a store's own files are no trace (one line, not a skip note)
            if (d / STORE_MARKER).is_file():
                what = "a moetrace store" if d == real else f"inside the moetrace store {shown(d)}"
                raise InputError(p, f"is {what}; ingest reads trace files, not a store's own files")
        if p.is_dir():
            inner = next((f.parent for f in p.rglob(STORE_MARKER) if f.is_file()), None)
            if inner is not None:
                raise InputError(p, f"holds the moetrace store {shown(inner)}; ingest reads trace files, not a "
                                    "store's own files")
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            if not files:
                raise InputError(p, "folder holds no files")
            out.extend((f, True) for f in files)
        else:
            check_regular_file(p)  # a FIFO or a device would hang or never end
            out.append((p, False))
    return out


def known_options() -> dict[str, str]:
    """:data:`OPTIONS` plus the options collectors declare, by key."""
    out = dict(OPTIONS)
    for c in registry().values():
        for k in c.options:
            out.setdefault(k, f"{c.name} collector option")
    return dict(sorted(out.items()))


def precheck(path: Path) -> None:
    """Bounds every collector shares, checked before any reads the file's data: a Parquet
    file's footer, columns and decoded size; a CSV's header line and columns
    (``safety.check_parquet`` / ``check_csv_header``; the limits in docs/hardening.md)."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        check_parquet(path)
    elif name.endswith((".csv", ".tsv")):
        check_csv_header(path, b"\t" if name.endswith(".tsv") else b",")


def head(path: Path, n: int = 4096) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None


#: the format names a user types, as the collector that reads them (the generic collector
#: reads CSV, JSON Lines and Parquet expert loads)
FORMAT_ALIASES = {"csv": "generic", "jsonl": "generic", "ndjson": "generic", "parquet": "generic"}


def _collect_as(name: str, files: list[Path], options: dict, chosen: bool):
    """The runs collector ``name`` reads from ``files``; when ``--format`` chose a collector
    and it cannot read a file, the error says which format the file looks like."""
    try:
        yield from registry()[name].collect(files, options)
    except InputError as e:
        if not chosen:
            raise
        looks = None
        for f in files:
            try:
                looks = detect(f).name
            except InputError:
                continue
            if looks != name:
                break
        if looks is None or looks == name:
            raise
        raise InputError(e.file, f"{e.message}; the file looks like {looks}: use --format {looks} (or leave "
                                 f"--format out)", e.position) from None


def detect(path: Path) -> Collector:
    h = head(path)
    if not h:
        raise InputError(path, "file is empty")
    for c in registry().values():
        try:
            if c.sniff(path, h):
                return c
        except InputError:
            raise
        except Exception:  # a sniffer must never crash detection
            continue
    raise InputError(path, "unknown file type (use --format; known formats: " + ", ".join(registry()) + ")")


def collect(paths: Sequence[str | Path], format: str | None = None, options: dict | None = None,
            on_skip=None, on_warn=None) -> list[RunData]:
    """Detect and run collectors; returns validated RunData, writes nothing.

    Files inside a folder that no collector recognizes (or that are empty) are skipped:
    ``on_skip(list_of_paths)`` is called, and every run of this call records them in
    ``runs.approximations``. A file named directly must be readable as given.
    ``on_warn(line)`` gets each shape warning (also in ``runs.approximations``: experts
    that do not divide evenly over the ranks)."""
    from ._shape_notes import uneven_blocks_note
    from .checks import validate_run

    options = dict(options or {})
    set_overrides(options)  # --set max_*=N raises a resource limit (safety.LIMITS)
    from .checks import check_shape

    check_shape(options)  # --ranks -4, --top-k 0, ...: refused before any collector uses them
    entries = _expand(paths)
    files = [f for f, _ in entries]
    groups: dict[str, list[Path]] = {}
    skipped: list[Path] = []
    if format:
        reg = registry()
        format = FORMAT_ALIASES.get(format.lower(), format)
        if format not in reg:
            raise InputError(None, f"--format {format!r} is not a known format: use one of "
                                   f"{', '.join(list(reg) + list(FORMAT_ALIASES))}, or leave --format out to detect it")
        for f in files:
            if not head(f, 1):
                raise InputError(f, "file is empty")
        groups[format] = files
    else:
        for f, from_folder in entries:
            try:
                groups.setdefault(detect(f).name, []).append(f)
            except InputError as e:
                # a stray README or an empty file inside a folder is skipped (and said);
                # a file named on the command line must be readable as given
                if from_folder and ("unknown file type" in e.message or "file is empty" in e.message):
                    skipped.append(f)
                    continue
                raise
        if not groups:
            raise InputError(files[0].parent if skipped else None,
                             f"no file of a known format ({len(skipped)} file(s) skipped: "
                             + ", ".join(f.name for f in skipped[:5]) + ")")
    if skipped and on_skip is not None:
        on_skip(skipped)
    model, model_said = {}, []
    if options.get("model_config"):
        from ._model_config import read_model_config

        model, model_said = read_model_config(options["model_config"])
        # options given on the command line win over the config; the config over the collectors' guesses
        options = {**{k: v for k, v in model.items() if k in OPTIONS}, **options}
    out: list[RunData] = []

    def finish(rd: RunData, name: str, fs: list[Path], warn: bool = True) -> RunData:
        for k, v in model.items():
            if rd.run.get(k) is None:
                rd.run[k] = v
        if model_said:
            meta = json.loads(rd.run.get("meta_json") or "{}")
            meta["model_config"] = model_said
            rd.run["meta_json"] = json.dumps(meta)
        rd.run.setdefault("collector", name)
        if not rd.files:
            rd.files = [str(f) for f in fs]
        if skipped:
            approx = json.loads(rd.run.get("approximations") or "[]")
            approx.append(f"{len(skipped)} file(s) in the input folder(s) were not recognized and were skipped: "
                          + ", ".join(f.name for f in skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
            rd.run["approximations"] = json.dumps(approx)
        note = uneven_blocks_note(rd.run)
        if note:
            approx = json.loads(rd.run.get("approximations") or "[]")
            if note not in approx:
                approx.append(note)
            rd.run["approximations"] = json.dumps(approx)
            if on_warn is not None and warn:
                on_warn(note)
        return validate_run(rd, options)

    for fs in groups.values():
        for f in fs:
            precheck(f)
    for name, fs in groups.items():
        try:
            rds = list(_collect_as(name, fs, options, chosen=bool(format)))
        except RecursionError:   # a collector's recursive walk of a crafted input
            raise InputError(fs[0] if len(fs) == 1 else fs[0].parent,
                             "input nested too deeply to process (a crafted or corrupt file)") from None
        for rd in rds:
            rd = finish(rd, name, fs)
            if rd.two_pass is not None:
                rd.two_pass = (lambda slow=rd.two_pass, name=name, fs=fs: finish(slow(), name, fs, warn=False))
            out.append(rd)
    return out


def ingest(store, paths: Sequence[str | Path], format: str | None = None, options: dict | None = None,
           run_id: str | None = None, *, on_skip=None, on_write=None, on_warn=None) -> list:
    """Collect ``paths`` and write each run to ``store`` (a Store, or a folder opened
    with ``create=True`` once every input collected and validated: bad input leaves no
    trace). Nothing is written unless every input collected and validated. A single run
    whose rows are checked while they are written (:attr:`RunData.two_pass`: a dense
    Parquet file, read once) is refused from inside its write, which is undone, and a
    store created for it is removed again; several runs are each checked before the first
    write. ``on_skip(paths)`` as in :func:`collect`; ``on_write(run_data, write_result)`` is
    called after each run is written (or skipped as already ingested). Returns the
    store's WriteResults."""
    from ..storage.cleanup import failed_write_leaves_no_trace, remove_empty_store
    from ..storage.store import Store

    runs = collect(paths, format=format, options=options, on_skip=on_skip, on_warn=on_warn)
    if run_id and len(runs) > 1:
        raise InputError(None, f"--run-id given but the inputs make {len(runs)} runs")
    # a run checked while it is written (one pass) is refused from inside its write, which
    # the transaction undoes; that leaves the store as it was only when it is the one run
    # and the store is new (removed again) or was written before (its lock file is there)
    fresh = None
    if not hasattr(store, "write_run"):
        fresh = _first_missing(Path(store))
    one_pass = len(runs) == 1 and (fresh is not None or failed_write_leaves_no_trace(
        store.path if hasattr(store, "write_run") else Path(store)))
    if not one_pass:
        runs = [rd.two_pass() if rd.two_pass is not None else rd for rd in runs]
    if not hasattr(store, "write_run"):
        store = Store(store, create=True)
    try:
        for rd in runs:   # every refusal before the first write: the store stays as it was
            _key(rd, store, options, run_id)
        results = []
        for rd in runs:
            try:
                res = _write(store, rd, run_id)
            except OnePassFailed:      # not what its footer promised: checked first, then written
                rd = rd.two_pass()
                _key(rd, store, options, run_id)
                res = _write(store, rd, run_id)
            if on_write is not None:
                on_write(rd, res)
            results.append(res)
    except InputError:
        if fresh is not None:      # refused while written into a store this ingest created
            remove_empty_store(store.path, fresh)
        raise
    return results


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (itself included) that does not exist, or None."""
    path = path.absolute()
    if path.exists() or path.is_symlink():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def _key(rd: RunData, store, options, run_id) -> None:
    rd.run["ingest_key"] = ingest_key(rd.run.get("source_sha256"), options, run_id)
    if run_id is None:
        refuse_silent_reingest(store, rd)


def _write(store, rd: RunData, run_id):
    hint = run_id or rd.run.get("run_id") or rd.run_id_hint
    rd.run.pop("run_id", None)
    return store.write_run(rd.run, rd.tables, run_id=run_id, run_id_hint=hint)


def refuse_silent_reingest(store, rd) -> None:
    """The same source again with other options (a corrected ``--ranks``) never becomes a
    second run silently (``loads-2``): without ``--run-id`` it is refused, naming the run that
    holds the source. The same source with the same options stays a no-op (write_run)."""
    sha = rd.run.get("source_sha256")
    if not sha or not store.has_files("runs"):
        return
    key = rd.run.get("ingest_key") or sha
    if store.find_by_sha(key) is not None:
        return                                   # same source, same options: already there, a no-op
    held = store.sql("SELECT run_id FROM runs WHERE source_sha256 = ? ORDER BY run_id", [sha])["run_id"].to_list()
    if held:
        src = (rd.files or [rd.run.get("source")])[0]
        raise InputError(src, f"already ingested as run {held[0]!r} with other options; to ingest it again with "
                              "these, name the new run: --run-id NEW (both runs are kept)")


def ingest_key(source_sha256: str | None, options: dict | None, run_id: str | None) -> str | None:
    """The dedupe key of an ingest: the source's sha256 with the options given and the run
    id asked for, so the same source with other options (``--ranks 32``) or another
    ``--run-id`` makes a new run and the same source with the same options is a no-op.
    None (dedupe on the source alone) when neither options nor a run id were given."""
    import hashlib
    import json

    opts = {k: v for k, v in (options or {}).items() if v not in (None, False)}
    if not source_sha256 or (not opts and not run_id):
        return None
    doc = json.dumps({"source": source_sha256, "options": opts, "run_id": run_id}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()
