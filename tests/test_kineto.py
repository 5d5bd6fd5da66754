"""Kineto (PyTorch profiler) collector: timestamps to exact ns, steps/layers/collectives
from CPU ranges, ranks of a folder, bad input, and the real traces in ../shared/data."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from moetrace.collect import collect
from moetrace.collect._chrome_json import rank_from_name
from moetrace.collect._chrome_ts import ts_to_ns
from moetrace.run import Store

from .helpers import shared_data, tree_hash
from .helpers.kineto_trace import (
    GEMM,
    SENDRECV,
    annotated_events,
    ev_x,
    kernel,
    launch,
    write_trace,
)

BASE = 1767189312000000000


def spans_of(run) -> list[dict]:
    t = run.tables["spans"]
    names = dict(zip(run.tables["kernel_names"].column("name_id").to_pylist(),
                     run.tables["kernel_names"].column("name").to_pylist()))
    rows = t.to_pylist()
    for r in rows:
        r["name"] = names[r["name_id"]]
    return sorted(rows, key=lambda r: (r["rank"], r["start_ns"]))


# ---------------------------------------------------------------- timestamps
def test_fractional_relative_ts_is_exact_where_float64_is_not():
    text = b"9714995100553.779"
    exact = 9714995100553779
    assert round(float(text) * 1000) != exact  # the test value defeats float64 µs * 1000
    assert ts_to_ns([text], BASE, Path("x"), 0) == [BASE + exact]


@pytest.mark.parametrize("text,ns", [
    (b"1740461679471346", 1740461679471346000),   # integer absolute µs
    (b"12.5", 12500), (b"12.0004", 12000), (b"12.0005", 12001), (b"-3.25", -3250),
    (b"1.5e3", 1500000), (b"7", 7000),
])
def test_ts_text_to_ns(text, ns):
    assert ts_to_ns([text], 0, Path("x"), 0) == [ns]


def test_relative_convention_end_to_end(tmp_path):
    f = write_trace(tmp_path / "t.json", [kernel(GEMM, "9714995100553.779", "1.5", 1)], base=BASE)
    (run,) = collect([f])
    (s,) = spans_of(run)
    assert s["start_ns"] == BASE + 9714995100553779
    assert s["end_ns"] == BASE + 9714995100553779 + 1500
    assert run.run["time_base"] == "epoch"


def test_integer_absolute_convention(tmp_path):
    f = write_trace(tmp_path / "t.json.gz", [kernel(GEMM, 1740461679471346, 52, 1)], gz=True)
    (run,) = collect([f])
    (s,) = spans_of(run)
    assert (s["start_ns"], s["end_ns"]) == (1740461679471346000, 1740461679471398000)
    assert run.run["time_base"] == "epoch"


# ---------------------------------------------------------------- labels from CPU ranges
def test_steps_layers_collectives_from_annotations(tmp_path):
    f = write_trace(tmp_path / "t.json", annotated_events(), rank=3, world=8)
    (run,) = collect([f])
    s = spans_of(run)
    got = [(r["kind"], r["step"], r["layer"], r["collective"], r["inferred"], r["stream"]) for r in s]
    assert got == [
        ("dispatch", 3, 5, "all_to_all", False, 20),
        ("expert_gemm", 3, 5, None, False, 7),
        ("combine", 3, 5, "all_to_all", False, 20),
        ("comm_other", 3, None, "all_reduce", False, 20),
        ("dispatch", 4, 0, "all_to_all", True, 20),     # no annotation: order gives dispatch, combine
        ("combine", 4, 0, "all_to_all", True, 20),
    ]
    assert {r["rank"] for r in s} == {3}
    steps = sorted(run.tables["steps"].to_pylist(), key=lambda r: r["step"])
    # a step on a GPU trace is its GPU activity: first to last kernel launched in ProfilerStep#N
    # (step 3: kernels at 1100..1150, 1160..1260, 1300..1340, 1500..1570 us; step 4: 2100..2150, 2200..2260 us)
    assert [(r["step"], r["rank"], r["start_ns"]) for r in steps] == [(3, 3, 1_100_000), (4, 3, 2_100_000)]
    assert steps[0]["end_ns"] == 1_570_000 and steps[1]["end_ns"] == 2_260_000
    host = sorted(run.tables["host_steps"].to_pylist(), key=lambda r: r["step"])   # the CPU ranges, kept apart
    assert [(r["step"], r["start_ns"], r["end_ns"]) for r in host] == [(3, 1_000_000, 2_000_000),
                                                                        (4, 2_000_000, 3_000_000)]
    approx = json.loads(run.run["approximations"])
    assert any("inferred from the order" in a for a in approx)


def test_dualpipe_suffix_gives_micro_batch(tmp_path):
    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 10000),
          ev_x("user_annotation", "dispatch(F)", 10, 50), launch(20, 1),
          ev_x("user_annotation", "combine(B)", 100, 50), launch(110, 2),
          kernel("void deep_ep::internode::dispatch<false, 8>(int4*)", 200, 100, 1, stream=27),
          kernel("void deep_ep::internode::dispatch<true, 8>(int4*)", 400, 100, 2, stream=27)]
    (run,) = collect([write_trace(tmp_path / "t.json", ev, rank=0, world=1)])
    s = spans_of(run)
    assert [(r["kind"], r["micro_batch"], r["layer"]) for r in s] == [("dispatch", 0, 0), ("dispatch", 1, 0)]


def test_rank_from_file_names():
    assert rank_from_name("job-rank-3.json.gz") == 3
    assert rank_from_name("rank12_trace.json.gz") == 12
    assert rank_from_name("x-TP-1-DP-0-PP-0-EP-5.trace.json.gz") == 5
    assert rank_from_name("worker-TP-2.trace.json.gz") == 2
    assert rank_from_name("host_123.1700000000.pt.trace.json") is None


def test_folder_of_ranks_is_one_run(tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    for r in (0, 1):
        write_trace(d / f"job-rank-{r}.json", [kernel(GEMM, 1000 + r, 10, 1)])
    (run,) = collect([d])
    assert run.run["num_ranks"] == 2
    assert sorted({r["rank"] for r in spans_of(run)}) == [0, 1]
    assert any("file name" in a for a in json.loads(run.run["approximations"]))


def test_unrelated_single_rank_files_are_separate_runs(tmp_path):
    for n in ("a", "b"):
        write_trace(tmp_path / f"{n}.json", [kernel(GEMM, 1000, 10, 1)], rank=0, world=1)
    runs = collect([tmp_path / "a.json", tmp_path / "b.json"])
    assert len(runs) == 2


def test_cpu_only_gloo_trace_makes_host_spans(tmp_path):
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000),
          ev_x("user_annotation", "dispatch layer 2", 10, 100),
          ev_x("cpu_op", "c10d::alltoall_base_", 20, 80),
          ev_x("cpu_op", "record_param_comms", 25, 70),
          ev_x("cpu_op", "gloo:all_to_all", 30, 60),
          ev_x("user_annotation", "experts layer 2", 200, 100),
          ev_x("cpu_op", "aten::mm", 210, 50),
          ev_x("cpu_op", "aten::empty", 215, 5),   # nested: not a top-level op
          ev_x("user_annotation", "combine layer 2", 300, 100),
          ev_x("cpu_op", "gloo:all_to_all", 310, 40)]
    (run,) = collect([write_trace(tmp_path / "rank0_trace.json", ev, rank=0, world=2)])
    s = spans_of(run)
    got = [(r["kind"], r["device"], r["layer"], r["name"], r["start_ns"], r["end_ns"]) for r in s]
    assert got == [("dispatch", -1, 2, "gloo:all_to_all", 30_000, 90_000),
                   # a matmul op under an experts range: the experts' GEMM on a CPU-only trace
                   ("expert_gemm", -1, 2, "aten::mm", 210_000, 260_000),
                   ("combine", -1, 2, "gloo:all_to_all", 310_000, 350_000)]
    assert any("host" in a for a in json.loads(run.run["approximations"]))


# ---------------------------------------------------------------- bad input
def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = write_trace(tmp_path / "good.json", [kernel(GEMM, 1000, 10, 1)]).read_bytes()
    out = {}
    p = tmp_path / "trunc.json.gz"
    p.write_bytes(gzip.compress(good)[:-20])
    out["truncated gzip"] = (p, "gzip")
    p = tmp_path / "trunc.json"
    p.write_bytes(good[: len(good) // 2])
    out["truncated json"] = (p, "JSON")
    p = tmp_path / "notrace.json"
    p.write_text('{"schemaVersion": 1, "deviceProperties": []}')
    out["no traceEvents"] = (p, "traceEvents")
    out["negative dur"] = (write_trace(tmp_path / "neg.json", [kernel(GEMM, 1000, 10, 1), kernel(GEMM, 1000, -5, 2)]),
                           "event 1")
    out["absurd dur"] = (write_trace(tmp_path / "long.json", [kernel(GEMM, 1000, 4e9, 1)]), "event 0")
    p = tmp_path / "badts.json"
    p.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "soon", '
                 '"dur": 1}]}')
    out["bad ts"] = (p, "event 0")
    return out


def test_bad_input_exit_2_store_unchanged(tmp_path, runner, cli):
    st = tmp_path / "st"
    ok = write_trace(tmp_path / "ok.json", [kernel(GEMM, 1000, 10, 1)])
    assert runner.invoke(cli, ["ingest", str(ok), "--store", str(st)]).exit_code == 0
    before = tree_hash(st)
    for what, (path, needle) in _bad_files(tmp_path).items():
        res = runner.invoke(cli, ["ingest", str(path), "--store", str(st), "--format", "kineto"])
        assert res.exit_code == 2, (what, res.output)
        assert path.name in res.output and needle in res.output, (what, res.output)
        assert tree_hash(st) == before, what


# ---------------------------------------------------------------- real traces
def _raw_events(path: Path) -> dict:
    return json.loads(gzip.open(path).read())


def _expected_collectives(doc: dict) -> dict[int, str]:
    """Independent: correlation -> innermost 'nccl:' CPU op around the kernel's launch."""
    ev = doc["traceEvents"]
    ops = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
           and e["name"].startswith("nccl:")]
    out = {}
    for r in ev:
        if r.get("cat") != "cuda_runtime" or "correlation" not in r.get("args", {}):
            continue
        inner = [o for o in ops if o["tid"] == r["tid"] and o["ts"] <= r["ts"] <= o["ts"] + o["dur"]]
        if inner:
            out[r["args"]["correlation"]] = max(inner, key=lambda o: o["ts"])["name"]
    return out


