"""Decoding data-parallel over a process's local devices.

    devices = data_parallel.devices_for(params)      # [d]: decode where params are
    groups = data_parallel.group_batches(batches, len(devices))
    run = data_parallel.Rows(devices)
    tokens = run(fn, static, params, group["inputs"])  # fn(params, inputs [b, S], **static)

A translation depends on its own source only (decoding.output_limits), so a batch's rows can
be split across devices, each running its own search loop over its share: a shard_map with
no collective, so a device whose rows are finished stops while the others go on. Evaluation
and `translate` use every local device of the parameters' platform when the parameters sit on
one device: a TPU VM's or GPU host's chips, or a CPU host's cores, which the checkpoint CLIs
make into as many XLA devices (backend.split_host_cpu): small decoding batches keep one core
busy each far better than XLA:CPU splits one batch's small operations over two.

`group_batches` stacks D consecutive eval batches (sorted by length, so of like lengths) into
one batch of D x B rows, batch k's rows on device k: a device decodes exactly what it would
have decoded alone, and the outputs are the same for any D (tests/test_evaluate.py).
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
    one device (a restored checkpoint), else that one device's list or, for parameters spread
    over a mesh (a training run's), the empty list (decode on the mesh as it is)."""
    placed = {d for x in jax.tree.leaves(params) if isinstance(x, jax.Array) for d in x.devices()}
    if len(placed) != 1:
        return []
    (device,) = placed
    return [d for d in jax.local_devices(backend=device.platform)] or [device]


def group_batches(batches: Sequence[dict[str, np.ndarray]], n: int) -> list[dict[str, np.ndarray]]:
    """Eval batches (inputs [B, S_i], example_index [B], example_mask [B]) -> batches of n x B
    rows: n consecutive ones, their inputs padded to the longest S among them (padding changes
    no output), a last short group filled with padding rows (example_mask 0: nothing decoded)."""
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
    """fn(params, inputs [D * b, S], **static) with each device's b rows decoded there alone.

    fn's outputs are pytrees of [rows, ...] arrays. The per-device program is
    compilation.program's (kept on disk with the persistent cache); one sharded program per
    (fn, static, shape), built on first use."""

    def __init__(self, devices: Sequence[jax.Device]):
        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self._params: tuple[int, Any] | None = None

    def replicated(self, params: Any) -> Any:
        """params on every device (copied once per params object)."""
        if self._params is None or self._params[0] != id(params):
            self._params = (id(params), jax.device_put(params, NamedSharding(self.mesh, P())))
        return self._params[1]

    def __call__(self, fn: Callable, static: dict[str, Any], params: Any, inputs: Any) -> Any:
        n = len(self.devices)
        if n == 1:
            return compilation.cached_call(
                fn, static, params, jax.device_put(inputs, self.devices[0])
            )
        if inputs.shape[0] % n:
            raise ValueError(f"{inputs.shape[0]} rows do not split over {n} devices")
        params = self.replicated(params)
        key = (tuple(self.devices), fn, repr(sorted(static.items())), inputs.shape, inputs.dtype)
        call = _programs.get(key)
        if call is None:
            shard = jax.ShapeDtypeStruct((inputs.shape[0] // n, *inputs.shape[1:]), inputs.dtype)
            spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
            per_device = compilation.program(fn, static, spec, shard)
            call = jax.jit(
                jax.shard_map(
                    per_device, mesh=self.mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS)
                )
            )
            _programs[key] = call
        return call(params, jax.device_put(inputs, NamedSharding(self.mesh, P(AXIS))))
