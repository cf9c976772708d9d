"""tx_jax.ops.matmul: the layout-aware VJPs give autodiff's gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.ops import matmul


def _vjps(fn, ref, *args, cot):
    out, vjp = jax.vjp(fn, *args)
    ref_out, ref_vjp = jax.vjp(ref, *args)
    return (out, ref_out), zip(jax.jit(vjp)(cot), ref_vjp(cot))


@pytest.mark.parametrize("lead", [(6,), (2, 5), (2, 3, 4)])
@pytest.mark.parametrize("k,n", [(8, 3), (3, 8), (4, 4)])  # both branches of the weight grad
def test_dense_equals_autodiff_of_the_einsum(lead, k, n):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(*lead, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(*lead, n)), jnp.float32)
    (out, ref), grads = _vjps(
        matmul.dense, lambda a, b: jnp.einsum("...k,kn->...n", a, b), x, w, cot=g
    )
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    for ours, theirs in grads:
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_dense_keeps_dtypes():
    x = jnp.ones((2, 4, 8), jnp.bfloat16)
    w = jnp.ones((8, 3), jnp.bfloat16)
    dx, dw = jax.grad(lambda a, b: matmul.dense(a, b).astype(jnp.float32).sum(), (0, 1))(x, w)
    assert (matmul.dense(x, w).dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    np.testing.assert_array_equal(np.asarray(dw, np.float32), 8.0)  # 2 * 4 rows of ones


def test_tied_logits_equal_autodiff_of_the_einsum():
    """dE computed as (x^T g)^T gives autodiff's gradient."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(11, 8)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 5, 11)), jnp.float32)
    (out, ref), grads = _vjps(
        matmul.tied_logits, lambda a, b: jnp.einsum("blm,vm->blv", a, b), x, table, cot=g
    )
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    for ours, theirs in grads:
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
