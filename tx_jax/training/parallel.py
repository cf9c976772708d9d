"""Putting state and batches on devices: `MeshStrategy` (one jax.jit program over a Mesh, the
default) or `PmapStrategy` (jax.pmap, an option), behind one interface, `Strategy`.

Model code names axes ('batch', 'embed', ...); only this file turns names into placements.
Train batches are global arrays assembled from the rows each process reads
(`process_row_spans`, `place_process_rows`); eval batches are per process (`place_batch`).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
STRATEGIES = ("mesh", "pmap")  # the default first
# Logical name -> mesh axis. A mesh axis is used once per array: activations
# ('batch', 'length', 'embed') put batch on (data, fsdp) and leave embed replicated, while
# parameters ('vocab', 'embed') shard embed over fsdp (ZeRO-3 style) and vocab over tensor.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def maybe_initialize_distributed(parallel: Any) -> None:
    """jax.distributed.initialize when parallel.coordinator_address (or JAX_COORDINATOR_ADDRESS,
    with num_processes / process_id or their JAX_* variables) or parallel.distributed (a TPU
    slice JAX discovers) asks for it."""
    address = parallel.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not (parallel.get("distributed") or address) or jax.distributed.is_initialized():
        return  # (a second build_run in the same process, e.g. evaluation after training)
    kwargs = {}
    if address:
        kwargs = dict(
            coordinator_address=address,
            num_processes=int(parallel.get("num_processes") or os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(
                parallel.get("process_id")
                if parallel.get("process_id") is not None
                else os.environ["JAX_PROCESS_ID"]
            ),
        )
    # CPU collectives across processes need an implementation (gloo, recent jax's default);
    # nothing here may ask for a backend, since initialize() must come first.
    if getattr(jax.config, "jax_cpu_collectives_implementation", None) is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    logging.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def mesh_shape(
    requested: dict[str, int], num_devices: int, platform_sizes: dict[str, int] | None = None
) -> tuple[int, ...]:
    """{'data': -1, 'fsdp': 2, 'tensor': 1} -> (4, 2, 1) on 8 devices; -1 fills the rest, 0
    takes `platform_sizes`' size of the axis where it divides the devices, else 1 (so a config
    can prefer a mesh on one platform and still run anywhere)."""
    unknown = sorted(set(requested) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"parallel.mesh has unknown axes {unknown}; valid: {MESH_AXES}")
    sizes = [int(requested.get(a, 1)) for a in MESH_AXES]
    for i, axis in enumerate(MESH_AXES):
        if sizes[i] != 0:
            continue
        want = int((platform_sizes or {}).get(axis, 1))
        others = int(np.prod([s for j, s in enumerate(sizes) if j != i and s > 0]))
        sizes[i] = want if want > 0 and num_devices % (want * others) == 0 else 1
    if sizes.count(-1) > 1:
        raise ValueError(f"parallel.mesh={requested}: at most one axis may be -1")
    fixed = int(np.prod([s for s in sizes if s != -1]))
    if fixed < 1:
        raise ValueError(f"parallel.mesh={requested}: sizes are -1, 0 or positive")
    if num_devices % fixed:
        raise ValueError(
            f"parallel.mesh={requested}: {fixed} does not divide the {num_devices} devices"
        )
    sizes = [num_devices // fixed if s == -1 else s for s in sizes]
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(
            f"parallel.mesh={requested} gives {int(np.prod(sizes))} devices, "
            f"but there are {num_devices}"
        )
    return tuple(sizes)


def platform_sizes(parallel: Any, platform: str | None) -> dict[str, int]:
    """parallel.mesh_by_platform's entry for `platform` ('tpu', 'gpu', 'cpu'), or {}."""
    table = parallel.get("mesh_by_platform") or {}
    entry = table.get(platform) if platform else None
    if entry is None:
        return {}
    entry = dict(entry)
    unknown = sorted(set(entry) - set(MESH_AXES))
    if unknown:
        raise ValueError(
            f"parallel.mesh_by_platform.{platform} has unknown axes {unknown}; valid: {MESH_AXES}"
        )
    return {k: int(v) for k, v in entry.items()}


