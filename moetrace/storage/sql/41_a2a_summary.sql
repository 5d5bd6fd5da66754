-- Per-rank and per-step summaries of all-to-all exposure, the straggler per step, the
-- all-to-all mode per stream (DeepEP low-latency hook mode) and whether a run has any
-- all-to-all at all (so a report can say "none found" instead of printing 0 or NaN).

CREATE OR REPLACE VIEW a2a_presence AS
SELECT r.run_id,
       count(s.kind) FILTER (WHERE s.kind IN ('dispatch', 'combine', 'a2a_other')) AS a2a_spans,
       count(s.kind) AS spans,
       count(s.kind) FILTER (WHERE s.kind = 'comm_other') AS other_comm_spans,
       count(s.kind) FILTER (WHERE s.kind IN ('dispatch', 'combine', 'a2a_other')) > 0 AS has_a2a,
       -- collective kernels whose CPU op was not found (no launch record, or launched outside any
       -- collective op): which collective they belong to is unknown, so they are not in a2a_exposure
       -- (an NCCL SendRecv among them may be an all-to-all). Counted so a report can say so.
       count(s.kind) FILTER (WHERE s.kind = 'comm_other' AND s.collective IS NULL) AS unlabelled_comm_spans,
       coalesce(sum(s.end_ns - s.start_ns) FILTER (WHERE s.kind = 'comm_other' AND s.collective IS NULL), 0)::BIGINT
           AS unlabelled_comm_ns,
       max(s.end_ns - s.start_ns) FILTER (WHERE s.kind = 'comm_other' AND s.collective IS NULL)::BIGINT
           AS unlabelled_comm_max_ns
FROM runs r
LEFT JOIN spans s ON s.run_id = r.run_id
GROUP BY r.run_id;

CREATE OR REPLACE VIEW a2a_step_rank AS
WITH e AS (
    SELECT run_id, rank, step,
           sum(comm_ns) AS comm_ns, sum(exposed_ns) AS exposed_ns,
           sum(exposed_ns) FILTER (WHERE kind = 'dispatch') AS dispatch_exposed_ns,
           sum(exposed_ns) FILTER (WHERE kind = 'combine') AS combine_exposed_ns,
           sum(comm_ns) FILTER (WHERE kind = 'combine') AS combine_ns
    FROM a2a_exposure
    GROUP BY run_id, rank, step
)
SELECT e.run_id, e.step, e.rank,
       (st.end_ns - st.start_ns)::BIGINT AS step_ns,
       e.comm_ns::BIGINT AS comm_ns, e.exposed_ns::BIGINT AS exposed_ns,
       coalesce(e.dispatch_exposed_ns, 0)::BIGINT AS dispatch_exposed_ns,
       coalesce(e.combine_exposed_ns, 0)::BIGINT AS combine_exposed_ns,
       coalesce(e.combine_ns, 0)::BIGINT AS combine_ns,
       e.exposed_ns / nullif(e.comm_ns, 0) AS exposed_share_of_comm,
       e.exposed_ns / nullif(st.end_ns - st.start_ns, 0) AS exposed_share_of_step
FROM e
LEFT JOIN steps st ON st.run_id = e.run_id AND st.rank = e.rank AND st.step IS NOT DISTINCT FROM e.step;

CREATE OR REPLACE VIEW a2a_rank_summary AS
SELECT run_id, rank,
       count(DISTINCT step) AS steps,
       sum(comm_ns)::BIGINT AS comm_ns,
       sum(exposed_ns)::BIGINT AS exposed_ns,
       sum(dispatch_exposed_ns)::BIGINT AS dispatch_exposed_ns,
       sum(combine_exposed_ns)::BIGINT AS combine_exposed_ns,
       sum(step_ns)::BIGINT AS step_ns,
       sum(exposed_ns) / nullif(sum(comm_ns), 0) AS exposed_share_of_comm,
       sum(exposed_ns) / nullif(sum(step_ns), 0) AS exposed_share_of_step
FROM a2a_step_rank
GROUP BY run_id, rank;

