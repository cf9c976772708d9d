"""A run built for a target's devices by the code that trains it, and its programs (train
step per batch shape, eval step, greedy and beam decoding) compiled by the target's own
compiler; no data is read (docs/planning.md says what is built and how)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tx_jax.config import task_of
from tx_jax.data import shards
from tx_jax.data.tokenizer import BOS_ID, EOS_ID
from tx_jax.inference import decoding
from tx_jax.planning import hlo
from tx_jax.planning.targets import Target
from tx_jax.runner.setup import build_model, train_step_fn
from tx_jax.runner.validation import check_batch_divides, validate_config
from tx_jax.training import parallel
from tx_jax.training.step import eval_step

DEFAULT_BEAM = 4  # the paper's beam, planned when the config decodes greedily only


@dataclasses.dataclass
class Program:
    """One compiled program: what the compiler says of it, per device."""

    name: str
    kind: str  # 'train' | 'eval' | 'greedy' | 'beam'
    shapes: dict[str, tuple[int, ...]]  # global input shapes
    compile_seconds: float
    memory: dict[str, int]  # argument, output, alias, temp, code (bytes per device)
    flops: float  # per device, from the compiler's cost analysis
    # per device, likewise (counts traffic inside fusions too); on GPU with the custom calls'
    # operands and results added, which the CPU client's analysis counts as nothing
    bytes_accessed: float
    hbm_bytes: float  # per device: hlo.hbm_traffic of the optimized program
    collectives: dict[str, dict]
    largest_buffers: list[dict]
    extra_bytes: int  # inputs other than the train state (batch, sources), per device
    custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # kernels by name
    # hlo.loop_trips: > 1 when a loop body runs several times (grad accumulation, decoding,
    # a blocked loss), which flops and bytes_accessed count once
    loop_trips: int = 1
    refused: str = ""  # the compiler's reason when it would not compile the program
    # hbm_bytes by what moves them, and the heaviest operations (hlo.traffic_split)
    traffic_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    top_traffic: list[dict] = dataclasses.field(default_factory=list)
    # the compiled program itself, callable where the target's devices are this host's
    # (benchmarks/gpu_step.py times the very program it plans); None when refused
    executable: Any = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class Built:
    """The run as train_and_evaluate would build it, on the target's devices."""

    config: ml_collections.ConfigDict
    target: Target
    strategy: parallel.Strategy
    model_config: Any
    model: nn.Module
    tx: Any
    schedule: Any
    state: Any  # ShapeDtypeStructs with the run's shardings
    num_processes: int
    notes: list[str]

    @property
    def num_devices(self) -> int:
        return self.strategy.mesh.size


def build(config: ml_collections.ConfigDict, target: Target, devices: list) -> Built:
    """Validate `config` and build its run over `devices` (a mesh, as train would)."""
    config = ml_collections.ConfigDict(config.to_dict())
    notes = []
    if config.parallel.strategy != "mesh":
        notes.append(
            f"parallel.strategy={config.parallel.strategy!r} is planned as the data-parallel "
            "mesh it equals (jax.pmap cannot be compiled for devices this host does not have)"
        )
        config.parallel.strategy = "mesh"
        config.parallel.mesh = {"data": -1, "fsdp": 1, "tensor": 1}
    validate_config(config)
    strategy = parallel.make_strategy(config.parallel, devices)
    check_batch_divides(config, strategy)
    model_config, model, tx, schedule, init_fn = build_model(
        config, config.data.vocab_size, BOS_ID, target.platform
    )
    boxed = jax.eval_shape(init_fn)
    shardings = strategy.state_shardings(boxed)
    state = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed),
        shardings,
    )
    processes = len({d.process_index for d in devices})
    return Built(
        config, target, strategy, model_config, model, tx, schedule, state, processes, notes
    )


# ----------------------------------------------------------------------- bytes


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def state_bytes(built: Built) -> dict[str, int]:
    """Per device: parameters, optimizer state, the rest of the train state (step, key)."""
    s = built.state
    params, opt = shard_bytes(s.params), shard_bytes(s.opt_state)
    return {"params": params, "optimizer": opt, "other": shard_bytes(s) - params - opt}


