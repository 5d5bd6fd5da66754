"""vLLM completions responses with routed experts, in the shape vLLM's own test parses
them (vllm-project/vllm tests, "Routed-experts capture + replay consistency":
``choices[0]["routed_experts"]`` is base64 of an ``np.save`` array of shape
(prompt_tokens + completion_tokens - 1, num_hidden_layers, top_k), beside
``choices[0]["token_ids"]`` and ``usage``; ``CompletionOutput.routed_experts`` is
``np.ndarray | None  # [seq_len, layer_num, topk]``). Expected counts come from the arrays
built here."""
from __future__ import annotations

import base64
import io
import json
from collections import Counter

import numpy as np
import pytest

from moetrace.run import Store

from .helpers import invoke

L, K, E = 2, 2, 8      # tiny-mixtral, as the vLLM test runs it: 2 layers, top-2 of 8 experts


def _response(i, prompt_tokens, completion_tokens, dtype):
    rng = np.random.default_rng(i)
    n = prompt_tokens + completion_tokens - 1          # the last sampled token is never forwarded
    arr = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)]).astype(dtype)
    buf = io.BytesIO()
    np.save(buf, arr)
    return arr, {"id": f"cmpl-{i}", "object": "text_completion", "model": "TitanML/tiny-mixtral",
                 "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None,
                              "token_ids": list(range(completion_tokens)),
                              "routed_experts": base64.b64encode(buf.getvalue()).decode()}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}}


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_vllm_completions_routed_experts(dtype, tmp_path, runner, cli):
    arrays, lines = [], []
    for i, (p, c) in enumerate([(5, 10), (12, 4), (3, 1)]):
        a, r = _response(i, p, c, dtype)
        arrays.append(a)
        lines.append(json.dumps(r))
    f = tmp_path / "vllm_responses.jsonl"
    f.write_text("\n".join(lines) + "\n")
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", f, "--store", st)
    assert res.exit_code == 0, res.output
    want = Counter()
    for step, a in enumerate(arrays):       # one step per returned sequence
        for t in range(a.shape[0]):
            for lay in range(L):
                for e in a[t, lay]:
                    want[(step, lay, int(e))] += 1
    got = Store(st).sql("SELECT step, layer, expert, count(*) AS n FROM routing GROUP BY ALL").rows()
    assert {(s, lay, e): n for s, lay, e, n in got} == dict(want)
    assert sum(want.values()) == sum((p + c - 1) * L * K for p, c in [(5, 10), (12, 4), (3, 1)])
