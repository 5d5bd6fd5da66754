"""Tables handed to the store as streams that can be read more than once."""
from __future__ import annotations


class Rereadable:
    """An iterable of table chunks whose every ``iter()`` starts a new pass (calls
    ``factory()``): the store writes it chunk by chunk, and checks that need a second look
    (collect/conservation.py) can take one. A plain generator is read once only."""

    def __init__(self, factory):
        self.factory = factory

    def __iter__(self):
        return iter(self.factory())
