-- DeepEP's own wait counters (deepep_waits, collect/deepep.py) beside the timeline's
-- cross-rank waits (rank_waits, 45_rank_waits.sql).
--
-- DeepEP charges the cycles a rank spent waiting to receive to the source rank it waited
-- for; the timeline charges the wait of every rank at a collective to its last arriver.
-- Both name a slow rank; deepep_wait_compare puts them side by side.

-- deepep_wait_blame: per DeepEP run and rank, the wait the counters charge to it as the
-- source others waited for (self entries excluded: a rank waiting on its own data is local).
-- cycles = sum over waiting ranks and both phases; share = its part of the run's total;
-- blame_rank = 1 for the rank charged most (ties share the position).
CREATE OR REPLACE VIEW deepep_wait_blame AS
WITH b AS (
    SELECT run_id, src_rank AS rank,
           sum(cycles) FILTER (WHERE phase = 'dispatch') AS dispatch_cycles,
           sum(cycles) FILTER (WHERE phase = 'combine') AS combine_cycles,
           sum(cycles) AS cycles, sum(wait_ns) AS wait_ns, any_value(stat) AS stat
    FROM deepep_waits
    WHERE rank <> src_rank
    GROUP BY run_id, src_rank
)
SELECT run_id, rank, CAST(coalesce(dispatch_cycles, 0) AS BIGINT) AS dispatch_cycles,
       CAST(coalesce(combine_cycles, 0) AS BIGINT) AS combine_cycles, CAST(cycles AS BIGINT) AS cycles, wait_ns,
       CAST(cycles AS DOUBLE) / nullif(sum(cycles) OVER (PARTITION BY run_id), 0) AS share,
       rank() OVER (PARTITION BY run_id ORDER BY cycles DESC) AS blame_rank, stat
FROM b;

-- deepep_wait_compare: each DeepEP run beside each timeline run of the store with the same
-- number of ranks (rank_wait_summary), rank by rank. deepep_share / timeline_share = the
-- rank's part of the wait each charges (DeepEP: cycles others waited for it; timeline:
-- caused_wait_ns as last arriver); deepep_blame_rank / timeline_blame_rank = its position
-- (1 = charged most); top_disagree = the two name different most-blamed ranks (true on
-- every row of the pair); share_gap = deepep_share - timeline_share.
CREATE OR REPLACE VIEW deepep_wait_compare AS
WITH d AS (
    SELECT b.*, count(*) OVER (PARTITION BY run_id) AS n FROM deepep_wait_blame b
), dn AS (
    SELECT run_id, max(rank) + 1 AS ranks FROM deepep_waits GROUP BY run_id
), t AS (
    SELECT run_id, rank, caused_wait_ns,
           CAST(caused_wait_ns AS DOUBLE) / nullif(sum(caused_wait_ns) OVER (PARTITION BY run_id), 0) AS share,
           rank() OVER (PARTITION BY run_id ORDER BY caused_wait_ns DESC) AS blame_rank,
           count(*) OVER (PARTITION BY run_id) AS ranks
    FROM rank_wait_summary
), pairs AS (
    SELECT DISTINCT dn.run_id AS deepep_run, t.run_id AS timeline_run
    FROM dn JOIN t ON t.ranks = dn.ranks AND t.run_id <> dn.run_id
), tops AS (
    SELECT p.deepep_run, p.timeline_run,
           (SELECT min(rank) FROM d WHERE d.run_id = p.deepep_run AND d.blame_rank = 1) AS deepep_top,
           (SELECT min(rank) FROM t WHERE t.run_id = p.timeline_run AND t.blame_rank = 1) AS timeline_top
    FROM pairs p
)
SELECT tp.deepep_run, tp.timeline_run, t.rank, d.cycles AS deepep_cycles, d.share AS deepep_share,
       d.blame_rank AS deepep_blame_rank, t.caused_wait_ns AS timeline_caused_wait_ns, t.share AS timeline_share,
       t.blame_rank AS timeline_blame_rank, tp.deepep_top, tp.timeline_top,
       tp.deepep_top IS DISTINCT FROM tp.timeline_top AS top_disagree,
       d.share - t.share AS share_gap
FROM tops tp
JOIN t ON t.run_id = tp.timeline_run
LEFT JOIN d ON d.run_id = tp.deepep_run AND d.rank = t.rank;
