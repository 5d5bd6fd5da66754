-- Who waited for whom across ranks (cross-rank alignment of collective instances).
--
-- Every rank enters the same collective instance; the instance cannot finish before the
-- last rank arrives. A collective span is a span with a communication kind (dispatch,
-- combine, a2a_other, comm_other) or a known collective (e.g. a gloo barrier classified
-- as compute). Instances are matched across ranks per group and order:
--   * group (grp): the span's process group where the trace names it ('pg <name>', from
--     spans.process_group), so the all-to-all of an EP group and the all-reduce of a TP
--     group, or the all-reduces of two TP groups, are never paired across ranks; where
--     the trace does not name it (group_inferred) a lane ('lane <n>'):
--   * lane: a GPU stream (NCCL / DeepEP put one communicator's kernels on one stream), or
--     the whole host for host collectives (device -1: gloo ops run on its worker threads
--     in call order); lanes of different ranks are paired by the order of their first
--     collective (lane_idx), since stream ids may differ;
--   * order, per collective: the n-th span of a collective (all_to_all, all_reduce, ...;
--     every all-to-all kind counts as all_to_all) in a group on one rank is the n-th on
--     every rank. Matching per collective, not across them, keeps two communicators that
--     share a stream apart (in the real nccl_a2a_2rank pair the ranks interleave an
--     all-reduce and a combine in opposite orders on one stream).
-- arrival = the span's start (kernel start, or op start for host collectives); the
-- instance's last arrival is the latest start over its ranks; wait = last arrival - own
-- arrival (charged to the last arriver); transfer = own end - last arrival (>= 0; a
-- negative value means the ranks' clocks disagree: flagged, clipped at 0). Ranks are
-- aligned only to the trace's shared time base (no per-rank clock correction).
-- An instance is matched when every rank that has the (group, collective) has a span at that
-- position and all carry the same kind and collective; otherwise coll_match says why.

CREATE OR REPLACE VIEW coll_spans AS
WITH c AS (
    SELECT run_id, rank, device, stream, kind, collective, name_id, start_ns, end_ns, step, layer, micro_batch,
           process_group,
           CASE WHEN device = -1 THEN -1 ELSE stream END AS lane_key,
           coalesce(collective, CASE WHEN kind IN ('dispatch', 'combine', 'a2a_other') THEN 'all_to_all'
                                     ELSE kind END) AS coll_key
    FROM spans
    WHERE kind IN ('dispatch', 'combine', 'a2a_other', 'comm_other') OR collective IS NOT NULL
), l AS (
    SELECT run_id, rank, lane_key, min(start_ns) AS lane_first_ns
    FROM c WHERE process_group IS NULL GROUP BY run_id, rank, lane_key
), li AS (
    SELECT *, row_number() OVER (PARTITION BY run_id, rank ORDER BY lane_first_ns, lane_key) - 1 AS lane_idx
    FROM l
), g AS (
    SELECT c.*, li.lane_idx,
           CASE WHEN c.process_group IS NOT NULL THEN 'pg ' || c.process_group
                ELSE 'lane ' || CAST(li.lane_idx AS VARCHAR) END AS grp
    FROM c LEFT JOIN li ON li.run_id = c.run_id AND li.rank = c.rank AND li.lane_key = c.lane_key
                       AND c.process_group IS NULL
)
SELECT run_id, rank, device, stream, lane_idx AS lane, grp, process_group IS NULL AS group_inferred,
       coll_key, kind, collective, name_id, start_ns, end_ns, step, layer, micro_batch,
       row_number() OVER (PARTITION BY run_id, rank, grp, coll_key ORDER BY start_ns, end_ns) - 1 AS seq
FROM g;

-- Ranks per (group, collective) and how many spans each rank has in it.
CREATE OR REPLACE VIEW coll_lanes AS
WITH per AS (
    SELECT run_id, grp, coll_key, rank, count(*) AS n FROM coll_spans GROUP BY run_id, grp, coll_key, rank
)
SELECT run_id, grp, coll_key, count(*) AS ranks, min(n) AS min_spans, max(n) AS max_spans,
       list(rank ORDER BY rank) AS rank_list
FROM per GROUP BY run_id, grp, coll_key;

-- One row per (group, collective, seq): matched or not, and why not.
CREATE OR REPLACE VIEW coll_match AS
SELECT s.run_id, s.grp, s.coll_key, s.seq, bool_or(s.group_inferred) AS group_inferred,
       l.ranks AS lane_ranks, count(*) AS ranks,
       count(DISTINCT s.kind) AS kinds, count(DISTINCT coalesce(s.collective, '')) AS collectives,
       count(*) = l.ranks AND count(DISTINCT s.kind) = 1 AND count(DISTINCT coalesce(s.collective, '')) = 1
           AND l.ranks > 1 AS matched,
       CASE WHEN l.ranks < 2 THEN 'lane on one rank only'
            WHEN count(*) < l.ranks THEN 'ranks missing (span counts differ between ranks)'
            WHEN count(DISTINCT s.kind) > 1 OR count(DISTINCT coalesce(s.collective, '')) > 1
                THEN 'kinds differ between ranks'
            ELSE NULL END AS reason,
       l.min_spans <> l.max_spans AS lane_counts_differ
FROM coll_spans s JOIN coll_lanes l ON l.run_id = s.run_id AND l.grp = s.grp AND l.coll_key = s.coll_key
GROUP BY s.run_id, s.grp, s.coll_key, s.seq, l.ranks, l.min_spans, l.max_spans;

-- Per matched instance: arrivals, the last arriver, completion.
CREATE OR REPLACE VIEW coll_instances AS
WITH s AS (
    SELECT s.*, row_number() OVER (PARTITION BY s.run_id, s.grp, s.coll_key, s.seq
                                   ORDER BY s.start_ns DESC, s.rank) AS by_late
    FROM coll_spans s
    JOIN coll_match m ON m.run_id = s.run_id AND m.grp = s.grp AND m.coll_key = s.coll_key AND m.seq = s.seq
                     AND m.matched
)
SELECT run_id, grp, coll_key, seq, bool_or(group_inferred) AS group_inferred,
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
GROUP BY run_id, grp, coll_key, seq;

-- Per (instance, rank): how long this rank waited for the last arriver and how long the
-- transfer took after everyone had arrived; the exposed part of each (no compute span of
-- the same rank and device running meanwhile, from compute_islands of 40_a2a_exposure).
CREATE OR REPLACE VIEW rank_waits AS
WITH w AS (
    SELECT s.run_id, s.grp, s.coll_key, s.seq, s.rank, s.device, s.kind, s.collective, s.step, s.layer, s.micro_batch,
           i.ranks, i.last_rank AS waited_for, s.start_ns AS arrival_ns, i.last_arrival_ns, s.end_ns,
           (i.last_arrival_ns - s.start_ns)::BIGINT AS wait_ns,
           greatest(s.end_ns - i.last_arrival_ns, 0)::BIGINT AS transfer_ns,
           s.end_ns < i.last_arrival_ns AS clock_inconsistent
    FROM coll_spans s
    JOIN coll_instances i ON i.run_id = s.run_id AND i.grp = s.grp AND i.coll_key = s.coll_key AND i.seq = s.seq
), ow AS (
    SELECT w.run_id, w.grp, w.coll_key, w.seq, w.rank,
           sum(greatest(least(w.last_arrival_ns, c.end_ns) - greatest(w.arrival_ns, c.start_ns), 0)) AS hid_wait,
           sum(greatest(least(w.end_ns, c.end_ns) - greatest(w.last_arrival_ns, c.start_ns), 0)) AS hid_transfer
    FROM w JOIN compute_islands c
      ON c.run_id = w.run_id AND c.rank = w.rank AND c.device = w.device
     AND c.start_ns < w.end_ns AND c.end_ns > w.arrival_ns
    GROUP BY w.run_id, w.grp, w.coll_key, w.seq, w.rank
)
SELECT w.run_id, w.grp, w.coll_key, w.seq, w.rank, w.kind, w.collective, w.step, w.layer, w.micro_batch,
       w.ranks, w.waited_for, w.arrival_ns, w.wait_ns, w.transfer_ns,
       (w.wait_ns - least(coalesce(ow.hid_wait, 0), w.wait_ns))::BIGINT AS exposed_wait_ns,
       (w.transfer_ns - least(coalesce(ow.hid_transfer, 0), w.transfer_ns))::BIGINT AS exposed_transfer_ns,
       w.clock_inconsistent
FROM w LEFT JOIN ow ON ow.run_id = w.run_id AND ow.grp = w.grp AND ow.coll_key = w.coll_key AND ow.seq = w.seq
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

-- Per run: how many instances were matched and, when some were not, why; how many
-- matched instances were paired by lane because the trace names no process group.
CREATE OR REPLACE VIEW wait_coverage AS
SELECT run_id, count(*) AS positions,
       count(*) FILTER (WHERE matched) AS matched,
       count(*) FILTER (WHERE NOT matched) AS unmatched,
       count(*) FILTER (WHERE reason = 'ranks missing (span counts differ between ranks)') AS unmatched_ranks_missing,
       count(*) FILTER (WHERE reason = 'kinds differ between ranks') AS unmatched_kinds_differ,
       count(*) FILTER (WHERE reason = 'lane on one rank only') AS unmatched_single_rank,
       count(*) FILTER (WHERE matched AND group_inferred) AS matched_group_inferred,
       count(DISTINCT (grp, coll_key)) AS lanes,
       count(DISTINCT (grp, coll_key)) FILTER (WHERE lane_counts_differ) AS lanes_counts_differ
FROM coll_match GROUP BY run_id;

-- instance_waits: per (instance, rank), the wait this rank caused (as the last arriver,
-- the sum of its peers' waits) and suffered, and net_ns = caused / (ranks - 1) - suffered,
-- the rank's lateness at this instance against the average peer (DOUBLE; a rank that
-- arrives d late shows d). pos = the instance's position among the rank's instances of
-- the same (group, collective) in its (step, layer, micro_batch): 0 = the layer's first
-- all-to-all, and so on. A rank held d before one collective in every layer shows a net
-- rise of d at that position (analyze/waits.py wait_shift).
CREATE OR REPLACE VIEW instance_waits AS
WITH caused AS (
    SELECT run_id, grp, coll_key, seq, waited_for AS rank, sum(wait_ns) AS caused_ns
    FROM rank_waits WHERE rank <> waited_for GROUP BY run_id, grp, coll_key, seq, waited_for
)
SELECT w.run_id, w.grp, w.coll_key, w.seq, w.rank, w.kind, w.step, w.layer, w.micro_batch,
       row_number() OVER (PARTITION BY w.run_id, w.rank, w.grp, w.coll_key, w.step, w.layer, w.micro_batch
                          ORDER BY w.seq) - 1 AS pos,
       w.ranks, coalesce(c.caused_ns, 0)::BIGINT AS caused_ns, w.wait_ns AS waited_ns,
       CAST(coalesce(c.caused_ns, 0) AS DOUBLE) / greatest(w.ranks - 1, 1) - w.wait_ns AS net_ns
FROM rank_waits w
LEFT JOIN caused c ON c.run_id = w.run_id AND c.grp = w.grp AND c.coll_key = w.coll_key AND c.seq = w.seq
                  AND c.rank = w.rank;

-- layer_waits: per (step, layer, rank), the sums of instance_waits: the wait this rank
-- caused per waiting peer, the wait it suffered, net = caused - suffered. A rank whose
-- compute runs d late in every layer shows net ~ d in every (step, layer). Rounded to
-- whole ns explicitly (round half away from zero, then cast), the same on every engine.
CREATE OR REPLACE VIEW layer_waits AS
SELECT run_id, step, layer, rank,
       CAST(round(sum(CAST(caused_ns AS DOUBLE) / greatest(ranks - 1, 1))) AS BIGINT) AS caused_per_peer_ns,
       sum(waited_ns)::BIGINT AS waited_ns,
       CAST(round(sum(net_ns)) AS BIGINT) AS net_ns
FROM instance_waits
GROUP BY run_id, step, layer, rank;
