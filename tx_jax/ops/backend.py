"""The platform that 'auto' choices are made for: the host's default backend, or the target
a step is being compiled for.

    backend.current()                 'cpu' | 'gpu' | 'tpu': what 'auto' picks for
    with backend.target('tpu'): ...   trace for a TPU from any host (tx_jax.planning compiles for
                                      a TPU slice on a CPU host; 'auto' must pick the TPU's kernels)

Only the *choice* reads this; the model code reads the same on every platform.
"""

from __future__ import annotations

import contextlib
import contextvars
import glob
import importlib.util
import os

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("tx_jax_target", default=None)


def current() -> str:
    """The target set by `target(...)`, else jax.default_backend() ('cuda'/'rocm' -> 'gpu')."""
    platform = _TARGET.get() or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


@contextlib.contextmanager
def target(platform: str):
    """Make 'auto' choices for `platform` ('cpu', 'gpu', 'tpu'; 'cuda' means 'gpu') while
    tracing inside this block."""
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}; expected one of {PLATFORMS}")
    token = _TARGET.set(platform)
    try:
        yield platform
    finally:
        _TARGET.reset(token)


_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tx_jax_pallas_interpret", default=False
)


@contextlib.contextmanager
def pallas_interpreter():
    """Trace the Pallas levers (model.residual_norm='pallas', loss_impl='fused',
    ffn_impl='pallas') as their kernels in Pallas' interpreter on a CPU or TPU, where they
    otherwise resolve to their XLA references: for tests and debugging (slow)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def pallas_kernels() -> bool:
    """Whether a Pallas lever runs as its kernels here: compiled by Triton for a GPU, or in the
    interpreter inside `pallas_interpreter()` (or with TX_JAX_PALLAS_INTERPRET=1). Elsewhere
    (a CPU, a TPU) the model computes the same function the XLA way, so a GPU run's config
    trains, evaluates and decodes anywhere at that platform's speed."""
    if current() == "gpu":
        return True
    return _INTERPRET.get() or os.environ.get("TX_JAX_PALLAS_INTERPRET") == "1"


def pallas_interpret(interpret: bool | None, lever: str, instead: str) -> bool:
    """A Pallas op called directly: `interpret` as given, else the interpreter unless
    compiling for a GPU; a ValueError naming `lever` and what to use `instead` for a TPU,
    where the interpreter would be the whole step."""
    if interpret is not None:
        return bool(interpret)
    if current() == "tpu":
        raise ValueError(f"{lever} has Triton (GPU) kernels only; on TPU use {instead}")
    return current() != "gpu"


def shard_map_kernels(fn, mesh, in_specs, out_specs):
    """jax.shard_map for Pallas kernels run per shard (see batch_split), without the
    varying-axes check: pallas_call's outputs carry no such type (jax 0.10); replicated
    inputs' cotangents are then summed across the mesh by the transpose."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


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
            f"{DETERMINISTIC_FLAG}; set it before the process uses JAX (tx_jax.main does)"
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


def batch_split(ndim: int):
    """For a Pallas kernel that runs per shard (its custom call is not partitioned by XLA):
    (mesh, spec, batch axes) where the jit being traced has a mesh of several devices and
    flax's logical rules split the [B, L, M] activations' batch axis alone; else None (one
    device, or a layout whose rows are not whole on each device: XLA then gathers the
    operands)."""
    import flax.linen as nn

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or ndim != 3:
        return None
    spec = nn.logical_to_mesh_axes(("batch", "length", "embed"))
    if spec is None or len(spec) == 0 or any(e is not None for e in tuple(spec)[1:]):
        return None
    axes = spec[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if not axes or all(mesh.shape[a] == 1 for a in axes):
        return None
    return mesh, jax.sharding.PartitionSpec(spec[0], None, None), axes