def test_nccl_two_ranks_tell_all_to_all_from_all_reduce_and_all_gather():
    d = shared_data("nccl_a2a_2rank")
    (run,) = collect([d])
    spans = spans_of(run)
    assert sorted({s["rank"] for s in spans}) == [0, 1]
    for rank in (0, 1):
        doc = _raw_events(d / f"rank-{rank}.json.gz")
        assert doc["distributedInfo"]["rank"] == rank
        coll = _expected_collectives(doc)
        want = {}
        for e in doc["traceEvents"]:
            if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_SendRecv"):
                op = coll.get(e["args"]["correlation"], "")
                key = "a2a" if op in ("nccl:all_to_all", "nccl:all_to_allv") else "other"
                n, t = want.get(key, (0, 0))
                want[key] = (n + 1, t + round(e["dur"] * 1000))
        got = {}
        for s in spans:
            if s["rank"] == rank and s["name"].startswith("ncclKernel_SendRecv"):
                key = "a2a" if s["kind"] in ("dispatch", "combine") else "other"
                assert key == "a2a" or s["kind"] == "comm_other"
                n, t = got.get(key, (0, 0))
                got[key] = (n + 1, t + s["end_ns"] - s["start_ns"])
        assert got == want
        assert want["a2a"][0] == 4 and want["other"][0] == 6


