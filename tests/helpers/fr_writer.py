"""Writes real PyTorch Flight Recorder dumps: four gloo ranks (torch.distributed on CPU,
forked by torch.multiprocessing), each dumping with the recorder's own writers,
``torch._C._distributed_c10d._dump_fr_trace()`` (the pickle) and ``_dump_fr_trace_json()``
(the JSON), into OUT as ``fr_rank_<r>`` and ``fr_rank_<r>.json``.

What the ranks run (the hand count the tests compare with):

* default group (gloo names it "0", desc "default_pg"): all_reduce x12, barrier, all_gather
  (collective seq ids 1-14 on every rank; twelve all_reduces make the JSON dump longer than
  4 KiB before its sorted keys reach pg_config and version);
* a sub-group of ranks 0 and 1 (named "1", desc "pair"): one all_reduce (its seq 1), then a
  send 0 -> 1 on the default group (gloo records no Flight Recorder entry for a send or recv,
  but counts it in its sequence number, which is what pg_status carries);
* ranks 0, 1 and 3 then start a 15th default-group collective, all_reduce, asynchronously;
  rank 2 never calls it. Every rank dumps while that all_reduce is pending, so the dumps
  show a hang in default-group collective #15 that rank 2 never reached.

Run: ``python -m tests.helpers.fr_writer OUT [--timing]``; ``--timing`` sets TORCH_NCCL_ENABLE_TIMING=1
(gloo records no duration either way: the dumps must read the same). The ranks meet through a
FileStore in OUT, so nothing listens on a port. Each rank waits until all four have dumped
before it exits, so no rank's exit can fail the pending all_reduce before it is dumped.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

WORLD = 4
SKIPPER = 2
N_ALL_REDUCE = 12


def _rank(rank: int, out: str, timing: bool) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"   # the recorder is off (0 entries) unless set
    if timing:
        os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    import torch
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(out, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    pair = dist.new_group([0, 1], group_desc="pair")
    x = torch.ones(4)
    for _ in range(N_ALL_REDUCE):
        dist.all_reduce(x)
    if rank in (0, 1):
        dist.all_reduce(x, group=pair)
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
    dist.barrier()
    dist.all_gather([torch.zeros(2) for _ in range(WORLD)], torch.ones(2))
    if rank != SKIPPER:
        dist.all_reduce(x, async_op=True)   # left pending: rank 2 never joins
    # a real hang dump is written when the watchdog's timeout fires, long after the ops
    # before the stuck one ended; gloo records an op's end (retired, pg_status) from its
    # worker threads some time after the caller's wait returned: wait for those records
    c10d = torch._C._distributed_c10d
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ents = json.loads(c10d._dump_fr_trace_json())["entries"]
        if all(e["retired"] for e in ents if e["collective_seq_id"] <= N_ALL_REDUCE + 2 or e["pg_id"] != 0):
            break
        time.sleep(0.05)
    with open(os.path.join(out, f"fr_rank_{rank}"), "wb") as f:
        f.write(c10d._dump_fr_trace())
    j = c10d._dump_fr_trace_json()
    with open(os.path.join(out, f"fr_rank_{rank}.json"), "wb") as f:
        f.write(j if isinstance(j, bytes) else j.encode())
    store.set(f"dumped_{rank}", "1")
    store.wait([f"dumped_{r}" for r in range(WORLD)], datetime.timedelta(seconds=60))
    os._exit(0)   # the pending all_reduce would otherwise hold the process until its timeout


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    out = os.path.abspath(argv[0])
    os.makedirs(out, exist_ok=True)
    mp.start_processes(_rank, args=(out, "--timing" in argv), nprocs=WORLD, start_method="fork", join=True)
    os.remove(os.path.join(out, "store"))


if __name__ == "__main__":
    main(sys.argv[1:])
