"""The trace store: a folder of Parquet tables (:mod:`.store`, writes in :mod:`.txn`),
their contracts (:mod:`.schema`), the SQL views defined over them (:mod:`.views`,
``sql/*.sql``), the dense expert-count tables (:mod:`.dense`) and the Spark engine over the
same files (:mod:`.spark`)."""