@pytest.mark.parametrize("fname", ["vllm_moe_piecewise_prefill_decode.json.gz", "sglang_dense_decode.json.gz"])
def test_traces_without_all_to_all(fname, tmp_path, runner, cli):
    p = shared_data(fname)
    doc = _raw_events(p)
    n_dev = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                        "gpu_memset"))
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(p), "--store", str(st)])
    assert res.exit_code == 0, res.output
    store = Store(st)
    assert store.sql("SELECT count(*) AS n FROM spans")["n"][0] == n_dev
    assert store.sql("SELECT has_a2a FROM a2a_presence")["has_a2a"][0] is False
    assert store.sql("SELECT count(*) AS n FROM a2a_exposure")["n"][0] == 0
    res = runner.invoke(cli, ["exposure", str(st)])
    assert res.exit_code == 0 and "no all-to-all found" in res.output
    assert "nan" not in res.output.lower()


def test_deepseek_trace_spans_and_step():
    p = shared_data("deepseek_ep64_train_rank0.json.gz")
    doc = _raw_events(p)
    dev = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                   "gpu_memset")]
    (run,) = collect([p])
    spans = spans_of(run)
    assert len(spans) == len(dev)
    assert sum(s["end_ns"] - s["start_ns"] for s in spans) == sum(e["dur"] for e in dev) * 1000
    kinds = {}
    for s in spans:
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
    want_disp = sum(1 for e in dev if "dpsk::ep::internode::dispatch" in e["name"])
    want_comb = sum(1 for e in dev if "dpsk::ep::internode::combine" in e["name"])
    assert (kinds["dispatch"], kinds["combine"]) == (want_disp, want_comb) == (8, 8)
    assert [r["step"] for r in run.tables["steps"].to_pylist()] == [1]
    assert run.run["time_base"] == "epoch"


