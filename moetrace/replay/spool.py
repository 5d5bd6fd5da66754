"""Result rows spooled to a temporary Parquet file while a replay streams, read back in
row groups when the replay commits them: a replay's memory stays that of one chunk
however many steps it judges (an hour and a week of a fleet need the same).

A :class:`Spool` is used like the list of tables it replaces: ``append(table)`` while the
replay runs, then handed to ``Store.append`` as an iterable of tables. Small tables are
buffered and written ``rows`` at a time (one Parquet row group each); the file is deleted
when the spool has been read back or is closed."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pyarrow as pa


class Spool:
    def __init__(self, rows: int = 1 << 17):
        self.rows = int(rows)
        self._buf: list[pa.Table] = []
        self._buffered = 0
        self._writer = None
        self._path: str | None = None
        self.num_rows = 0

    def append(self, tbl: pa.Table) -> None:
        if not tbl.num_rows:
            return
        self._buf.append(tbl)
        self._buffered += tbl.num_rows
        self.num_rows += tbl.num_rows
        if self._buffered >= self.rows:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        import pyarrow.parquet as pq

        t = pa.concat_tables(self._buf)
        if self._writer is None:
            fd, self._path = tempfile.mkstemp(prefix="moetrace-spool-", suffix=".parquet")
            os.close(fd)
            # light compression: the file lives for one replay, the store's copy is zstd; no
            # dictionaries or statistics either (read back once, whole): half the CPU of a
            # flush, 33 ms instead of 64 per 2^17 replay_layer rows, and the same size
            self._writer = pq.ParquetWriter(self._path, t.schema, compression="lz4", use_dictionary=False,
                                            write_statistics=False)
        self._writer.write_table(t.cast(self._writer.schema) if t.schema != self._writer.schema else t,
                                 row_group_size=max(self.rows, t.num_rows))
        self._buf, self._buffered = [], 0

    def __bool__(self) -> bool:
        return self.num_rows > 0

    def __len__(self) -> int:
        return self.num_rows

    def __iter__(self) -> Iterator[pa.Table]:
        """The spooled tables, one row group at a time (then the file is deleted)."""
        if self._writer is None:      # everything still in memory
            yield from self._buf
            return
        self._flush()
        self._writer.close()
        self._writer = None
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self._path)
            for g in range(pf.metadata.num_row_groups):
                yield pf.read_row_group(g)
        finally:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None
        self._buf, self._buffered = [], 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
