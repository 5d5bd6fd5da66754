"""Regenerate the small communication-log samples in sample_traces/ (deterministic, no GPU
or NCCL needed; each file is written in the layout its tool's own source writes, see
docs/engines.md; nothing is copied from a tool's output).

    python sample_traces/make_comm_samples.py

Writes:
- nccl_inspector/node0-pid{1000..1003}.log: NCCL Inspector JSON lines of 4 processes on one
  host, verbose (NCCL_INSPECTOR_DUMP_VERBOSE=1): a 4-rank communicator "EP" with 6 All2All
  (coll_sn 0..5) and 3 AllReduce (coll_sn 0..2), and two 2-rank communicators (ranks 0-1,
  2-3) with 2 AllGather each; rank 2 arrives 150 µs late at every All2All; rank 3's record
  of AllReduce #2 is missing (an incomplete instance); one Send/Recv pair between ranks 0
  and 1 (p2p_perf). Two kernel channels per record.
- flight_recorder/nccl_trace_rank_{0..3}: PyTorch Flight Recorder dumps (pickle protocol 2
  of plain dicts and lists, as c10d's FlightRecorder writes them) of a hang: in the
  default group (ranks 0-3) ranks 0, 1 and 3 entered all_reduce #8 and wait in it; rank 2
  completed #7 and never reached #8. Group tp_0 (ranks 0, 1) holds a size mismatch at
  all_gather #2 ([[1024]] against [[2048]]); group tp_1 (ranks 2, 3) an op mismatch at #2
  (all_reduce against broadcast); a send/recv pair in tp_0.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

HERE = Path(__file__).resolve().parent
T0_US = 1_764_633_600_000_000          # 2025-12-02 00:00:00 UTC, in µs


# ----------------------------------------------------------------------------- NCCL Inspector
def _bw(op: str, nbytes: int, nranks: int, exec_us: int) -> tuple[float, float]:
    """algorithm and bus bandwidth (GB/s) as the Inspector computes them (inspectorComputeOpBw)."""
    t = exec_us / 1e6
    traffic, factor = {
        "AllReduce": (nbytes, 2 * (nranks - 1) / nranks),
        "AllGather": (nbytes * nranks, (nranks - 1) / nranks),
        "ReduceScatter": (nbytes * nranks, (nranks - 1) / nranks),
        "Send": (nbytes, 1.0), "Recv": (nbytes, 1.0),
    }.get(op, (0, 0.0))            # All2All: the Inspector's default case (0, 0)
    algo = traffic / 1e9 / t if t else 0.0
    return round(algo, 6), round(algo * factor, 6)


def _record(comm: tuple, rank: int, pid: int, perf_key: str, perf: dict) -> dict:
    cid, name, n = comm
    return {"header": {"id": cid, "comm_name": name, "rank": rank, "n_ranks": n, "nnodes": 1},
            "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "sample", "rec_mechanism":
                         "nccl_profiler_interface", "dump_timestamp_us": T0_US + 900_000, "hostname": "node0",
                         "pid": pid},
            perf_key: perf}


def _coll(op: str, sn: int, nbytes: int, nranks: int, arrival: int, last: int, transfer: int) -> dict:
    chans = [{"start": arrival + 3 * c, "stop": last + transfer + 2 * c} for c in range(2)]
    exec_us = max(ch["stop"] - ch["start"] for ch in chans)
    algo, bus = _bw(op, nbytes, nranks, exec_us)
    return {"coll": op, "coll_sn": sn, "coll_msg_size_bytes": nbytes, "coll_exec_time_us": exec_us,
            "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": algo, "coll_busbw_gbs": bus,
            "event_trace_sn": {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": [
                {"channel_id": c, "kernel_start_sn": 3 + c, "kernel_stop_sn": 6 + c, "kernel_record_sn": 5 + c}
                for c in range(2)]},
            "event_trace_ts": {"coll_start_ts": arrival - 20, "coll_stop_ts": arrival - 15, "kernel_events": [
                {"channel_id": c, "kernel_start_ts": ch["start"], "kernel_stop_ts": ch["stop"],
                 "kernel_record_ts": ch["stop"]} for c, ch in enumerate(chans)]}}


def nccl_inspector() -> None:
    out = HERE / "nccl_inspector"
    out.mkdir(exist_ok=True)
    for f in out.glob("*"):
        f.unlink()
    ep = ("0x5a17c0ffee01", "EP", 4)
    tp = {0: ("0x7e1100000a01", "TP 0", 2), 1: ("0x7e1100000a01", "TP 0", 2),
          2: ("0x7e1100000b02", "TP 1", 2), 3: ("0x7e1100000b02", "TP 1", 2)}
    lines: dict[int, list[tuple[int, dict]]] = {r: [] for r in range(4)}
    t = T0_US
    for i in range(6):                                     # All2All #0..5: rank 2 150 µs late
        arr = {r: t + 10 * r + (150 if r == 2 else 0) for r in range(4)}
        last = max(arr.values())
        for r in range(4):
            perf = _coll("All2All", i, 1 << 20, 4, arr[r], last, 80)
            lines[r].append((last + 80, _record(ep, r, 1000 + r, "coll_perf", perf)))
        t += 1000
        if i % 2 == 1:                                     # AllReduce #0..2 after every second All2All
            j = i // 2
            arr = {r: t + (40 if r == 0 else 5 * r) for r in range(4)}
            last = max(arr.values())
            for r in range(4):
                if (r, j) == (3, 2):
                    continue                                # rank 3's record of AllReduce #2 is missing
                perf = _coll("AllReduce", j, 4 << 20, 4, arr[r], last, 120)
                lines[r].append((last + 120, _record(ep, r, 1000 + r, "coll_perf", perf)))
            t += 1000
    for k in range(2):                                     # AllGather #0, #1 in each TP communicator
        for pair in ((0, 1), (2, 3)):
            arr = {r: t + 7 * (r % 2) + 11 * k for r in pair}
            last = max(arr.values())
            for r in pair:
                perf = _coll("AllGather", k, 512 << 10, 2, arr[r], last, 30)
                lines[r].append((last + 30, _record(tp[r], r % 2, 1000 + r, "coll_perf", perf)))
        t += 500
    for r, (op, peer) in ((0, ("Send", 1)), (1, ("Recv", 0))):   # one P2P pair in the EP communicator
        start, stop = t + 2, t + 52
        algo, bus = _bw(op, 256 << 10, 4, stop - start)
        perf = {"p2p": op, "p2p_sn": 1, "p2p_peer": peer, "p2p_msg_size_bytes": 256 << 10,
                "p2p_exec_time_us": stop - start, "p2p_timing_source": "kernel_gpu", "p2p_algobw_gbs": algo,
                "p2p_busbw_gbs": bus,
                "event_trace_ts": {"p2p_start_ts": t, "p2p_stop_ts": t + 1, "kernel_events": [
                    {"channel_id": 0, "kernel_start_ts": start, "kernel_stop_ts": stop, "kernel_record_ts": stop}]}}
        lines[r].append((stop, _record(ep, r, 1000 + r, "p2p_perf", perf)))
    for r in range(4):
        recs = [rec for _, rec in sorted(lines[r], key=lambda x: x[0])]
        (out / f"node0-pid{1000 + r}.log").write_text("".join(json.dumps(x) + "\n" for x in recs))


# ----------------------------------------------------------------------------- Flight Recorder
GROUPS = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("tp_0", [0, 1]), "2": ("tp_1", [2, 3])}
HANG_SEQ = 8          # default_pg all_reduce #8: ranks 0, 1, 3 wait in it, rank 2 never reached it
HUNG_RANK = 2


def _entry(rid: int, pg: str, pg_id: int, seq: int, p2p_seq: int, name: str, sizes, state: str, t_ns: int,
           dtype: str = "Float", is_p2p: bool = False) -> dict:
    started = t_ns + 20_000 if state in ("started", "completed") else None
    done = t_ns + 300_000 if state == "completed" else None
    e = {"record_id": rid, "pg_id": pg_id, "process_group": (pg, GROUPS[pg][0]), "thread_name": "pt_main_thread",
         "thread_id": "140001", "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": rid + 1,
         "profiling_name": name, "time_created_ns": t_ns, "input_sizes": sizes, "input_dtypes": [dtype] * len(sizes),
         "output_sizes": sizes, "output_dtypes": [dtype] * len(sizes), "state": state,
         "time_discovered_started_ns": started, "time_discovered_completed_ns": done,
         "retired": state == "completed", "timeout_ms": 600_000, "is_p2p": is_p2p}
    if state == "completed":
        e["duration_ms"] = 0.25
    return e


def flight_recorder_dumps() -> dict[int, dict]:
    """The four ranks' dump dictionaries (what each file pickles)."""
    t0 = T0_US * 1000
    dumps = {}
    for r in range(4):
        entries, rid = [], 0
        status = {}
        tp = "1" if r < 2 else "2"
        tp_id = 1
        tp_seq = 0
        last = HANG_SEQ - 1 if r == HUNG_RANK else HANG_SEQ
        for s in range(1, last + 1):
            t = t0 + s * 1_000_000 + 1000 * r
            state = "completed" if s < HANG_SEQ else ("started" if r in (0, 1) else "scheduled")
            entries.append(_entry(rid, "0", 0, s, 0, "nccl:all_reduce", [[4, 1024]], state, t))
            rid += 1
            if s in (2, 3) and s < HANG_SEQ:            # a tp collective after all_reduce #2 and #3
                tp_seq += 1
                name, sizes = "nccl:all_gather", [[1024]]
                if tp == "1" and tp_seq == 2 and r == 1:
                    sizes = [[2048]]                     # size mismatch in tp_0 all_gather #2
                if tp == "2" and tp_seq == 2:
                    name = "nccl:all_reduce" if r == 2 else "nccl:broadcast"   # op mismatch in tp_1 #2
                entries.append(_entry(rid, tp, tp_id, tp_seq, 0, name, sizes, "completed", t + 400_000))
                rid += 1
            if s == 4 and tp == "1":                     # a send / recv pair in tp_0 (group ranks 0 -> 1)
                name = "nccl:send 0->1" if r == 0 else "nccl:recv 1<-0"
                entries.append(_entry(rid, tp, tp_id, tp_seq, 1, name, [[256]], "completed", t + 500_000,
                                      is_p2p=True))
                rid += 1
        started = max(e["collective_seq_id"] for e in entries if e["process_group"][0] == "0"
                      and e["state"] in ("started", "completed"))
        status["0"] = {"last_enqueued_collective": last, "last_started_collective": started,
                       "last_completed_collective": min(last, HANG_SEQ - 1)}
        status[str(tp_id)] = {"last_enqueued_collective": tp_seq, "last_started_collective": tp_seq,
                              "last_completed_collective": tp_seq}
        entries[0]["frames"] = [{"name": "all_reduce", "filename": "torch/distributed/distributed_c10d.py",
                                 "line": 2696}, {"name": "train_step", "filename": "train.py", "line": 41}]
        cfg = {g: {"name": g, "desc": d, "ranks": json.dumps(m)} for g, (d, m) in GROUPS.items() if r in m}
        dumps[r] = {"version": "2.4", "comm_lib_version": "2.21.5", "pg_config": cfg, "pg_status": status,
                    "entries": entries}
    return dumps


def flight_recorder() -> None:
    out = HERE / "flight_recorder"
    out.mkdir(exist_ok=True)
    for f in out.glob("*"):
        f.unlink()
    for r, d in flight_recorder_dumps().items():
        (out / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(d, protocol=2))


def main() -> None:
    nccl_inspector()
    flight_recorder()
    for d in ("nccl_inspector", "flight_recorder"):
        files = sorted((HERE / d).iterdir())
        print(f"{d}/: {len(files)} files, {sum(f.stat().st_size for f in files)} bytes")


if __name__ == "__main__":
    main()
