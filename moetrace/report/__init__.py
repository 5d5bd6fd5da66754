"""Reports: terminal tables, PNG plots, Markdown and self-contained HTML.

A report is a list of sections; each module in ``report/sections/`` exposes
``ORDER`` (int) and ``build(ctx) -> Section | None`` (None when it has nothing to say for
the run). Reports read the store only (analysis views, replay tables); they never write to
it.
"""
