-- skew_summary: per run and layer, the distribution of imbalance over steps (steps with
-- undefined imbalance are counted in steps_undefined, not averaged in).
CREATE OR REPLACE VIEW skew_summary AS
SELECT run_id, layer,
       count(*) AS steps,
       count(*) - count(imbalance) AS steps_undefined,
       avg(imbalance) AS imbalance_mean,
       quantile_cont(imbalance, 0.5) AS imbalance_p50,
       quantile_cont(imbalance, 0.99) AS imbalance_p99,
       max(imbalance) AS imbalance_max,
       avg(efficiency) AS efficiency_mean,
       avg(gini) AS gini_mean,
       avg(cv) AS cv_mean,
       avg(top5pct_share) AS top5pct_share_mean,
       avg(hottest_share) AS hottest_share_mean,
       mode(hottest_expert) AS hottest_expert_mode,
       mode(straggler_rank) AS straggler_rank_mode,
       sum(assignments) AS assignments,
       any_value(num_ranks) AS num_ranks,
       any_value(placement_source) AS placement_source
FROM layer_skew
GROUP BY run_id, layer;

-- run_skew_summary: per run over every (step, layer). balancedness is sum(mean)/sum(max)
-- of rank load over all steps and layers: the fraction of expert-GPU time doing useful
-- work if a layer's time is proportional to its busiest rank (vLLM's EPLB figure).
CREATE OR REPLACE VIEW run_skew_summary AS
WITH worst AS (
    SELECT run_id, arg_max(layer, imbalance_mean) AS worst_layer, max(imbalance_mean) AS worst_layer_imbalance
    FROM skew_summary GROUP BY run_id
)
SELECT s.run_id,
       count(DISTINCT s.layer) AS layers,
       count(DISTINCT s.step) AS steps,
       count(*) - count(s.imbalance) AS step_layers_undefined,
       avg(s.imbalance) AS imbalance_mean,
       quantile_cont(s.imbalance, 0.5) AS imbalance_p50,
       quantile_cont(s.imbalance, 0.99) AS imbalance_p99,
       max(s.imbalance) AS imbalance_max,
       sum(s.mean_rank_tokens) / nullif(sum(s.max_rank_tokens), 0) AS balancedness,
       w.worst_layer, w.worst_layer_imbalance,
       string_agg(DISTINCT s.placement_source, ',') AS placement_source,
       any_value(s.num_ranks) AS num_ranks
FROM layer_skew s LEFT JOIN worst w USING (run_id)
GROUP BY s.run_id, w.worst_layer, w.worst_layer_imbalance;
