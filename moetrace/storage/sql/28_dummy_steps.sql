-- dummy_steps: per rank, how many steps it ran with nothing to do (is_dummy: no tokens,
-- but the forward ran to keep the collectives aligned), and, where step times were
-- recorded, the time those steps took.
CREATE OR REPLACE VIEW dummy_steps AS
SELECT run_id, rank,
       count(*) AS steps,
       count(*) FILTER (WHERE is_dummy) AS dummy_steps,
       CAST(count(*) FILTER (WHERE is_dummy) AS DOUBLE) / count(*) AS dummy_share,
       sum(end_ns - start_ns) FILTER (WHERE is_dummy AND end_ns IS NOT NULL AND start_ns IS NOT NULL)
           AS dummy_time_ns,
       sum(end_ns - start_ns) FILTER (WHERE end_ns IS NOT NULL AND start_ns IS NOT NULL) AS timed_ns,
       CAST(sum(end_ns - start_ns) FILTER (WHERE is_dummy AND end_ns IS NOT NULL AND start_ns IS NOT NULL) AS DOUBLE)
           / nullif(sum(end_ns - start_ns) FILTER (WHERE end_ns IS NOT NULL AND start_ns IS NOT NULL), 0)
           AS dummy_time_share,
       bool_or(inferred) AS inferred
FROM steps
GROUP BY run_id, rank;

-- dummy_by_step: per step, how many ranks idled (a step where most ranks idle wastes
-- most of the fleet on the barrier).
CREATE OR REPLACE VIEW dummy_by_step AS
SELECT run_id, step, count(*) AS ranks, count(*) FILTER (WHERE is_dummy) AS dummy_ranks,
       CAST(count(*) FILTER (WHERE is_dummy) AS DOUBLE) / count(*) AS dummy_share,
       sum(num_tokens) AS tokens
FROM steps
GROUP BY run_id, step;
