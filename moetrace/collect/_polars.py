"""polars for the collectors, imported on first use.

Every collector module is imported to sniff an input (``collect.registry``), so a module
that imported polars at its top made every ``moetrace ingest`` pay for it (0.3-0.4 s),
also for a Parquet file that is read with pyarrow alone (a command's start-up). ``pl`` here is the
polars module once something is asked of it; :class:`Dtypes` names a frame's column
types without importing polars until they are used.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping


class _LazyPolars:
    """Stands for the polars module: the first attribute asked for imports it."""

    def __getattr__(self, name: str):
        value = getattr(importlib.import_module("polars"), name)
        setattr(self, name, value)      # the next look-up is a plain attribute
        return value

    def __repr__(self) -> str:
        return "<polars, imported on first use>"


pl = _LazyPolars()


class Dtypes(Mapping):
    """column -> polars dtype, given by the dtype's name (``Dtypes(rank="Int32")``) and
    looked up in polars the first time a type is asked for (the names alone need nothing)."""

    def __init__(self, **names: str):
        self._names = names
        self._types: dict | None = None

    def __getitem__(self, column: str):
        if self._types is None:
            self._types = {k: getattr(pl, v) for k, v in self._names.items()}
        return self._types[column]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