def test_kernel_rules_file_and_kernels_command(tmp_path, runner, cli):
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000), launch(1, 1), launch(2, 2), launch(3, 3),
          kernel("void my_ep::send_tokens<4>(int)", 10, 40, 1, stream=20),
          kernel("void my_ep::recv_tokens<4>(int)", 100, 25, 2, stream=20),
          kernel(GEMM, 20, 60, 3, stream=7)]
    f = write_trace(tmp_path / "t.json", ev, rank=0, world=1)
    rules = tmp_path / "rules.csv"
    rules.write_text("kind,pattern\ndispatch,^my_ep::send_tokens\ncombine,^my_ep::recv_tokens\n")
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(f), "--store", str(st), "--kernel-rules", str(rules)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["kernels", str(st), "--format", "json"])
    rows = {r["kind"]: r for r in json.loads(res.output)}
    assert rows["dispatch"]["name"].startswith("my_ep::send_tokens")
    assert rows["dispatch"]["total_ms"] == pytest.approx(0.04)
    assert rows["combine"]["total_ms"] == pytest.approx(0.025)
    assert rows["expert_gemm"]["total_ms"] == pytest.approx(0.06)
    assert rows["expert_gemm"]["share_of_all"] == pytest.approx(60 / 125)
    # without the rules the same kernels are unknown compute: the command shows them as such
    res = runner.invoke(cli, ["ingest", str(f), "--store", str(tmp_path / "st2")])
    res = runner.invoke(cli, ["kernels", str(tmp_path / "st2"), "--kind", "compute_other", "--format", "json"])
    assert sorted(r["name"][:18] for r in json.loads(res.output)) == ["my_ep::recv_tokens", "my_ep::send_tokens"]


def test_reingest_is_a_no_op(tmp_path, runner, cli):
    d = tmp_path / "job"
    d.mkdir()
    for r in (0, 1):
        write_trace(d / f"rank-{r}.json", [kernel(GEMM, 1000 + r, 10, 1)], rank=r, world=2)
    st = tmp_path / "st"
    assert runner.invoke(cli, ["ingest", str(d), "--store", str(st)]).exit_code == 0
    before = tree_hash(st)
    res = runner.invoke(cli, ["ingest", str(d), "--store", str(st)])
    assert res.exit_code == 0 and "already ingested" in res.output
    assert tree_hash(st) == before
    # one changed byte in one rank makes it a new run
    (d / "rank-1.json").write_text((d / "rank-1.json").read_text().replace("1001", "1002"))
    res = runner.invoke(cli, ["ingest", str(d), "--store", str(st)])
    assert res.exit_code == 0 and "already ingested" not in res.output


def test_collective_name_arg_and_old_category_spellings(tmp_path):
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000),
          ev_x("Runtime", "cudaLaunchKernel", 5, 1, pid=100, tid=1, correlation=1),
          ev_x("Runtime", "cudaLaunchKernel", 6, 1, pid=100, tid=1, correlation=2),
          # newer traces copy the collective into the kernel's args; no CPU op needed
          ev_x("kernel", SENDRECV, 10, 20, pid=0, tid=20, device=0, stream=20, correlation=1,
               **{"Collective name": "all_to_allv"}),
          ev_x("Kernel", SENDRECV, 40, 20, pid=0, tid=20, device=0, stream=20, correlation=2,
               **{"Collective name": "allreduce"})]
    (run,) = collect([write_trace(tmp_path / "t.json", ev, rank=0, world=1)])
    s = spans_of(run)
    assert [(r["kind"], r["collective"], r["step"]) for r in s] == [("dispatch", "all_to_all", 0),
                                                                     ("comm_other", "all_reduce", 0)]


