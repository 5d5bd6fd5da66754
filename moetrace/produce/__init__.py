"""Producers of traces: things that *make* data for moetrace to read.

Kept apart from ``moetrace.collect`` (which only reads what a run left behind):

- ``synth``: synthetic expert traffic with a known truth (``moetrace synth``);
- ``capture``: routing captured live from a transformers MoE model (``moetrace capture``);
- ``refrun``: a real expert-parallel reference run on CPU (``moetrace refrun``).
"""
