"""The FLOP formula (tx_jax/analysis/flops.py) against a hand count and the model's own matmuls."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.analysis import flops
from tx_jax.model.config import ModelConfig, variant
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder, count_params
from tx_jax.training import losses


def _dot_flops(jaxpr) -> int:
    """2 x multiply-adds of every dot_general in a (closed) jaxpr, sub-jaxprs included."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            total += _dot_flops(sub)
    return total


def test_hand_count_of_a_one_layer_model():
    """B=2, S=3, L=5, M=8, H=2 (D=4), F=16, V=11, one layer each, counted term by term."""
    cfg = ModelConfig(
        vocab_size=11,
        d_model=8,
        num_heads=2,
        d_ff=16,
        num_encoder_layers=1,
        num_decoder_layers=1,
    )
    f = flops.encoder_decoder_flops(cfg, batch=2, source_len=3, target_len=5)
    mac = 2  # FLOPs per multiply-add
    enc_proj = 4 * (2 * 3) * 8 * 8  # 4 projections, 6 tokens, 8x8 each
    dec_proj = 4 * (2 * 5) * 8 * 8 + 2 * (2 * 5) * 8 * 8 + 2 * (2 * 3) * 8 * 8  # self; Q,O; K,V
    assert f.projections == mac * (enc_proj + dec_proj)
    # per head: QK^T and AV, each (queries x keys x D) multiply-adds
    attn = 2 * 2 * 2 * (3 * 3 * 4) + 2 * 2 * 2 * (5 * 5 * 4) + 2 * 2 * 2 * (5 * 3 * 4)
    assert f.attention == mac * attn
    assert f.ffn == mac * (2 * 3 + 2 * 5) * 2 * 8 * 16
    assert f.logits == mac * 2 * 5 * 8 * 11
    assert f.train == 3 * f.forward


def test_six_n_d_for_a_paper_shaped_layer():
    """With H D = M, K = H: non-attention FLOPs per token = 2 x non-embedding parameters."""
    cfg = variant("base", vocab_size=100)
    f = flops.encoder_decoder_flops(cfg, batch=1, source_len=1, target_len=1)
    params = count_params(
        jax.eval_shape(
            EncoderDecoder(cfg).init,
            jax.random.key(0),
            jnp.ones((1, 1), jnp.int32),
            jnp.ones((1, 1), jnp.int32),
        )["params"]
    )
    M, F, V = 512, 2048, 100
    ffn_biases = 12 * (F + M)  # 6 + 6 layers
    norms = 6 * 2 * (2 * M) + 6 * 3 * (2 * M)  # scale and bias; 2 per encoder, 3 per decoder layer
    biases_and_norms = ffn_biases + norms
    matrices = params - V * M - biases_and_norms
    assert f.projections + f.ffn + f.logits == 2 * (matrices + V * M)


CONFIGS = {
    "post_ln": dict(),
    "gqa_swiglu_untied": dict(
        num_heads=4,
        num_kv_heads=2,
        activation="swiglu",
        tie_output=False,
        share_embeddings=False,
        target_vocab_size=37,
    ),
    "head_dim": dict(num_heads=2, head_dim=12),
    "value_head_dim": dict(num_heads=4, num_kv_heads=2, head_dim=6, value_head_dim=10),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_formula_equals_the_matmuls_xla_runs(name):
    """Forward: every dot_general in the model's jaxpr; train: the grad's jaxpr is 3x."""
    base = dict(
        vocab_size=29,
        d_model=16,
        num_heads=2,
        d_ff=24,
        num_encoder_layers=2,
        num_decoder_layers=1,
        dropout_rate=0.0,
        attention_impl="xla",
    )
    cfg = ModelConfig(**{**base, **CONFIGS[name]})
    B, S, L = 3, 7, 5
    model = EncoderDecoder(cfg)
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(1, 29, (B, S)), jnp.int32)
    tgt = jnp.asarray(rng.integers(1, cfg.output_vocab_size, (B, L)), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.key(0), src, tgt)["params"])
    expected = flops.encoder_decoder_flops(cfg, B, S, L)

    forward = jax.make_jaxpr(lambda p: model.apply({"params": p}, src, tgt))(params)
    assert _dot_flops(forward.jaxpr) == expected.forward

    def loss(p):
        logits = model.apply({"params": p}, src, tgt)
        return losses.smoothed_cross_entropy(logits, tgt, jnp.ones((B, L)), 0.1)[0]

    train = jax.make_jaxpr(jax.grad(loss))(params)
    assert _dot_flops(train.jaxpr) == expected.train

    # XLA's own count adds the elementwise work (softmax, norms) on top of the matmuls.
    compiled = jax.jit(lambda p: model.apply({"params": p}, src, tgt)).lower(params).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert expected.forward <= cost["flops"] <= 2 * expected.forward


@pytest.mark.parametrize("value_head_dim", [None, 6])
def test_decoder_only_matches_its_matmuls(value_head_dim):
    cfg = ModelConfig(
        vocab_size=31,
        d_model=16,
        num_heads=4,
        num_kv_heads=1,
        value_head_dim=value_head_dim,
        d_ff=32,
        num_decoder_layers=2,
        dropout_rate=0.0,
        attention_impl="xla",
    )
    model = DecoderOnly(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 31, (2, 9)), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.key(0), tokens)["params"])
    forward = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(params)
    assert _dot_flops(forward.jaxpr) == flops.decoder_only_flops(cfg, 2, 9).forward