def largest_state_leaves(built: Built, n: int = 5) -> list[dict]:
    leaves = jax.tree_util.tree_leaves_with_path(built.state)
    rows = [
        {"name": jax.tree_util.keystr(path), "shape": list(x.shape), "bytes": shard_bytes([x])}
        for path, x in leaves
    ]
    return sorted(rows, key=lambda r: -r["bytes"])[:n]


# ----------------------------------------------------------------------- compiling


@contextlib.contextmanager
def _optimized():
    """Compile as a run would: without jax_disable_most_optimizations (tests set it), and
    outside the persistent compilation cache (a topology's executables cannot be loaded
    without its client; plans have their own cache, search.py)."""
    keys = ("jax_disable_most_optimizations", "jax_enable_compilation_cache")
    before = {k: jax.config.values[k] for k in keys}
    for k in keys:
        jax.config.update(k, False)
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)


def _cost(compiled, platform: str = "gpu", module: hlo.Module | None = None) -> dict[str, float]:
    """The compiler's cost analysis (per device). XLA:GPU's compile-only executables do not
    implement it (UNIMPLEMENTED); there the same HLO cost analysis runs on the optimized module
    through the CPU client, which counts the partitioned module's FLOPs and bytes just the
    same. On GPU either analysis gives a custom call (cuDNN's attention, a cuBLAS or Pallas
    kernel) no bytes: its operands and results are added as the planner counts them, or a
    kernel of our own would look free (benchmarks/HISTORY.md, "One kernel for the residual,
    dropout and layer norm"); 'custom call bytes' says how much that was."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        optimized = compiled.runtime_executable().hlo_modules()[0]
        cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), optimized)
    cost = dict(cost)
    if platform in ("gpu", "cuda", "rocm"):
        module = module or hlo.parse(compiled.as_text())
        seen = hlo.hbm_traffic(module, custom_calls_only=True)
        cost["bytes accessed"] = cost.get("bytes accessed", 0.0) + seen
        cost["custom call bytes"] = float(seen)
    return cost


_OOM = re.compile(r"Ran out of memory.*?\(([\d.]+)G\) exceeds available \w+ \(([\d.]+)G\)")


def _compile(built: Built, name: str, kind: str, lower, shapes, extra_bytes: int) -> Program:
    start = time.perf_counter()
    with _optimized():
        lowered = lower()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            m = _OOM.search(str(e))
            if m is None:
                raise
            # The TPU compiler refuses a program whose temporaries exceed the HBM: that is
            # the plan's answer (does not fit), with the compiler's own figures.
            memory = dict.fromkeys(("argument", "output", "alias", "code"), 0)
            memory["temp"] = int(float(m.group(1)) * 2**30)
            seconds = time.perf_counter() - start
            refused = Program(
                name, kind, shapes, seconds, memory, 0.0, 0.0, 0.0, {}, [], extra_bytes
            )
            refused.refused = f"the compiler: {m.group(0)}"
            return refused
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    memory = {
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
        "code": int(mem.generated_code_size_in_bytes),
    }
    module = hlo.parse(compiled.as_text())
    cost = _cost(compiled, built.target.platform, module)
    by_kind, top = hlo.traffic_split(module)
    return Program(
        name,
        kind,
        shapes,
        seconds,
        memory,
        float(cost.get("flops", 0.0)),
        float(cost.get("bytes accessed", 0.0)),
        float(hlo.hbm_traffic(module)),
        hlo.collectives(module, built.num_devices),
        hlo.largest_buffers(module),
        extra_bytes,
        hlo.custom_calls(module),
        loop_trips=hlo.loop_trips(module),
        traffic_by_kind=by_kind,
        top_traffic=top,
        executable=compiled,
    )


def available_memory(target: Target) -> float | None:
    """GiB one program may use on a chip of `target`, as its compiler says: it compiles a
    program needing 128 GiB of temporaries on one device and reads the refusal (None when
    the compiler does not say). What chips.py's TPU `available` figures come from."""
    from jax.sharding import Mesh

    mesh = Mesh(target.devices()[:1], ("x",))
    fn = jax.jit(
        lambda x: jnp.cumsum(jnp.exp(x)) * jnp.cumsum(x[::-1]),
        in_shardings=NamedSharding(mesh, P()),
    )
    try:
        with _optimized():
            fn.lower(jax.ShapeDtypeStruct((2**33,), jnp.float32)).compile()
    except jax.errors.JaxRuntimeError as e:
        m = _OOM.search(str(e))
        return float(m.group(2)) if m else None
    return None


