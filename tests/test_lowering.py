"""The train and eval steps, greedy and beam decoding and the 'cudnn' attention path, lowered
for 'cuda' and 'tpu' on a CPU host (jax.export / jit(...).trace(...).lower(lowering_platforms)).

Lowering produces the StableHLO that the accelerator's compiler would get; it needs no device
of the target (the mesh case lowers for 8 devices of an AbstractMesh) and compiles nothing.
A path that this jaxlib cannot lower for a platform (a lowering rule or plugin missing) is
skipped with jax's message. docs/planning.md ("Accelerator lowering, checked on the CPU")
lists them.
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import default_config
from jax.sharding import PartitionSpec as P

from tx_jax.inference.decoding import translate_beam, translate_greedy
from tx_jax.model import ModelConfig, make_model
from tx_jax.training import optim, parallel
from tx_jax.training.state import init_state
from tx_jax.training.step import eval_step, train_step

PLATFORMS = ("cuda", "tpu")
MESH = {"data": 2, "fsdp": 2, "tensor": 2}  # every axis > 1: 8 abstract devices
BATCH, LENGTH = 8, 16  # the global batch: 2 rows per (data, fsdp) shard
METRICS = ("accuracy", "grad_norm", "loss", "lr", "nll", "nonfinite_run", "nonfinite_total")


@contextlib.contextmanager
def _skip_if_unlowerable(platform: str):
    """Skip (with jax's message) where this jaxlib has no lowering rule for `platform`."""
    try:
        yield
    except NotImplementedError as e:
        if f"platform {platform}" not in str(e) and f"'{platform}'" not in str(e):
            raise
        pytest.skip(f"not lowerable for {platform!r} with this jaxlib: {e}")


@contextlib.contextmanager
def _skip_without_cudnn():
    """Skip where tracing 'cudnn' attention fails because this jaxlib has no CUDA
    (attention.py's ValueError raised from jax's RuntimeError)."""
    try:
        yield
    except ValueError as e:
        if not isinstance(e.__cause__, RuntimeError):
            raise
        pytest.skip(f"'cudnn' attention not lowerable without CUDA's jaxlib: {e.__cause__}")


def _setup(platform: str, **model_overrides):
    """The debug config's model (dropout on: its random bits are lowered too) resolved for
    `platform` as a run there resolves it, its optimizer, and the state's init function, as
    runner/setup.py builds them."""
    c = default_config.get_config("debug")
    c.model.update({"dropout_rate": 0.1, **model_overrides})
    mc = ModelConfig.of_run(c, platform, vocab_size=64, max_len=64)
    model = make_model(mc, "translation")
    tx, schedule = optim.make_optimizer(c.train, mc.d_model)
    return c, mc, model, tx, schedule, functools.partial(init_state, model, tx, c.seed)


def _batch() -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32) for k in ("inputs", "targets")}


def _strategy(num_devices: int) -> parallel.Strategy:
    mesh = MESH if num_devices > 1 else {"data": -1}
    return parallel.make_abstract_strategy({"strategy": "mesh", "mesh": mesh}, num_devices)


def _normal(spec: P, ndim: int) -> tuple:
    """A PartitionSpec padded to `ndim` entries, 1-tuples of axes written as the axis."""
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
    return tuple(entries) + (None,) * (ndim - len(entries))


def _check_mesh_shardings(exported, strategy, boxed_state) -> None:
    """The exported inputs carry the rules' state shardings and the (data, fsdp) batch split;
    the module declares the 2x2x2 mesh and constrains activations to it."""
    text = exported.mlir_module()
    assert 'sdy.mesh @mesh = <["data"=2, "fsdp"=2, "tensor"=2]>' in text
    expected = jax.tree_util.tree_leaves(strategy.state_shardings(boxed_state)) + [
        strategy.batch_sharding()
    ] * len(_batch())
    got = exported.in_shardings_jax(strategy.mesh)
    assert len(got) == len(expected) == len(exported.in_avals)
    kept = exported.module_kept_var_idx  # inputs the step reads (eval: params and batch)
    n_params = len(jax.tree_util.tree_leaves(boxed_state.params))
    assert set(range(1, 1 + n_params)) | {len(got) - 2, len(got) - 1} <= set(kept)
    specs = set()
    for i in kept:
        ndim = exported.in_avals[i].ndim
        assert _normal(got[i].spec, ndim) == _normal(expected[i].spec, ndim)
        specs.add(_normal(got[i].spec, ndim))
    # Parameters sharded over fsdp and tensor both (e.g. the [vocab, embed] table), and the
    # batch over (data, fsdp): the rules reached the lowered module.
    assert ("tensor", "fsdp") in specs and (("data", "fsdp"), None) in specs
    assert "sdy.sharding_constraint" in text and '[{"data", "fsdp"}, {}, {}]' in text


