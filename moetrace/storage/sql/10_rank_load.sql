-- Rank load: tokens each expert-parallel rank received per (step, layer).
--
-- run_shape: the shape every rank metric uses, per run. num_experts falls back to the
-- highest expert id seen + 1, num_ranks to the recorded placement's highest rank + 1;
-- when neither runs.num_ranks nor a recorded placement gives it, num_ranks is NULL and
-- every rank metric is NULL with a note (an expert-per-rank guess would be wrong for
-- most deployments). *_from columns say where each number came from.
--
-- Every view of this file reads the long rows (expert_load_long) and the dense rows
-- (expert_counts: one list of E expert counts per step and layer) each the fast way: the
-- dense rows with list functions, never unnested (docs/explanation/fleet-scale.md). A (run, step, layer) is
-- in one of them only, so each view is the union of the two parts.
CREATE OR REPLACE VIEW run_shape AS
WITH seen AS (
    SELECT run_id, max(max_expert) AS max_expert, max(max_slot) AS max_slot FROM (
        SELECT run_id, max(expert) + 1 AS max_expert, max(slot) + 1 AS max_slot
        FROM expert_load_long GROUP BY run_id
        UNION ALL
        -- dense lists are num_experts long: their length is read only when runs lacks it
        SELECT c.run_id, max(len(c.tokens)), CAST(NULL AS INTEGER) FROM expert_counts c
        SEMI JOIN runs r ON r.run_id = c.run_id AND r.num_experts IS NULL GROUP BY c.run_id
    ) GROUP BY run_id
), rec AS (
    SELECT run_id, max(rank) + 1 AS rec_ranks, max(slot) + 1 AS rec_slots
    FROM placement WHERE plan_id = 'recorded' GROUP BY run_id
)
SELECT r.run_id,
       CAST(coalesce(r.num_experts, s.max_expert) AS BIGINT) AS num_experts,
       CASE WHEN r.num_experts IS NOT NULL THEN 'runs'
            WHEN s.max_expert IS NOT NULL THEN 'max expert id + 1' END AS experts_from,
       CAST(coalesce(r.num_ranks, rec.rec_ranks) AS BIGINT) AS num_ranks,
       CASE WHEN r.num_ranks IS NOT NULL THEN 'runs'
            WHEN rec.rec_ranks IS NOT NULL THEN 'recorded placement' END AS ranks_from,
       CAST(coalesce(r.num_slots, rec.rec_slots, s.max_slot, r.num_experts, s.max_expert) AS BIGINT) AS num_slots,
       CAST(r.top_k AS BIGINT) AS top_k
FROM runs r
LEFT JOIN seen s USING (run_id)
LEFT JOIN rec USING (run_id);

