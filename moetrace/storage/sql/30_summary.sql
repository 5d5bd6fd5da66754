-- skew_summary: per run and layer, the distribution of imbalance over steps. A step's
-- imbalance is undefined for one of two reasons, counted apart and never averaged in:
-- steps_undefined (the step routed no tokens) and steps_no_ranks (tokens, but the run's
-- num_ranks is unknown: ingest with --ranks). The modal
-- hottest expert and straggler rank break ties toward the lowest id.
CREATE OR REPLACE VIEW skew_summary AS
WITH ls AS MATERIALIZED (
    SELECT * FROM layer_skew
), hot AS (
    SELECT run_id, layer, arg_max(hottest_expert, struct_pack(n := n, neg_id := -hottest_expert)) AS hottest_expert_mode
    FROM (SELECT run_id, layer, hottest_expert, count(*) AS n FROM ls WHERE hottest_expert IS NOT NULL
          GROUP BY run_id, layer, hottest_expert)
    GROUP BY run_id, layer
), strag AS (
    SELECT run_id, layer, arg_max(straggler_rank, struct_pack(n := n, neg_id := -straggler_rank)) AS straggler_rank_mode
    FROM (SELECT run_id, layer, straggler_rank, count(*) AS n FROM ls WHERE straggler_rank IS NOT NULL
          GROUP BY run_id, layer, straggler_rank)
    GROUP BY run_id, layer
), agg AS (
    SELECT run_id, layer,
           count(*) AS steps,
           count(*) FILTER (WHERE imbalance IS NULL AND (num_ranks IS NOT NULL OR coalesce(assignments, 0) = 0))
               AS steps_undefined,
           count(*) FILTER (WHERE imbalance IS NULL AND num_ranks IS NULL AND assignments > 0) AS steps_no_ranks,
           avg(imbalance) AS imbalance_mean,
           quantile_cont(imbalance, 0.5) AS imbalance_p50,
           quantile_cont(imbalance, 0.99) AS imbalance_p99,
           max(imbalance) AS imbalance_max,
           avg(efficiency) AS efficiency_mean,
           avg(gini) AS gini_mean,
           avg(cv) AS cv_mean,
           avg(top5pct_share) AS top5pct_share_mean,
           avg(hottest_share) AS hottest_share_mean,
           sum(assignments) AS assignments,
           any_value(num_ranks) AS num_ranks,
           any_value(placement_source) AS placement_source
    FROM ls
    GROUP BY run_id, layer
)
SELECT agg.run_id, agg.layer, agg.steps, agg.steps_undefined, agg.steps_no_ranks, agg.imbalance_mean, agg.imbalance_p50,
       agg.imbalance_p99, agg.imbalance_max, agg.efficiency_mean, agg.gini_mean, agg.cv_mean,
       agg.top5pct_share_mean, agg.hottest_share_mean, hot.hottest_expert_mode, strag.straggler_rank_mode,
       agg.assignments, agg.num_ranks, agg.placement_source
FROM agg
LEFT JOIN hot ON hot.run_id = agg.run_id AND hot.layer = agg.layer
LEFT JOIN strag ON strag.run_id = agg.run_id AND strag.layer = agg.layer;

-- run_skew_summary: per run over every (step, layer). balancedness is sum(mean)/sum(max)
-- of rank load over all steps and layers: the fraction of expert-GPU time doing useful
-- work if a layer's time is proportional to its busiest rank (vLLM's EPLB figure).
-- worst_layer: highest mean imbalance (lowest id on ties).
CREATE OR REPLACE VIEW run_skew_summary AS
WITH ls AS MATERIALIZED (
    SELECT * FROM layer_skew
), per_layer AS (
    SELECT run_id, layer, avg(imbalance) AS imb FROM ls GROUP BY run_id, layer
), worst AS (
    SELECT run_id, arg_max(layer, struct_pack(imb := imb, neg_layer := -layer)) AS worst_layer,
           max(imb) AS worst_layer_imbalance
    FROM per_layer WHERE imb IS NOT NULL GROUP BY run_id
)
SELECT s.run_id,
       count(DISTINCT s.layer) AS layers,
       count(DISTINCT s.step) AS steps,
       count(*) FILTER (WHERE s.imbalance IS NULL AND (s.num_ranks IS NOT NULL OR coalesce(s.assignments, 0) = 0))
           AS step_layers_undefined,
       count(*) FILTER (WHERE s.imbalance IS NULL AND s.num_ranks IS NULL AND s.assignments > 0)
           AS step_layers_no_ranks,
       avg(s.imbalance) AS imbalance_mean,
       quantile_cont(s.imbalance, 0.5) AS imbalance_p50,
       quantile_cont(s.imbalance, 0.99) AS imbalance_p99,
       max(s.imbalance) AS imbalance_max,
       sum(s.mean_rank_tokens) / nullif(sum(s.max_rank_tokens), 0) AS balancedness,
       w.worst_layer, w.worst_layer_imbalance,
       string_agg(DISTINCT s.placement_source, ',' ORDER BY s.placement_source) AS placement_source,
       any_value(s.num_ranks) AS num_ranks
FROM ls s LEFT JOIN worst w USING (run_id)
GROUP BY s.run_id, w.worst_layer, w.worst_layer_imbalance;
