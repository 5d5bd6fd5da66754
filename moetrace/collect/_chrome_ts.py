"""Kineto Chrome-trace timestamps and durations: ``ts`` kept as its decimal text (so
fractional µs relative to ``baseTimeNanoseconds`` and integer absolute-epoch µs both
convert to integer ns exactly) and ``dur`` checked, as columns. Used by the reader in
:mod:`._chrome_json`."""
from __future__ import annotations

from decimal import Decimal, InvalidOperation
from pathlib import Path

import msgspec

from ..errors import InputError
from ._polars import pl

MAX_DUR_NS = 3600 * 10**9          # an event longer than an hour is corrupt


def ts_to_ns(texts: list[bytes], base_ns: int, path: Path, offset: int) -> list[int]:
    """Decimal µs text -> integer ns (+ base), exactly; rounds half away from zero past ns."""
    out = []
    for j, t in enumerate(texts):
        s = t.decode("ascii", "replace") if isinstance(t, (bytes, bytearray, memoryview)) else str(t)
        neg = s.startswith("-")
        body = s[1:] if neg else s
        ip, dot, fp = body.partition(".")
        if ip.isdigit() and len(ip) <= 24 and (not fp or fp.isdigit()):   # longer: checked below
            v = int(ip) * 1000 + int((fp + "000")[:3] or 0)
            if len(fp) > 3 and fp[3] >= "5":
                v += 1
        else:
            shown = s if len(s) <= 40 else s[:37] + "..."
            try:
                d = Decimal(s.strip().strip('"'))
            except InvalidOperation:
                raise InputError(path, f"timestamp {shown!r} is not a number", f"event {offset + j}") from None
            if not d.is_finite():
                raise InputError(path, f"timestamp {shown!r} is not finite", f"event {offset + j}")
            if d != 0 and d.adjusted() > 30:  # 1e999999999: refused before any arithmetic can overflow
                raise InputError(path, f"timestamp {shown!r} µs is outside the 64-bit ns range", f"event {offset + j}")
            neg = d < 0
            v = int((abs(d) * 1000).to_integral_value(rounding="ROUND_HALF_UP"))
        ns = base_ns + (-v if neg else v)
        if not -(2 ** 63) <= ns < 2 ** 63:
            raise InputError(path, f"timestamp {s!r} µs is outside the 64-bit ns range", f"event {offset + j}")
        out.append(ns)
    return out


def int_or_none(v) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return None
    return None


class TsTexts:
    """The ``ts`` texts of one column: per batch, the numbers joined by commas (a number
    holds no comma), or, for a batch with a string, list or object value, each text on
    its own."""

    def __init__(self):
        self.parts: list = []
        self.n = 0

    def add(self, raws: list) -> None:
        joined = b",".join(raws)
        plain = b'"' not in joined and b"[" not in joined and b"{" not in joined  # numbers (or null/true)
        self.parts.append(joined if plain else [bytes(r) for r in raws])
        self.n += len(raws)

    def __len__(self) -> int:
        return self.n

    def joined(self) -> bytes:
        return b",".join(p if isinstance(p, bytes) else b",".join(p) for p in self.parts)

    def texts(self) -> list:
        out: list = []
        for p in self.parts:
            out.extend(p.split(b",") if isinstance(p, bytes) else p)
        return out


_NUM_RE = r"^-?\d+(?:\.\d*)?$"
_INTS_DEC = msgspec.json.Decoder(list[int])


def ts_column(ts_list, idx: list | None, base_ns: int, path: Path) -> pl.Series:
    """Decimal µs texts (msgspec Raw slices, or :class:`TsTexts`) -> exact integer ns
    (+ base), vectorized.

    All integers (absolute-epoch µs): decoded as one JSON array of ints, times 1000.
    Otherwise exact decimal arithmetic on the text: integer part * 1000 + the first three
    decimals, rounded half away from zero on the fourth; anything else (exponents, quoted
    numbers) goes through Decimal one value at a time."""
    if not len(ts_list):
        return pl.Series("t", [], pl.Int64)
    limit = (2**63 - 1 - abs(base_ns)) // 1000 - 1
    if isinstance(ts_list, TsTexts):
        joined = ts_list.joined()
    else:
        joined = b",".join(ts_list)
    try:
        ints = pl.Series("t", _INTS_DEC.decode(b"[" + joined + b"]"), pl.Int64)
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError, TypeError):
        ints = None
    if ints is not None and len(ints) == len(ts_list) and -limit < ints.min() and ints.max() < limit:
        return (ints * 1000 + base_ns).alias("t")
    del ints
    if isinstance(ts_list, TsTexts):
        ts_list = ts_list.texts()
    for j, t in enumerate(ts_list):
        if not len(t):
            raise InputError(path, "complete event without ts", f"event {idx[j] if idx else j}")
    text = pl.Series("t", [b"\n".join(ts_list).decode("utf-8", "replace")], pl.Utf8).str.split("\n").explode()
    del joined
    ok = text.str.contains(_NUM_RE)
    neg = text.str.starts_with("-")
    body = text.str.strip_prefix("-")
    parts = body.str.split_exact(".", 1).struct.unnest()
    frac = parts["field_1"].fill_null("").str.pad_end(4, "0")
    ip = parts["field_0"].cast(pl.Int64, strict=False)
    v = ip * 1000 + frac.str.slice(0, 3).cast(pl.Int64, strict=False) + (frac.str.slice(3, 1) >= "5").cast(pl.Int64)
    v = pl.select(pl.when(neg).then(-v).otherwise(v)).to_series()
    # where ip * 1000 (+ base) could wrap around int64, take the exact (range-checked) path
    bad = ~ok | v.is_null() | ip.is_null() | (ip >= limit)
    if bad.any():
        vals = v.to_list()
        for j in bad.arg_true().to_list():
            vals[j] = ts_to_ns([text[j].encode()], 0, path, idx[j] if idx else j)[0]
        v = pl.Series("t", vals, pl.Int64)
    return (v + base_ns).alias("t")


def dur_column(dur_list: list, idx: list, path: Path) -> pl.Series:
    d = pl.Series("d", dur_list, pl.Float64, strict=False)
    if d.null_count():   # every event kept is a complete ('X') one: its dur says when it ended
        j = d.is_null().arg_true()[0]
        raise InputError(path, "a complete ('X') event has no numeric dur, so when it ended is unknown",
                         f"event {idx[j]}")
    ns = (d * 1000).round(0)
    bad = (ns < 0) | (ns > MAX_DUR_NS) | d.is_nan()
    if bad.any():
        j = bad.arg_true()[0]
        v = dur_list[j]
        if v is not None and v < 0:
            raise InputError(path, f"event has a negative duration ({v} µs)", f"event {idx[j]}")
        raise InputError(path, f"event lasts {v} µs (over an hour): corrupt trace", f"event {idx[j]}")
    return ns.cast(pl.Int64)