-- dense_experts: the experts of each dense (run, layer): 0..E-1 (list index; a dense
-- list holds the run's num_experts counts).
CREATE OR REPLACE VIEW dense_experts AS
SELECT d.run_id, d.layer, CAST(unnest(range(sh.num_experts)) AS INTEGER) AS expert
FROM (SELECT DISTINCT run_id, layer FROM expert_counts) d JOIN run_shape sh USING (run_id);

-- step_layers: the (run, step, layer) that have expert_load rows, long or dense.
CREATE OR REPLACE VIEW step_layers AS
SELECT DISTINCT run_id, step, layer FROM expert_load_long
UNION ALL
SELECT run_id, step, layer FROM expert_counts;

-- layer_placement: how rank load is derived for each (run, layer).
--   slot        every row carries its physical slot: rank from the slot (exact)
--   recorded    rows per logical expert, spread evenly over the replicas of the
--               recorded placement (plan_id = 'recorded')
--   contiguous  no placement recorded: vLLM's initial map (view contiguous_map), the
--               one the replay assumes too: slot i holds expert i mod num_experts, on
--               rank i * num_ranks // num_slots; replicas share an expert's tokens evenly
--               (with num_slots = num_experts: expert e on rank e * num_ranks // num_experts)
--   none        num_ranks unknown: no rank metrics
-- Mixed layers say so ('slot+recorded', 'slot+contiguous'); experts missing from the
-- recorded placement fall back to contiguous ('recorded+contiguous').
CREATE OR REPLACE VIEW layer_placement AS
WITH l AS (
    SELECT run_id, layer, bool_or(any_slot) AS any_slot, bool_and(all_slot) AS all_slot FROM (
        SELECT run_id, layer, bool_or(slot IS NOT NULL) AS any_slot, bool_and(slot IS NOT NULL) AS all_slot
        FROM expert_load_long GROUP BY run_id, layer
        UNION ALL
        SELECT DISTINCT run_id, layer, false, false FROM expert_counts
    ) GROUP BY run_id, layer
), rec AS (
    SELECT run_id, layer, count(*) AS recorded_slots, count(DISTINCT expert) AS recorded_experts
    FROM placement WHERE plan_id = 'recorded' GROUP BY run_id, layer
), unplaced AS (
    SELECT e.run_id, e.layer, count(DISTINCT e.expert) AS unplaced_experts
    FROM (SELECT DISTINCT x.run_id, x.layer, x.expert FROM expert_load_long x
          SEMI JOIN rec ON rec.run_id = x.run_id AND rec.layer = x.layer
          WHERE x.slot IS NULL
          UNION
          SELECT x.run_id, x.layer, x.expert FROM dense_experts x
          SEMI JOIN rec ON rec.run_id = x.run_id AND rec.layer = x.layer) e
    ANTI JOIN (SELECT DISTINCT run_id, layer, expert FROM placement WHERE plan_id = 'recorded') p
        ON p.run_id = e.run_id AND p.layer = e.layer AND p.expert = e.expert
    GROUP BY e.run_id, e.layer
)
SELECT l.run_id, l.layer,
       CASE WHEN sh.num_ranks IS NULL THEN 'none'
            WHEN l.all_slot THEN 'slot'
            WHEN rec.layer IS NOT NULL THEN
                (CASE WHEN l.any_slot THEN 'slot+' ELSE '' END) || 'recorded'
                || (CASE WHEN coalesce(u.unplaced_experts, 0) > 0 THEN '+contiguous' ELSE '' END)
            ELSE (CASE WHEN l.any_slot THEN 'slot+' ELSE '' END) || 'contiguous' END AS placement_source,
       rec.layer IS NOT NULL AS has_recorded,
       coalesce(rec.recorded_slots, 0) AS recorded_slots,
       coalesce(u.unplaced_experts, 0) AS unplaced_experts,
       sh.num_ranks, sh.ranks_from, sh.num_experts, sh.experts_from, sh.num_slots
FROM l
JOIN run_shape sh USING (run_id)
LEFT JOIN rec USING (run_id, layer)
LEFT JOIN unplaced u USING (run_id, layer);

-- expert_tokens: tokens per logical expert per (step, layer). Experts without rows
-- received nothing. By the table's key (step, layer, expert, slot, src_rank), a row with
-- neither slot nor src_rank is already the expert's total and is used as is (no
-- group-by over hundreds of millions of rows); rows split by slot or source rank are
-- summed per expert. expert_tokens_long is the long part alone.
CREATE OR REPLACE VIEW expert_tokens_long AS
SELECT run_id, step, layer, expert, tokens
FROM expert_load_long WHERE slot IS NULL AND src_rank IS NULL
UNION ALL
SELECT run_id, step, layer, expert, CAST(sum(tokens) AS BIGINT) AS tokens
FROM expert_load_long WHERE slot IS NOT NULL OR src_rank IS NOT NULL
GROUP BY run_id, step, layer, expert;

CREATE OR REPLACE VIEW expert_tokens AS
SELECT run_id, step, layer, expert, tokens FROM expert_tokens_long
UNION ALL
SELECT run_id, step, layer, CAST(generate_subscripts(tokens, 1) - 1 AS INTEGER) AS expert, unnest(tokens) AS tokens
FROM expert_counts;

-- contiguous_map: where an expert sits when no placement records it (the replay's
-- "recorded (contiguous assumed)" plan, moetrace.placement.planners.contiguous): vLLM's
-- initial map over S = max(num_slots, num_experts) slots, slot i holding expert
-- i mod num_experts on rank i * num_ranks // S; one row per slot, with the expert's number
-- of slots (its tokens are split evenly over them).
CREATE OR REPLACE VIEW contiguous_map AS
WITH sh AS (
    SELECT run_id, CAST(num_experts AS BIGINT) AS E, CAST(num_ranks AS BIGINT) AS R,
           CAST(greatest(num_slots, num_experts) AS BIGINT) AS S
    FROM run_shape WHERE num_ranks IS NOT NULL
), s AS (
    SELECT run_id, E, R, S, unnest(range(S)) AS slot FROM sh
)
SELECT run_id, CAST(slot % E AS INTEGER) AS expert, CAST(slot * R // S AS BIGINT) AS rank,
       CAST(count(*) OVER (PARTITION BY run_id, slot % E) AS DOUBLE) AS copies
FROM s;

-- dense_rank_map: for each dense (run, layer), the ranks that hold experts and, per rank,
-- its (expert list index, copies) pairs: a replica of the recorded placement takes
-- tokens / copies, an expert the placement lacks (or every expert, without a recorded
-- placement) sits where contiguous_map puts it: the rules of rank_tokens_long below, as
-- a lookup table applied to each list.
CREATE OR REPLACE VIEW dense_rank_map AS
WITH sh AS (
    SELECT run_id, num_experts AS E, num_ranks AS R FROM run_shape WHERE num_ranks IS NOT NULL
), reps AS (
    SELECT run_id, layer, expert, rank, count(*) OVER (PARTITION BY run_id, layer, expert) AS copies
    FROM placement WHERE plan_id = 'recorded'
), entries AS (
    SELECT x.run_id, x.layer, x.expert, CAST(r.rank AS BIGINT) AS rank, CAST(r.copies AS DOUBLE) AS copies
    FROM dense_experts x JOIN reps r ON r.run_id = x.run_id AND r.layer = x.layer AND r.expert = x.expert
    UNION ALL
    SELECT x.run_id, x.layer, x.expert, c.rank, c.copies
    FROM dense_experts x
    JOIN contiguous_map c ON c.run_id = x.run_id AND c.expert = x.expert
    ANTI JOIN (SELECT DISTINCT run_id, layer, expert FROM placement WHERE plan_id = 'recorded') p
        ON p.run_id = x.run_id AND p.layer = x.layer AND p.expert = x.expert
), per_rank AS (
    SELECT run_id, layer, rank, list(struct_pack(i := expert + 1, c := copies) ORDER BY expert) AS slots
    FROM entries GROUP BY run_id, layer, rank
)
SELECT run_id, layer, list(rank ORDER BY rank) AS ranks, list(slots ORDER BY rank) AS slots
FROM per_rank GROUP BY run_id, layer;

-- dense_step_stats: what the per-(step, layer) views need from a dense row, in one scan:
-- the expert-level sums (sorted counts are stored: first maximum = lowest expert id) and
-- the rank lists from the rank map (NULL without one: num_ranks unknown).
CREATE OR REPLACE VIEW dense_step_stats AS
SELECT c.run_id, c.step, c.layer,
       CAST(list_sum(c.tokens) AS BIGINT) AS assignments,
       list_inner_product(CAST(c.tokens AS DOUBLE[]), CAST(c.tokens AS DOUBLE[])) AS sumsq,
       CAST(len(list_filter(c.tokens, lambda x: x > 0)) AS BIGINT) AS experts_hit,
       CAST(len(c.tokens) AS BIGINT) AS experts_present,
       c.tokens_desc[-1] AS min_present,
       c.tokens_desc[1] AS max_tokens,
       CAST(list_position(c.tokens, c.tokens_desc[1]) - 1 AS INTEGER) AS hottest_expert,
       CAST(c.tokens_desc AS DOUBLE[]) AS tokens_desc,
       m.ranks,
       list_transform(m.slots, lambda rs: list_sum(list_transform(rs, lambda x: tokens[x.i] / x.c))) AS rank_tokens
FROM expert_counts c LEFT JOIN dense_rank_map m ON m.run_id = c.run_id AND m.layer = c.layer;

-- rank_tokens_by_step: per (run, step, layer) the ranks that received rows (ascending)
-- and their tokens, as two lists. Long rows (rank_tokens_long): rank of each row
-- (recorded slot, recorded replicas, contiguous: see rank_load_sparse) summed per rank;
-- dense rows: the rank map applied to the list (dense_step_stats).
CREATE OR REPLACE VIEW rank_tokens_long AS
WITH sh AS (
    SELECT run_id, num_experts AS E, num_ranks AS R, num_slots AS S FROM run_shape WHERE num_ranks IS NOT NULL
), reps AS (
    SELECT run_id, layer, expert, rank, count(*) OVER (PARTITION BY run_id, layer, expert) AS copies
    FROM placement WHERE plan_id = 'recorded'
), placed AS (
    SELECT DISTINCT run_id, layer, expert FROM placement WHERE plan_id = 'recorded'
), per_row AS (
    SELECT e.run_id, e.step, e.layer,
           CAST(coalesce(p.rank, (CAST(e.slot AS BIGINT) * sh.R) // sh.S) AS BIGINT) AS rank,
           CAST(e.tokens AS DOUBLE) AS tokens
    FROM expert_load_long e
    JOIN sh USING (run_id)
    LEFT JOIN placement p ON p.plan_id = 'recorded' AND p.run_id = e.run_id AND p.layer = e.layer
                         AND p.slot = e.slot
    WHERE e.slot IS NOT NULL
    UNION ALL
    SELECT e.run_id, e.step, e.layer, CAST(r.rank AS BIGINT), CAST(e.tokens AS DOUBLE) / r.copies
    FROM expert_load_long e
    JOIN reps r ON r.run_id = e.run_id AND r.layer = e.layer AND r.expert = e.expert
    WHERE e.slot IS NULL
    UNION ALL
    SELECT e.run_id, e.step, e.layer, c.rank, CAST(e.tokens AS DOUBLE) / c.copies
    FROM expert_load_long e
    JOIN contiguous_map c ON c.run_id = e.run_id AND c.expert = e.expert
    ANTI JOIN placed pl ON pl.run_id = e.run_id AND pl.layer = e.layer AND pl.expert = e.expert
    WHERE e.slot IS NULL
), long_ranks AS (
    SELECT run_id, step, layer, rank, sum(tokens) AS tokens
    FROM per_row GROUP BY run_id, step, layer, rank
)
SELECT run_id, step, layer, list(rank ORDER BY rank) AS ranks, list(tokens ORDER BY rank) AS tokens
FROM long_ranks GROUP BY run_id, step, layer;

CREATE OR REPLACE VIEW rank_tokens_by_step AS
SELECT run_id, step, layer, ranks, tokens FROM rank_tokens_long
UNION ALL
SELECT run_id, step, layer, ranks, rank_tokens FROM dense_step_stats WHERE ranks IS NOT NULL;

-- rank_load_sparse: ranks that received rows (no zero-fill), one row per rank.
CREATE OR REPLACE VIEW rank_load_sparse AS
SELECT run_id, step, layer, unnest(ranks) AS rank, unnest(tokens) AS tokens FROM rank_tokens_by_step;

-- rank_load: every rank of every (step, layer) that has expert_load rows, zero-filled,
-- with placement_source saying how ranks were derived. Tokens are DOUBLE because
-- replicas split an expert's tokens evenly.
CREATE OR REPLACE VIEW rank_load AS
WITH sl AS (
    SELECT run_id, step, layer FROM step_layers
), grid AS (
    SELECT sl.run_id, sl.step, sl.layer, unnest(range(sh.num_ranks)) AS rank
    FROM sl JOIN run_shape sh USING (run_id) WHERE sh.num_ranks IS NOT NULL
)
SELECT g.run_id, g.step, g.layer, CAST(g.rank AS INTEGER) AS rank, coalesce(s.tokens, 0.0) AS tokens,
       lp.placement_source
FROM grid g
LEFT JOIN rank_load_sparse s ON s.run_id = g.run_id AND s.step = g.step AND s.layer = g.layer AND s.rank = g.rank
JOIN layer_placement lp ON lp.run_id = g.run_id AND lp.layer = g.layer;
