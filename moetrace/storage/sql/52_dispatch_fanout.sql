-- Dispatch fan-out: to how many ranks and nodes each token is sent, from the per-token
-- routing table (routing). A dispatch that sends one copy of a token to each destination
-- rank (DeepEP, pplx, TensorRT-LLM's all-to-all) moves ranks_per_token x hidden x dtype
-- bytes per token; TensorRT-LLM's examples/wide_ep/ep_load_balancer/
-- report_send_ranks_per_token.py counts the same quantity. Every view of this file is
-- empty for a run without per-token routing (aggregated expert_load cannot say which
-- experts one token chose together) or without a rank count (run_shape.num_ranks NULL).
--
-- fanout_shape: per run with a rank count, what the fan-out views assume: ranks_per_node
-- (runs, else all ranks one node, nodes_from says so), hidden and dtype_bytes for the
-- bytes (runs, else DeepSeek-V3's 7168 and BF16's 2 bytes: moetrace/domain/model_shape.py,
-- hidden_from and dtype_from say so).
CREATE OR REPLACE VIEW fanout_shape AS
SELECT sh.run_id, CAST(sh.num_ranks AS BIGINT) AS num_ranks, CAST(sh.num_slots AS BIGINT) AS num_slots,
       CAST(coalesce(least(r.ranks_per_node, sh.num_ranks), sh.num_ranks) AS BIGINT) AS ranks_per_node,
       CASE WHEN r.ranks_per_node IS NOT NULL THEN 'runs' ELSE 'unknown: all ranks one node' END AS nodes_from,
       CAST(coalesce(r.hidden, 7168) AS BIGINT) AS hidden,
       CASE WHEN r.hidden IS NOT NULL THEN 'runs' ELSE 'default 7168 (DeepSeek-V3)' END AS hidden_from,
       CAST(coalesce(r.dtype_bytes, 2) AS BIGINT) AS dtype_bytes,
       CASE WHEN r.dtype_bytes IS NOT NULL THEN 'runs' ELSE 'default 2 (BF16)' END AS dtype_from
FROM run_shape sh JOIN runs r ON r.run_id = sh.run_id
WHERE sh.num_ranks IS NOT NULL;

-- expert_dest: per (run, layer with routing, expert) the ranks holding a copy of the
-- expert and the share of its tokens each gets: the recorded placement (plan_id =
-- 'recorded') where it places the expert, else contiguous_map (vLLM's initial map, as
-- every rank view assumes); replicas split an expert's tokens evenly (share = copies on
-- the rank / copies). source = 'recorded' or 'contiguous'.
CREATE OR REPLACE VIEW expert_dest AS
WITH rl AS (
    SELECT DISTINCT run_id, layer FROM routing
), rec AS (
    SELECT p.run_id, p.layer, p.expert, CAST(p.rank AS BIGINT) AS rank, CAST(min(p.node) AS BIGINT) AS node,
           CAST(count(*) AS DOUBLE) AS n
    FROM placement p SEMI JOIN rl ON rl.run_id = p.run_id AND rl.layer = p.layer
    WHERE p.plan_id = 'recorded'
    GROUP BY p.run_id, p.layer, p.expert, p.rank
), cont AS (
    SELECT rl.run_id, rl.layer, c.expert, c.rank, c.rank // f.ranks_per_node AS node,
           CAST(count(*) AS DOUBLE) AS n
    FROM rl JOIN contiguous_map c ON c.run_id = rl.run_id JOIN fanout_shape f ON f.run_id = rl.run_id
    GROUP BY rl.run_id, rl.layer, c.expert, c.rank, f.ranks_per_node
)
SELECT run_id, layer, expert, rank, node, n / sum(n) OVER (PARTITION BY run_id, layer, expert) AS share,
       'recorded' AS source
FROM rec
UNION ALL
SELECT c.run_id, c.layer, c.expert, c.rank, c.node, c.n / sum(c.n) OVER (PARTITION BY c.run_id, c.layer, c.expert),
       'contiguous'
FROM cont c
ANTI JOIN (SELECT DISTINCT run_id, layer, expert FROM rec) x
    ON x.run_id = c.run_id AND x.layer = c.layer AND x.expert = c.expert;

