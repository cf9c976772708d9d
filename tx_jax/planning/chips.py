"""Per-chip figures the plan divides by: memory, peak matmul FLOP/s, memory and interconnect
bandwidth. Data with its sources; nothing here is measured by tx_jax.

Units: bytes, FLOP/s, bytes/s. `interconnect` is the bidirectional chip-to-chip bandwidth
per chip (TPU ICI, NVIDIA NVLink); a chip sends at half of it. `usable_hbm` is what one
program may fill: on TPU the HBM the TPU compiler says is available (its out-of-memory
message, libtpu 0.0.42: "exceeds available HBM (15.75G)" on v5e), on GPU 75% of the memory,
what JAX preallocates by default (XLA_PYTHON_CLIENT_MEM_FRACTION).

Peak FLOP/s are dense (no sparsity). 'f32' is what a float32 matmul runs at with JAX's default
precision: one bf16 pass on TPU (so the bf16 peak) and TF32 tensor cores on A100/H100.
"""

from __future__ import annotations

import dataclasses

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    platform: str  # 'tpu' | 'gpu'
    hbm: int  # bytes per chip
    peak_bf16: float  # FLOP/s
    peak_f32: float  # FLOP/s at JAX's default matmul precision
    hbm_bandwidth: float  # bytes/s
    interconnect: float  # bytes/s, bidirectional, per chip
    source: str
    usable: float = 1.0  # fraction of `hbm` a program may use, unless `available` is known
    available: float | None = None  # GiB the compiler makes available, when it says

    def peak(self, dtype: str) -> float:
        return self.peak_bf16 if dtype in ("bfloat16", "float16") else self.peak_f32

    @property
    def usable_hbm(self) -> int:
        if self.available is not None:
            return int(self.available * GiB)
        return int(self.hbm * self.usable)


_TPU_DOCS = "Cloud TPU documentation, system architecture page of the version"
_V4_ICI = "v4's ICI: the pod's 1.1 PB/s all-reduce bandwidth over its 4,096 chips"
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", "tpu", 32 * GiB, 275e12, 275e12, 1200e9, 1.1e15 / 4096,
               f"{_TPU_DOCS} (v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s); {_V4_ICI}",
               available=30.75),
    "v5e": Chip("TPU v5e", "tpu", 16 * GiB, 197e12, 197e12, 819e9, 400e9,
                f"{_TPU_DOCS} (v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s)",
                available=15.75),
    "v5p": Chip("TPU v5p", "tpu", 95 * GiB, 459e12, 459e12, 2765e9, 1200e9,
                f"{_TPU_DOCS} (v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s, ICI 1,200 GB/s)",
                available=95.74),
    "v6e": Chip("TPU v6e", "tpu", 32 * GiB, 918e12, 918e12, 1638e9, 800e9,
                f"{_TPU_DOCS} (v6e: 918 TFLOP/s bf16, 32 GB HBM at 1,638 GB/s, ICI 800 GB/s)",
                available=31.25),
    "h100": Chip("NVIDIA H100 SXM", "gpu", 80 * GiB, 989.4e12, 494.7e12, 3.35e12, 900e9,
                 "NVIDIA H100 datasheet (SXM: 989 TFLOP/s bf16 and 495 TF32 dense, 80 GB HBM3 "
                 "at 3.35 TB/s, NVLink 900 GB/s)", usable=0.75),
    "h200": Chip("NVIDIA H200 SXM", "gpu", 141 * 10**9, 989.4e12, 494.7e12, 4.8e12, 900e9,
                 "NVIDIA H200 datasheet (SXM: H100's compute, 141 GB HBM3e at 4.8 TB/s, "
                 "NVLink 900 GB/s)", usable=0.75),
    "a100": Chip("NVIDIA A100 SXM 80GB", "gpu", 80 * GiB, 312e12, 156e12, 2.039e12, 600e9,
                 "NVIDIA A100 datasheet (SXM 80GB: 312 TFLOP/s bf16, 156 TF32 dense, HBM2e at "
                 "2,039 GB/s, NVLink 600 GB/s)", usable=0.75),
    "a100_40": Chip("NVIDIA A100 SXM 40GB", "gpu", 40 * GiB, 312e12, 156e12, 1.555e12, 600e9,
                    "NVIDIA A100 datasheet (SXM 40GB: 312 TFLOP/s bf16, 156 TF32 dense, HBM2 at "
                    "1,555 GB/s, NVLink 600 GB/s)", usable=0.75),
}  # fmt: skip
