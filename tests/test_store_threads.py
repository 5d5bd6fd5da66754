"""The DuckDB thread count of a store's connections: ``Store(..., threads=N)``, else the
environment variable ``MOETRACE_DUCKDB_THREADS``, else DuckDB's default; a bad value is one
line naming where it came from."""
from __future__ import annotations

import pytest

from moetrace.errors import UsageError
from moetrace.storage.duck import THREADS_ENV
from moetrace.storage.store import Store


def _threads(con) -> int:
    return int(con.execute("SELECT current_setting('threads')").fetchall()[0][0])


def test_threads_option_reaches_every_connection(tmp_path, monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    st = Store(tmp_path / "s", create=True, threads=2)
    assert st.rows("SELECT current_setting('threads') AS t").rows == [(2,)]   # the lazy connection
    eager = st.connect()
    assert _threads(eager) == 2
    eager.close()
    assert _threads(st.connect(threads=3)) == 3      # one connection's own setting wins
    st.close()


def test_threads_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    st = Store(tmp_path / "s", create=True)
    assert st.threads == 3 and _threads(st.con) == 3
    st.close()
    st = Store(tmp_path / "s", threads=1)             # the option wins over the variable
    assert _threads(st.con) == 1
    st.close()


@pytest.mark.parametrize("env, option, needle", [("0", None, THREADS_ENV), ("two", None, THREADS_ENV),
                                                 (None, 0, "threads=0"), (None, True, "threads=True")])
def test_bad_thread_count_is_one_line(tmp_path, monkeypatch, env, option, needle):
    if env is None:
        monkeypatch.delenv(THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(THREADS_ENV, env)
    with pytest.raises(UsageError) as e:
        Store(tmp_path / "s", create=True, threads=option)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s").exists()              # refused before anything was created
