-- Expert co-occurrence: which experts the same token chose together, from the per-token
-- routing table (empty for a run without it: aggregated counts cannot say). Experts that
-- fire together and sit on one rank cost one dispatch copy instead of two; TensorRT-LLM's
-- examples/wide_ep/ep_load_balancer/report_load_cooccurrence.py counts the same matrix, and
-- the placement policy `cooccurrence` (moetrace/placement/cooccurrence.py) packs by it.
--
-- expert_cooccurrence: per (run, layer, expert_a < expert_b), the tokens that chose both
-- experts over the run, with each expert's tokens and the lift over independent choices.
-- Empty for a run without per-token routing (routing table): expert_load alone cannot say
-- which experts one token chose together. A choice listed twice for one token counts once.
CREATE OR REPLACE VIEW expert_cooccurrence AS
WITH t AS (
    SELECT DISTINCT run_id, step, layer, token, expert FROM routing
), one AS (
    SELECT run_id, layer, expert, CAST(count(*) AS BIGINT) AS tokens FROM t GROUP BY run_id, layer, expert
), lt AS (
    SELECT run_id, layer, CAST(count(*) AS BIGINT) AS layer_tokens
    FROM (SELECT DISTINCT run_id, step, layer, token FROM t) GROUP BY run_id, layer
), pairs AS (
    SELECT a.run_id, a.layer, a.expert AS expert_a, b.expert AS expert_b, CAST(count(*) AS BIGINT) AS tokens
    FROM t a JOIN t b ON a.run_id = b.run_id AND a.step = b.step AND a.layer = b.layer AND a.token = b.token
                     AND a.expert < b.expert
    GROUP BY a.run_id, a.layer, a.expert, b.expert
)
SELECT p.run_id, p.layer, p.expert_a, p.expert_b, p.tokens, oa.tokens AS tokens_a, ob.tokens AS tokens_b,
       lt.layer_tokens,
       CAST(p.tokens AS DOUBLE) * lt.layer_tokens / (CAST(oa.tokens AS DOUBLE) * ob.tokens) AS lift
FROM pairs p
JOIN one oa ON oa.run_id = p.run_id AND oa.layer = p.layer AND oa.expert = p.expert_a
JOIN one ob ON ob.run_id = p.run_id AND ob.layer = p.layer AND ob.expert = p.expert_b
JOIN lt ON lt.run_id = p.run_id AND lt.layer = p.layer;
