"""Accelerator presets: datasheet peaks the planner's rooflines divide by.

Invariants: every number is positive and finite; `fp8_flops` is None where the part has no fp8
tensor cores; `cores` is None for a GPU (a worker runs on whole devices) and the core count for
a CPU machine, whose cores `pdserve up` splits evenly among its workers (`share`).
FLOP/s are DENSE (no 2:4 sparsity): NVIDIA datasheets headline the sparse figure with an
asterisk, so dense = sparse / 2 is written out below. Memory sizes are the datasheet's decimal
GB; bandwidths are decimal bytes/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Hardware:
    """One device (one GPU, or this machine's two CPU cores)."""

    name: str
    bf16_flops: float  # dense bf16 (= fp16) tensor FLOP/s
    fp8_flops: float | None  # dense fp8 FLOP/s; None: no fp8 units
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    source: str
    cores: int | None = None  # a CPU machine's cores; None: a GPU

    def __post_init__(self) -> None:
        for field in ("bf16_flops", "memory_bandwidth", "memory_bytes"):
            _check_rate(self.name, field, getattr(self, field))
        if self.fp8_flops is not None:
            _check_rate(self.name, "fp8_flops", self.fp8_flops)
        if self.cores is not None and (isinstance(self.cores, bool)
                                       or not isinstance(self.cores, int) or self.cores < 1):
            raise ValueError(f"hardware {self.name}: cores must be a positive integer or None, "
                             f"got {self.cores!r}")
        if not self.source:
            raise ValueError(f"hardware {self.name}: source must cite where the numbers are from")

    @property
    def has_fp8(self) -> bool:
        return self.fp8_flops is not None

    def share(self, workers: int) -> Hardware:
        """What one of `workers` workers gets of this CPU machine: its cores split evenly, so
        1/workers of the FLOP/s, the memory bandwidth and the memory (an even split of the
        bandwidth is an assumption: one core alone can draw more than its share)."""
        if self.cores is None:
            raise ValueError(f"{self.name} is a GPU: a worker runs on whole devices")
        if workers > self.cores:
            raise ValueError(f"{workers} workers cannot share the {self.cores} cores of "
                             f"{self.name}: one core each at least")
        if workers == 1:
            return self
        return Hardware(f"{self.name} / {workers}", self.bf16_flops / workers,
                        None if self.fp8_flops is None else self.fp8_flops / workers,
                        self.memory_bandwidth / workers, self.memory_bytes / workers,
                        self.source, self.cores // workers)

    def peak_flops(self, weight_dtype: str) -> float:
        """fp8 peak for fp8 weights where the part has fp8 units, else the bf16 peak."""
        if weight_dtype == "fp8" and self.fp8_flops is not None:
            return self.fp8_flops
        return self.bf16_flops


def _check_rate(name: str, field: str, value: float) -> None:
    if not isinstance(value, int | float) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"hardware {name}: {field} must be a positive finite number, "
                         f"got {value!r}")


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "H100 SXM", bf16_flops=1979 * TERA / 2, fp8_flops=3958 * TERA / 2,
        memory_bandwidth=3.35 * TERA, memory_bytes=80 * GIGA,
        source="NVIDIA H100 Tensor Core GPU datasheet, SXM column (sparse figures halved)"),
    "h200": Hardware(
        "H200 SXM", bf16_flops=1979 * TERA / 2, fp8_flops=3958 * TERA / 2,
        memory_bandwidth=4.8 * TERA, memory_bytes=141 * GIGA,
        source="NVIDIA H200 Tensor Core GPU datasheet, SXM column (sparse figures halved)"),
    "a100": Hardware(
        "A100 80GB SXM", bf16_flops=312 * TERA, fp8_flops=None,
        memory_bandwidth=2.039 * TERA, memory_bytes=80 * GIGA,
        source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (dense BF16 312 TFLOPS)"),
    "l40s": Hardware(
        "L40S", bf16_flops=733 * TERA / 2, fp8_flops=1466 * TERA / 2,
        memory_bandwidth=864 * GIGA, memory_bytes=48 * GIGA,
        source="NVIDIA L40S datasheet (sparse figures halved; GDDR6 864 GB/s)"),
    "mi300x": Hardware(
        "MI300X", bf16_flops=1307.4 * TERA, fp8_flops=2614.9 * TERA,
        memory_bandwidth=5.3 * TERA, memory_bytes=192 * GIGA,
        source="AMD Instinct MI300X data sheet (dense BF16 1307.4, FP8 2614.9 TFLOPS)"),
    # A 2-core AMD EPYC (Zen 4) VM, measured: bf16 matmul ~435 GFLOP/s per core, memory
    # read ~59 GB/s with both cores. Memory size is /proc/meminfo MemTotal here (24.7 GB).
    "cpu-epyc-2core": Hardware(
        "cpu-epyc-2core", bf16_flops=2 * 435 * GIGA, fp8_flops=None,
        memory_bandwidth=59 * GIGA, memory_bytes=24 * GIGA,
        source="measured on a 2-core AMD EPYC Zen 4 VM: 2048^3 bf16 matmul, large reads",
        cores=2),
}

# Other spellings the CLI accepts.
ALIASES: dict[str, str] = {"h100-sxm": "h100", "h200-sxm": "h200", "a100-80gb": "a100",
                           "cpu": "cpu-epyc-2core"}


def get_hardware(name: str) -> Hardware:
    """The preset called `name` (case-insensitive, aliases allowed); ValueError listing them."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(f"gpu (--gpu) {name!r} is not a known device; pick one of "
                         f"{', '.join(HARDWARE)}")
    return HARDWARE[key]
