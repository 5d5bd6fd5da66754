"""Regenerate the synthetic sample traces shipped in sample_traces/ (deterministic).

    python sample_traces/make_samples.py

Writes, in the generic collector's canonical columns (ingest with `moetrace ingest`):
- dsv3_synth_expert_load.parquet: a DeepSeek-V3-shaped run (4 MoE layers x 256 experts,
  top-8, 4096 tokens per step, 200 steps, log-normal skew sigma 0.6, popularity drifting
  halfway to another expert order), to be read as 32 ranks x 8 per node.
- dsv3_synth_routing.parquet: per-token routing of a smaller run (2 layers, 24 steps,
  1024 tokens per step) for exact dispatch-byte replay.

The real CPU expert-parallel runs (refrun/, refrun_eplb/, refrun_eplb_plan.json) come from
`moetrace refrun` (timings differ on every run; the routing is the same under any placement).
Hidden 512 and 128 tokens per rank, the fidelity matrix's size: at hidden 64 the expert
block's per-call overhead dwarfs its GEMMs. Five timed passes give the CPU basis that
`moetrace calibrate` judges on:

    moetrace refrun sample_traces/refrun --ranks 4 --experts 16 --layers 2 --steps 8 --hidden 512 \
        --ffn 1024 --tokens-per-rank 128 --prefill-tokens 256 --skew 1.0 --idle 3:2 --idle 5:3 --seed 0 \
        --repeats 5
    moetrace ingest sample_traces/refrun --store st --run-id refrun
    moetrace plan st --run refrun --policy eplb --replicas 4 --plan-id eplb4 --export sample_traces/refrun_eplb_plan.json
    moetrace refrun sample_traces/refrun_eplb <same options> --placement sample_traces/refrun_eplb_plan.json
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from moetrace.produce.synth import SynthConfig, synth
from moetrace.run import Store

HERE = Path(__file__).resolve().parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        st = Store(Path(tmp) / "st", create=True)
        synth(st, SynthConfig(layers=4, steps=200, tokens_per_step=4096, sigma=0.6, drift=0.5, seed=42), run_id="load")
        synth(st, SynthConfig(layers=2, steps=24, tokens_per_step=1024, sigma=0.6, per_token=True, seed=43),
              run_id="tok")
        st.sql("SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = 'load' ORDER BY ALL") \
            .write_parquet(HERE / "dsv3_synth_expert_load.parquet", compression="zstd")
        st.sql("SELECT step, layer, token, src_rank, choice, expert, gate FROM routing WHERE run_id = 'tok' "
               "ORDER BY step, layer, token, choice") \
            .write_parquet(HERE / "dsv3_synth_routing.parquet", compression="zstd")
    for f in sorted(HERE.glob("*.parquet")):
        print(f"{f.name}: {f.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
