-- Kernel time by kind: where a profiler run's device time went, per (rank, step) and kind.
--
-- kind is the span kind the one classifier gave at ingest (domain/kernels.py, the same
-- as `moetrace kernels`). kernel_ns sums the spans' durations (kernels on different
-- streams may overlap, so kinds can add up to more than the wall time);
-- share_of_kernel_time = kernel_ns over all kinds of the same (rank, step).
-- step_ns is the step's window from steps (on a GPU trace: first to last kernel of the
-- step); busy_ns the union of all the (rank, step)'s spans, so step_ns - busy_ns is the
-- time no kernel ran at all.

CREATE OR REPLACE VIEW kernel_time AS
WITH k AS (
    SELECT run_id, rank, step, kind, count(*) AS spans, sum(end_ns - start_ns)::BIGINT AS kernel_ns
    FROM spans
    GROUP BY run_id, rank, step, kind
)
SELECT k.run_id, k.rank, k.step, k.kind, k.spans, k.kernel_ns,
       k.kernel_ns / sum(k.kernel_ns) OVER (PARTITION BY k.run_id, k.rank, k.step) AS share_of_kernel_time
FROM k;

CREATE OR REPLACE VIEW kernel_busy AS
WITH o AS (
    SELECT run_id, rank, step, start_ns, end_ns,
           max(end_ns) OVER (PARTITION BY run_id, rank, step ORDER BY start_ns, end_ns
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
    FROM spans
), g AS (
    SELECT *, sum(CASE WHEN prev_end IS NULL OR start_ns > prev_end THEN 1 ELSE 0 END)
                  OVER (PARTITION BY run_id, rank, step ORDER BY start_ns, end_ns ROWS UNBOUNDED PRECEDING) AS island
    FROM o
), u AS (
    SELECT run_id, rank, step, island, min(start_ns) AS s, max(end_ns) AS e FROM g GROUP BY ALL
)
SELECT u.run_id, u.rank, u.step, sum(u.e - u.s)::BIGINT AS busy_ns,
       any_value(st.end_ns - st.start_ns)::BIGINT AS step_ns
FROM u
LEFT JOIN steps st ON st.run_id = u.run_id AND st.rank = u.rank AND st.step IS NOT DISTINCT FROM u.step
GROUP BY u.run_id, u.rank, u.step;
