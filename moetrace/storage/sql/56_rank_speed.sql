-- Per-rank expert speed measured in a run's profiler spans: a GPU that runs its experts
-- slower (clocks, thermals, a noisy neighbour) holds the combine barrier longer for the same
-- tokens. The replay carries speed_ratio into its time answer (`replay --rank-speed
-- measured`).
--
-- rank_speed: per (run, rank) with expert GEMM spans, expert_ns = the rank's expert_gemm
-- span time and tokens = the tokens its experts received (rank_load), both over the (step,
-- layer) cells where some rank has an expert_gemm span with a step and layer; ns_per_token
-- = expert_ns / tokens; speed_ratio = ns_per_token / the median ns_per_token over the run's
-- ranks (1.1: this rank takes 10% longer per token). A rank's fixed costs (weights read
-- once per expert, launches) count in its time per token, so a rank with few tokens on many
-- experts reads slower than its silicon is; ranks with no tokens have no ratio.
CREATE OR REPLACE VIEW rank_speed AS
WITH cells AS (
    SELECT DISTINCT run_id, step, layer FROM spans
    WHERE kind = 'expert_gemm' AND step IS NOT NULL AND layer IS NOT NULL
), t AS (
    SELECT s.run_id, s.rank, CAST(sum(s.end_ns - s.start_ns) AS BIGINT) AS expert_ns, count(*) AS spans
    FROM spans s SEMI JOIN cells c ON c.run_id = s.run_id AND c.step = s.step AND c.layer = s.layer
    WHERE s.kind = 'expert_gemm' AND s.end_ns IS NOT NULL AND s.start_ns IS NOT NULL
    GROUP BY s.run_id, s.rank
), k AS (
    SELECT r.run_id, r.rank, sum(r.tokens) AS tokens
    FROM rank_load r SEMI JOIN cells c ON c.run_id = r.run_id AND c.step = r.step AND c.layer = r.layer
    GROUP BY r.run_id, r.rank
), per AS (
    SELECT t.run_id, CAST(t.rank AS INTEGER) AS rank, t.expert_ns, CAST(t.spans AS BIGINT) AS spans,
           k.tokens, CASE WHEN k.tokens > 0 THEN t.expert_ns / k.tokens END AS ns_per_token
    FROM t LEFT JOIN k ON k.run_id = t.run_id AND k.rank = t.rank
), med AS (
    SELECT run_id, median(ns_per_token) AS median_ns_per_token FROM per GROUP BY run_id
)
SELECT p.run_id, p.rank, p.expert_ns, p.spans, p.tokens, p.ns_per_token, m.median_ns_per_token,
       p.ns_per_token / nullif(m.median_ns_per_token, 0) AS speed_ratio
FROM per p JOIN med m ON m.run_id = p.run_id;
