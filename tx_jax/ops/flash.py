"""Blockwise attention with a FlashAttention-style custom VJP: the 'chunked' implementation.

Shape letters (as in model/attention.py): B batch, L query length, S key length, K key/value heads,
G = H // K query heads per key/value head, Dk the query/key and Dv the value head dim (the
paper's d_k and d_v; einsums write both as d); Q and C are the query and key block lengths
(both `chunk_size`), nq = ceil(L / Q) and nk = ceil(S / C) the block counts.

Forward (Milakov & Gimelshein 2018; Rabe & Staats 2021; Dao et al. 2022): for each block of
Q queries, scan over key blocks keeping the running max m, normaliser l and unnormalised
output o, each block rescaling them by exp(m_old - m_new). Only an [B, K, G, Q, C] score block
exists at a time, so memory is O(B H (Q C + L Dv)) instead of O(B H L S).

Backward (Dao 2023, FlashAttention-2, algorithm 2): the forward saves only its output and the
row log-sum-exp lse = m + log l, and the backward recomputes each block's probabilities
p = exp(s - lse). With delta_i = sum_d dO_id O_id:
    dV_j += p^T dO      dP = dO V^T      dS = p * (dP - delta)
    dQ_i += dS K_j / sqrt(Dk)            dK_j += dS^T Q_i / sqrt(Dk)
Dropout on the weights is redrawn per block from fold_in(fold_in(rng, i), j), the same draw
in both passes. Causal attention skips key blocks that lie wholly after a query block
(lax.cond), in both passes, so it does about half the work of the dense computation.

Masks are as in model/attention.py: a boolean `mask` broadcastable to [B, H, L, S], causal, and
segment ids (0 = padding). A query that may attend to nothing gets zeros (and zero
gradients). An additive bias is refused (ops/attention_kernels.py): it is O(L S) memory by
itself, which is what blockwise attention avoids, and no model passes one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.ops.kernels import effective_rate, keep_mask

Array = jax.Array
_NEG = -1e30  # finite "minus infinity" (model/attention.py)


def flash_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    is_causal: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    chunk_size: int = 512,
    precision: Any = None,
    dropout_bits: str = "bernoulli",
) -> Array:
    """[B, L, H, Dk] queries, [B, S, K, Dk] keys, [B, S, K, Dv] values -> [B, L, H, Dv] in
    value's dtype.

    Same contract as dot_product_attention(..., implementation='chunked') without a bias.
    """
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs a dropout_rng")
    L, S = query.shape[1], key.shape[1]
    spec = _Spec(
        is_causal=is_causal,
        q_block=min(chunk_size, L),
        k_block=min(chunk_size, S),
        rate=float(dropout_rate) if dropout_rng is not None else 0.0,
        precision=precision,
        bits=dropout_bits,
    )
    extras = (mask, q_segment_ids, kv_segment_ids, dropout_rng)
    return _flash(spec, query, key, value, extras)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static (hashable) settings of one call."""

    is_causal: bool
    q_block: int
    k_block: int
    rate: float
    precision: Any
    bits: str = "bernoulli"  # the dropout masks' bits (ModelConfig.dropout_bits)


# ------------------------------------------------------------------------- block layout


