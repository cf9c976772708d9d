"""Process-wide settings of JAX's backends, made before a run starts: XLA:GPU's deterministic
mode, and keeping JAX from starting libtpu on a host without TPU chips. Which kernels a model
runs is not decided here: ModelConfig.resolved(platform) makes those choices once, when a
run is built.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import jax

DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"


def deterministic_ops() -> bool:
    """Whether XLA:GPU runs in its deterministic mode (the flag in XLA_FLAGS): no atomics in
    reductions and scatters, and no cuDNN fused attention, which fails under it (jax 0.11.2,
    H100: `raw_hash_map<>::at` at the first call; BENCHMARKS.md)."""
    return DETERMINISTIC_FLAG in os.environ.get("XLA_FLAGS", "").split()


def require_deterministic_ops() -> None:
    """Set XLA:GPU's deterministic mode for this process (train.deterministic=True): before
    JAX starts its backends; a ValueError naming the flag where they run without it."""
    if deterministic_ops():
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() and any(d.platform == "gpu" for d in jax.devices()):
        raise ValueError(
            "train.deterministic=True: JAX's GPU backend started without XLA_FLAGS="
            f"{DETERMINISTIC_FLAG}; set it before the process uses JAX (tx_jax train does)"
        )
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC_FLAG}".strip()


def skip_absent_tpu() -> str | None:
    """On a host without TPU chips, keep JAX from starting libtpu (tx_jax's `plan` extra
    installs it; it then probes for chips at start-up and prints errors): name the host's
    platforms instead, as launch.sh does -> the platforms set, or None (JAX_PLATFORMS
    already set, TPU chips present, or no libtpu)."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return None
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return None
    if importlib.util.find_spec("libtpu") is None:
        return None
    platforms = "cuda,cpu" if os.path.exists("/dev/nvidiactl") else "cpu"
    jax.config.update("jax_platforms", platforms)
    return platforms
