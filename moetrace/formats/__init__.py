"""File formats moetrace reads and writes that are not traces of a run: engine plan files
and the reference run's manifest and timing summary (they import only the ground files
and :mod:`moetrace.placement`)."""
