"""Per-GPU peak figures the GPU cost model scales (datasheet numbers, dense tensor math).

Every figure is a peak the vendor states; the model multiplies each by an achieved
efficiency fitted on published kernel measurements (:mod:`.fit`, ``data/fitted.json``).
Only the H800 has published measurements in ``data/published.csv``; the other GPUs reuse
the H800's fitted efficiencies as fractions of their own peaks (an extrapolation, stated in
every answer's ``band_source``).

Units: tensor FLOP/s, bytes/s. NVLink is per direction per GPU; RDMA is the GPU's NIC.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    #: dense tensor-core FLOP/s by operand dtype (absent: the GPU has no such tensor math)
    tensor_flops: dict
    hbm_Bps: float
    nvlink_Bps: float     # one direction, one GPU
    rdma_Bps: float       # one NIC per GPU
    source: str


def _t(x):
    return x * 1e12


GPUS: dict[str, GPU] = {
    "H800": GPU("H800", 132, {"fp8": _t(1979.0), "bf16": _t(989.5)}, 3.35e12, 200e9, 50e9,
                "H800 SXM5: H100 SXM compute and HBM3 (FP8 1,979 / BF16 989.5 dense TFLOPS, 3.35 TB/s, 132 SMs); "
                "NVLink cut to 400 GB/s bidirectional; CX7 400 Gb/s InfiniBand (DeepEP README: ~160 GB/s NVLink and "
                "~50 GB/s RDMA achievable)"),
    "H100": GPU("H100", 132, {"fp8": _t(1979.0), "bf16": _t(989.5)}, 3.35e12, 450e9, 50e9,
                "NVIDIA H100 SXM datasheet (FP8 1,979 / BF16 989.5 dense TFLOPS, HBM3 3.35 TB/s, NVLink 900 GB/s "
                "bidirectional, 132 SMs); CX7 400 Gb/s"),
    "H200": GPU("H200", 132, {"fp8": _t(1979.0), "bf16": _t(989.5)}, 4.8e12, 450e9, 50e9,
                "NVIDIA H200 SXM datasheet (FP8 1,979 / BF16 989.5 dense TFLOPS, HBM3e 4.8 TB/s, NVLink 900 GB/s "
                "bidirectional, 132 SMs); CX7 400 Gb/s"),
    "H20": GPU("H20", 78, {"fp8": _t(296.0), "bf16": _t(148.0)}, 4.0e12, 450e9, 50e9,
               "NVIDIA H20 (FP8 296 / BF16 148 dense TFLOPS, HBM3 4.0 TB/s, NVLink 900 GB/s bidirectional, 78 SMs); "
               "CX7 400 Gb/s"),
    "B200": GPU("B200", 148, {"fp4": _t(9000.0), "fp8": _t(4500.0), "bf16": _t(2250.0)}, 8.0e12, 900e9, 50e9,
                "NVIDIA HGX B200 datasheet per GPU (FP4 9 / FP8 4.5 / BF16 2.25 dense PFLOPS, HBM3e 8 TB/s, NVLink 5 "
                "1.8 TB/s bidirectional, 148 SMs); CX7 400 Gb/s"),
}

#: bytes per element of each operand dtype (FP4 weights carry one 8-bit scale per 32 values: 4.25 bits)
DTYPE_BYTES = {"fp4": 0.53125, "fp8": 1.0, "bf16": 2.0}


def gpu(name: str) -> GPU:
    key = str(name).upper()
    if key not in GPUS:
        raise UsageError(f"unknown hardware {name!r} (choose from {', '.join(GPUS)})")
    return GPUS[key]
