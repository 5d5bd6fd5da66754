-- Imbalance against batch size. Consecutive steps are merged into batches of
-- w = 1, 2, 4, ... steps (their rank loads summed: the load one step of w times the
-- tokens would see under the same routing). Every full window of the tiling that starts
-- at the run's first step is used (windows [0, w), [w, 2w), ...; the last n mod w steps
-- fill no window of that size). imbalance is the mean max/mean over the merged batches
-- with tokens.
--
-- Drift is kept apart from batch size: step_imbalance_mean is the mean one-step
-- imbalance of exactly the steps those windows cover (first_step..last_step,
-- steps_used of them), so imbalance / step_imbalance_mean (batch_gain) is what merging
-- did to the same steps. On a drifting run the long windows cover only the early steps,
-- and comparing their imbalance with the whole run's mean would mix time with batch size.
-- tokens_per_batch is tokens per merged batch (assignments / top_k; assignments when
-- top_k is unknown, said in note).
CREATE OR REPLACE VIEW skew_by_batch AS
WITH RECURSIVE st AS (
    SELECT run_id, step, row_number() OVER (PARTITION BY run_id ORDER BY step) - 1 AS ord,
           count(*) OVER (PARTITION BY run_id) AS n_steps
    FROM (SELECT DISTINCT run_id, step FROM expert_load)
), merged(run_id, layer, w, batch, rank, tokens, n_steps) AS (
    SELECT r.run_id, r.layer, CAST(1 AS BIGINT), st.ord, r.rank, r.tokens, st.n_steps
    FROM rank_load_sparse r JOIN st ON st.run_id = r.run_id AND st.step = r.step
    UNION ALL
    -- each level merges pairs of the level below: rows halve, so all levels cost ~2x one
    SELECT run_id, layer, w * 2, batch // 2, rank, sum(tokens), any_value(n_steps)
    FROM merged WHERE w * 2 <= n_steps
    GROUP BY run_id, layer, w, batch // 2, rank
), per_batch AS (
    SELECT run_id, layer, w, batch, max(tokens) AS mx, sum(tokens) AS total
    FROM merged
    WHERE batch < n_steps // w
    GROUP BY run_id, layer, w, batch
), agg AS (
    SELECT b.run_id, b.layer, b.w AS steps_per_batch,
           avg(b.total / coalesce(sh.top_k, 1)) AS tokens_per_batch,
           avg(b.mx / (b.total / sh.num_ranks)) FILTER (WHERE b.total > 0) AS imbalance,
           count(*) FILTER (WHERE b.total > 0) AS batches,
           CASE WHEN sh.top_k IS NULL THEN 'top_k unknown: tokens_per_batch counts token-expert assignments' END
               AS note
    FROM per_batch b JOIN run_shape sh USING (run_id)
    GROUP BY b.run_id, b.layer, b.w, sh.top_k, sh.num_ranks
)
SELECT a.*, c.steps_used, c.first_step, c.last_step, c.step_imbalance_mean,
       a.imbalance / c.step_imbalance_mean AS batch_gain
FROM agg a
LEFT JOIN LATERAL (
    SELECT count(*) AS steps_used, min(st.step) AS first_step, max(st.step) AS last_step,
           avg(ls.imbalance) AS step_imbalance_mean
    FROM st JOIN layer_skew ls ON ls.run_id = st.run_id AND ls.step = st.step AND ls.layer = a.layer
    WHERE st.run_id = a.run_id AND st.ord < (st.n_steps // a.steps_per_batch) * a.steps_per_batch
) c ON true;

-- skew_decomposition: a layer's mean step imbalance split into its structural part
-- (max/mean of the rank loads summed over the whole run, i.e. the run's mean popularity
-- under the placement) and the sampling part on top of it:
--   imbalance_mean = 1 + structural_excess + sampling_excess
CREATE OR REPLACE VIEW skew_decomposition AS
WITH tot AS (
    SELECT run_id, layer, rank, sum(tokens) AS tokens FROM rank_load_sparse GROUP BY run_id, layer, rank
), structural AS (
    SELECT t.run_id, t.layer, max(t.tokens) / (sum(t.tokens) / sh.num_ranks) AS structural_imbalance
    FROM tot t JOIN run_shape sh USING (run_id)
    GROUP BY t.run_id, t.layer, sh.num_ranks
    HAVING sum(t.tokens) > 0
), per_layer AS (
    SELECT run_id, layer, avg(imbalance) AS imbalance_mean, count(imbalance) AS steps
    FROM layer_skew GROUP BY run_id, layer
)
SELECT s.run_id, s.layer, s.steps, s.imbalance_mean, st.structural_imbalance,
       st.structural_imbalance - 1 AS structural_excess,
       s.imbalance_mean - st.structural_imbalance AS sampling_excess,
       CASE WHEN s.imbalance_mean > 1 THEN (st.structural_imbalance - 1) / (s.imbalance_mean - 1) END
           AS structural_fraction
FROM per_layer s JOIN structural st USING (run_id, layer);
