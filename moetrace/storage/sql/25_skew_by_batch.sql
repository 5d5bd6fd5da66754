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
--
-- Every step in some window: where the tiling leaves the last n mod w steps out, the
-- window of the last w steps is added (imbalance_all over windows_all windows: the
-- tiling's and that one; step_imbalance_all the one-step mean over the same steps, counted
-- as often as they are covered). The last-w windows come from per-(layer, rank) suffix
-- sums: bucket k = ceil(log2(n - ord)) holds the steps that are in the last 2^k but not
-- in the last 2^(k-1), so the last 2^k steps are buckets 0..k.
CREATE OR REPLACE VIEW skew_by_batch AS
WITH RECURSIVE st AS (
    SELECT run_id, step, row_number() OVER (PARTITION BY run_id ORDER BY step) - 1 AS ord,
           count(*) OVER (PARTITION BY run_id) AS n_steps
    FROM (SELECT DISTINCT run_id, step FROM step_layers)   -- one row per (step, layer), not per expert
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
), nrun AS (
    SELECT run_id, any_value(n_steps) AS n FROM st GROUP BY run_id
), suffix AS (
    SELECT r.run_id, r.layer, r.rank, CAST(ceil(log2(st.n_steps - st.ord)) AS BIGINT) AS k, sum(r.tokens) AS tokens
    FROM rank_load_sparse r JOIN st ON st.run_id = r.run_id AND st.step = r.step
    GROUP BY ALL
), levels AS (      -- the levels whose tiling leaves steps out
    SELECT a.run_id, a.layer, a.steps_per_batch AS w
    FROM agg a JOIN nrun USING (run_id) WHERE nrun.n % a.steps_per_batch <> 0
), tail AS (
    SELECT run_id, layer, w, max(tokens) AS mx, sum(tokens) AS total FROM (
        SELECT lv.run_id, lv.layer, lv.w, s.rank, sum(s.tokens) AS tokens
        FROM levels lv JOIN suffix s ON s.run_id = lv.run_id AND s.layer = lv.layer
                                    AND s.k <= CAST(round(log2(lv.w)) AS BIGINT)
        GROUP BY ALL)
    GROUP BY run_id, layer, w
), tail_steps AS (
    SELECT lv.run_id, lv.layer, lv.w, sum(ls.imbalance) AS s, count(ls.imbalance) AS c
    FROM levels lv JOIN nrun USING (run_id)
    JOIN st ON st.run_id = lv.run_id AND st.ord >= nrun.n - lv.w
    JOIN layer_skew ls ON ls.run_id = st.run_id AND ls.step = st.step AND ls.layer = lv.layer
    GROUP BY ALL
), c AS (
    -- the steps the tiling from step 0 covers at each window size (a plain join, not a
    -- correlated LATERAL: the same rows, and Spark can run it)
    SELECT a.run_id, a.layer, a.steps_per_batch AS w, count(*) AS steps_used, min(st.step) AS first_step,
           max(st.step) AS last_step, avg(ls.imbalance) AS step_imbalance_mean, sum(ls.imbalance) AS s,
           count(ls.imbalance) AS c
    FROM agg a
    JOIN st ON st.run_id = a.run_id AND st.ord < (st.n_steps // a.steps_per_batch) * a.steps_per_batch
    JOIN layer_skew ls ON ls.run_id = st.run_id AND ls.step = st.step AND ls.layer = a.layer
    GROUP BY a.run_id, a.layer, a.steps_per_batch
)
SELECT a.run_id, a.layer, a.steps_per_batch, a.tokens_per_batch, a.imbalance, a.batches, a.note,
       coalesce(c.steps_used, 0) AS steps_used, c.first_step, c.last_step, c.step_imbalance_mean,
       a.imbalance / c.step_imbalance_mean AS batch_gain,
       (coalesce(a.imbalance * a.batches, 0) + coalesce(t.mx / (t.total / sh.num_ranks), 0))
           / nullif(a.batches + CASE WHEN t.total > 0 THEN 1 ELSE 0 END, 0) AS imbalance_all,
       a.batches + CASE WHEN t.total > 0 THEN 1 ELSE 0 END AS windows_all,
       (c.s + coalesce(ts.s, 0)) / nullif(c.c + coalesce(ts.c, 0), 0) AS step_imbalance_all
FROM agg a
JOIN run_shape sh USING (run_id)
LEFT JOIN tail t ON t.run_id = a.run_id AND t.layer = a.layer AND t.w = a.steps_per_batch AND t.total > 0
LEFT JOIN tail_steps ts ON ts.run_id = a.run_id AND ts.layer = a.layer AND ts.w = a.steps_per_batch
LEFT JOIN c ON c.run_id = a.run_id AND c.layer = a.layer AND c.w = a.steps_per_batch;

-- skew_decomposition: a layer's mean step imbalance split into its structural part
-- (max/mean of the rank loads summed over the whole run, i.e. the run's mean popularity
-- under the placement) and the sampling part on top of it:
--   imbalance_mean = 1 + structural_excess + sampling_excess
CREATE OR REPLACE VIEW skew_decomposition AS
WITH structural AS (    -- the rank loads summed over the run: rank_totals
    SELECT t.run_id, t.layer, max(t.tokens) / (sum(t.tokens) / sh.num_ranks) AS structural_imbalance
    FROM rank_totals t JOIN run_shape sh USING (run_id)
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
