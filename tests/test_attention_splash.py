"""implementation='splash' (JAX's Pallas TPU kernel): run in Pallas interpret mode on the CPU
against the float64 reference and 'xla', and compiled for a TPU v5e from this CPU host."""

from tx_jax.planning.targets import prepare_tpu_compiler

# before libtpu initialises (at the first TPU topology request): no probing for a TPU, and
# other processes (pytest workers, plans) may compile with it at the same time
prepare_tpu_compiler()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import reference_attention  # noqa: E402

from tx_jax.model import attention as A  # noqa: E402
from tx_jax.ops import masks, splash  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    """The kernel's Pallas interpret mode: the TPU kernel's own program, run by XLA on a CPU."""
    monkeypatch.setattr(splash, "_INTERPRET", True)


def _problem(rng, B=2, L=200, S=200, H=4, K=2, D=16, Dv=None):
    q = rng.normal(size=(B, L, H, D)).astype(np.float32)
    k = rng.normal(size=(B, S, K, D)).astype(np.float32)
    v = rng.normal(size=(B, S, K, Dv or D)).astype(np.float32)
    return q, k, v


def _packed_ids(L):
    """[2, L]: row 0 packs three segments then padding; row 1 one segment then padding."""
    ids = np.zeros((2, L), np.int32)
    a, b, c = L // 4, L // 2, 3 * L // 4
    ids[0, :a], ids[0, a:b], ids[0, b:c] = 1, 2, 3
    ids[1, : L - 7] = 1
    return ids


def _attend(q, k, v, impl, **kw):
    return A.dot_product_attention(q, k, v, implementation=impl, **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_splash_with_padding_and_packing_matches_float64_reference(rng, causal, kv_heads):
    """L = 200 is padded to a 256 block inside; packed segments, padding (id 0), causal."""
    q, k, v = _problem(rng, K=kv_heads)
    seg = _packed_ids(200)
    kw = dict(is_causal=causal, q_segment_ids=seg, kv_segment_ids=seg)
    out = _attend(q, k, v, "splash", **kw)
    full = masks.dense_mask(200, 200, **kw)
    ref, _ = reference_attention(q, k, v, mask=np.asarray(full))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, _attend(q, k, v, "xla", **kw), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out[1, -7:], 0.0)  # padding queries: zeros


@pytest.mark.parametrize("L, S", [(128, 256), (77, 150)])
@pytest.mark.parametrize("causal", [False, True])
def test_splash_without_segment_ids_matches_xla(rng, L, S, causal):
    """Whole blocks (no ids at all) and padded lengths (ids made inside); L != S."""
    q, k, v = _problem(rng, L=L, S=S, Dv=8)  # d_v != d_k
    out = _attend(q, k, v, "splash", is_causal=causal)
    full = masks.dense_mask(L, S, is_causal=causal)  # None when not causal
    ref, _ = reference_attention(q, k, v, mask=None if full is None else np.asarray(full))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_splash_query_without_any_key_gives_zeros(rng):
    """Cross attention where query segments 5 (absent from the keys) and 0 (padding) see no
    key, and causal queries whose segment's keys all lie after them: zeros, as 'xla' gives."""
    L, S = 130, 260
    q, k, v = _problem(rng, B=1, L=L, S=S)
    q_seg = np.ones((1, L), np.int32)
    q_seg[0, 40:60], q_seg[0, 60:100], q_seg[0, 120:] = 5, 2, 0
    kv_seg = np.ones((1, S), np.int32)
    kv_seg[0, 80:200], kv_seg[0, 200:] = 2, 0
    for causal in (False, True):
        kw = dict(is_causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
        out = np.asarray(_attend(q, k, v, "splash", **kw))
        np.testing.assert_allclose(out, _attend(q, k, v, "xla", **kw), rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(out[0, 40:60], 0.0)
        np.testing.assert_array_equal(out[0, 120:], 0.0)
        if causal:  # segment 2's keys start at 80: queries 60..79 have none yet
            np.testing.assert_array_equal(out[0, 60:80], 0.0)
            assert np.abs(out[0, 80:100]).max() > 0


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_splash_gradients_equal_xla(rng, kv_heads):
    """Training differentiates it: dq, dk, dv through the kernel's custom VJP (padding,
    packing, causal) equal autodiff of 'xla'."""
    q, k, v = _problem(rng, K=kv_heads)
    seg = _packed_ids(200)
    w = rng.normal(size=(2, 200, 4, 16)).astype(np.float32)  # a loss that weighs every output

    def grads(impl):
        def loss(q, k, v):
            out = _attend(q, k, v, impl, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
            return jnp.sum(out * w)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads("splash"), grads("xla"), strict=True):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_splash_rejects_what_the_kernel_cannot_do(rng):
    q, k, v = _problem(rng, L=128, S=128)
    mask = np.ones((1, 1, 128, 128), bool)
    for kw, name in [
        (dict(mask=mask), "mask"),
        (dict(bias=np.zeros((1, 1, 128, 128), np.float32)), "bias"),
        (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), deterministic=False), "dropout"),
        (dict(return_weights=True), "return_weights"),
    ]:
        with pytest.raises(ValueError, match=name):
            _attend(q, k, v, "splash", **kw)
    # dropout_rate with deterministic=True (evaluation) is no dropout: allowed
    _attend(q, k, v, "splash", dropout_rate=0.1, deterministic=True)


