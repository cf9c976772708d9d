"""Matmuls whose backward passes suit XLA:CPU's dot kernels (same math as autodiff).

    dense(x, w):           x [..., K] @ w [K, N] -> [..., N]        (projections, FFN)
    tied_logits(x, table): x [B, L, M] @ table [V, M]^T -> [B, L, V] (tied output layer)

For y = x w over T = prod(...) rows, autodiff's weight gradient is dw = x^T g, a dot that
contracts the rows of both operands. XLA:CPU's fast (YNNPACK) dot wants the contracted axis
minor on the left operand and major on the right, and reaches that form by transposing
whichever operand layout assignment picks: it can copy the *larger* operand (the
[T, F] FFN hidden activations, or the [T, V] logits cotangent) into transposed order, in the
fusion that produced it, and then sometimes run a slower generic dot. Here the backward
materialises the transpose of the *smaller* operand behind an optimisation barrier, so the
weight gradient is one canonical dot: x^T [K, T] when K <= N (every projection), and g^T
[N, T] when K > N (the FFN's second matrix, whose [T, 4d] input would be a 4x larger copy),
computing dw^T = g^T x and transposing the small [N, K] result. benchmarks/HISTORY.md
('Optimisations and their measured effect') has the effect.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def _dot(spec: str, a: Array, b: Array, precision: Any = None) -> Array:
    """einsum in a's dtype; bfloat16 operands accumulate and return float32 from the dot, then
    round: XLA:CPU's bfloat16-out dots are slower than float32 ones, its float32-out ones use
    the CPU's bfloat16 matrix units (AMX) where it has them."""
    if a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16:
        out = jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)
        return out.astype(a.dtype)
    return jnp.einsum(spec, a, b, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x: Array, w: Array, precision: Any = None) -> Array:
    """x [..., K], w [K, N] -> [..., N] (x's dtype; cast w beforehand)."""
    return _dot("...k,kn->...n", x, w, precision)


def _dense_fwd(x, w, precision):
    return dense(x, w, precision), (x, w)


def _dense_bwd(precision, residuals, g):
    x, w = residuals
    K, N = w.shape
    dx = _dot("...n,kn->...k", g, w.astype(g.dtype), precision)
    x, g = x.reshape(-1, K).astype(g.dtype), g.reshape(-1, N)
    if K <= N:  # dw = x^T g with x^T [K, T] materialised
        x_t = jax.lax.optimization_barrier(x.T)
        dw = _contract_rows(x_t, g, precision)
    else:  # the FFN's second matrix: dw^T = g^T x with g^T [N, T], then transpose [N, K]
        g_t = jax.lax.optimization_barrier(g.T)
        dw_t = _contract_rows(g_t, x, precision)
        dw = jax.lax.optimization_barrier(dw_t).T
    return dx.astype(x.dtype), dw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def _contract_rows(a_t: Array, b: Array, precision: Any = None) -> Array:
    """a_t [P, T] @ b [T, Q] -> [P, Q] (a's dtype), the weight gradients' long contraction.
    bfloat16: T is split into two contracted axes [T / c, c]. XLA:CPU turns a bfloat16 dot
    over one long axis of an array transposed in the program into a float32 one (both
    operands converted, the float32 kernel), but keeps the split form in bfloat16 for
    YNNPACK; same sum (BENCHMARKS.md has the figures)."""
    T = a_t.shape[1]
    c = next((c for c in (128, 64, 32, 16, 8) if T % c == 0), 0)
    if a_t.dtype != jnp.bfloat16 or not c:
        return _dot("pt,tq->pq", a_t, b, precision)
    a3 = a_t.reshape(a_t.shape[0], T // c, c)
    b3 = b.reshape(T // c, c, b.shape[1])
    out = jnp.einsum("pac,acq->pq", a3, b3, precision=precision, preferred_element_type=jnp.float32)
    return out.astype(a_t.dtype)


@jax.custom_vjp
def bias_add(y: Array, b: Array) -> Array:
    """y [..., N] + b [N] (y's dtype). Its bias gradient sums the cotangent over every row
    as one [rows, N] array: autodiff's sum over [B, L, N]'s two leading axes became a slow
    tree reduction (reduce-window) in bfloat16 on XLA:CPU."""
    return y + b.astype(y.dtype)


def _bias_add_fwd(y: Array, b: Array):
    return bias_add(y, b), b


def _bias_add_bwd(b: Array, g: Array):
    db = jnp.sum(g.reshape(-1, g.shape[-1]).astype(jnp.float32), axis=0)
    return g, db.astype(b.dtype)


bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


@jax.custom_vjp
def tied_logits(x: Array, table: Array) -> Array:
    """x [B, L, M], table E [V, M] -> x E^T [B, L, V].

    Autodiff computes dE = g^T x as einsum('blv,blm->vm') and XLA:CPU transposes the
    [B*L, V] cotangent g (the largest array of the step) inside the fusion that produces it.
    dE^T = x^T g ('blm,blv->mv': the transpose falls on the small x), then transposing the
    [M, V] result, is the same arithmetic without that copy.
    """
    return _dot("blm,vm->blv", x, table)


def _tied_logits_fwd(x: Array, table: Array):
    return tied_logits(x, table), (x, table)


def _tied_logits_bwd(residuals, g: Array):
    x, table = residuals
    dx = _dot("blv,vm->blm", g, table.astype(g.dtype)).astype(x.dtype)
    if g.dtype == jnp.bfloat16:  # x^T [M, B*L] materialised: _contract_rows' fast form
        B, L, M = x.shape
        x_t = jax.lax.optimization_barrier(x.astype(g.dtype).reshape(B * L, M).T)
        d_table_t = _contract_rows(x_t, g.reshape(B * L, -1))
    else:
        d_table_t = _dot("blm,blv->mv", x.astype(g.dtype), g)
    # Without the barrier XLA folds the transpose back into the dot (and the copy returns).
    d_table_t = jax.lax.optimization_barrier(d_table_t)
    return dx, d_table_t.T.astype(table.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)
