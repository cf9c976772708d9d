"""What a plan compiles for (`tpu:v5e-16`, `tpu:v5e-256x2`: two slices, `gpu:h100-8`; names as
docs/planning.md gives them), parsed into a Target whose `devices()` are that topology's,
described by the accelerator's own compiler on any host (no chip needed)."""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re

from tx_jax.planning.chips import CHIPS, Chip

# Chips -> the slice's shape, for the shapes Cloud TPU offers.
_TORUS_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_TORUS_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
TPU_GENERATIONS = {  # name -> (cores per chip in the accelerator type's count, shapes)
    "v4": (2, _TORUS_3D),
    "v5p": (2, _TORUS_3D),
    "v5e": (1, _TORUS_2D),
    "v6e": (1, _TORUS_2D),
}
GPUS_PER_HOST = 8
_SPEC = re.compile(r"^(tpu|gpu):([a-z0-9_]+)-(\d+)(?:x(\d+))?$")
EXAMPLES = "tpu:v5e-16, tpu:v4-8, tpu:v5p-128, tpu:v6e-256x2 (2 slices), gpu:h100-8, gpu:a100-16"


@dataclasses.dataclass(frozen=True)
class Target:
    spec: str  # as given, e.g. 'tpu:v5e-16'
    platform: str  # 'tpu' | 'gpu'
    generation: str  # key of CHIPS
    chips_per_slice: int
    num_slices: int = 1

    @property
    def chip(self) -> Chip:
        return CHIPS[self.generation]

    @property
    def num_devices(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def topology(self) -> str:
        """The compiler's name of one slice: 'v5e:4x4', or a GPU's hosts x GPUs '1x2x8'."""
        if self.platform == "tpu":
            return f"{self.generation}:{TPU_GENERATIONS[self.generation][1][self.chips_per_slice]}"
        hosts = max(1, self.chips_per_slice // GPUS_PER_HOST)
        return f"1x{hosts}x{min(self.chips_per_slice, GPUS_PER_HOST)}"

    def _host_bounds(self) -> tuple[int, int, int]:
        """Chips per host: 2x2x1, or the whole topology when it is smaller (a one-chip v5e)."""
        dims = [int(x) for x in self.topology.split(":")[-1].split("x")]
        dims += [1] * (3 - len(dims))
        return tuple(min(b, d) for b, d in zip((2, 2, 1), dims, strict=True))

    def devices(self) -> list:
        """The devices of this topology (compile-only: they cannot run anything)."""
        from jax.experimental import topologies

        if self.platform == "tpu":
            prepare_tpu_compiler()
            desc = topologies.get_topology_desc(
                topology_name=self.topology,
                platform="tpu",
                chip_config_name="megacore" if self.generation in ("v4", "v5p") else "default",
                chips_per_host_bounds=self._host_bounds(),
                num_slices=self.num_slices,
            )
            return list(desc.devices)
        return _gpu_devices(self)


def parse(spec: str) -> Target:
    """'tpu:v5e-16' -> Target; ValueError naming the part that is wrong."""
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(
            f"--target={spec!r}: expected PLATFORM:NAME-COUNT[xSLICES], e.g. {EXAMPLES}"
        )
    platform, name, count, slices = m.group(1), m.group(2), int(m.group(3)), int(m.group(4) or 1)
    if platform == "tpu":
        if name not in TPU_GENERATIONS:
            raise ValueError(
                f"--target={spec!r}: TPU {name!r} unknown; known: {sorted(TPU_GENERATIONS)}"
            )
        cores, shapes = TPU_GENERATIONS[name]
        chips = count // cores
        if count % cores or chips not in shapes:
            offered = ", ".join(f"{name}-{n * cores}" for n in shapes)
            raise ValueError(f"--target={spec!r}: no {name} slice of {count}; offered: {offered}")
        return Target(spec, platform, name, chips, slices)
    gpus = [k for k, c in CHIPS.items() if c.platform == "gpu"]
    if name not in gpus:
        raise ValueError(f"--target={spec!r}: GPU {name!r} unknown; known: {gpus}")
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise ValueError(f"--target={spec!r}: {count} GPUs; use 1-8 or a multiple of 8")
    return Target(spec, platform, name, count, slices)


def on_tpu_host() -> bool:
    """Whether this machine has TPU chips (a TPU VM): /dev/accel* or /dev/vfio devices."""
    return any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))


def prepare_tpu_compiler() -> None:
    """libtpu takes a lock file so that one process owns the chips: a plan opens no chip, so
    several may compile at once (the search; a plan beside a training run on a TPU VM). And it
    looks for a TPU (metadata server, worker names) when it loads, printing errors when there
    is none: on a host without TPU chips tell it there is nothing to find."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if on_tpu_host():
        return
    for key, value in {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-4",
        "TPU_WORKER_HOSTNAMES": "localhost",
    }.items():
        os.environ.setdefault(key, value)


# GPU -> its XLA GpuTargetConfig in gpu_specs/ (copied from XLA; each file says from where)
GPU_SPECS = {"h100": "h100_sxm", "h200": "h200", "a100": "a100_sxm_80", "a100_40": "a100_sxm_40"}


def gpu_target_config(generation: str) -> str:
    """The XLA GpuTargetConfig text proto of a GPU (data in planning/gpu_specs/)."""
    files = importlib.resources.files("tx_jax.planning") / "gpu_specs"
    path = files / f"{GPU_SPECS.get(generation, generation)}.txtpb"
    if not path.is_file():
        raise ValueError(f"no GPU description for {generation!r} in tx_jax/planning/gpu_specs/")
    return path.read_text()


def _gpu_devices(target: Target) -> list:
    from jax.experimental import topologies

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        desc = topologies.get_topology_desc(
            platform="cuda",
            target_config=gpu_target_config(target.generation),
            topology=target.topology,
        )
    except Exception as e:  # no CUDA plugin: jax raises a RuntimeError/ValueError of its own
        raise RuntimeError(
            f"planning for {target.spec} needs jax's CUDA plugin (compile-only, no GPU needed): "
            f"pip install -e '.[plan-gpu]' ({type(e).__name__}: {e})"
        ) from e
    return list(desc.devices)