class Strategy(abc.ABC):
    """How a run places its state and batches: `MeshStrategy` or `PmapStrategy`, built by
    `make_strategy(config.parallel)`. A batch is a dict of [B, ...] arrays, B_local rows of
    them on a process; `init_fn() -> state` returns the state boxed with logical axis names."""

    kind: ClassVar[str]  # parallel.strategy's value

    @property
    @abc.abstractmethod
    def global_batch_multiple(self) -> int:
        """B must divide by this (all devices, or the mesh's batch shards)."""

    @property
    @abc.abstractmethod
    def local_batch_multiple(self) -> int:
        """B_local must divide by this (local devices, or this host's share of the shards)."""

    @abc.abstractmethod
    def init_state(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        """Allocate `init_fn(*args)`'s state placed as the step takes it; `args` (placed as
        `abstract_state` places them) are donated."""

    @abc.abstractmethod
    def abstract_state(self, init_fn: Callable[[], Any]) -> Any:
        """ShapeDtypeStructs, with the shardings of this run, to restore a checkpoint into."""

    def step_shardings(self, init_fn: Callable[[], Any]) -> Any:
        """compile_step's `state_shardings` for `init_fn`'s state (None: the step places it)."""
        return None

    def place_restored(self, state: Any) -> Any:
        """A state restored into `abstract_state` -> ready for the step."""
        return state

    def for_checkpoint(self, state: Any) -> Any:
        """The state as the checkpoint stores it."""
        return state

    @abc.abstractmethod
    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host-local numpy batch [B_local, ...] -> device arrays for the step."""

    @abc.abstractmethod
    def process_row_spans(self) -> list[tuple[Fraction, Fraction]]:
        """The rows of a global train batch on this process's devices: sorted fractions [a, b)."""

    def place_process_rows(self, batch: dict[str, np.ndarray], share: Fraction) -> dict:
        """This process's rows of a global batch (`process_row_spans`, `share` of its rows,
        in order) -> global device arrays for the step."""
        return self.place_batch(batch)

    def context(self) -> contextlib.AbstractContextManager:
        """Trace-time context of the step (calls, lowering)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def compile_step(
        self,
        step_fn: Callable,
        *,
        donate: bool,
        state_shardings: Any = None,
        returns_state: bool = True,
    ) -> Callable:
        """step_fn(state, batch, axis_name=...) -> (state', metrics) (or metrics alone when
        returns_state=False), compiled for this run; `donate`: the state's buffers are reused."""

    @abc.abstractmethod
    def fetch_metrics(self, metrics: Any) -> dict[str, float]:
        """The step's device metrics -> host floats."""

    def release(self) -> None:
        """Free what compiling this run's steps keeps (one process may run many)."""
        return None


@dataclasses.dataclass
class PmapStrategy(Strategy):
    """jax.pmap over the n local devices: the state replicated as [n, ...], the batch split as
    [n, B_local / n, ...]; the step averages gradient and metric sums with lax.pmean."""

    kind: ClassVar[str] = "pmap"

    @property
    def global_batch_multiple(self) -> int:
        return jax.device_count()

    @property
    def local_batch_multiple(self) -> int:
        return jax.local_device_count()

    def init_state(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        init = jax.jit(lambda *a: nn.meta.unbox(init_fn(*a)), donate_argnums=_all(args))
        return replicate(init(*args))

    def abstract_state(self, init_fn: Callable[[], Any]) -> Any:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # one replica
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            nn.meta.unbox(jax.eval_shape(init_fn)),
        )

    def place_restored(self, state: Any) -> Any:
        return replicate(state)

    def for_checkpoint(self, state: Any) -> Any:
        # one replica; with several processes the copies are host-local arrays, which Orbax
        # cannot save, so they become one global array replicated over every device
        one = _replicas_as_global if jax.process_count() > 1 else _first_replica
        return jax.tree_util.tree_map(one, state)

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        n = jax.local_device_count()
        sharding = _pmap_sharding()
        return jax.tree_util.tree_map(
            lambda x: jax.device_put(x.reshape(n, x.shape[0] // n, *x.shape[1:]), sharding),
            batch,
        )

    def process_row_spans(self) -> list[tuple[Fraction, Fraction]]:
        i, n = jax.process_index(), jax.process_count()
        return [(Fraction(i, n), Fraction(i + 1, n))]  # the process's block

    def compile_step(
        self,
        step_fn: Callable,
        *,
        donate: bool,
        state_shardings: Any = None,
        returns_state: bool = True,
    ) -> Callable:
        # the pmap places the state (state_shardings unused) and returns what step_fn returns
        return jax.pmap(
            lambda s, b: step_fn(s, b, axis_name=PMAP_AXIS),
            axis_name=PMAP_AXIS,
            donate_argnums=(0,) if donate else (),
        )

    def fetch_metrics(self, metrics: Any) -> dict[str, float]:
        # every device holds a copy of the reduced values
        return {k: float(v[0]) for k, v in jax.device_get(metrics).items()}

    def release(self) -> None:
        # jax.pmap's cache keeps every pmapped function's programs and cannot drop one entry
        jax.clear_caches()


@dataclasses.dataclass
class MeshStrategy(Strategy):
    """jax.jit over a Mesh with axes (data, fsdp, tensor): the state sharded by the logical axis
    names the model attaches (`nn.with_logical_partitioning`), mapped to mesh axes by `rules`
    (config.parallel.rules), and donated to the step; the batch split over (data, fsdp). An
    AbstractMesh is for lowering only (make_abstract_strategy)."""

    mesh: Mesh | AbstractMesh
    rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES
    kind: ClassVar[str] = "mesh"

    @property
    def global_batch_multiple(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    @property
    def local_batch_multiple(self) -> int:
        return max(1, self.global_batch_multiple // jax.process_count())

    def init_state(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        shardings = self.step_shardings(init_fn)
        with self.context():
            return jax.jit(
                lambda *a: nn.meta.unbox(init_fn(*a)),
                out_shardings=shardings,
                donate_argnums=_all(args),
            )(*args)

    def state_shardings(self, abstract_boxed_state: Any) -> Any:
        """Shardings for a boxed abstract state; same tree as the unboxed state."""
        specs = nn.get_partition_spec(abstract_boxed_state)
        return nn.logical_to_mesh_sharding(specs, self.mesh, self.rules)

    def step_shardings(self, init_fn: Callable[[], Any]) -> Any:
        return self.state_shardings(jax.eval_shape(init_fn))

    def abstract_state(self, init_fn: Callable[[], Any]) -> Any:
        boxed = jax.eval_shape(init_fn)
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            nn.meta.unbox(boxed),
            self.state_shardings(boxed),
        )

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        sharding = self.batch_sharding()
        return jax.tree_util.tree_map(
            lambda x: jax.make_array_from_process_local_data(sharding, x), batch
        )

    def process_row_spans(self) -> list[tuple[Fraction, Fraction]]:
        # whatever the batch sharding gives this process's devices (all rows when the batch
        # axes lie within one process)
        n = self.global_batch_multiple
        held = self.batch_sharding().addressable_devices_indices_map((n,)).values()
        starts = sorted({index[0].indices(n)[:2] for index in held})
        spans: list[tuple[int, int]] = []
        for a, b in starts:  # merged where contiguous
            if spans and spans[-1][1] == a:
                spans[-1] = (spans[-1][0], b)
            else:
                spans.append((a, b))
        return [(Fraction(a, n), Fraction(b, n)) for a, b in spans]

    def place_process_rows(self, batch: dict[str, np.ndarray], share: Fraction) -> dict:
        if jax.process_count() == 1:
            return self.place_batch(batch)
        sharding = self.batch_sharding()
        return {
            k: jax.make_array_from_process_local_data(
                sharding, x, (int(len(x) / share), *x.shape[1:])
            )
            for k, x in batch.items()
        }

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(("data", "fsdp")))

    @contextlib.contextmanager
    def context(self):
        """The mesh and the logical rules (activation constraints)."""
        # jax.set_mesh takes only a Mesh of real devices; an AbstractMesh (lowering) is set
        # as the abstract mesh, which is all that tracing and flax's constraints read.
        if isinstance(self.mesh, AbstractMesh):
            mesh_ctx = jax.sharding.use_abstract_mesh(self.mesh)
        else:
            mesh_ctx = jax.set_mesh(self.mesh)
        with mesh_ctx, nn.logical_axis_rules(self.rules):
            yield

    def compile_step(
        self,
        step_fn: Callable,
        *,
        donate: bool,
        state_shardings: Any = None,
        returns_state: bool = True,
    ) -> Callable:
        jitted = self.jit_step(
            step_fn, donate=donate, state_shardings=state_shardings, returns_state=returns_state
        )

        def run(state, batch):
            with self.context():
                return jitted(state, batch)

        return run

    def jit_step(
        self,
        step_fn: Callable,
        *,
        donate: bool,
        state_shardings: Any,
        returns_state: bool = True,
    ) -> Any:
        """The step as a `jax.jit` object (call or lower it inside `context()`): what
        compile_step runs, and what `export_step` lowers."""
        replicated = NamedSharding(self.mesh, P())
        return jax.jit(
            lambda s, b: step_fn(s, b, axis_name=None),
            in_shardings=(state_shardings, self.batch_sharding()),
            out_shardings=(state_shardings, replicated) if returns_state else replicated,
            donate_argnums=(0,) if donate else (),
        )

    def export_step(
        self,
        step_fn: Callable,
        init_fn: Callable[[], Any],
        batch: dict[str, Any],
        platforms: Sequence[str],
        *,
        donate: bool = False,
        returns_state: bool = True,
    ) -> Any:
        """`jax.export.Exported` of the step for `platforms` ('cuda', 'tpu', ...), lowered on
        any host for the global batch's ShapeDtypeStructs `batch` (no target device needed
        with a `make_abstract_strategy` mesh)."""
        boxed = jax.eval_shape(init_fn)
        state = nn.meta.unbox(boxed)  # outside the mesh context: unbox would constrain there
        jitted = self.jit_step(
            step_fn,
            donate=donate,
            state_shardings=self.state_shardings(boxed),
            returns_state=returns_state,
        )
        with self.context():
            return jax.export.export(jitted, platforms=tuple(platforms))(state, batch)

    def fetch_metrics(self, metrics: Any) -> dict[str, float]:
        return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _first_replica(x: jax.Array) -> jax.Array:
    """Device 0's copy of a pmap-replicated array, with no program over every device (`x[0]`
    compiles an all-reduce per leaf, which can deadlock XLA:CPU's collectives)."""
    local = x.addressable_shards[0].data  # [1, ...] on device 0
    return local.reshape(local.shape[1:])


def _replicas_as_global(x: jax.Array) -> jax.Array:
    """pmap's host-local copies [n_local, ...] of every process -> one global array [...]
    replicated over every device. (Orbax's fully_replicated_host_local_array_to_global_array
    keeps the leading axis when a process has one device: it compares shapes to find it.)"""
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    copies = [s.data.reshape(s.data.shape[1:]) for s in shards]  # each [1, ...] -> [...]
    mesh = Mesh(np.asarray(jax.devices()), ("replica",))
    return jax.make_array_from_single_device_arrays(x.shape[1:], NamedSharding(mesh, P()), copies)


PMAP_AXIS = "batch"  # the axis name of compile_step's pmap


def _pmap_sharding() -> NamedSharding:
    """Leading axis over the local devices, in jax.pmap's order, on an axis named like
    pmap's own (a sharding differing only in the name compiles the step a second time)."""
    return NamedSharding(Mesh(np.asarray(jax.local_devices()), (PMAP_AXIS,)), P(PMAP_AXIS))


def _all(args: tuple) -> tuple[int, ...]:
    return tuple(range(len(args)))


def replicate(tree: Any) -> Any:
    """Copy a (single-device) tree onto every local device, stacked on a leading axis."""
    n = jax.local_device_count()
    sharding = _pmap_sharding()
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(jnp.broadcast_to(x, (n, *jnp.shape(x))), sharding), tree
    )


def make_strategy(parallel: Any, devices: Sequence[Any] | None = None) -> Strategy:
    """config.parallel (strategy, mesh, rules) -> MeshStrategy or PmapStrategy, validated.
    `devices`: default jax.devices(); tx_jax.planning passes a topology's, to compile for."""
    kind = parallel.strategy
    if kind not in STRATEGIES:
        raise ValueError(f"parallel.strategy={kind!r}; expected one of {STRATEGIES}")
    rules = _rules(parallel)  # read for pmap too: a malformed table fails either way
    if kind == "pmap":
        return PmapStrategy()
    devices = jax.devices() if devices is None else list(devices)
    sizes = platform_sizes(parallel, devices[0].platform)
    shape = mesh_shape(dict(parallel.mesh), len(devices), sizes)
    return MeshStrategy(Mesh(np.asarray(devices).reshape(shape), MESH_AXES), rules)


def make_abstract_strategy(
    parallel: Any, num_devices: int, platform: str | None = None
) -> MeshStrategy:
    """A MeshStrategy over an AbstractMesh of `num_devices` devices, for lowering steps
    (`MeshStrategy.export_step`) for a platform or slice this host lacks, never running them."""
    if parallel.get("strategy", "mesh") != "mesh":
        raise ValueError(
            f"parallel.strategy={parallel.get('strategy')!r}: an abstract mesh needs 'mesh' "
            "(jax.export lowers jax.jit, not jax.pmap)"
        )
    sizes = platform_sizes(parallel, platform)
    shape = mesh_shape(dict(parallel.get("mesh", {})), num_devices, sizes)
    return MeshStrategy(AbstractMesh(shape, MESH_AXES), _rules(parallel))


def _rules(parallel: Any) -> tuple[tuple[str, Any], ...]:
    rules = parallel.get("rules", DEFAULT_RULES)  # a config's lists -> tuples
    return tuple((name, tuple(a) if isinstance(a, list) else a) for name, a in rules)
