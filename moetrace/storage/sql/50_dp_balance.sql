-- Attention data-parallel balance: how evenly the steps' tokens were spread over the DP
-- ranks (steps.num_tokens, one row per (step, rank)). Each rank of the steps table is
-- taken as one attention-DP rank (DP attention: every rank runs attention on its own
-- batch); under tensor-parallel attention ranks share one batch and are equal by
-- construction. The ratio is TensorRT-LLM's attention-DP balance (mean over max tokens
-- per DP rank) and vLLM's balancedness form (avg / max).
--
-- dp_balance: tokens per attention-DP rank of each step (steps.num_tokens): max, mean,
-- balance = mean / max, and the time the slowest DP rank costs at the barrier. The time is
-- a tokens-proportional estimate (time_model): a rank's time taken to grow in proportion
-- to its tokens, so balancing would save barrier_share = 1 - balance of the step
-- (barrier_ns where step times were recorded). It is an upper bound when part of the step
-- does not scale with the rank's own tokens (the MoE layers after the dispatch), and
-- carries no fitted error band. balance is NULL when no rank had tokens (undefined, not 1).
CREATE OR REPLACE VIEW dp_balance AS
WITH s AS (
    SELECT run_id, step, rank, num_tokens, is_dummy, start_ns, end_ns,
           max(num_tokens) OVER (PARTITION BY run_id, step) AS step_max
    FROM steps
), agg AS (
    SELECT run_id, step,
           CAST(count(*) AS BIGINT) AS dp_ranks,
           CAST(count(num_tokens) AS BIGINT) AS ranks_with_tokens,
           CAST(count(*) FILTER (WHERE is_dummy) AS BIGINT) AS dummy_ranks,
           CAST(sum(num_tokens) AS BIGINT) AS tokens,
           CAST(max(num_tokens) AS BIGINT) AS max_tokens,
           CAST(min(num_tokens) AS BIGINT) AS min_tokens,
           avg(CAST(num_tokens AS DOUBLE)) AS mean_tokens,
           min(rank) FILTER (WHERE num_tokens = step_max) AS slowest_rank,
           CASE WHEN count(*) = count(start_ns) AND count(*) = count(end_ns)
                THEN max(end_ns) - min(start_ns) END AS step_ns
    FROM s GROUP BY run_id, step
)
SELECT run_id, step, dp_ranks, ranks_with_tokens, dummy_ranks, tokens, max_tokens, min_tokens, mean_tokens,
       CASE WHEN max_tokens > 0 THEN mean_tokens / max_tokens END AS balance,
       CASE WHEN max_tokens > 0 THEN slowest_rank END AS slowest_rank,
       CASE WHEN max_tokens > 0 THEN max_tokens - mean_tokens END AS excess_tokens,
       CASE WHEN max_tokens > 0 THEN 1.0 - mean_tokens / max_tokens END AS barrier_share,
       step_ns,
       CASE WHEN max_tokens > 0 THEN step_ns * (1.0 - mean_tokens / max_tokens) END AS barrier_ns,
       'tokens-proportional estimate' AS time_model
FROM agg;

-- dp_balance_summary: dp_balance of each run in one row: mean and lowest step balance,
-- balance_overall = sum of mean tokens / sum of max tokens (the tokens-proportional share
-- of DP-rank time doing work), the barrier share and time it implies, and the rank most
-- often the slowest where the step was uneven.
CREATE OR REPLACE VIEW dp_balance_summary AS
WITH d AS (
    SELECT * FROM dp_balance
), slow AS (
    SELECT run_id, slowest_rank, count(*) AS n,
           row_number() OVER (PARTITION BY run_id ORDER BY count(*) DESC, slowest_rank) AS pos
    FROM d WHERE balance < 1 GROUP BY run_id, slowest_rank
), worst AS (
    SELECT run_id, step, row_number() OVER (PARTITION BY run_id ORDER BY balance, step) AS pos
    FROM d WHERE balance IS NOT NULL
), agg AS (
    SELECT run_id,
           CAST(count(*) AS BIGINT) AS steps,
           CAST(count(balance) AS BIGINT) AS steps_defined,
           CAST(count(*) FILTER (WHERE balance < 1) AS BIGINT) AS steps_uneven,
           CAST(max(dp_ranks) AS BIGINT) AS dp_ranks,
           avg(balance) AS balance_mean,
           min(balance) AS balance_min,
           sum(mean_tokens) FILTER (WHERE balance IS NOT NULL)
               / nullif(sum(max_tokens) FILTER (WHERE balance IS NOT NULL), 0) AS balance_overall,
           CAST(count(barrier_ns) AS BIGINT) AS timed_steps,
           sum(barrier_ns) AS barrier_ns,
           sum(step_ns) FILTER (WHERE barrier_ns IS NOT NULL) AS step_ns
    FROM d GROUP BY run_id
)
SELECT a.run_id, a.steps, a.steps_defined, a.steps_uneven, a.dp_ranks, a.balance_mean, a.balance_min, w.step AS worst_step,
       a.balance_overall, 1.0 - a.balance_overall AS barrier_share, a.timed_steps, a.barrier_ns, a.step_ns,
       s.slowest_rank AS slowest_rank_mode, CAST(s.n AS DOUBLE) / nullif(a.steps_uneven, 0) AS slowest_rank_share,
       'tokens-proportional estimate' AS time_model
FROM agg a
LEFT JOIN (SELECT * FROM worst WHERE pos = 1) w ON w.run_id = a.run_id
LEFT JOIN (SELECT * FROM slow WHERE pos = 1) s ON s.run_id = a.run_id;