-- dispatch_fanout_tokens: per routed token (run, step, layer, token), ranks = the distinct
-- destination ranks of its choices and nodes = the distinct destination nodes. A choice
-- with a recorded slot goes to that slot's rank (recorded placement, else slot x ranks //
-- slots); a choice of a replicated expert without a slot goes to one copy picked evenly at
-- random, and ranks / nodes are then expectations (TensorRT-LLM's report does the same):
-- a rank is reached with probability 1 - prod over the choices of (1 - its share).
-- expected = some choice was split over replicas; placement_source = where the
-- destinations came from ('slot', 'recorded', 'contiguous', joined by '+' when mixed).
CREATE OR REPLACE VIEW dispatch_fanout_tokens AS
WITH d AS (
    SELECT r.run_id, r.step, r.layer, r.token, r.choice, x.rank, x.node, x.share, x.source
    FROM routing r
    JOIN expert_dest x ON x.run_id = r.run_id AND x.layer = r.layer AND x.expert = r.expert
    WHERE r.slot IS NULL
    UNION ALL
    SELECT r.run_id, r.step, r.layer, r.token, r.choice,
           coalesce(CAST(p.rank AS BIGINT), CAST(r.slot AS BIGINT) * f.num_ranks // f.num_slots),
           coalesce(CAST(p.node AS BIGINT), (CAST(r.slot AS BIGINT) * f.num_ranks // f.num_slots) // f.ranks_per_node),
           1.0, 'slot'
    FROM routing r
    JOIN fanout_shape f ON f.run_id = r.run_id
    LEFT JOIN placement p ON p.plan_id = 'recorded' AND p.run_id = r.run_id AND p.layer = r.layer AND p.slot = r.slot
    WHERE r.slot IS NOT NULL
), by_rank AS (   -- share of each choice per rank (two copies on one rank add up)
    SELECT run_id, step, layer, token, choice, rank, least(sum(share), 1.0) AS share
    FROM d GROUP BY run_id, step, layer, token, choice, rank
), by_node AS (
    SELECT run_id, step, layer, token, choice, node, least(sum(share), 1.0) AS share
    FROM d GROUP BY run_id, step, layer, token, choice, node
), p_rank AS (    -- probability each rank receives the token
    SELECT run_id, step, layer, token,
           CASE WHEN max(share) >= 1.0 THEN 1.0
                ELSE 1.0 - exp(sum(ln(1.0 - share))) END AS p
    FROM by_rank GROUP BY run_id, step, layer, token, rank
), p_node AS (
    SELECT run_id, step, layer, token,
           CASE WHEN max(share) >= 1.0 THEN 1.0
                ELSE 1.0 - exp(sum(ln(1.0 - share))) END AS p
    FROM by_node GROUP BY run_id, step, layer, token, node
), t_rank AS (
    SELECT run_id, step, layer, token, sum(p) AS ranks FROM p_rank GROUP BY run_id, step, layer, token
), t_node AS (
    SELECT run_id, step, layer, token, sum(p) AS nodes FROM p_node GROUP BY run_id, step, layer, token
), t_meta AS (
    SELECT run_id, step, layer, token, CAST(count(DISTINCT choice) AS BIGINT) AS choices,
           bool_or(share < 1.0) AS expected,
           string_agg(DISTINCT source, '+' ORDER BY source) AS placement_source
    FROM d GROUP BY run_id, step, layer, token
)
SELECT m.run_id, m.step, m.layer, m.token, m.choices, r.ranks, n.nodes, m.expected, m.placement_source
FROM t_meta m
JOIN t_rank r ON r.run_id = m.run_id AND r.step = m.step AND r.layer = m.layer AND r.token = m.token
JOIN t_node n ON n.run_id = m.run_id AND n.step = m.step AND n.layer = m.layer AND n.token = m.token;

-- dispatch_fanout: the mean distinct destination ranks and nodes per token of each (run,
-- step, layer), and the dispatch bytes they imply (one copy per destination rank, of
-- hidden x dtype_bytes; fanout_shape says when either was defaulted). The placement is the
-- recorded one, else contiguous (placement_source says which). Empty for a run without
-- per-token routing (routing table) or without a rank count: expert_load alone cannot say
-- which experts one token chose together.
CREATE OR REPLACE VIEW dispatch_fanout AS
SELECT t.run_id, t.step, t.layer, CAST(count(*) AS BIGINT) AS tokens,
       avg(t.ranks) AS ranks_per_token, max(t.ranks) AS max_ranks_per_token, avg(t.nodes) AS nodes_per_token,
       sum(t.ranks) * f.hidden * f.dtype_bytes AS dispatch_bytes,
       sum(t.nodes) * f.hidden * f.dtype_bytes AS node_bytes,
       bool_or(t.expected) AS expected,
       string_agg(DISTINCT t.placement_source, ',' ORDER BY t.placement_source) AS placement_source,
       f.nodes_from, f.hidden_from, f.dtype_from
FROM dispatch_fanout_tokens t JOIN fanout_shape f ON f.run_id = t.run_id
GROUP BY t.run_id, t.step, t.layer, f.hidden, f.dtype_bytes, f.nodes_from, f.hidden_from, f.dtype_from;
