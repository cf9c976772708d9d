"""Decoding data-parallel over a process's local devices.

    devices = data_parallel.devices_for(params)      # where params are; [] for a mesh
    groups = data_parallel.group_batches(batches, len(devices))
    run = data_parallel.Rows(devices, params)
    tokens = run(fn, static, group["inputs"])       # fn(params, inputs [b, S], **static)

A translation depends on its own source only, so a batch's rows can be split across devices,
each running its own search loop (a shard_map with no collective: a device whose rows are
finished stops). Parameters on one device are decoded on every local device of their
platform; a CPU host keeps its one device by default, threads (compilation.dispatch)
running its batches side by side. `group_batches` stacks D consecutive eval batches, batch
k's rows on device k, so the outputs are the same for any D.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tx_jax.inference import compilation

AXIS = "rows"
_programs: dict[Any, Callable] = {}  # (devices, fn, static, shape) -> the sharded program


def devices_for(params: Any) -> list[jax.Device]:
    """Where to decode with `params`: every local device of their platform when they all sit on
    one device (a restored checkpoint); [] for parameters over a mesh (decode on it)."""
    placed = {d for x in jax.tree.leaves(params) if isinstance(x, jax.Array) for d in x.devices()}
    if len(placed) != 1:
        return []
    (device,) = placed
    return jax.local_devices(backend=device.platform) or [device]


def group_batches(batches: Sequence[dict[str, np.ndarray]], n: int) -> list[dict[str, np.ndarray]]:
    """Eval batches (inputs [B, S_i], example_index [B], example_mask [B]) -> batches of n x B
    rows: n consecutive ones padded to their longest S, a last short group filled with
    padding rows (example_mask 0: nothing decoded)."""
    if n <= 1:
        return list(batches)
    out = []
    for start in range(0, len(batches), n):
        part = list(batches[start : start + n])
        B = part[0]["inputs"].shape[0]
        S = max(b["inputs"].shape[1] for b in part)
        inputs = np.zeros((n * B, S), part[0]["inputs"].dtype)
        index = np.full((n * B,), -1, np.int32)
        mask = np.zeros((n * B,), np.int32)
        for k, b in enumerate(part):
            rows = slice(k * B, (k + 1) * B)
            inputs[rows, : b["inputs"].shape[1]] = b["inputs"]
            index[rows], mask[rows] = b["example_index"], b["example_mask"]
        out.append({"inputs": inputs, "example_index": index, "example_mask": mask})
    return out


class Rows:
    """fn(params, inputs [D * b, S], **static) -> pytrees of [rows, ...], each device's b rows
    decoded there alone; one sharded program per (devices, fn, static, shape)."""

    def __init__(self, devices: Sequence[jax.Device], params: Any):
        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        if len(self.devices) == 1:
            self.params = jax.device_put(params, self.devices[0])
        else:
            self.params = jax.device_put(params, NamedSharding(self.mesh, P()))

    def __call__(self, fn: Callable, static: dict[str, Any], inputs: Any) -> Any:
        n = len(self.devices)
        if n == 1:
            inputs = jax.device_put(inputs, self.devices[0])
            return compilation.cached_call(fn, static, self.params, inputs)
        if inputs.shape[0] % n:
            raise ValueError(f"{inputs.shape[0]} rows do not split over {n} devices")
        key = (tuple(self.devices), fn, repr(sorted(static.items())), inputs.shape, inputs.dtype)
        call = _programs.get(key)
        if call is None:
            shard = jax.ShapeDtypeStruct((inputs.shape[0] // n, *inputs.shape[1:]), inputs.dtype)
            spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
            per_device = compilation.program(fn, static, spec, shard)
            call = jax.jit(
                jax.shard_map(
                    per_device, mesh=self.mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS)
                )
            )
            _programs[key] = call
        return call(self.params, jax.device_put(inputs, NamedSharding(self.mesh, P(AXIS))))
