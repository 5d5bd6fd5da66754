"""Numbers as a person reads them, in one place: times (every time here is given in
nanoseconds, the unit the store and the replay keep), percentages and bytes.

The report, the notebook views and the CLI format with these; none defines its own.
"""
from __future__ import annotations

#: the units of :func:`time_text`, largest first
_TIME_UNITS = (("s", 1e9), ("ms", 1e6), ("µs", 1e3))


def ns_to_ms(ns: float | None) -> float | None:
    """Nanoseconds as milliseconds (None stays None)."""
    return None if ns is None else ns / 1e6


def ms_to_ns(ms: float | None) -> float | None:
    """Milliseconds (a stored ``*_ms`` column) as nanoseconds (None stays None)."""
    return None if ms is None else ms * 1e6


def ms_text(ns: float | None, *, none: str = "–", micro_below_ms: float | None = None) -> str:
    """A time given in ns, as ms with two decimals ("29.07 ms"); below ``micro_below_ms``
    ms in µs instead (tiny models would all read 0.00 ms); ``none`` when unknown."""
    if ns is None:
        return none
    ms = ns / 1e6
    if micro_below_ms is not None and ms < micro_below_ms:
        return f"{ms * 1e3:.2f} µs"
    return f"{ms:.2f} ms"


def time_text(ns: float | None) -> str:
    """A time in ns in the largest of s, ms, µs in which it reads at least 1, four
    significant digits: 87577.5 -> "87.58 µs", 29070674 -> "29.07 ms"; "" when unknown."""
    if ns is None:
        return ""
    v = float(ns)
    if v == 0:
        return "0"
    for name, size in _TIME_UNITS:
        if abs(v) >= size:
            return f"{v / size:.4g} {name}"
    return f"{v:.4g} ns"


def pct_change(x: float | None, ref: float | None) -> str:
    """`` (+1.2%)``: ``x`` against ``ref`` with a typographic minus; "" when either is
    unknown or ``ref`` is 0."""
    if x is None or not ref:
        return ""
    return f" ({(x / ref - 1) * 100:+.1f}%)".replace("-", "−")


def percent(share: float | None, digits: int = 1) -> float | None:
    """A share (0.123) as a percentage number rounded to ``digits`` (12.3); None stays None."""
    return None if share is None else round(100.0 * share, digits)


def share_text(share: float) -> str:
    """A share as text: "12.3%", and "<0.1%" for a share too small to read as 0.0%."""
    return "<0.1%" if 0 < share < 0.0005 else f"{100 * share:.1f}%"


def gib(nbytes: float) -> float:
    """Bytes in GiB (2^30 bytes)."""
    return nbytes / 2**30


# ----------------------------------------------------------------------------- verdict words
#: the words every answer uses for "a plan against the recorded placement" (replay, drift,
#: sweep, the report): one comparison, one word
PAYS_OFF, DOES_NOT, NOT_ENOUGH = "pays off", "does not pay off", "not enough evidence"


def compare_word(x_ns: float | None, ref_ns: float | None, band: float) -> tuple[str, float | None]:
    """The one word for "``x`` against ``ref``" under a model whose times carry ±``band``
    (a share): :data:`PAYS_OFF` when ``x`` is faster by more than the band,
    :data:`DOES_NOT` when slower by more, :data:`NOT_ENOUGH` within it or unknown; with the
    relative difference. Replay, drift, sweep and the report all say their comparisons
    with it, so the same comparison reads the same everywhere."""
    if x_ns is None or ref_ns is None or not ref_ns:
        return NOT_ENOUGH, None
    diff = (x_ns - ref_ns) / ref_ns
    if abs(diff) <= band:
        return NOT_ENOUGH, diff
    return (PAYS_OFF if diff < 0 else DOES_NOT), diff
