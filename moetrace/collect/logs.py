"""vLLM and SGLang server logs: EPLB balancedness and rebalance lines.

Recognized lines (docs/reference/formats.md, "vLLM and SGLang server log lines"; any prefix
before the message is allowed):

- vLLM ``EPLB step: avg_tokens=.., max_tokens=.., balancedness=..`` and the variants with
  ``EPLB step: N for model M:`` and ``, steps until the next rearrangement: N``;
  ``Rearranging experts (profile)...`` (start), ``Rearranged experts (profile) in X
  seconds.`` / ``Rearranged experts in X s.`` (end). The vLLM prefix ``(proc pid=N) INFO
  MM-DD HH:MM:SS [file.py:N]`` gives the time (no year).
- SGLang ``[Expert Balancedness] forward_pass_id=.. current_pass_balancedness=..
  last_10_average_balancedness=.. ... gpu_physical_count_sum=..``, ``[EPLBManager]
  rebalance start``, ``[EPLBManager] rebalance end time=X s``, ``[EPLBManager] Skipped ep
  rebalancing: current GPU utilization U > minimum rebalance threshold T``. The SGLang
  prefix ``[YYYY-MM-DD HH:MM:SS DP0 TP0 EP0]`` gives the time.

A line that carries one of the markers but does not parse is counted (and its line
numbers kept) in ``runs.meta_json`` and stated in ``runs.approximations``; every other line
is counted as unrelated. Nothing is dropped silently. One run per log file.
"""
from __future__ import annotations

import calendar
import datetime as dt
import json
import re
from pathlib import Path

import pyarrow as pa

from ..domain.hashing import sha256_files
from ..errors import InputError
from ..safety import check_regular_file, limit, limit_error
from . import Collector, RunData, register

MARKERS = (b"EPLB step", b"[Expert Balancedness]", b"[EPLBManager]", b"Rearranged experts", b"Rearranging experts")
_TEXT_EXT = (".log", ".txt", ".out", ".err", ".stdout", ".stderr")
_SCAN_BYTES = 64 << 20

# Numbers match one way only (possessive quantifiers): a long digit run cannot make the
# regexes backtrack (a 300 KB line parses in linear time). Lines longer than
# safety max_line_bytes are not parsed at all (counted).
_NUM = r"(?>[-+]?+(?:\d++(?:\.\d*+)?+|\.\d++)(?:[eE][-+]?+\d++)?+|nan|inf)"
VLLM_BAL = re.compile(
    r"EPLB step(?::\s*(?P<step>\d+)\s+for model\s+(?P<model>.+?))?:\s*avg_tokens=(?P<avg>" + _NUM + r"),\s*"
    r"max_tokens=(?P<max>" + _NUM + r"),\s*balancedness=(?P<bal>" + _NUM + r")"
    r"(?:,\s*steps until the next rearrangement:\s*(?P<until>\d+))?\s*$")
VLLM_START = re.compile(r"Rearranging experts\s*(?P<profile>\(profile\))?\s*\.\.\.\s*$")
VLLM_END = re.compile(r"Rearranged experts\s*(?P<profile>\(profile\))?\s*in\s+(?P<dur>" + _NUM + r")\s*(?:s|seconds)\.?\s*$")
SGL_BAL = re.compile(
    r"\[Expert Balancedness\]\s+forward_pass_id=(?P<fpid>\d+)\s+current_pass_balancedness=(?P<bal>" + _NUM + r")"
    r"(?P<hist>(?:\s+last_\d+_average_balancedness=(?:" + _NUM + r"))*)\s+gpu_physical_count_sum=(?P<sum>\d+)\s*$")
SGL_HIST = re.compile(r"last_(\d+)_average_balancedness=(" + _NUM + r")")
SGL_START = re.compile(r"\[EPLBManager\]\s+rebalance start\s*$")
SGL_END = re.compile(r"\[EPLBManager\]\s+rebalance end(?:\s+time=(?P<dur>" + _NUM + r")\s*s?)?\s*$")
SGL_SKIP = re.compile(r"\[EPLBManager\]\s+Skipped ep rebalancing: current GPU utilization (?P<util>" + _NUM + r")"
                      r"\s*(?:>|<|<=|>=)\s*minimum rebalance threshold (?P<thr>" + _NUM + r")\s*$")