def test_auto_never_picks_splash_until_a_tpu_has_run_it():
    """'splash' has run in Pallas' interpreter and compiled for a TPU, but no TPU has run its
    tests or timed it: 'auto' resolved for a TPU keeps to 'xla' at any length; an explicit
    'splash' is kept (long context)."""
    from tx_jax.model.config import ModelConfig

    auto = ModelConfig(attention_impl="auto", dtype="bfloat16")
    assert auto.resolved("tpu", longest=32768).attention_impl == "xla"
    assert ModelConfig(attention_impl="splash").resolved("tpu").attention_impl == "splash"


def _tpu_devices():
    pytest.importorskip("libtpu", reason="libtpu is not installed: no TPU compiler on this host")
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices


def _train_like_grad(B, L, H, K, D):
    """Forward and backward of one causal, packed attention call in bf16."""

    def grad(q, k, v, seg):
        def loss(q, k, v):
            kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
            return _attend(q, k, v, "splash", **kw).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    bf = jnp.bfloat16
    shapes = (
        jax.ShapeDtypeStruct((B, L, H, D), bf),
        jax.ShapeDtypeStruct((B, L, K, D), bf),
        jax.ShapeDtypeStruct((B, L, K, D), bf),
        jax.ShapeDtypeStruct((B, L), jnp.int32),
    )
    return grad, shapes


@pytest.fixture
def no_cache_writes():
    """Keep TPU executables out of the tests' persistent cache (conftest): this host has no
    TPU client to load them back with, so a later run would only warn about the entries."""
    name = "jax_persistent_cache_min_compile_time_secs"
    old = getattr(jax.config, name)
    jax.config.update(name, float("inf"))
    yield
    jax.config.update(name, old)


def test_splash_compiles_for_a_tpu_from_this_host(monkeypatch, no_cache_writes):
    """Lower and compile (Mosaic, libtpu) for a v5e chip and for a 2x2 slice with the batch
    sharded: the kernel's forward, dq and dkv custom calls are in the TPU executable, and on
    the slice each device runs it on its own examples (no all-gather of q, k, v). conftest's
    JAX_DISABLE_MOST_OPTIMIZATIONS stays on: the kernel compiles with it."""
    devices = _tpu_devices()
    monkeypatch.setattr(splash, "_INTERPRET", False)  # the TPU's own kernel, not interpret
    grad, shapes = _train_like_grad(B=4, L=256, H=4, K=2, D=64)

    one = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
    rep = jax.sharding.NamedSharding(one, jax.P())
    compiled = jax.jit(grad, in_shardings=(rep,) * 4, out_shardings=(rep,) * 3)
    text = compiled.lower(*shapes).compile().as_text()
    assert text.count("tpu_custom_call") >= 3, "forward, dq and dkv kernels"
    assert "splash_mha_fwd" in text

    four = jax.sharding.Mesh(np.array(devices), ("data",))
    data = jax.sharding.NamedSharding(four, jax.P("data"))
    # The mesh and logical rules that training's step sets while tracing (parallel.py).
    with jax.set_mesh(four), nn.logical_axis_rules([("batch", "data"), ("heads", None)]):
        compiled = jax.jit(grad, in_shardings=(data,) * 4, out_shardings=(data,) * 3)
        text = compiled.lower(*shapes).compile().as_text()
    assert text.count("tpu_custom_call") >= 3
    assert "all-gather" not in text