@pytest.mark.parametrize("num_devices", [1, 8], ids=["one_device", "mesh_2x2x2"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_train_step_lowers(platform, num_devices):
    _, mc, model, tx, schedule, init_fn = _setup(platform)
    # what 'auto' resolves to off a CPU: jax's own kernels and masks, XLA's attention in float32
    assert (mc.kernels, mc.dropout_bits, mc.attention_impl) == ("generic", "bernoulli", "xla")
    step_fn = functools.partial(
        train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1
    )
    strategy = _strategy(num_devices)
    with _skip_if_unlowerable(platform):
        exported = strategy.export_step(step_fn, init_fn, _batch(), [platform], donate=True)
    assert exported.platforms == (platform,)
    assert exported.nr_devices == num_devices
    boxed = jax.eval_shape(init_fn)
    state_avals = [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(nn.meta.unbox(boxed))]
    n = len(state_avals)
    # In: the state then the batch; out: the new state (same avals), then scalar metrics.
    assert [(a.shape, a.dtype) for a in exported.in_avals[:n]] == state_avals
    assert [a.shape for a in exported.in_avals[n:]] == [(BATCH, LENGTH)] * 2
    assert [(a.shape, a.dtype) for a in exported.out_avals[:n]] == state_avals
    assert all(a.shape == () for a in exported.out_avals[n:])
    text = exported.mlir_module()
    for name in METRICS:
        assert f"result[1]['{name}']" in text
    assert "tf.aliasing_output" in text  # the donated state is written in place
    assert "stablehlo.dot_general" in text
    # a non-finite update is skipped by a select per leaf, written in place, not a conditional
    assert "stablehlo.case" not in text and "stablehlo.select" in text
    assert "optimization_barrier" not in text  # no CPU-tuned kernel in an accelerator step
    if num_devices > 1:
        _check_mesh_shardings(exported, strategy, boxed)


@pytest.mark.parametrize("num_devices", [1, 8], ids=["one_device", "mesh_2x2x2"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_eval_step_lowers(platform, num_devices):
    _, _, model, _, _, init_fn = _setup(platform)
    strategy = _strategy(num_devices)
    step_fn = functools.partial(eval_step, model=model)
    with _skip_if_unlowerable(platform):
        exported = strategy.export_step(step_fn, init_fn, _batch(), [platform], returns_state=False)
    assert exported.platforms == (platform,) and exported.nr_devices == num_devices
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [((), jnp.float32)] * 3
    text = exported.mlir_module()
    for name in ("correct", "nll", "weight"):
        assert f"result['{name}']" in text
    assert "tf.aliasing_output" not in text  # eval does not donate the state
    if num_devices > 1:
        _check_mesh_shardings(exported, strategy, jax.eval_shape(init_fn))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_greedy_and_beam_decoding_lower(platform):
    _, mc, _, _, _, init_fn = _setup(platform)
    params = nn.meta.unbox(jax.eval_shape(init_fn)).params
    inputs = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    T, N = 10, 3
    with _skip_if_unlowerable(platform):
        greedy = jax.export.export(translate_greedy, platforms=[platform])(
            mc, params, inputs, max_decode_len=T
        )
        beam = jax.export.export(translate_beam, platforms=[platform])(
            mc, params, inputs, beam_size=N, max_decode_len=T
        )
    for exported in (greedy, beam):
        assert exported.platforms == (platform,)
        assert exported.in_avals[-1].shape == (2, 8)
        # One lax.while_loop over the KV-cached decoder steps.
        assert "stablehlo.while" in exported.mlir_module()
    assert [(a.shape, a.dtype) for a in greedy.out_avals] == [((2, T), jnp.int32)]
    assert [(a.shape, a.dtype) for a in beam.out_avals] == [
        ((2, N, T), jnp.int32),
        ((2, N), jnp.float32),
    ]


def test_cudnn_attention_lowers_for_cuda():
    """A bf16 run resolved for a GPU takes cuDNN's fused attention: its train step lowers to
    it, forward and backward. Lowered on one device, not exported: the cuDNN primitive needs
    concrete devices during lowering (no AbstractMesh), and jax.export refuses its custom
    call (no compatibility guarantee)."""
    _, mc, model, tx, schedule, init_fn = _setup("cuda", dtype="bfloat16", dropout_rate=0.0)
    assert mc.attention_impl == "cudnn"
    step_fn = functools.partial(
        train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1
    )
    with _skip_without_cudnn():  # init traces the model too: its shapes come under the check
        state = nn.meta.unbox(jax.eval_shape(init_fn))
        traced = jax.jit(step_fn).trace(state, _batch())
    with _skip_if_unlowerable("cuda"):
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmha" in text
    assert "Backward" in text  # the gradient goes through cuDNN's backward kernel
    assert "fmhaScaleBiasSoftmax" in text  # 'cudnn': the masks as a dense bias


def _fmha_calls(text: str) -> list[str]:
    """The cuDNN attention custom calls of a lowered module, one line each."""
    return [line for line in text.splitlines() if "__cudnn$fmha" in line]


def test_cudnn_bias_has_every_head():
    """A packed causal mask [B, 1, L, L] reaches cuDNN as a [B, H, L, L] bias. The backward
    writes dq, dk and dv, and through jax.nn's call a bias gradient of the bias's shape as
    well (jax 0.10 asks for it whatever the bias; a jax that skips it for a boolean mask does
    not)."""
    from tx_jax.model import attention as A

    impl, heads = "cudnn", 4
    B, L, H, D = 2, 128, 4, 64  # L != D: the bias's type is no other operand's
    q = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, L), jnp.int32)

    def loss(q, k, v, seg):
        kw = {"q_segment_ids": seg, "kv_segment_ids": seg, "is_causal": True}
        out = A.dot_product_attention(q, k, v, implementation=impl, **kw)
        return out.astype(jnp.float32).sum()

    with _skip_without_cudnn():
        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q, seg)
    with _skip_if_unlowerable("cuda"):
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls = _fmha_calls(text)
    fwd = [c for c in calls if "@__cudnn$fmhaScaleBiasSoftmax(" in c]
    bwd = [c for c in calls if "@__cudnn$fmhaScaleBiasSoftmaxBackward(" in c]
    assert len(fwd) == len(bwd) == 1, [c[:120] for c in calls]
    bias = f"tensor<{B}x{heads}x{L}x{L}xbf16>"
    other = f"tensor<{B}x{H + 1 - heads}x{L}x{L}xbf16>"
    assert bias in fwd[0] and other not in fwd[0], fwd[0][-400:]
    result = bwd[0].rsplit("->", 1)[1]  # dq, dk, dv, workspace
    assert bias in bwd[0].rsplit("->", 1)[0]  # the backward reads the bias
    dbias = result.count("bf16>") - 3  # after dq, dk, dv
    assert other not in result, result
    assert dbias in (0, 1) and (bias in result) == (dbias == 1), result


def test_abstract_strategy_names_bad_config():
    with pytest.raises(ValueError, match="parallel.strategy='pmap'"):
        parallel.make_abstract_strategy({"strategy": "pmap"}, 8)
    with pytest.raises(ValueError, match="parallel.mesh"):
        parallel.make_abstract_strategy({"strategy": "mesh", "mesh": {"data": 3}}, 8)
    strategy = parallel.make_abstract_strategy({"strategy": "mesh", "mesh": {"fsdp": -1}}, 8)
    assert dict(strategy.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert strategy.global_batch_multiple == 8


def test_a_mesh_axis_of_zero_takes_the_platforms_size_where_it_fits():
    """parallel.mesh's 0: mesh_by_platform's size on that platform where it divides the
    devices, else 1; an explicit size wins; a bad entry is named."""
    p = {
        "strategy": "mesh",
        "mesh": {"data": -1, "fsdp": 1, "tensor": 0},
        "mesh_by_platform": {"tpu": {"tensor": 2}},
    }

    def shape(n, platform, **mesh):
        q = {**p, "mesh": {**p["mesh"], **mesh}}
        return tuple(parallel.make_abstract_strategy(q, n, platform).mesh.shape.values())

    assert shape(16, "tpu") == (8, 1, 2)
    assert shape(16, "gpu") == (16, 1, 1) and shape(16, None) == (16, 1, 1)
    assert shape(1, "tpu") == (1, 1, 1)  # 2 does not divide one chip
    assert shape(16, "tpu", tensor=1) == (16, 1, 1)
    assert shape(16, "tpu", fsdp=0) == (8, 1, 2)  # no fsdp entry: 1
    with pytest.raises(ValueError, match="mesh_by_platform.tpu has unknown axes"):
        parallel.make_abstract_strategy({**p, "mesh_by_platform": {"tpu": {"model": 2}}}, 16, "tpu")