# prefixes (timestamps)
VLLM_PREFIX = re.compile(r"(?:\((?P<proc>[^()]*?pid=\d+)\)\s+)?(?:INFO|DEBUG|WARNING|ERROR)\s+"
                         r"(?P<mon>\d{2})-(?P<day>\d{2})\s+(?P<hms>\d{2}:\d{2}:\d{2})(?:\.\d+)?\s+\[[^\]]*\]\s")
SGL_PREFIX = re.compile(r"\[(?P<date>\d{4}-\d{2}-\d{2})\s+(?P<hms>\d{2}:\d{2}:\d{2})(?:[.,]\d+)?(?P<proc>(?:\s+[A-Z]+\d+)*)\]\s")
# Python logging's default asctime at the start of the line ("2026-11-30 10:15:02,345 - name - INFO - msg",
# "2026-11-30 10:15:02,345 INFO msg"): SGLang run under a logging.basicConfig format
PY_PREFIX = re.compile(r"^\s*(?P<date>\d{4}-\d{2}-\d{2})[ T](?P<hms>\d{2}:\d{2}:\d{2})(?:[.,]\d+)?\s")


def _sniff(path: Path, head: bytes) -> bool:
    name = path.name.lower()
    if not (name.endswith(_TEXT_EXT) or "." not in name):
        return False
    if head.count(b"\x00") > len(head) // 100 + 1:  # binary, not a log with a stray NUL
        return False
    if any(m in head for m in MARKERS):
        return True
    try:
        with open(path, "rb") as f:
            data = f.read(_SCAN_BYTES)
    except OSError:
        return False
    return any(m in data for m in MARKERS)


def _epoch(year: int, mon: int, day: int, hms: str) -> int | None:
    try:
        h, m, s = (int(x) for x in hms.split(":"))
        return calendar.timegm(dt.datetime(year, mon, day, h, m, s).timetuple()) * 1_000_000_000
    except (ValueError, OverflowError):
        return None


def _f(x: str | None) -> float | None:
    return None if x is None else float(x)


def parse_line(text: str) -> dict | None:
    """Parse one log line; a dict of balancedness columns, or None when nothing matched.

    Raises ValueError for a line that carries a marker but does not parse."""
    row: dict = {}
    m = VLLM_PREFIX.search(text)
    if m:
        row["_vllm_md"] = (int(m["mon"]), int(m["day"]), m["hms"])
        row["process"] = m["proc"]
    else:
        m2 = SGL_PREFIX.search(text)
        m3 = None if m2 else PY_PREFIX.match(text)
        if m2 or m3:
            y, mo, d = (int(x) for x in (m2 or m3)["date"].split("-"))
            row["ts_ns"] = _epoch(y, mo, d, (m2 or m3)["hms"])
            row["process"] = (m2["proc"].strip() or None) if m2 else None
    msg = text.rstrip("\r\n")
    if "EPLB step:" in msg:
        g = VLLM_BAL.search(msg)
        if not g:
            raise ValueError("vLLM balancedness line")
        # vLLM logs balancedness 0.0 when no token was routed (max_tokens = 0): undefined, stored null (never 0)
        empty = float(g["max"]) == 0
        row.update(engine="vllm", event="balancedness", step=int(g["step"]) if g["step"] else None,
                   model=g["model"], avg_tokens=float(g["avg"]), max_tokens=float(g["max"]),
                   balancedness=None if empty else float(g["bal"]), _empty=empty,
                   steps_until_rearrangement=int(g["until"]) if g["until"] else None)
        return row
    if "Rearranging experts" in msg:
        g = VLLM_START.search(msg)
        if not g:
            raise ValueError("vLLM rearrange start line")
        row.update(engine="vllm", event="rebalance_start", is_profile=bool(g["profile"]))
        return row
    if "Rearranged experts" in msg:
        g = VLLM_END.search(msg)
        if not g:
            raise ValueError("vLLM rearrange end line")
        row.update(engine="vllm", event="rebalance_end", is_profile=bool(g["profile"]), duration_s=float(g["dur"]))
        return row
    if "[Expert Balancedness]" in msg:
        g = SGL_BAL.search(msg)
        if not g:
            raise ValueError("SGLang balancedness line")
        row.update(engine="sglang", event="balancedness", step=int(g["fpid"]), balancedness=float(g["bal"]),
                   gpu_physical_count_sum=int(g["sum"]))
        for size, val in SGL_HIST.findall(g["hist"] or ""):
            if size in ("10", "100", "1000"):  # the window sizes SGLang logs; others are not columns
                row[f"balancedness_last_{size}"] = float(val)
        return row
    if "[EPLBManager]" in msg:
        for rx, ev in ((SGL_START, "rebalance_start"), (SGL_END, "rebalance_end"), (SGL_SKIP, "rebalance_skip")):
            g = rx.search(msg)
            if g:
                row.update(engine="sglang", event=ev)
                if ev == "rebalance_end":
                    row["duration_s"] = _f(g["dur"])
                if ev == "rebalance_skip":
                    row.update(utilization=float(g["util"]), threshold=float(g["thr"]))
                return row
        if re.search(r"\[EPLBManager\]\s+(rebalance|Skipped)", msg):
            raise ValueError("SGLang EPLBManager line")
        return None  # other EPLBManager chatter: unrelated
    return None


