-- Whole-run distributions the report draws, each one small table per layer, so that a
-- report never needs the expert_load rows again once these (and the per-(step, layer)
-- views) are computed (moetrace.analyze.cache stores them).
--
-- expert_token_hist: how many (step, expert) pairs of a layer received each token count.
-- Only pairs with expert_load rows are counted: an expert without a row in a step
-- received 0 tokens and is left out (a dense row has all E experts, zeros included).
CREATE OR REPLACE VIEW expert_token_hist AS
SELECT run_id, layer, tokens, count(*) AS pairs
FROM expert_tokens GROUP BY run_id, layer, tokens;

-- rank_totals: tokens each rank received in a layer, summed over the run's steps (the
-- sparse rank rows: a rank that never received a row is absent).
CREATE OR REPLACE VIEW rank_totals AS
SELECT r.run_id, r.layer, r.rank, sum(r.tokens) AS tokens
FROM rank_load_sparse r GROUP BY r.run_id, r.layer, r.rank;

-- expert_step_bins: a layer's steps (those with expert_load rows, in step order) cut into
-- bins = least(steps, 300) consecutive bins, step number ord (0-based) in bin
-- ord * bins // steps; tokens of each expert summed per bin (experts without rows in a
-- bin are absent). The report's per-expert heatmap averages each bin over its steps.
CREATE OR REPLACE VIEW expert_step_bins AS
WITH o AS (
    SELECT run_id, layer, step, row_number() OVER (PARTITION BY run_id, layer ORDER BY step) - 1 AS ord,
           count(*) OVER (PARTITION BY run_id, layer) AS steps
    FROM step_layers
)
SELECT e.run_id, e.layer, CAST(o.ord * least(o.steps, 300) // o.steps AS BIGINT) AS bin, e.expert,
       CAST(sum(e.tokens) AS BIGINT) AS tokens, CAST(least(o.steps, 300) AS BIGINT) AS bins,
       CAST(o.steps AS BIGINT) AS steps
FROM expert_tokens e JOIN o ON o.run_id = e.run_id AND o.layer = e.layer AND o.step = e.step
GROUP BY e.run_id, e.layer, o.ord * least(o.steps, 300) // o.steps, e.expert, o.steps;
