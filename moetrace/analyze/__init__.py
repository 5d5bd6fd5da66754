"""Analysis of a stored run: the facade's frames (skew, tokens per expert, dummy steps),
all-to-all exposure, rank waits, and materialized heavy views. The metrics themselves are
SQL views (:mod:`moetrace.storage.views`, ``storage/sql/*.sql``) the store defines on every
connection."""
from .materialize import (
    HEAVY_VIEWS,
    Materialized,
    choose_batch_steps,
    configure,
    default_memory_limit,
    drop_materialized,
    materialize_layer_skew,
)

__all__ = ["HEAVY_VIEWS", "Materialized", "choose_batch_steps", "configure", "default_memory_limit",
           "drop_materialized", "materialize_layer_skew"]