COLUMNS = ["file", "line", "engine", "event", "step", "ts_ns", "model", "process", "avg_tokens", "max_tokens",
           "balancedness", "balancedness_last_10", "balancedness_last_100", "balancedness_last_1000",
           "gpu_physical_count_sum", "steps_until_rearrangement", "duration_s", "utilization", "threshold",
           "is_profile", "imbalance", "definition"]
_TYPES = {"definition": pa.string(), "file": pa.string(), "line": pa.int64(), "engine": pa.string(), "event": pa.string(), "step": pa.int64(),
          "ts_ns": pa.int64(), "model": pa.string(), "process": pa.string(), "gpu_physical_count_sum": pa.int64(),
          "steps_until_rearrangement": pa.int64(), "is_profile": pa.bool_()}


_INT64 = 1 << 63
_INT_FIELDS = ("step", "gpu_physical_count_sum", "steps_until_rearrangement")


def _check_ranges(row: dict, path: Path, n: int) -> None:
    """Integers of a parsed line must fit the int64 columns; a timestamp must be a time
    64-bit ns since 1970 can hold (years 1970..2262): else one line naming the line."""
    ts = row.get("ts_ns")
    if ts is not None and not 0 <= ts < _INT64:
        raise InputError(path, "timestamp is outside the years 1970..2262 (64-bit nanoseconds since 1970)",
                         f"line {n}")
    for k in _INT_FIELDS:
        v = row.get(k)
        if v is not None and not 0 <= v < _INT64:
            raise InputError(path, f"{k} = {str(v)[:30]}{'...' if len(str(v)) > 30 else ''} does not fit a "
                                   "64-bit integer", f"line {n}")


def _lines(f, cap: int):
    """(line number, bytes, too_long) of a binary file, never holding more than ``cap``
    bytes of one line in memory (the rest of an over-long line is skipped)."""
    n = 0
    while True:
        raw = f.readline(cap + 1)
        if not raw:
            return
        n += 1
        if len(raw) > cap and not raw.endswith(b"\n"):
            while True:  # drain the rest of the over-long line
                more = f.readline(1 << 20)
                if not more or more.endswith(b"\n"):
                    break
            yield n, raw, True
        else:
            yield n, raw, False


def parse_file(path: Path, year: int | None = None) -> tuple[list[dict], dict]:
    """Rows and counts (lines, matched, malformed, unrelated, too_long) of one log file."""
    rows, malformed, n, too_long, empty = [], [], 0, [], []
    check_regular_file(path)
    if year is None:
        year = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).year
    cap = limit("max_line_bytes")
    records = limit("max_text_records")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    with f:
        for n, raw, long_line in _lines(f, cap):
            if long_line:
                too_long.append(n)
                continue
            text = raw.decode("utf-8", "replace")
            try:
                row = parse_line(text)
            except ValueError as e:
                malformed.append((n, str(e)))
                continue
            if row is None:
                continue
            md = row.pop("_vllm_md", None)
            if md is not None:
                row["ts_ns"] = _epoch(year, md[0], md[1], md[2])
            _check_ranges(row, path, n)
            if row.pop("_empty", False):
                empty.append(n)
            _convert(row)
            row["file"], row["line"] = path.name, n
            rows.append(row)
            if len(rows) + len(malformed) > records:
                raise limit_error(path, "max_text_records", f"more than {records} parsed lines", f"line {n}")
    counts = {"lines": n, "matched": len(rows), "malformed": len(malformed),
              "unrelated": n - len(rows) - len(malformed) - len(too_long),

              "malformed_lines": [m[0] for m in malformed[:50]],
              "malformed_kinds": sorted({m[1] for m in malformed})}
    if too_long:
        counts.update(too_long=len(too_long), too_long_lines=too_long[:50])
    if empty:
        counts.update(empty_windows=len(empty), empty_window_lines=empty[:50])
    return rows, counts


