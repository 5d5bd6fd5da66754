-- All-to-all exposure: how much dispatch / combine time was not hidden behind compute.
--
-- A group is (run, rank, step, layer, micro_batch, kind). comm_ns is the length of the
-- union of the group's all-to-all spans; overlapped_ns the part of that union during
-- which a compute span (expert_gemm, moe_other, attention, compute_other) ran on any stream of the
-- same device; exposed_ns = comm_ns - overlapped_ns. Unions are computed with window
-- functions (gaps and islands), the overlap with a range join of two disjoint unions.

CREATE OR REPLACE VIEW a2a_spans AS
SELECT run_id, rank, device, stream, step, layer, micro_batch, kind, name_id, start_ns, end_ns, inferred
FROM spans
WHERE kind IN ('dispatch', 'combine', 'a2a_other');

CREATE OR REPLACE VIEW a2a_islands AS
WITH o AS (
    SELECT *,
           max(end_ns) OVER (PARTITION BY run_id, rank, device, step, layer, micro_batch, kind
                             ORDER BY start_ns, end_ns
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
    FROM a2a_spans
), g AS (
    SELECT *,
           sum(CASE WHEN prev_end IS NULL OR start_ns > prev_end THEN 1 ELSE 0 END)
               OVER (PARTITION BY run_id, rank, device, step, layer, micro_batch, kind
                     ORDER BY start_ns, end_ns ROWS UNBOUNDED PRECEDING) AS island
    FROM o
)
SELECT run_id, rank, device, step, layer, micro_batch, kind, island,
       min(start_ns) AS start_ns, max(end_ns) AS end_ns, bool_or(inferred) AS inferred, count(*) AS n_spans
FROM g
GROUP BY run_id, rank, device, step, layer, micro_batch, kind, island;

CREATE OR REPLACE VIEW compute_islands AS
WITH c AS (
    SELECT run_id, rank, device, start_ns, end_ns
    FROM spans
    WHERE kind IN ('expert_gemm', 'moe_other', 'attention', 'compute_other')
), o AS (
    SELECT *,
           max(end_ns) OVER (PARTITION BY run_id, rank, device ORDER BY start_ns, end_ns
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
    FROM c
), g AS (
    SELECT *,
           sum(CASE WHEN prev_end IS NULL OR start_ns > prev_end THEN 1 ELSE 0 END)
               OVER (PARTITION BY run_id, rank, device ORDER BY start_ns, end_ns ROWS UNBOUNDED PRECEDING) AS island
    FROM o
)
SELECT run_id, rank, device, island, min(start_ns) AS start_ns, max(end_ns) AS end_ns
FROM g
GROUP BY run_id, rank, device, island;

CREATE OR REPLACE VIEW a2a_island_overlap AS
SELECT a.run_id, a.rank, a.device, a.step, a.layer, a.micro_batch, a.kind, a.island,
       sum(least(a.end_ns, c.end_ns) - greatest(a.start_ns, c.start_ns)) AS overlapped_ns
FROM a2a_islands a
JOIN compute_islands c
  ON a.run_id = c.run_id AND a.rank = c.rank AND a.device = c.device
 AND c.start_ns < a.end_ns AND c.end_ns > a.start_ns
GROUP BY a.run_id, a.rank, a.device, a.step, a.layer, a.micro_batch, a.kind, a.island;

CREATE OR REPLACE VIEW a2a_exposure AS
SELECT i.run_id, i.rank, i.step, i.layer, i.micro_batch, i.kind,
       sum(i.end_ns - i.start_ns)::BIGINT AS comm_ns,
       coalesce(sum(o.overlapped_ns), 0)::BIGINT AS overlapped_ns,
       (sum(i.end_ns - i.start_ns) - coalesce(sum(o.overlapped_ns), 0))::BIGINT AS exposed_ns,
       bool_or(i.inferred) AS inferred
FROM a2a_islands i
LEFT JOIN a2a_island_overlap o
  ON i.run_id = o.run_id AND i.rank = o.rank AND i.device = o.device AND i.kind = o.kind AND i.island = o.island
 AND i.step IS NOT DISTINCT FROM o.step AND i.layer IS NOT DISTINCT FROM o.layer
 AND i.micro_batch IS NOT DISTINCT FROM o.micro_batch
GROUP BY i.run_id, i.rank, i.step, i.layer, i.micro_batch, i.kind;
