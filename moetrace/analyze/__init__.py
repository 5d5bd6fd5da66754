"""Metrics as SQL: every ``sql/*.sql`` file holds CREATE VIEW statements over the
canonical tables (files run in name order, so a view may use views of earlier files)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent / "sql"


def _split(text: str) -> list[str]:
    out, buf = [], []
    for line in text.splitlines():
        if line.strip().startswith("--"):
            continue
        buf.append(line)
        if line.rstrip().endswith(";"):
            stmt = "\n".join(buf).strip().rstrip(";").strip()
            if stmt:
                out.append(stmt)
            buf = []
    rest = "\n".join(buf).strip()
    if rest:
        out.append(rest)
    return out


@lru_cache(maxsize=None)
def view_statements() -> list[str]:
    stmts: list[str] = []
    for f in sorted(SQL_DIR.glob("*.sql")):
        stmts.extend(_split(f.read_text()))
    return stmts