def to_kg(x: Array | None, K: int) -> Array | None:
    """A mask/bias broadcastable to [B, H, L, S] -> [B|1, K|1, G|1, L|1, S|1] (H = K * G)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, h, l, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, l, s)
    return x.reshape(b, K, h // K, l, s)


def _pad_to(x: Array, axis: int, length: int, fill) -> Array:
    if x.shape[axis] in (1, length):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def _blocks(x: Array, axis: int, n: int, size: int, fill) -> Array:
    """Pad `axis` to n * size and move its n blocks to a new leading axis."""
    x = _pad_to(x, axis, n * size, fill)
    x = x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


class _Problem:
    """Padded, blocked views of one call's arrays, and the per-block scores/masks."""

    def __init__(self, spec: _Spec, q: Array, k: Array, v: Array, extras):
        mask, q_seg, kv_seg, rng = extras
        B, L, H, D = q.shape
        S, K = k.shape[1], k.shape[2]
        self.spec, self.shape, self.dv = spec, (B, L, S, H, K, D), v.shape[-1]
        Q, C = spec.q_block, spec.k_block
        self.nq, self.nk = -(-L // Q), -(-S // C)
        self.scale = 1.0 / math.sqrt(D)
        q = (q * jnp.asarray(self.scale, q.dtype)).reshape(B, L, K, H // K, D)
        self.q = _blocks(q, 1, self.nq, Q, 0)  # [nq, B, Q, K, G, D]
        self.k = _blocks(k, 1, self.nk, C, 0)  # [nk, B, C, K, D]
        self.v = _blocks(v, 1, self.nk, C, 0)
        self.k_valid = _blocks(jnp.ones((S,), bool), 0, self.nk, C, False)  # [nk, C]
        self.q_seg = None if q_seg is None else _blocks(q_seg, 1, self.nq, Q, 0)  # [nq, B, Q]
        self.kv_seg = None if kv_seg is None else _blocks(kv_seg, 1, self.nk, C, 0)
        mask = to_kg(mask, K)
        if mask is not None:  # sliced per block: pad its non-broadcast L and S axes
            mask = _pad_to(_pad_to(mask, 3, self.nq * Q, False), 4, self.nk * C, False)
        self.mask, self.rng = mask, rng

    def needed(self, i, j) -> Array:
        """False when causal masking hides the whole key block j from query block i."""
        if not self.spec.is_causal:
            return jnp.asarray(True)
        return j * self.spec.k_block <= i * self.spec.q_block + self.spec.q_block - 1

    def scores(self, qb, kb, i, j, q_seg, kv_seg, k_valid) -> tuple[Array, Array]:
        """s [B, K, G, Q, C] float32 and where it may attend."""
        Q, C = self.spec.q_block, self.spec.k_block
        s = jnp.einsum(
            "bqkgd,bckd->bkgqc",
            qb,
            kb,
            precision=self.spec.precision,
            preferred_element_type=jnp.float32,
        )
        allowed = k_valid[None, None, None, None, :]
        if self.mask is not None:
            m = self.mask
            starts = [0, 0, 0, i * Q if m.shape[3] > 1 else 0, j * C if m.shape[4] > 1 else 0]
            sizes = [*m.shape[:3], Q if m.shape[3] > 1 else 1, C if m.shape[4] > 1 else 1]
            allowed = allowed & lax.dynamic_slice(m, starts, sizes)
        if self.spec.is_causal:
            q_pos = i * Q + jnp.arange(Q)
            k_pos = j * C + jnp.arange(C)
            allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
        if q_seg is not None:
            ks = kv_seg[:, None, None, None, :]
            allowed = allowed & (q_seg[:, None, None, :, None] == ks) & (ks != 0)
        return jnp.where(allowed, s, _NEG), allowed

    def dropout(self, p: Array, i, j) -> Array:
        """p with the block's dropout applied (the same draw in forward and backward)."""
        if self.spec.rate == 0.0:
            return p
        rng = jax.random.fold_in(jax.random.fold_in(self.rng, i), j)
        spec = self.spec
        keep = keep_mask(rng, spec.rate, p.shape, spec.bits)
        return jnp.where(keep, p / (1.0 - effective_rate(spec.rate, spec.bits)), 0.0)

    def unblock(self, x: Array, n: int, length: int) -> Array:
        """[n, B, block, ...] -> [B, length, ...] (padding dropped)."""
        x = jnp.moveaxis(x, 0, 1)
        x = x.reshape(x.shape[0], -1, *x.shape[3:])
        return x[:, :length]


def _optional(x: Array | None, i) -> Array | None:
    return None if x is None else x[i]


# ------------------------------------------------------------------------------ forward


def _forward(spec: _Spec, q: Array, k: Array, v: Array, extras) -> tuple[Array, Array]:
    """-> out [B, L, H, Dv] (value dtype), lse [nq, B, K, G, Q] float32."""
    P = _Problem(spec, q, k, v, extras)
    B, L, S, H, K, _ = P.shape
    D = P.dv  # the output's (and o's) head dim
    G, Q = H // K, spec.q_block

    def query_block(i):
        qb, q_seg = P.q[i], _optional(P.q_seg, i)

        def key_block(carry, j):
            def compute(carry):
                o, m, l = carry  # [B, Q, K, G, Dv], [B, K, G, Q], [B, K, G, Q]; float32
                s, allowed = P.scores(qb, P.k[j], i, j, q_seg, _optional(P.kv_seg, j), P.k_valid[j])
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                l_new = l * corr + p.sum(-1)
                p = P.dropout(p, i, j)
                pv = jnp.einsum(
                    "bkgqc,bckd->bqkgd",
                    p.astype(v.dtype),
                    P.v[j],
                    precision=spec.precision,
                    preferred_element_type=jnp.float32,
                )
                o_new = o * jnp.moveaxis(corr, 3, 1)[..., None] + pv
                return o_new, m_new, l_new

            return lax.cond(P.needed(i, j), compute, lambda c: c, carry), None

        init = (
            jnp.zeros((B, Q, K, G, D), jnp.float32),
            jnp.full((B, K, G, Q), _NEG, jnp.float32),
            jnp.zeros((B, K, G, Q), jnp.float32),
        )
        (o, m, l), _ = lax.scan(key_block, init, jnp.arange(P.nk))
        out = o / jnp.moveaxis(jnp.where(l == 0.0, 1.0, l), 3, 1)[..., None]
        lse = jnp.where(l > 0.0, m + jnp.log(jnp.where(l > 0.0, l, 1.0)), 0.0)
        return out.astype(v.dtype), lse

    out, lse = lax.map(query_block, jnp.arange(P.nq))  # [nq, B, Q, K, G, Dv], [nq, B, K, G, Q]
    return P.unblock(out, P.nq, L).reshape(B, L, H, D), lse


# ----------------------------------------------------------------------------- backward


def _backward(spec: _Spec, q, k, v, extras, out, lse, d_out):
    P = _Problem(spec, q, k, v, extras)
    B, L, S, H, K, D = P.shape
    G, Q, C, Dv = H // K, spec.q_block, spec.k_block, P.dv
    d_out = d_out.reshape(B, L, K, G, Dv)
    delta = jnp.sum(
        d_out.astype(jnp.float32) * out.reshape(B, L, K, G, Dv).astype(jnp.float32), axis=-1
    )
    delta = _blocks(jnp.moveaxis(delta, 1, -1), 3, P.nq, Q, 0.0)  # [nq, B, K, G, Q]
    do_blocks = _blocks(d_out, 1, P.nq, Q, 0)  # [nq, B, Q, K, G, Dv]

    def key_block(dq, j):
        kb, vb = P.k[j], P.v[j]
        kv_seg, k_valid = _optional(P.kv_seg, j), P.k_valid[j]

        def query_block(carry, i):
            def compute(carry):
                dk, dv = carry
                qb, dob = P.q[i], do_blocks[i]
                s, allowed = P.scores(qb, kb, i, j, _optional(P.q_seg, i), kv_seg, k_valid)
                p = jnp.where(allowed, jnp.exp(s - lse[i][..., None]), 0.0)  # [B, K, G, Q, C]
                pz = P.dropout(p, i, j)
                dv = dv + jnp.einsum(
                    "bkgqc,bqkgd->bckd",
                    pz.astype(dob.dtype),
                    dob,
                    preferred_element_type=jnp.float32,
                )
                dpz = jnp.einsum("bqkgd,bckd->bkgqc", dob, vb, preferred_element_type=jnp.float32)
                dp = dpz if spec.rate == 0.0 else P.dropout(dpz, i, j)
                ds = p * (dp - delta[i][..., None])
                dq_i = jnp.einsum(
                    "bkgqc,bckd->bqkgd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32
                )
                dk = dk + jnp.einsum(
                    "bkgqc,bqkgd->bckd", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32
                )
                return (dk, dv), dq_i

            def skip(carry):
                return carry, jnp.zeros((B, Q, K, G, D), jnp.float32)

            return lax.cond(P.needed(i, j), compute, skip, carry)

        zeros = (jnp.zeros((B, C, K, D), jnp.float32), jnp.zeros((B, C, K, Dv), jnp.float32))
        (dk, dv), dq_blocks = lax.scan(query_block, zeros, jnp.arange(P.nq))
        return dq + dq_blocks, (dk, dv)

    dq0 = jnp.zeros((P.nq, B, Q, K, G, D), jnp.float32)
    dq, (dk, dv) = lax.scan(key_block, dq0, jnp.arange(P.nk))
    dq = P.unblock(dq, P.nq, L).reshape(B, L, H, D) * P.scale  # s = (q / sqrt(Dk)) k
    dk = P.unblock(dk, P.nk, S)  # dk already carries the 1 / sqrt(D) of the scaled q
    dv = P.unblock(dv, P.nk, S)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec: _Spec, q: Array, k: Array, v: Array, extras) -> Array:
    return _forward(spec, q, k, v, extras)[0]


def _flash_fwd(spec, q, k, v, extras):
    out, lse = _forward(spec, q, k, v, extras)
    return out, (q, k, v, extras, out, lse)


def _flash_bwd(spec, residuals, d_out):
    q, k, v, extras, out, lse = residuals
    dq, dk, dv = _backward(spec, q, k, v, extras, out, lse, d_out)
    no_grad = jax.tree_util.tree_map(lambda _: None, extras)  # masks, ids, key: not floats
    return dq, dk, dv, no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)


def reference_forward(spec_kwargs: dict, q, k, v, extras) -> Array:
    """The forward pass without the custom VJP (tests differentiate it with autodiff)."""
    return _forward(_Spec(**spec_kwargs), q, k, v, extras)[0]
