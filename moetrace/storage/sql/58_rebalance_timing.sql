-- Rebalance timing as the engines log it (table balancedness, from `ingest` of vLLM / SGLang
-- server logs and Prometheus scrapes): what one rearrangement of the experts stalled the
-- server for, the measured stall the replay can charge per plan change (`replay
-- --move-stall-ms measured`).
--
-- rebalance_timing: per (run, engine), rebalances = the rebalance_end events with a
-- duration (vLLM's startup profile pass left out), total_s, mean_s, median_s, min_s and
-- max_s of their durations (duration_s, seconds), started = rebalance_start events and
-- skipped = rebalance_skip events (SGLang skips a rebalance when GPU utilization is high).
CREATE OR REPLACE VIEW rebalance_timing AS
SELECT run_id, engine,
       CAST(count(duration_s) FILTER (WHERE event = 'rebalance_end' AND NOT coalesce(is_profile, false)) AS BIGINT)
           AS rebalances,
       sum(duration_s) FILTER (WHERE event = 'rebalance_end' AND NOT coalesce(is_profile, false)) AS total_s,
       avg(duration_s) FILTER (WHERE event = 'rebalance_end' AND NOT coalesce(is_profile, false)) AS mean_s,
       median(duration_s) FILTER (WHERE event = 'rebalance_end' AND NOT coalesce(is_profile, false)) AS median_s,
       min(duration_s) FILTER (WHERE event = 'rebalance_end' AND NOT coalesce(is_profile, false)) AS min_s,
       max(duration_s) FILTER (WHERE event = 'rebalance_end' AND NOT coalesce(is_profile, false)) AS max_s,
       CAST(count(*) FILTER (WHERE event = 'rebalance_start') AS BIGINT) AS started,
       CAST(count(*) FILTER (WHERE event = 'rebalance_skip') AS BIGINT) AS skipped
FROM balancedness
WHERE event IN ('rebalance_start', 'rebalance_end', 'rebalance_skip')
GROUP BY run_id, engine;
