"""Per-GPU peak figures the GPU cost model scales (datasheet numbers, dense tensor math).

Every figure is a peak the vendor states (the page is in each GPU's ``source``); the model
multiplies each by an achieved efficiency fitted on published kernel measurements
(:mod:`.fit`, ``data/fitted.json``). Which GPUs have published rows, and the band where
they have none, is in ``data/fitted.json`` (``bands``) and docs/calibration.md.

Units: tensor FLOP/s, bytes/s. NVLink (AMD: Infinity Fabric) is per direction per GPU;
RDMA is the GPU's NIC. ``domain`` is the GPUs of one NVLink domain (one HGX node: 8;
GB200 NVL72: 72), the default ``--ranks-per-node``.
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
    domain: int = 8       # GPUs per NVLink (scale-up) domain


def _t(x):
    return x * 1e12


GPUS: dict[str, GPU] = {
    "H800": GPU("H800", 132, {"fp8": _t(1979.0), "bf16": _t(989.5)}, 3.35e12, 200e9, 50e9,
                "H800 SXM5: H100 SXM compute and HBM3 (FP8 1,979 / BF16 989.5 dense TFLOPS, 3.35 TB/s, 132 SMs, "
                "https://www.nvidia.com/en-us/data-center/h100/); NVLink cut to 400 GB/s bidirectional; CX7 400 Gb/s "
                "InfiniBand (DeepEP README: ~160 GB/s NVLink and ~50 GB/s RDMA achievable)"),
    "H100": GPU("H100", 132, {"fp8": _t(1979.0), "bf16": _t(989.5)}, 3.35e12, 450e9, 50e9,
                "NVIDIA H100 SXM datasheet, https://www.nvidia.com/en-us/data-center/h100/ (FP8 1,979 / BF16 989.5 "
                "dense TFLOPS, HBM3 3.35 TB/s, NVLink 900 GB/s bidirectional, 132 SMs); CX7 400 Gb/s"),
    "H200": GPU("H200", 132, {"fp8": _t(1979.0), "bf16": _t(989.5)}, 4.8e12, 450e9, 50e9,
                "NVIDIA H200 SXM datasheet, https://www.nvidia.com/en-us/data-center/h200/ (FP8 1,979 / BF16 989.5 "
                "dense TFLOPS, HBM3e 4.8 TB/s, NVLink 900 GB/s bidirectional, 132 SMs); CX7 400 Gb/s"),
    "H20": GPU("H20", 78, {"fp8": _t(296.0), "bf16": _t(148.0)}, 4.0e12, 450e9, 50e9,
               "NVIDIA H20 (no public NVIDIA page; the figures of its partner spec sheets: FP8 296 / BF16 148 dense "
               "TFLOPS, HBM3 4.0 TB/s, NVLink 900 GB/s bidirectional, 78 SMs); CX7 400 Gb/s"),
    "B200": GPU("B200", 148, {"fp4": _t(9000.0), "fp8": _t(4500.0), "bf16": _t(2250.0)}, 8.0e12, 900e9, 50e9,
                "NVIDIA HGX B200 datasheet per GPU, https://www.nvidia.com/en-us/data-center/hgx/ (FP4 9 / FP8 4.5 / "
                "BF16 2.25 dense PFLOPS, HBM3e 8 TB/s, NVLink 5 1.8 TB/s bidirectional, 148 SMs); CX7 400 Gb/s"),
    "B300": GPU("B300", 160, {"fp4": _t(13500.0), "fp8": _t(4500.0), "bf16": _t(2250.0)}, 8.0e12, 900e9, 100e9,
                "NVIDIA HGX B300 per GPU, https://www.nvidia.com/en-us/data-center/hgx/ (FP4 13.5 / FP8 4.5 / BF16 2.25 "
                "dense PFLOPS, HBM3e 8 TB/s, NVLink 5 1.8 TB/s bidirectional); 160 SMs (NVIDIA technical blog 'Inside "
                "NVIDIA Blackwell Ultra'); ConnectX-8 800 Gb/s"),
    "GB200": GPU("GB200", 148, {"fp4": _t(10000.0), "fp8": _t(5000.0), "bf16": _t(2500.0)}, 8.0e12, 900e9, 50e9,
                 "NVIDIA GB200 NVL72 datasheet divided by its 72 GPUs, https://www.nvidia.com/en-us/data-center/"
                 "gb200-nvl72/ (FP4 10 / FP8 5 / BF16 2.5 dense PFLOPS, HBM3e 8 TB/s, NVLink 5 1.8 TB/s bidirectional "
                 "inside the 72-GPU domain, 148 SMs per Blackwell GPU); CX7 400 Gb/s between racks", domain=72),
    "MI300X": GPU("MI300X", 304, {"fp8": _t(2614.9), "bf16": _t(1307.4)}, 5.3e12, 448e9, 50e9,
                  "AMD Instinct MI300X datasheet, https://www.amd.com/en/products/accelerators/instinct/mi300/"
                  "mi300x.html (FP8 2,614.9 / BF16 1,307.4 dense TFLOPS, HBM3 5.3 TB/s, 304 CUs, Infinity Fabric "
                  "896 GB/s aggregate peer bandwidth = 448 GB/s per direction); a 400 Gb/s NIC per GPU"),
    "MI355X": GPU("MI355X", 256, {"fp4": _t(10000.0), "fp8": _t(5000.0), "bf16": _t(2500.0)}, 8.0e12, 537.6e9, 50e9,
                  "AMD Instinct MI355X datasheet, https://www.amd.com/en/products/accelerators/instinct/mi350/"
                  "mi355x.html (FP4 ~10 / FP8 ~5 / BF16 ~2.5 dense PFLOPS, HBM3E 8 TB/s, 256 CUs, 7 Infinity Fabric "
                  "links of 153.6 GB/s = 1,075.2 GB/s aggregate, 537.6 GB/s per direction); a 400 Gb/s NIC per GPU"),
}

#: bytes per element of each operand dtype (FP4 weights carry one 8-bit scale per 32 values: 4.25 bits)
DTYPE_BYTES = {"fp4": 0.53125, "fp8": 1.0, "bf16": 2.0}


def gpu(name: str) -> GPU:
    key = str(name).upper()
    if key not in GPUS:
        raise UsageError(f"unknown hardware {name!r} (choose from {', '.join(GPUS)})")
    return GPUS[key]
