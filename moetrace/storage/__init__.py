"""The trace store: a folder of Parquet tables (:mod:`.store`, the one ``Store`` and
``open_store``; writes as transactions in :mod:`.writer`), their contracts (:mod:`.schema`),
the views over them (:mod:`.views`, ``sql/*.sql``; older stores in :mod:`.compat`), the
catalog file (:mod:`.catalog`), the dense expert-count tables (:mod:`.dense`) and the Spark
engine over the same files (:mod:`.spark`)."""
