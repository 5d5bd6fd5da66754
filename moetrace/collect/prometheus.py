"""Saved Prometheus scrapes (text exposition format) of the engines' EPLB metrics.

One file, or a folder of timestamped scrapes, is one run; every EPLB sample becomes a
``balancedness`` row at its time:

- vLLM (``EplbProm``): gauges ``vllm:eplb_balancedness_avg`` (event ``balancedness``),
  ``..._min`` / ``..._p50`` / ``..._p90`` (events ``balancedness_min`` / ``_p50`` / ``_p90``),
  per-layer avg/max token load over EP ranks summarized over MoE layers; the counter
  ``vllm:eplb_rearrangements_total`` gives one ``rebalance_end`` row per rearrangement
  counted between two scrapes, the last carrying ``vllm:eplb_rearrangement_seconds``.
- SGLang: the summary ``sglang:eplb_balancedness`` (``_sum`` / ``_count`` per
  ``forward_mode``; on with ``--enable-metrics`` and ``SGLANG_ENABLE_EPLB_BALANCEDNESS_METRIC=1``):
  between two scrapes Δsum / Δcount is the mean balancedness of the passes in between
  (event ``balancedness``, ``gpu_physical_count_sum`` left empty); a lone scrape gives the
  lifetime mean, said in the run.

Time of a sample: its own exposition timestamp (ms), else the scrape's time from the file
name (Unix seconds or ms, or ``YYYY-MM-DDTHH:MM:SS``, taken as UTC), else the file's
modification time (said). Labels go to ``model`` (``model_name``) and ``process`` (the
rest, ``k=v`` joined). Every other metric family is counted (families and samples, in
``runs.meta_json`` and ``runs.approximations``), never dropped silently; lines that are
not valid exposition syntax are refused with the line number.
"""
from __future__ import annotations

import calendar
import datetime as dt
import json
import math
import re
from pathlib import Path

import pyarrow as pa

from ..domain.hashing import sha256_files
from ..errors import InputError
from ..safety import check_whole_input, checked_int, limit, limit_error
from . import Collector, RunData, register
from .logs import _TYPES, COLUMNS

_EXT = (".prom", ".metrics", ".txt", ".scrape")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)"
                     r"(?:\s+(?P<ts>-?\d+))?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_EPOCH = re.compile(r"(?<!\d)(\d{10}|\d{13})(?!\d)")
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})[T_ ](\d{2})[:\-]?(\d{2})[:\-]?(\d{2})")
VLLM_BAL = {"vllm:eplb_balancedness_avg": "balancedness", "vllm:eplb_balancedness_min": "balancedness_min",
            "vllm:eplb_balancedness_p50": "balancedness_p50", "vllm:eplb_balancedness_p90": "balancedness_p90"}
VLLM_COUNT = "vllm:eplb_rearrangements_total"
VLLM_SECONDS = "vllm:eplb_rearrangement_seconds"
SGL_SUMMARY = re.compile(r"^(?:sglang[:_])?eplb_balancedness_(sum|count)$")
SGL_CREATED = re.compile(r"^(?:sglang[:_])?eplb_balancedness_created$")
MAX_EVENTS = 100_000   # rearrangement rows one counter step may make
_SCAN = 1 << 20


#: the prefix of NCCL Inspector's Prometheus-mode families (nccl_bus_bandwidth_gbs,
#: nccl_collective_exec_time_microseconds, nccl_p2p_*)
_INSPECTOR_PROM = b"nccl_"


def _sniff(path: Path, head: bytes) -> bool:
    name = path.name.lower()
    if not (name.endswith(_EXT) or "." not in name):
        return False
    if b"\x00" in head:
        return False
    text = head.decode("utf-8", "replace")
    whole = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]   # a cut last line is not judged
    lines = [l.strip() for l in whole if l.strip() and not l.startswith("#")][:5]
    if not (re.search(r"^# (?:TYPE|HELP) [a-zA-Z_:]", text, re.M) or (lines and all(_SAMPLE.match(l) for l in lines))):
        return False
    if b"eplb_" in head or _INSPECTOR_PROM in head:
        return True
    try:
        with open(path, "rb") as f:
            body = f.read(_SCAN)
            return b"eplb_" in body or _INSPECTOR_PROM in body
    except OSError:
        return False


def _float(s: str) -> float:
    low = s.lower()
    if low in ("nan", "+inf", "inf", "-inf"):
        return float(low.replace("+", ""))
    return float(s)


def _labels(text: str | None, path: Path, line: int) -> dict:
    out, pos = {}, 0
    text = (text or "").strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise InputError(path, f"bad label set {{{text[:80]}}}", f"line {line}")
        out[m.group(1)] = m.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = m.end()
    return out


