"""Megatron per-rank files of different pipeline stages. Both writers take ``layer`` from
the module name ``decoder.layers.<n>`` (NVIDIA/Megatron-LM
megatron/core/transformer/moe/router_trace.py ``_parse_router_module_name`` at 059f0f5c;
megatron/training/activation_logging.py ``_parse_tpe_module_name`` / ``save_tpe`` at
191d70cf), and a stage's TransformerBlock numbers its own layers from 0, so stage 1's
layer 0 is the model's layer ``offset`` (``get_transformer_layer_offset``). Records here
carry the fields, types and order those functions write (``router_trace_rank{rank}.jsonl``
records from ``_make_index_record``; ``tokens_per_expert/rank{rank}.jsonl`` lines of
``save_tpe``). Expected global layers worked out by hand."""
from __future__ import annotations

import json
from collections import Counter

from moetrace.run import Store

from .helpers import invoke

# 4 ranks, pipeline size 2 (default order tp-cp-ep-dp-pp: ranks 0, 1 stage 0; ranks 2, 3
# stage 1), 6 layers: stage 0 holds layers 0..2, stage 1 layers 3..5
TOP = {0: [[0, 1], [2, 3]], 1: [[1, 2]], 2: [[4, 5], [6, 7], [0, 7]], 3: [[3, 4]]}


def _router_files(d):
    d.mkdir()
    for rank, rows in TOP.items():
        lines = []
        for step in (0, 1):
            for local in range(3):
                lines.append(json.dumps({"step": step, "stage": "pre_dispatch", "block": "decoder", "layer": local,
                                         "rank": rank, "num_tokens": len(rows), "topk": 2, "top_indices": rows}))
        (d / f"router_trace_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return d


def _loads(st):
    return dict(((s, li, e), n) for s, li, e, n in Store(st).sql(
        "SELECT step, layer, expert, tokens FROM expert_load WHERE tokens > 0").rows())


def test_router_trace_stages_map_to_global_layers(tmp_path, runner, cli):
    d = _router_files(tmp_path / "trace")
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", d, "--store", st, "--layers", "6", "--set", "pp_size=2")
    assert res.exit_code == 0, res.output
    want = Counter()
    for rank, rows in TOP.items():
        offset = 0 if rank < 2 else 3
        for step in (0, 1):
            for local in range(3):
                for row in rows:
                    for e in row:
                        want[(step, offset + local, e)] += 1
    assert _loads(st) == dict(want)
    assert Store(st).sql("SELECT max(layer) AS m FROM routing")["m"][0] == 5


def test_uneven_stages_by_pp_layers(tmp_path, runner, cli):
    d = _router_files(tmp_path / "trace")
    st = tmp_path / "st"
    # stage 0 with 4 layers (its files use 0..2 of them), stage 1 with 3: stage 1 starts at 4
    res = invoke(runner, cli, "ingest", d, "--store", st, "--set", "pp_size=2", "--set", "pp_layers=4,3")
    assert res.exit_code == 0, res.output
    got = sorted({li for (_, li, _) in _loads(st)})
    assert got == [0, 1, 2, 4, 5, 6]


def test_collision_refused_in_one_line(tmp_path, runner, cli):
    d = _router_files(tmp_path / "trace")
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", d, "--store", st, "--layers", "6")
    assert res.exit_code == 2
    out = res.output.strip()
    assert len(out.splitlines()) == 1
    assert "router_trace_rank0.jsonl" in out and "pp_size" in out and "6 layers" in out, out
    assert not st.exists()
    # a stage with more local layers than --set pp_layers gives it: named with the rank
    res = invoke(runner, cli, "ingest", d, "--store", st, "--set", "pp_size=2", "--set", "pp_layers=2,4")
    assert res.exit_code == 2 and "router_trace_rank0.jsonl" in res.output and "pp_layers" in res.output, res.output
    res = invoke(runner, cli, "ingest", d, "--store", st, "--set", "pp_size=2")
    assert res.exit_code == 2 and "--layers" in res.output, res.output


def test_tokens_per_expert_stages(tmp_path, runner, cli):
    d = tmp_path / "tokens_per_expert"
    d.mkdir()
    # 2 ranks, pp 2, ep 1: rank 0 = stage 0 (layers 0, 1), rank 1 = stage 1 (layers 2, 3); 2 local experts
    for rank in (0, 1):
        lines = [json.dumps({"iter": 100, "block": "decoder", "layer": local, "tpe": [[rank + 1, local], [2, 2]]})
                 for local in (0, 1)]
        (d / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", d, "--store", st, "--layers", "4", "--set", "pp_size=2",
                 "--set", "ep_size=1")
    assert res.exit_code == 0, res.output
    # rank r's layer n is the model's layer 2r + n; tokens summed over the 2 micro-batches
    want = {(100, 2 * r + n, e): v for r in (0, 1) for n in (0, 1)
            for e, v in ((0, r + 1 + 2), (1, n + 2)) if v}
    assert _loads(st) == want
