"""A store holding one run, ingested from a small CSV (the seed of the bad-input tests)."""
from __future__ import annotations

from pathlib import Path

from moetrace.run import Store


# ----------------------------------------------------------------------------- helpers
def _load_csv_text(steps=3, layers=2, experts=4) -> str:
    lines = ["step,layer,expert,tokens"]
    for s in range(steps):
        for l in range(layers):
            for e in range(experts):
                lines.append(f"{s},{l},{e},{(s + 1) * (e + 2) + l}")
    return "\n".join(lines) + "\n"


def _seed_store(path: Path) -> Path:
    """A store that already holds one run, so 'unchanged' means something."""
    src = path.parent / f"seed-{path.name}.csv"
    src.write_text(_load_csv_text(steps=2))
    from moetrace.collect import ingest

    ingest(Store(path, create=True), [src])
    return path
