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


# Views worth computing once when many queries read them (a report): small results over
# large inputs. Order matters: later ones reuse the earlier ones.
CACHEABLE = ("layer_skew", "tokens_per_expert", "skew_by_batch", "skew_decomposition")


def cache_views(con, run_id: str, views=CACHEABLE) -> list[str]:
    """Materialize ``views`` for one run as TEMP tables on ``con``; they shadow the views
    of the same name (dependent views read them too), so repeated queries about that run
    do not recompute them. Undo with :func:`uncache_views`. Only rows of ``run_id`` are
    kept: use it for per-run work such as a report."""
    from .materialize import _main

    db = _main(con)   # a bare main."v" would find an existing TEMP table "v" first
    done = []
    try:
        for v in views:
            con.execute(f'CREATE OR REPLACE TEMP TABLE "{v}" AS SELECT * FROM {db}."{v}" WHERE run_id = ?', [run_id])
            done.append(v)
    except Exception:
        uncache_views(con, done)
        raise
    return done


def uncache_views(con, views) -> None:
    for v in views:
        con.execute(f'DROP TABLE IF EXISTS temp."{v}"')


from .materialize import (  # noqa: E402  (uses nothing above; exported here for callers)
    HEAVY_VIEWS, Materialized, choose_batch_steps, configure, default_memory_limit, drop_materialized,
    materialize_layer_skew,
)
