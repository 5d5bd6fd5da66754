-- Who waited for whom across ranks (cross-rank alignment of collective instances).
--
-- Every rank enters the same collective instance; the instance cannot finish before the
-- last rank arrives. A collective span is a span with a communication kind (dispatch,
-- combine, a2a_other, comm_other) or a known collective (e.g. a gloo barrier classified
-- as compute). Instances are matched across ranks per lane and order:
--   * lane: a GPU stream (NCCL / DeepEP put one communicator's kernels on one stream), or
--     the whole host for host collectives (device -1: gloo ops run on its worker threads
--     in call order, so the thread id says nothing); lanes of different ranks are paired
--     by the order of their first collective (lane_idx), since stream ids may differ;
--   * order, per collective: the n-th span of a collective (all_to_all, all_reduce, ...;
--     every all-to-all kind counts as all_to_all) in a lane on one rank is the n-th on
--     every rank. Matching per collective, not across them, keeps two communicators that
--     share a stream apart (in the real nccl_a2a_2rank pair the ranks interleave an
--     all-reduce and a combine in opposite orders on one stream).
-- arrival = the span's start (kernel start, or op start for host collectives); the
-- instance's last arrival is the latest start over its ranks; wait = last arrival - own
-- arrival (charged to the last arriver); transfer = own end - last arrival (>= 0; a
-- negative value means the ranks' clocks disagree: flagged, clipped at 0). Ranks are
-- aligned only to the trace's shared time base (no per-rank clock correction).
-- An instance is matched when every rank that has the (lane, collective) has a span at that position
-- and all carry the same kind and collective; otherwise coll_match says why.

CREATE OR REPLACE VIEW coll_spans AS
WITH c AS (
    SELECT run_id, rank, device, stream, kind, collective, name_id, start_ns, end_ns, step, layer, micro_batch,
           CASE WHEN device = -1 THEN -1 ELSE stream END AS lane_key,
           coalesce(collective, CASE WHEN kind IN ('dispatch', 'combine', 'a2a_other') THEN 'all_to_all'
                                     ELSE kind END) AS coll_key
    FROM spans
    WHERE kind IN ('dispatch', 'combine', 'a2a_other', 'comm_other') OR collective IS NOT NULL
), l AS (
    SELECT run_id, rank, lane_key, min(start_ns) AS lane_first_ns
    FROM c GROUP BY run_id, rank, lane_key
), li AS (
    SELECT *, row_number() OVER (PARTITION BY run_id, rank ORDER BY lane_first_ns, lane_key) - 1 AS lane_idx
    FROM l
)
SELECT c.run_id, c.rank, c.device, c.stream, li.lane_idx AS lane, c.coll_key, c.kind, c.collective, c.name_id,
       c.start_ns, c.end_ns, c.step, c.layer, c.micro_batch,
       row_number() OVER (PARTITION BY c.run_id, c.rank, li.lane_idx, c.coll_key ORDER BY c.start_ns, c.end_ns) - 1 AS seq
FROM c JOIN li ON li.run_id = c.run_id AND li.rank = c.rank AND li.lane_key = c.lane_key;

-- Ranks per (lane, collective) and how many spans each rank has in it.
CREATE OR REPLACE VIEW coll_lanes AS
WITH per AS (
    SELECT run_id, lane, coll_key, rank, count(*) AS n FROM coll_spans GROUP BY run_id, lane, coll_key, rank
)
SELECT run_id, lane, coll_key, count(*) AS ranks, min(n) AS min_spans, max(n) AS max_spans,
       list(rank ORDER BY rank) AS rank_list
FROM per GROUP BY run_id, lane, coll_key;

-- One row per (lane, collective, seq): matched or not, and why not.
CREATE OR REPLACE VIEW coll_match AS
SELECT s.run_id, s.lane, s.coll_key, s.seq, l.ranks AS lane_ranks, count(*) AS ranks,
       count(DISTINCT s.kind) AS kinds, count(DISTINCT coalesce(s.collective, '')) AS collectives,
       count(*) = l.ranks AND count(DISTINCT s.kind) = 1 AND count(DISTINCT coalesce(s.collective, '')) = 1
           AND l.ranks > 1 AS matched,
       CASE WHEN l.ranks < 2 THEN 'lane on one rank only'
            WHEN count(*) < l.ranks THEN 'ranks missing (span counts differ between ranks)'
            WHEN count(DISTINCT s.kind) > 1 OR count(DISTINCT coalesce(s.collective, '')) > 1
                THEN 'kinds differ between ranks'
            ELSE NULL END AS reason,
       l.min_spans <> l.max_spans AS lane_counts_differ
FROM coll_spans s JOIN coll_lanes l ON l.run_id = s.run_id AND l.lane = s.lane AND l.coll_key = s.coll_key
GROUP BY s.run_id, s.lane, s.coll_key, s.seq, l.ranks, l.min_spans, l.max_spans;

-- Per matched instance: arrivals, the last arriver, completion.
CREATE OR REPLACE VIEW coll_instances AS
WITH s AS (
    SELECT s.*, row_number() OVER (PARTITION BY s.run_id, s.lane, s.coll_key, s.seq
                                   ORDER BY s.start_ns DESC, s.rank) AS by_late
    FROM coll_spans s
    JOIN coll_match m ON m.run_id = s.run_id AND m.lane = s.lane AND m.coll_key = s.coll_key AND m.seq = s.seq
                     AND m.matched
)
SELECT run_id, lane, coll_key, seq,
       any_value(kind) AS kind, any_value(collective) AS collective,
       min(step) AS step, min(layer) AS layer, min(micro_batch) AS micro_batch,
       count(*) AS ranks,
       max(rank) FILTER (WHERE by_late = 1) AS last_rank,
       min(start_ns) AS first_arrival_ns, max(start_ns) AS last_arrival_ns,
       (max(start_ns) - min(start_ns))::BIGINT AS arrival_spread_ns,
       min(end_ns) AS first_end_ns, max(end_ns) AS completion_ns,
       (min(end_ns) - max(start_ns))::BIGINT AS min_transfer_ns,
       min(end_ns) < max(start_ns) AS clock_inconsistent
FROM s
GROUP BY run_id, lane, coll_key, seq;

-- Per (instance, rank): how long this rank waited for the last arriver and how long the
-- transfer took after everyone had arrived; the exposed part of each (no compute span of
-- the same rank and device running meanwhile, from compute_islands of 40_a2a_exposure).
CREATE OR REPLACE VIEW rank_waits AS
WITH w AS (
    SELECT s.run_id, s.lane, s.coll_key, s.seq, s.rank, s.device, s.kind, s.collective, s.step, s.layer, s.micro_batch,
           i.last_rank AS waited_for, s.start_ns AS arrival_ns, i.last_arrival_ns, s.end_ns,
           (i.last_arrival_ns - s.start_ns)::BIGINT AS wait_ns,
           greatest(s.end_ns - i.last_arrival_ns, 0)::BIGINT AS transfer_ns,
           s.end_ns < i.last_arrival_ns AS clock_inconsistent
    FROM coll_spans s
    JOIN coll_instances i ON i.run_id = s.run_id AND i.lane = s.lane AND i.coll_key = s.coll_key AND i.seq = s.seq
), ow AS (
    SELECT w.run_id, w.lane, w.coll_key, w.seq, w.rank,
           sum(greatest(least(w.last_arrival_ns, c.end_ns) - greatest(w.arrival_ns, c.start_ns), 0)) AS hid_wait,
           sum(greatest(least(w.end_ns, c.end_ns) - greatest(w.last_arrival_ns, c.start_ns), 0)) AS hid_transfer
    FROM w JOIN compute_islands c
      ON c.run_id = w.run_id AND c.rank = w.rank AND c.device = w.device
     AND c.start_ns < w.end_ns AND c.end_ns > w.arrival_ns
    GROUP BY w.run_id, w.lane, w.coll_key, w.seq, w.rank
)
SELECT w.run_id, w.lane, w.coll_key, w.seq, w.rank, w.kind, w.collective, w.step, w.layer, w.micro_batch,
       w.waited_for, w.arrival_ns, w.wait_ns, w.transfer_ns,
       (w.wait_ns - least(coalesce(ow.hid_wait, 0), w.wait_ns))::BIGINT AS exposed_wait_ns,
       (w.transfer_ns - least(coalesce(ow.hid_transfer, 0), w.transfer_ns))::BIGINT AS exposed_transfer_ns,
       w.clock_inconsistent
FROM w LEFT JOIN ow ON ow.run_id = w.run_id AND ow.lane = w.lane AND ow.coll_key = w.coll_key AND ow.seq = w.seq
                    AND ow.rank = w.rank;

-- Who waited for whom: total wait of `rank` charged to `waited_for` (self rows and ties
-- -- equal arrivals, no wait -- excluded).
CREATE OR REPLACE VIEW wait_matrix AS
SELECT run_id, rank, waited_for, count(*) AS instances, sum(wait_ns)::BIGINT AS wait_ns,
       sum(exposed_wait_ns)::BIGINT AS exposed_wait_ns
FROM rank_waits
WHERE rank <> waited_for AND wait_ns > 0
GROUP BY run_id, rank, waited_for;

-- Per rank: the wait it caused others (as last arriver), the wait it suffered, and its
-- exposed collective time split into waiting-for-a-peer and transfer.
CREATE OR REPLACE VIEW rank_wait_summary AS
WITH caused AS (
    SELECT run_id, waited_for AS rank, sum(wait_ns) AS caused_wait_ns
    FROM rank_waits WHERE rank <> waited_for GROUP BY run_id, waited_for
), last AS (
    SELECT run_id, last_rank AS rank, count(*) AS times_last FROM coll_instances GROUP BY run_id, last_rank
), own AS (
    SELECT run_id, rank, count(*) AS instances,
           sum(wait_ns) AS wait_ns, sum(transfer_ns) AS transfer_ns,
           sum(exposed_wait_ns) AS exposed_wait_ns, sum(exposed_transfer_ns) AS exposed_transfer_ns,
           count(*) FILTER (WHERE clock_inconsistent) AS clock_inconsistent
    FROM rank_waits GROUP BY run_id, rank
)
SELECT o.run_id, o.rank, o.instances, coalesce(l.times_last, 0) AS times_last,
       coalesce(c.caused_wait_ns, 0)::BIGINT AS caused_wait_ns,
       o.wait_ns::BIGINT AS wait_ns, o.transfer_ns::BIGINT AS transfer_ns,
       o.exposed_wait_ns::BIGINT AS exposed_wait_ns, o.exposed_transfer_ns::BIGINT AS exposed_transfer_ns,
       o.clock_inconsistent
FROM own o
LEFT JOIN caused c ON c.run_id = o.run_id AND c.rank = o.rank
LEFT JOIN last l ON l.run_id = o.run_id AND l.rank = o.rank;

-- Per run: how many instances were matched and, when some were not, why.
CREATE OR REPLACE VIEW wait_coverage AS
SELECT run_id, count(*) AS positions,
       count(*) FILTER (WHERE matched) AS matched,
       count(*) FILTER (WHERE NOT matched) AS unmatched,
       count(*) FILTER (WHERE reason = 'ranks missing (span counts differ between ranks)') AS unmatched_ranks_missing,
       count(*) FILTER (WHERE reason = 'kinds differ between ranks') AS unmatched_kinds_differ,
       count(*) FILTER (WHERE reason = 'lane on one rank only') AS unmatched_single_rank,
       count(DISTINCT (lane, coll_key)) AS lanes,
       count(DISTINCT (lane, coll_key)) FILTER (WHERE lane_counts_differ) AS lanes_counts_differ
FROM coll_match GROUP BY run_id;

-- Per (step, layer, rank): the wait this rank caused (others' wait charged to it, per
-- waiting peer) and the wait it suffered; net = caused - suffered. A rank whose compute
-- runs d late in every layer shows net ~ d in every (step, layer).
CREATE OR REPLACE VIEW layer_waits AS
WITH r AS (
    SELECT run_id, step, layer, rank, count(DISTINCT rank) OVER (PARTITION BY run_id) AS ranks,
           wait_ns, waited_for
    FROM rank_waits
), caused AS (
    SELECT run_id, step, layer, waited_for AS rank, sum(wait_ns) AS caused_ns
    FROM r WHERE rank <> waited_for GROUP BY ALL
), suffered AS (
    SELECT run_id, step, layer, rank, any_value(ranks) AS ranks, sum(wait_ns) AS waited_ns
    FROM r GROUP BY run_id, step, layer, rank
)
SELECT s.run_id, s.step, s.layer, s.rank,
       (coalesce(c.caused_ns, 0) / greatest(s.ranks - 1, 1))::BIGINT AS caused_per_peer_ns,
       s.waited_ns::BIGINT AS waited_ns,
       (coalesce(c.caused_ns, 0) / greatest(s.ranks - 1, 1) - s.waited_ns)::BIGINT AS net_ns
FROM suffered s
LEFT JOIN caused c ON c.run_id = s.run_id AND c.step IS NOT DISTINCT FROM s.step
                  AND c.layer IS NOT DISTINCT FROM s.layer AND c.rank = s.rank;