def test_parallel_parse_gives_the_same_tables(tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    for r in range(3):
        write_trace(d / f"rank-{r}.json", annotated_events(), rank=r, world=3)
    (seq,) = collect([d], options={"jobs": 1})
    (par,) = collect([d], options={"jobs": 2})
    for t in ("spans", "kernel_names", "steps"):
        assert seq.tables[t].equals(par.tables[t]), t
    assert seq.run["source_sha256"] == par.run["source_sha256"]


def test_kernels_command_keeps_full_names_in_csv_and_json(tmp_path, runner, cli):
    """The table view shortens long names; csv/json give them whole (users paste them into rules)."""
    long_name = "void my_ep::dispatch_kernel<" + ", ".join(f"(int){i}" for i in range(40)) + ">(int4*)"
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000), launch(1, 1), kernel(long_name, 10, 40, 1, stream=20)]
    st = tmp_path / "st"
    assert runner.invoke(cli, ["ingest", str(write_trace(tmp_path / "t.json", ev, rank=0, world=1)),
                               "--store", str(st)]).exit_code == 0
    stored = Store(st).sql("SELECT name FROM kernel_names")["name"][0]
    assert len(stored) > 150                       # a long name really reached the store
    rows = json.loads(runner.invoke(cli, ["kernels", str(st), "--format", "json"]).output)
    assert [r["name"] for r in rows] == [stored]


# ---------------------------------------------------------------- sliced decoding (fast path)
def _tricky_kernels(n: int, tricky: bool = True) -> tuple[list[str], list[tuple[str, int, int]]]:
    """Kernels whose names and args hold '}, {' inside strings and lists of objects, so
    that cuts between events land in the wrong place; with the (name, start_ns, end_ns)
    each must give, from the numbers written (integer and fractional µs)."""
    evs, want = [], []
    for i in range(n):
        name = f'k{i} }}, {{"ph": "X", "ts": 1}}' if i % 3 == 0 and tricky else f"gemm_{i}"
        ts = f"{1000 + 7 * i}.{i % 1000:03d}" if i % 2 else str(1000 + 7 * i)
        extra = {"shapes": [{"a": [1, 2]}, {"b": {"c": "}, {"}}]} if i % 5 == 0 and tricky else {}
        evs.append(kernel(name, ts, "2.5", i + 1, **extra))
        start = (1000 + 7 * i) * 1000 + (i % 1000 if i % 2 else 0)
        want.append((name, start, start + 2500))
    return evs, want


@pytest.mark.parametrize("slice_bytes,tricky", [(1, True), (97, True), (600, True), (1 << 20, True), (1, False),
                                                (600, False)])
def test_sliced_decoding_is_exact_wherever_the_cuts_fall(tmp_path, monkeypatch, slice_bytes, tricky):
    import moetrace.collect._chrome_json as kin

    evs, want = _tricky_kernels(200, tricky)
    f = write_trace(tmp_path / "t.json", evs, rank=0, world=1)
    monkeypatch.setattr(kin, "SLICE_BYTES", slice_bytes)
    slow = []
    real_slow = kin._decode_in_batches
    monkeypatch.setattr(kin, "_decode_in_batches", lambda *a: slow.append(1) or real_slow(*a))
    (run,) = collect([f])
    got = [(r["name"], r["start_ns"], r["end_ns"]) for r in spans_of(run)]
    assert got == sorted(want, key=lambda w: w[1])
    if slice_bytes >= 1 << 20:
        assert slow, "a document smaller than one slice has no cut: the batch path reads it"
    elif not tricky:
        assert not slow, "every cut lands between two events here: the fast path holds"


def test_sliced_decoding_finds_the_real_trace_events(tmp_path, monkeypatch):
    """A 'traceEvents' key nested in an earlier field (inside deviceProperties) must not be
    taken for the document's: the check on where traceEvents starts sends it to the batch path."""
    import moetrace.collect._chrome_json as kin

    evs, want = _tricky_kernels(60)
    decoy = ",\n".join(kernel(f"decoy_{i}", 5, 1, 900 + i) for i in range(40))
    text = ('{"deviceProperties": [{"x": {"traceEvents": [\n' + decoy + '\n]}}], "traceEvents": [\n'
            + ",\n".join(evs) + "\n]}")
    f = tmp_path / "t.json"
    f.write_text(text)
    monkeypatch.setattr(kin, "SLICE_BYTES", 50)
    slow = []
    real_slow = kin._decode_in_batches
    monkeypatch.setattr(kin, "_decode_in_batches", lambda *a: slow.append(1) or real_slow(*a))
    (run,) = collect([f])
    assert [(r["name"], r["start_ns"], r["end_ns"]) for r in spans_of(run)] == sorted(want, key=lambda w: w[1])
    assert slow


