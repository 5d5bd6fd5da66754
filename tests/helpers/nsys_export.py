"""A crafted Nsight Systems SQLite export (the tables the nsys collector reads)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

EPOCH = 1_700_000_000_000_000_000


def make_export(path: Path, *, processes=(1001, 1002)) -> Path:
    """A minimal export in the real schema: two processes, one GPU each, NVTX labels."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, contextId INT, streamId INT,
            correlationId INT, globalPid INT, demangledName INT, shortName INT, mangledName INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, eventClass INT, globalTid INT,
            correlationId INT, nameId INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INT, end INT, deviceId INT, contextId INT, streamId INT,
            correlationId INT, globalPid INT, value INT, bytes INT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, eventType INT, rangeId INT, category INT, color INT,
            text TEXT, globalTid INT, endGlobalTid INT, textId INT, domainId INT);
        CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INT, utcTime TEXT, localTime TEXT);
    """)
    names = {1: "void deep_ep::internode_ll::dispatch<(bool)1, (int)3, (int)7168>(void *, float *)",
             2: "void deep_ep::internode_ll::combine<(bool)0, (int)3, (int)7168>(void *)",
             3: "void cutlass::device_kernel<grouped_gemm::Kernel>(Params)",
             4: "ProfilerStep#2", 5: "dispatch layer 1", 6: "combine layer 1", 7: "cudaLaunchKernel"}
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", names.items())
    db.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '', '')", (EPOCH,))
    for i, pid in enumerate(processes):
        gpid = (0x1 << 56) | (pid << 24)
        gtid = gpid | pid
        off = i * 7  # the second process is a little late
        c = 100 * (i + 1)
        # NVTX: step 0..1000, dispatch 10..60 (launch at 20), combine 300..360 (launch at 310)
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, NULL, NULL, NULL, ?, NULL, 4, 0)",
                   (0 + off, 1000 + off, gtid))
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, NULL, NULL, 'dispatch layer 1', ?, NULL, NULL, 0)",
                   (10 + off, 60 + off, gtid))
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, NULL, NULL, NULL, ?, NULL, 6, 0)",
                   (300 + off, 360 + off, gtid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 7)", (20 + off, 25 + off, gtid, c))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 7)",
                   (100 + off, 105 + off, gtid, c + 1))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 7)",
                   (310 + off, 315 + off, gtid, c + 2))
        # hook mode: LL kernels on the compute stream 7
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, 7, ?, ?, 1, 1, 1)",
                   (100 + off, 150 + off, i, c, gpid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, 7, ?, ?, 3, 3, 3)",
                   (160 + off, 400 + off, i, c + 1, gpid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, 7, ?, ?, 2, 2, 2)",
                   (410 + off, 470 + off, i, c + 2, gpid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (?, ?, ?, 1, 7, ?, ?, 0, 64)",
                   (480 + off, 481 + off, i, 9999, gpid))
    db.commit()
    db.close()
    return path