def _batch(built: Built, shapes: dict[str, tuple[int, ...]], sharding) -> dict:
    return {k: jax.ShapeDtypeStruct(v, jnp.int32, sharding=sharding) for k, v in shapes.items()}


def train_batches(built: Built) -> list[dict[str, tuple[int, int]]]:
    """Every global train batch shape of the config (one per bucket)."""
    s = built.strategy
    multiple = s.global_batch_multiple * built.config.train.grad_accum_steps
    lm = task_of(built.config) == "lm"
    return shards.train_batch_shapes(built.config.data, batch_multiple=multiple, lm=lm)


def compile_train(built: Built, shapes: dict[str, tuple[int, int]]) -> Program:
    """The train step on one batch shape, the state donated (as the loop runs it)."""
    s = built.strategy
    step_fn = train_step_fn(built.config, built.model, built.tx, built.schedule)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, built.state)
    jitted = s.jit_step(step_fn, donate=True, state_shardings=shardings)
    batch = _batch(built, shapes, s.batch_sharding())

    def lower():
        with s.context():
            return jitted.lower(built.state, batch)

    B, L = shapes["targets"]
    return _compile(built, f"train {B}x{L}", "train", lower, shapes, shard_bytes(batch))


def eval_shapes(built: Built) -> dict[str, tuple[int, int]]:
    """The global eval batch: every process feeds data.eval_batch_size rows."""
    d = built.config.data
    shape = (d.eval_batch_size * built.num_processes, d.max_eval_len)
    keys = ("targets",) if task_of(built.config) == "lm" else ("inputs", "targets")
    return dict.fromkeys(keys, shape)


def compile_eval(built: Built) -> Program:
    s = built.strategy
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, built.state)
    jitted = s.jit_step(
        functools.partial(eval_step, model=built.model),
        donate=False,
        state_shardings=shardings,
        returns_state=False,
    )
    shapes = eval_shapes(built)
    batch = _batch(built, shapes, s.batch_sharding())

    def lower():
        with s.context():
            return jitted.lower(built.state, batch)

    B, L = shapes[next(iter(shapes))]
    return _compile(built, f"eval {B}x{L}", "eval", lower, shapes, shard_bytes(batch))


def decode_beam_size(config: ml_collections.ConfigDict) -> int:
    e = config.eval
    beam = max(int(e.get("test_beam_size") or 0), int(e.beam_size))
    return beam if beam > 1 else DEFAULT_BEAM


def compile_decoding(built: Built, beam_size: int) -> Program:
    """Greedy (beam_size 1) or beam decoding of one eval batch, as quality.py calls it: the
    run's sharded parameters, the sources given whole to every device."""
    d = built.config.data
    shape = (d.eval_batch_size, d.max_eval_len)
    sources = jax.ShapeDtypeStruct(
        shape, jnp.int32, sharding=NamedSharding(built.strategy.mesh, P())
    )
    mc, params = built.model_config, built.state.params
    if beam_size == 1:
        lower = functools.partial(
            decoding.translate_greedy.lower, mc, params, sources, eos_id=EOS_ID
        )
        name, kind = f"greedy {shape[0]}x{shape[1]}", "greedy"
    else:
        lower = functools.partial(
            decoding.translate_beam.lower,
            mc,
            params,
            sources,
            beam_size=beam_size,
            length_penalty=float(built.config.eval.length_penalty),
            eos_id=EOS_ID,
        )
        name, kind = f"beam {beam_size} {shape[0]}x{shape[1]}", "beam"
    return _compile(built, name, kind, lower, {"inputs": shape}, shard_bytes([sources]))


def compile_all(built: Built, programs: tuple[str, ...]) -> list[Program]:
    """The named programs ('train', 'eval', 'greedy', 'beam') of the run, compiled."""
    out = []
    if "train" in programs:
        out += [compile_train(built, shapes) for shapes in train_batches(built)]
    if "eval" in programs:
        out.append(compile_eval(built))
    if task_of(built.config) != "lm":
        if "greedy" in programs:
            out.append(compile_decoding(built, 1))
        if "beam" in programs:
            out.append(compile_decoding(built, decode_beam_size(built.config)))
    return out
