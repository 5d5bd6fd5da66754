#!/usr/bin/env bash
# The main job on the shipped sample traces: ingest, report, replay.
#   bash sample_traces/demo.sh [OUT]      (default OUT=moetrace-demo)
# Every step is a plain moetrace command; read them as the tour of the tool.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:-moetrace-demo}"
rm -rf "$OUT"
# echo each command so it can be pasted back: arguments with spaces or quotes in single quotes
show() {
    local out="\$" a
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+=" $a"; else out+=" '${a//\'/\'\\\'\'}'"; fi
    done
    echo "$out"
}
run() { echo; show "$@"; "$@"; }

# 1. a DeepSeek-V3-shaped serving run (expert load per step; 32 ranks, 8 per node)
run moetrace ingest "$HERE/dsv3_synth_expert_load.parquet" --store "$OUT/store" \
    --run-id dsv3 --ranks 32 --ranks-per-node 8 --top-k 8 --experts 256 --layers 4 --groups 8
# 2. a real expert-parallel run on CPU (4 gloo ranks, profiler traces, routing, dummy steps),
#    and the same traffic re-run for real under an EPLB placement planned from the first
run moetrace ingest "$HERE/refrun" --store "$OUT/store" --run-id refrun
run moetrace ingest "$HERE/refrun_eplb" --store "$OUT/store" --run-id refrun_eplb
run moetrace runs "$OUT/store"
# 3. the numbers: skew per layer, and SQL over everything
run moetrace skew "$OUT/store" --run dsv3
run moetrace sql "$OUT/store" "SELECT layer, round(avg(imbalance), 3) AS mean_max_over_mean, round(avg(gini), 3) AS gini FROM layer_skew WHERE run_id = 'dsv3' GROUP BY layer ORDER BY layer"
# 4. what another placement would have done: EPLB fitted on steps 0-99, judged on steps 100-199 against
#    the recorded placement on the same steps, net of moving the experts (break-even, verdict); then
#    re-planning every 25 steps from the last 25 (static vs re-planned vs oracle, judged on steps 25-199),
#    and the operator's decision table (replica budgets x re-plan intervals, net time, memory, moves)
run moetrace replay "$OUT/store" --run dsv3 --policy eplb --replicas 32 --fit-steps 0:100
run moetrace replay "$OUT/store" --run dsv3 --policy eplb --replicas 32 --replan-every 25 --window 25
run moetrace sweep "$OUT/store" --run dsv3 --replicas 0,32 --replan-every 25,50 --window 50
# 5. all-to-all exposure on the real multi-rank trace
run moetrace exposure "$OUT/store" --run refrun
# 6. was the prediction right? replay the first real run under the plan the second one used (an imported
#    plan: judged on all 8 steps), compare with what the second run measured, and calibrate the cost model
#    on one, judge on the other
run moetrace plan "$OUT/store" --run refrun --import "$HERE/refrun_eplb_plan.json" --plan-id eplb4
run moetrace replay "$OUT/store" --run refrun --plan eplb4 --split hash
run moetrace sql "$OUT/store" "SELECT run_id, round(avg(imbalance), 4) AS measured_mean_max_over_mean FROM layer_skew WHERE run_id LIKE 'refrun%' GROUP BY 1 ORDER BY 1"
run moetrace calibrate "$OUT/store" --run refrun --judge-run refrun_eplb
# 7. the reports (terminal summary + report.html, report.md, PNGs)
run moetrace report "$OUT/store" --run dsv3 --out-dir "$OUT/report-dsv3" --quiet
run moetrace report "$OUT/store" --run refrun --out-dir "$OUT/report-refrun" --quiet
echo
echo "open $OUT/report-dsv3/report.html and $OUT/report-refrun/report.html"