def _file_time(path: Path) -> tuple[int | None, str]:
    m = _ISO.search(path.name)
    if m:
        y, mo, d, h, mi, s = (int(x) for x in m.groups())
        try:
            return calendar.timegm(dt.datetime(y, mo, d, h, mi, s).timetuple()) * 10**9, "file name (ISO, UTC)"
        except ValueError:
            pass
    m = _EPOCH.search(path.name)
    if m:
        v = int(m.group(1))
        ns = v * 10**9 if len(m.group(1)) == 10 else v * 10**6
        if ns < 2**63:
            return ns, "file name (Unix time)"
    return None, "file modification time"


def _ts_ns(text: str | None, path: Path, line: int) -> int | None:
    """An exposition timestamp (ms since the epoch) as ns, within 1970..2262 (int64 ns)."""
    if not text:
        return None
    ms = checked_int(text, 0, (2**63 - 1) // 10**6, path, "sample timestamp (ms)", position=f"line {line}")
    return ms * 10**6


def parse(path: Path) -> list[dict]:
    """Samples of one scrape: [{name, labels, value, ts_ns, line}]."""
    samples: list[dict] = []
    records = limit("max_text_records")
    try:
        check_whole_input(path)
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(path, "not UTF-8 text", f"byte {e.start}") from None
    max_line = limit("max_line_bytes")
    for n, line in enumerate(text.splitlines(), 1):
        if len(line) > max_line:
            raise limit_error(path, "max_line_bytes", f"a line of {len(line)} characters", f"line {n}")
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = _SAMPLE.match(s)
        if not m:
            raise InputError(path, f"not a Prometheus sample line: {s[:80]!r}", f"line {n}")
        try:
            value = _float(m["value"])
        except ValueError:
            raise InputError(path, f"sample value {m['value'][:40]!r} is not a number", f"line {n}") from None
        samples.append({"name": m["name"], "labels": _labels(m["labels"], path, n), "value": value,
                        "ts_ns": _ts_ns(m["ts"], path, n), "line": n})
        if len(samples) > records:
            raise limit_error(path, "max_text_records", f"more than {records} samples", f"line {n}")
    if not samples:
        raise InputError(path, "no samples in the file")
    return samples


def _who(labels: dict) -> tuple[str | None, str | None]:
    rest = {k: v for k, v in labels.items() if k not in ("model_name", "forward_mode", "quantile")}
    return labels.get("model_name"), (",".join(f"{k}={v}" for k, v in sorted(rest.items())) or None)


def _collect(paths: list[Path], options: dict) -> list[RunData]:
    scrapes = []
    time_from = set()
    for p in paths:
        samples = parse(p)
        t, how = _file_time(p)
        if t is None:
            t = int(p.stat().st_mtime * 1e9)
        time_from.add(how)
        scrapes.append((t, p, samples))
    scrapes.sort(key=lambda x: (x[0], x[1].name))
    rows: list[dict] = []
    other: dict[str, int] = {}
    nan = 0
    prev_count: dict[tuple, float] = {}
    prev_sum: dict[tuple, tuple[float, float]] = {}
    approx: list[str] = []
    baseline_rearr = 0.0
    single = len(scrapes) == 1
    for _si, (t_file, path, samples) in enumerate(scrapes):
        seconds = {json.dumps(s["labels"], sort_keys=True): s["value"] for s in samples if s["name"] == VLLM_SECONDS}
        sgl: dict[tuple, dict] = {}
        for s in samples:
            name, ts = s["name"], s["ts_ns"] if s["ts_ns"] is not None else t_file
            model, proc = _who(s["labels"])
            base = {"file": path.name, "line": s["line"], "ts_ns": ts, "model": model, "process": proc}
            if name in VLLM_BAL:
                if math.isnan(s["value"]):
                    nan += 1
                    continue
                rows.append({**base, "engine": "vllm", "event": VLLM_BAL[name], "balancedness": s["value"]})
            elif name == VLLM_COUNT:
                key = (name, json.dumps(s["labels"], sort_keys=True))
                before = prev_count.get(key)
                prev_count[key] = s["value"]
                if before is None:
                    baseline_rearr += s["value"]
                    continue
                delta = s["value"] - before
                if delta < 0:   # counter reset (restart): everything since the restart is new
                    delta = s["value"]
                    approx.append(f"{path.name}: {name} went down (server restarted?): counted from zero")
                if delta != int(delta) or delta > MAX_EVENTS:
                    raise InputError(path, f"{name} rose by {delta} between two scrapes (expected a small whole "
                                           "number)", f"line {s['line']}")
                dur = seconds.get(key[1])
                for j in range(int(delta)):
                    rows.append({**base, "engine": "vllm", "event": "rebalance_end",
                                 "duration_s": dur if j == int(delta) - 1 else None})
            elif SGL_SUMMARY.match(name):
                part = SGL_SUMMARY.match(name).group(1)
                labels = {k: v for k, v in s["labels"].items() if k != "quantile"}
                key = json.dumps(labels, sort_keys=True)
                sgl.setdefault(key, {"base": base, "labels": labels})[part] = s["value"]
            elif name != VLLM_SECONDS and not SGL_CREATED.match(name):
                fam = re.sub(r"_(sum|count|bucket|total|created)$", "", name)
                other[fam] = other.get(fam, 0) + 1
        for key, d in sgl.items():
            if "sum" not in d or "count" not in d:
                raise InputError(path, "sglang:eplb_balancedness summary without both _sum and _count",
                                 f"line {d['base']['line']}")
            fm = d["labels"].get("forward_mode")
            before = prev_sum.get(key)
            prev_sum[key] = (d["sum"], d["count"])
            if before is None and not single:
                continue   # the first scrape is the baseline of the differences
            ds, dc = (d["sum"] - before[0], d["count"] - before[1]) if before else (d["sum"], d["count"])
            if dc < 0:
                ds, dc = d["sum"], d["count"]
                approx.append(f"{path.name}: sglang:eplb_balancedness count went down (restart?): counted from zero")
            if dc <= 0:
                continue
            row = {**d["base"], "engine": "sglang", "event": "balancedness", "balancedness": ds / dc}
            if fm:
                row["process"] = ",".join(x for x in (row["process"], f"forward_mode={fm}") if x)
            rows.append(row)
    if not rows and not prev_count and not prev_sum:
        if any(f.startswith(_INSPECTOR_PROM.decode()) for f in other):
            # NCCL_INSPECTOR_PROM_DUMP=1 (plugins/profiler/inspector/inspector_prom.cc): gauges per
            # communicator, collective and message-size bucket, no per-operation record
            raise InputError(paths[0], "NCCL Inspector Prometheus-mode metrics (nccl_* gauges per communicator and "
                                       "message-size bucket) hold no per-operation record: write the Inspector's "
                                       "JSON lines instead (NCCL_INSPECTOR_PROM_DUMP=0) and ingest those")
        raise InputError(paths[0], "no vLLM or SGLang EPLB metric in the scrape(s) "
                                   f"({sum(other.values())} samples of {len(other)} other families)")
    if not rows:
        raise InputError(paths[0], "the EPLB metrics never changed between the scrapes: no balancedness or "
                                   "rearrangement to record")
    n_other = sum(other.values())
    if n_other:
        approx.append(f"{n_other} samples of {len(other)} other metric families counted and not read "
                      f"({', '.join(sorted(other)[:5])}{' ...' if len(other) > 5 else ''})")
    if nan:
        approx.append(f"{nan} NaN balancedness samples skipped (no EP load in that interval)")
    if prev_sum:
        approx.append("SGLang balancedness from the eplb_balancedness summary: "
                      + ("lifetime mean (one scrape)" if single else
                         "mean over the passes between consecutive scrapes (Δsum/Δcount); the first scrape is the "
                         "baseline"))
    if prev_count and not single:
        approx.append(f"vLLM rearrangements: {int(baseline_rearr)} counted before the first scrape (baseline, no "
                      "rows); each later one is a rebalance_end row at the scrape that saw it")
    elif prev_count:
        approx.append(f"vLLM rearrangements: one scrape, {int(baseline_rearr)} counted since start, no times: no rows")
    if any(r["event"].startswith("balancedness_") for r in rows):
        approx.append("balancedness_min / _p50 / _p90 rows (vLLM gauges) are the worst / median / 10th-percentile "
                      "per-layer balancedness of the engine's last EPLB step before the scrape")
    if "file modification time" in time_from:
        approx.append("scrape time from the file modification time (no timestamp in the samples or file name)")
    from .logs import _convert

    for r in rows:
        _convert(r)   # moetrace's imbalance beside the engine's figure (moetrace.domain.balance)
    rows.sort(key=lambda r: (r["ts_ns"] or 0, r["file"], r["line"]))
    table = pa.table({c: pa.array([r.get(c) for r in rows], _TYPES.get(c, pa.float64())) for c in COLUMNS})
    srcs = [p for _, p, _ in scrapes]
    run = {"source": srcs[0].name if single else f"{srcs[0].resolve().parent.name}/ ({len(srcs)} scrapes)",
           "source_sha256": sha256_files(srcs), "collector": "prometheus", "time_base": "epoch",
           "num_layers": options.get("num_layers"), "num_experts": options.get("num_experts"),
           "top_k": options.get("top_k"), "num_ranks": options.get("num_ranks"),
           "ranks_per_node": options.get("ranks_per_node"),
           "approximations": json.dumps(approx),
           "meta_json": json.dumps({"format": "prometheus_text", "scrapes": len(srcs),
                                    "time_from": sorted(time_from), "other_families": dict(sorted(other.items())),
                                    "rearrangements_before_first_scrape": baseline_rearr})}
    return [RunData(run=run, tables={"balancedness": table},
                    run_id_hint=srcs[0].stem if single else srcs[0].parent.name, files=[str(p) for p in srcs])]


register(Collector("prometheus", "saved Prometheus scrapes (text format) with vLLM / SGLang EPLB metrics",
                   _sniff, _collect, priority=55))