def _convert(row: dict) -> None:
    """moetrace's imbalance (max/mean) beside the engine's balancedness (moetrace.domain.balance)."""
    from ..domain.balance import ENGINE_FIGURE, definition, to_imbalance

    if row.get("event", "").startswith("balancedness") and row.get("engine") in ENGINE_FIGURE:
        fig = ENGINE_FIGURE[row["engine"]]
        row["imbalance"] = to_imbalance(fig, row.get("balancedness"))
        row["definition"] = definition(fig)


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    out = []
    year = options.get("year")
    if year is not None:
        try:
            year = int(year)
        except (TypeError, ValueError):
            year = -1
        if not 1970 <= year <= 2262:
            raise InputError(None, f"--set year={options.get('year')!r}: a year 1970..2262 is needed")
    for path in sorted(paths):
        rows, counts = parse_file(path, int(year) if year else None)
        if not rows:
            raise InputError(path, f"no EPLB balancedness or rebalance line parsed ({counts['lines']} lines, "
                                   f"{counts['malformed']} malformed)")
        table = pa.table({c: pa.array([r.get(c) for r in rows], _TYPES.get(c, pa.float64())) for c in COLUMNS})
        engines = sorted({r["engine"] for r in rows})
        approx = []
        if counts["malformed"]:
            approx.append(f"{counts['malformed']} log lines carry an EPLB marker but did not parse and were skipped "
                          f"({', '.join(counts['malformed_kinds'])}; first at line {counts['malformed_lines'][0]})")
        if "vllm" in engines and any(r.get("ts_ns") is not None and r["engine"] == "vllm" for r in rows):
            approx.append("vLLM log timestamps carry no year or time zone: year from --set year=YYYY or the file's "
                          "modification time, clock taken as UTC")
        sgl = [r for r in rows if r["engine"] == "sglang"]
        if any(r.get("ts_ns") is not None for r in sgl):
            approx.append("SGLang log timestamps are local time of the server, taken as UTC")
        untimed = sum(r.get("ts_ns") is None for r in sgl)
        if untimed:
            approx.append(f"{untimed} SGLang log lines carry no timestamp (no '[YYYY-MM-DD HH:MM:SS ...]' or "
                          "'YYYY-MM-DD HH:MM:SS,mmm' prefix): their ts_ns is empty")
        if counts.get("empty_windows"):
            approx.append(f"{counts['empty_windows']} vLLM EPLB lines had no token routed (max_tokens=0; vLLM logs "
                          "balancedness 0.0 there): balancedness undefined, stored empty (first at line "
                          f"{counts['empty_window_lines'][0]})")
        if counts.get("too_long"):
            approx.append(f"{counts['too_long']} log lines longer than max_line_bytes={limit('max_line_bytes')} were "
                          f"counted and not parsed (first at line {counts['too_long_lines'][0]}; raise the limit with "
                          "--set max_line_bytes=N or MOETRACE_MAX_LINE_BYTES=N)")
        if counts["unrelated"]:
            approx.append(f"{counts['unrelated']} unrelated log lines counted and ignored")
        run = {"source": path.name, "source_sha256": sha256_files([path]), "collector": "logs",
               "time_base": "epoch" if any(r.get("ts_ns") is not None for r in rows) else "none",
               "num_layers": options.get("num_layers"), "num_experts": options.get("num_experts"),
               "top_k": options.get("top_k"), "num_ranks": options.get("num_ranks"),
               "ranks_per_node": options.get("ranks_per_node"),
               "approximations": json.dumps(approx) if approx else None,
               "meta_json": json.dumps({"format": "engine_log", "engines": engines, "line_counts": counts})}
        out.append(RunData(run=run, tables={"balancedness": table}, run_id_hint=path.stem, files=[str(path)]))
    return out


register(Collector("logs", "vLLM / SGLang server logs: EPLB balancedness and rebalance lines",
                   _sniff, _collect, priority=60))