def test_bad_event_named_by_index_on_either_path(tmp_path, monkeypatch):
    import moetrace.collect._chrome_json as kin
    from moetrace.errors import InputError

    evs, _ = _tricky_kernels(30)
    evs[17] = evs[17].replace('"dur": 2.5', '"dur": "long"')
    f = write_trace(tmp_path / "t.json", evs)
    for slice_bytes in (40, 1 << 20):
        monkeypatch.setattr(kin, "SLICE_BYTES", slice_bytes)
        with pytest.raises(InputError) as e:
            collect([f])
        assert "event 17" in str(e.value) and "t.json" in str(e.value), str(e.value)


def test_bad_file_found_by_a_parsing_worker_is_named(tmp_path):
    """With several processes, a bad file parsed by a worker still gives the InputError
    naming that file and event (it comes back across the process boundary)."""
    from moetrace.errors import InputError

    d = tmp_path / "job"
    d.mkdir()
    for r in range(3):
        write_trace(d / f"rank-{r}.json", annotated_events(), rank=r, world=3)
    bad = annotated_events()
    bad[2] = bad[2].replace('"dur": 50', '"dur": -50')
    write_trace(d / "rank-2.json", bad, rank=2, world=3)  # the last file: the worker takes it first
    with pytest.raises(InputError) as e:
        collect([d], options={"jobs": 2})
    assert "rank-2.json" in str(e.value) and "event 2" in str(e.value) and "negative" in str(e.value)


@pytest.mark.parametrize("with_isal", [True, False], ids=["isal-if-installed", "zlib"])
def test_gzip_one_or_several_members_read_whole(tmp_path, monkeypatch, with_isal):
    """A .json.gz made of two gzip members (e.g. appended streams) is read whole, through
    ISA-L (when installed) or zlib alike; spans equal the plain file's written values."""
    import moetrace.collect._chrome_json as kin

    if not with_isal:
        monkeypatch.setattr(kin, "_isal_zlib", None)
    evs, want = _tricky_kernels(80, tricky=False)
    text = write_trace(tmp_path / "plain.json", evs, rank=0, world=1).read_bytes()
    one = tmp_path / "one" / "t.json.gz"
    two = tmp_path / "two" / "t.json.gz"
    one.parent.mkdir()
    two.parent.mkdir()
    one.write_bytes(gzip.compress(text))
    cut = len(text) // 3
    two.write_bytes(gzip.compress(text[:cut]) + gzip.compress(text[cut:]))
    for f in (one, two):
        (run,) = collect([f])
        assert [(r["name"], r["start_ns"], r["end_ns"]) for r in spans_of(run)] == sorted(want, key=lambda w: w[1])


@pytest.mark.parametrize("slice_bytes", [300, 1 << 20])
def test_quoted_and_odd_timestamps_keep_their_event(tmp_path, monkeypatch, slice_bytes):
    """ts texts are kept compactly per batch; a quoted number is still read exactly, and a
    list where a number belongs is refused naming its own event (not a neighbour's)."""
    import moetrace.collect._chrome_json as kin
    from moetrace.errors import InputError

    monkeypatch.setattr(kin, "SLICE_BYTES", slice_bytes)
    evs, want = _tricky_kernels(40, tricky=False)
    evs[9] = evs[9].replace('"ts": 1063.009,', '"ts": "1063.0125",')
    assert '"1063.0125"' in evs[9]
    want[9] = (want[9][0], 1063013, 1063013 + 2500)
    (run,) = collect([write_trace(tmp_path / "q.json", evs)])
    assert [(r["name"], r["start_ns"], r["end_ns"]) for r in spans_of(run)] == sorted(want, key=lambda w: w[1])
    evs[7] = evs[7].replace('"ts": 1049.007,', '"ts": [1049, 7],')
    assert '[1049, 7]' in evs[7]
    with pytest.raises(InputError) as e:
        collect([write_trace(tmp_path / "l.json", evs)])
    assert "event 7" in str(e.value), str(e.value)
