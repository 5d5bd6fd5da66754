"""NCCL Flight Recorder pg_status after point-to-point operations. ProcessGroupNCCL
(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) numbers each work with
``isP2P ? seqP2P_ : seqCollective_`` in ``initWork``, and ``workEnqueue`` stores
``pgStatus_->lastEnqueuedSeq = work->seq_`` (the watchdog likewise lastCompletedSeq) for
every work, a send / recv included; the dump writes those as ``last_*_collective``
(FlightRecorderDetail.hpp ``getPgStatus``, torch 2.13.0 cf30153c). So after a send the
"collective" numbers are point-to-point ids. The entries (collective_seq_id = seqCollective_
and p2p_seq_id = seqP2P_ at record time, is_p2p) tell them apart. Dumps here follow that
source; expected answers worked out by hand."""
from __future__ import annotations

import json
import pickle

from moetrace.run import Store

from .helpers import invoke


def _e(rid, seq, p2p_seq, name, state, retired, is_p2p):
    # the fields and order of FlightRecorder<...>::dump_entries (torch 2.13: FlightRecorderDetail.hpp)
    return {"record_id": rid, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": p2p_seq, "op_id": rid + 1, "profiling_name": name, "time_created_ns": 10**18 + rid,
            "duration_ms": None, "input_sizes": [[8]], "input_dtypes": ["Float"], "output_sizes": [[8]],
            "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": retired, "timeout_ms": 600000, "is_p2p": is_p2p,
            "frames": []}


def _dump(entries, enq, comp):
    return {"version": "2.10", "comm_lib_version": "2.27.5", "nccl_version": "2.27.5",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps([0, 1])}},
            "pg_status": {"0": {"last_enqueued_collective": enq, "last_started_collective": -1,
                                "last_completed_collective": comp}},
            "entries": entries}


def test_p2p_ids_in_pg_status_are_not_read_as_collectives(tmp_path, runner, cli):
    """Both ranks finish all_reduce #1 and then five send/recv; rank 0 enqueues all_reduce
    #2 and waits; rank 1 never calls it. Rank 0's pg_status: enqueued 2 (the all_reduce),
    completed 5 (its fifth send, a P2P id); rank 1's: enqueued 5 and completed 5 (P2P ids)."""
    d = tmp_path / "dumps"
    d.mkdir()
    for rank in (0, 1):
        op = "nccl:send 0->1" if rank == 0 else "nccl:recv 1<-0"
        ents = [_e(0, 1, 0, "nccl:all_reduce", "completed", True, False)]
        ents += [_e(i, 1, i, op, "completed", True, True) for i in range(1, 6)]
        if rank == 0:
            ents.append(_e(6, 2, 5, "nccl:all_reduce", "scheduled", False, False))
        enq = 2 if rank == 0 else 5
        (d / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(_dump(ents, enq, 5), protocol=2))
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", d, "--store", st)
    assert res.exit_code == 0, res.output
    s = Store(st)
    got = s.sql("SELECT rank, last_enqueued_seq, last_completed_seq FROM comm_groups ORDER BY rank").rows()
    # rank 0: the last enqueued work is all_reduce #2 (a collective: kept); the last completed
    # one was a send (P2P id 5: nothing said of collectives). Rank 1: its last enqueued work,
    # recv p2p #5, was enqueued after collective #1; its last completed one was that recv.
    assert got == [(0, 2, None), (1, 1, None)]
    row = s.run().hang().groups.row(0, named=True)
    assert (row["stuck_seq"], row["waiting"], row["never_reached"]) == (2, [0], [1])