-- Three notions of "the straggler of a step", named apart (they need not agree):
--   last_arrival_rank   the rank the others waited for at the combine: it arrives last, so its
--                       own combine waits least (smallest exposed combine time). wait_ns is how
--                       much longer the median rank's exposed combine was.
--   longest_step_rank   the rank with the longest step window (steps.start_ns..end_ns).
--   token_straggler_rank the rank that received the most tokens in the step, summed over layers
--                       (rank_load_sparse; NULL when the run has no expert_load).
CREATE OR REPLACE VIEW a2a_stragglers AS
WITH r AS (
    SELECT *,
           row_number() OVER (PARTITION BY run_id, step ORDER BY combine_exposed_ns, rank) AS by_wait,
           row_number() OVER (PARTITION BY run_id, step ORDER BY step_ns DESC NULLS LAST, rank) AS by_len,
           count(*) OVER (PARTITION BY run_id, step) AS ranks,
           median(combine_exposed_ns) OVER (PARTITION BY run_id, step) AS median_combine_exposed_ns
    FROM a2a_step_rank
    WHERE combine_ns > 0
), a AS (
    SELECT run_id, step, max(ranks) AS ranks,
           max(rank) FILTER (WHERE by_wait = 1) AS last_arrival_rank,
           max(combine_exposed_ns) FILTER (WHERE by_wait = 1) AS last_arrival_combine_exposed_ns,
           -- a median of an even count ends in .5: rounded half away from zero, explicitly
           -- (a bare cast rounds half to even in DuckDB and truncates on Spark)
           CAST(round(max(median_combine_exposed_ns)) AS BIGINT) AS median_combine_exposed_ns,
           CAST(round(max(median_combine_exposed_ns) - max(combine_exposed_ns) FILTER (WHERE by_wait = 1))
                AS BIGINT) AS wait_ns,
           max(rank) FILTER (WHERE by_len = 1) AS longest_step_rank,
           max(step_ns) FILTER (WHERE by_len = 1) AS longest_step_ns
    FROM r
    GROUP BY run_id, step
    HAVING count(*) > 1
), tok AS (
    SELECT run_id, step, arg_max(rank, struct_pack(t := tokens, neg := -rank)) AS token_straggler_rank,
           max(tokens) AS token_straggler_tokens
    FROM (SELECT run_id, step, rank, sum(tokens) AS tokens FROM rank_load_sparse
          WHERE run_id IN (SELECT run_id FROM a) GROUP BY ALL)
    GROUP BY run_id, step
)
SELECT a.*, tok.token_straggler_rank, tok.token_straggler_tokens
FROM a LEFT JOIN tok ON tok.run_id = a.run_id AND tok.step = a.step;

-- How the all-to-all ran, per (rank, device, stream) holding all-to-all spans:
-- 'deepep_ll_hook' when DeepEP low-latency kernels run on a stream that also runs compute
-- (send and receive kernels on the compute stream, the transfer between them with no
-- kernel running: interval overlap cannot see it); 'compute_stream' when another
-- all-to-all shares a compute stream; 'own_stream' otherwise.
CREATE OR REPLACE VIEW a2a_modes AS
WITH s AS (
    SELECT sp.run_id, sp.rank, sp.device, sp.stream,
           count(*) FILTER (WHERE sp.kind IN ('dispatch', 'combine', 'a2a_other')) AS a2a_spans,
           count(*) FILTER (WHERE sp.kind IN ('dispatch', 'combine', 'a2a_other')
                            AND (kn.name LIKE '%internode_ll%' OR kn.name LIKE '%low_latency%')) AS ll_spans,
           count(*) FILTER (WHERE sp.kind IN ('expert_gemm', 'moe_other', 'attention', 'compute_other')) AS compute_spans
    FROM spans sp
    LEFT JOIN kernel_names kn ON kn.run_id = sp.run_id AND kn.name_id = sp.name_id
    GROUP BY sp.run_id, sp.rank, sp.device, sp.stream
)
SELECT run_id, rank, device, stream, a2a_spans, ll_spans, compute_spans,
       CASE WHEN ll_spans > 0 AND compute_spans > 0 THEN 'deepep_ll_hook'
            WHEN compute_spans > 0 THEN 'compute_stream'
            ELSE 'own_stream' END AS mode
FROM s
WHERE a2a_spans > 0;
