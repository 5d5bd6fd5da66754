-- Per (step, layer) statistics over logical experts and over ranks.
--
-- expert_step_stats: one row per (run, step, layer) with the expert-level sums and the
-- present experts' tokens sorted descending (absent experts count as zero).
-- Long rows are aggregated per (step, layer) (expert_step_stats_long); a dense row is
-- already one (step, layer) and gets the same numbers from list functions
-- (dense_step_stats).
CREATE OR REPLACE VIEW expert_step_stats_long AS
SELECT run_id, step, layer,
       CAST(sum(tokens) AS BIGINT) AS assignments,
       sum(CAST(tokens AS DOUBLE) * tokens) AS sumsq,
       count(*) FILTER (WHERE tokens > 0) AS experts_hit,
       count(*) AS experts_present,
       min(tokens) AS min_present,
       max(tokens) AS max_tokens,
       arg_max(expert, struct_pack(t := tokens, neg_expert := -expert)) AS hottest_expert,
       list(CAST(tokens AS DOUBLE) ORDER BY tokens DESC) AS tokens_desc
FROM expert_tokens_long
GROUP BY run_id, step, layer;

CREATE OR REPLACE VIEW expert_step_stats AS
WITH agg AS (
    SELECT * FROM expert_step_stats_long
    UNION ALL
    SELECT run_id, step, layer, assignments, sumsq, experts_hit, experts_present, min_present, max_tokens,
           hottest_expert, tokens_desc
    FROM dense_step_stats
)
SELECT agg.run_id, agg.step, agg.layer, sh.num_experts, sh.top_k, agg.assignments, agg.sumsq, agg.experts_hit,
       agg.experts_present, agg.min_present, agg.max_tokens, agg.hottest_expert, agg.tokens_desc
FROM agg JOIN run_shape sh USING (run_id);

-- layer_skew: imbalance = max/mean of rank load (time lost at the combine barrier),
-- efficiency = 1/imbalance; straggler_rank = the most loaded rank (lowest id on ties).
-- Over all E logical experts (absent ones count as zero): gini, cv (population std /
-- mean), top5pct_share (share of the ceil(5% of E) busiest experts), hottest expert and
-- its share. A step with no tokens, or a run without num_ranks, gets NULLs and a note.
-- Long rows join their expert sums and rank lists; a dense row has both (one scan).
CREATE OR REPLACE VIEW layer_skew AS
WITH base AS (
    SELECT es.run_id, es.step, es.layer, es.assignments, es.sumsq, es.max_tokens, es.hottest_expert,
           es.tokens_desc, rk.ranks, rk.tokens AS rank_tokens
    FROM expert_step_stats_long es
    LEFT JOIN rank_tokens_long rk ON rk.run_id = es.run_id AND rk.step = es.step AND rk.layer = es.layer
    UNION ALL
    SELECT run_id, step, layer, assignments, sumsq, max_tokens, hottest_expert, tokens_desc, ranks, rank_tokens
    FROM dense_step_stats
), es AS (    -- ranks ascending: the first maximum is the lowest rank id
    SELECT b.*, sh.num_experts, sh.top_k, CAST(greatest(1, ceil(0.05 * sh.num_experts)) AS BIGINT) AS n_top,
           list_max(b.rank_tokens) AS max_rank_tokens, list_sum(b.rank_tokens) AS rank_total,
           b.ranks[list_position(b.rank_tokens, list_max(b.rank_tokens))] AS straggler_rank
    FROM base b JOIN run_shape sh USING (run_id)
)
SELECT es.run_id, es.step, es.layer,
       es.max_rank_tokens,
       es.rank_total / lp.num_ranks AS mean_rank_tokens,
       CASE WHEN es.rank_total > 0 THEN es.max_rank_tokens / (es.rank_total / lp.num_ranks) END AS imbalance,
       CASE WHEN es.rank_total > 0 THEN (es.rank_total / lp.num_ranks) / es.max_rank_tokens END AS efficiency,
       CASE WHEN es.rank_total > 0 THEN CAST(es.straggler_rank AS INTEGER) END AS straggler_rank,
       CASE WHEN es.assignments > 0 THEN
           2.0 * list_inner_product(es.tokens_desc,
                                    CAST(range(es.num_experts, es.num_experts - len(es.tokens_desc), -1) AS DOUBLE[]))
               / (es.num_experts * CAST(es.assignments AS DOUBLE)) - (es.num_experts + 1.0) / es.num_experts
       END AS gini,
       CASE WHEN es.assignments > 0 THEN
           sqrt(greatest(es.sumsq / es.num_experts - pow(es.assignments / es.num_experts, 2), 0.0))
               / (es.assignments / es.num_experts)
       END AS cv,
       CASE WHEN es.assignments > 0 THEN
           CAST(list_sum(list_slice(es.tokens_desc, 1, es.n_top)) AS DOUBLE) / es.assignments END AS top5pct_share,
       CASE WHEN es.assignments > 0 THEN CAST(es.hottest_expert AS INTEGER) END AS hottest_expert,
       CASE WHEN es.assignments > 0 THEN CAST(es.max_tokens AS DOUBLE) / es.assignments END AS hottest_share,
       es.assignments,
       lp.num_ranks,
       lp.placement_source,
       CASE WHEN lp.num_ranks IS NULL THEN 'num_ranks unknown (ingest with --ranks): rank metrics skipped'
            WHEN es.assignments = 0 THEN 'no tokens routed in this step: ratios undefined'
            WHEN lp.experts_from <> 'runs' THEN 'num_experts inferred from the highest expert id'
       END AS note
FROM es
JOIN layer_placement lp ON lp.run_id = es.run_id AND lp.layer = es.layer;

-- tokens_per_expert: the step's batch B = assignments / top_k tokens, experts touched vs
-- the uniform-routing expectation E * (1 - (1 - k/E)^B), and per-expert tokens over all
-- E experts (absent experts count as zero).
CREATE OR REPLACE VIEW tokens_per_expert AS
SELECT run_id, step, layer,
       CAST(assignments AS DOUBLE) / top_k AS tokens,
       assignments,
       experts_hit,
       num_experts * (1 - pow(1 - CAST(top_k AS DOUBLE) / num_experts, CAST(assignments AS DOUBLE) / top_k))
           AS experts_hit_expected,
       CAST(assignments AS DOUBLE) / num_experts AS per_expert_mean,
       CASE WHEN experts_present < num_experts THEN 0 ELSE min_present END AS per_expert_min,
       (coalesce(tokens_desc[CAST(ceil(num_experts / 2.0) AS BIGINT)], 0)
        + coalesce(tokens_desc[num_experts // 2 + 1], 0)) / 2.0 AS per_expert_median,
       max_tokens AS per_expert_max,
       num_experts,
       top_k
FROM expert_step_stats;
