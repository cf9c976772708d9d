r"""Sampling from a language model: prompts in, continuations out (`tx_jax generate`).

The checkpoint must hold a DecoderOnly model. Each prompt is encoded without BOS or EOS,
forced as the start of `num_samples` rows and continued by `decoding.sample` (temperature 0:
greedy); only the continuation is detokenized. Shape letters: P prompt length, T decode
length (prompt included), R rows = prompts x samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.data.tokenizer import Tokenizer
from tx_jax.inference import decoding, search
from tx_jax.model.config import ModelConfig

Array = jax.Array
PROMPT_MULTIPLE = 16  # prompt arrays are padded to a multiple of this: fewer compilations


# ----------------------------------------------------------------------- sampling


def sample_rows(
    model_config: ModelConfig,
    params: Any,
    prompt_ids: Sequence[Sequence[int]],
    rng: Array,
    *,
    num_samples: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int = search.EOS_ID,
) -> np.ndarray:
    """Token rows [R, T]: row i * num_samples + k is sample k of prompt i, its ids forced,
    then the sampled tokens, EOS and padding. T = P + max_new_tokens, P the longest prompt
    rounded up to PROMPT_MULTIPLE; shorter prompts may run past max_new_tokens."""
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"num_samples={num_samples}, max_new_tokens={max_new_tokens}: need >= 1")
    longest = max((len(p) for p in prompt_ids), default=0)
    P = -(-max(longest, 1) // PROMPT_MULTIPLE) * PROMPT_MULTIPLE
    prompt = np.zeros((len(prompt_ids) * num_samples, P), np.int32)
    for i, ids in enumerate(prompt_ids):
        if 0 in ids:
            raise ValueError(f"prompt {i} contains the padding id 0: {list(ids)}")
        prompt[i * num_samples : (i + 1) * num_samples, : len(ids)] = ids
    tokens = decoding.sample(
        model_config,
        params,
        rng,
        prompt=jnp.asarray(prompt),
        max_decode_len=P + max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
    )
    return np.asarray(jax.device_get(tokens))


@dataclasses.dataclass
class Sample:
    prompt: str
    sample: int  # index among the prompt's samples
    text: str  # the continuation only (a leading space is kept when the tokenizer gives one)
    tokens: list[int]  # its ids, EOS excluded
    finished: bool  # ended with EOS (rather than at max_new_tokens or the position limit)


def generate(
    model_config: ModelConfig,
    params: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    rng: Array | None = None,
    seed: int = 0,
    num_samples: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 0.95,
) -> list[list[Sample]]:
    """Continue each prompt `num_samples` times -> samples[prompt][k]; all prompts form one
    batch (so a prompt's samples depend on the batch it is in). rng defaults to key(seed)."""
    rng = jax.random.key(seed) if rng is None else rng
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    rows = sample_rows(
        model_config,
        params,
        prompt_ids,
        rng,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tokenizer.eos_id,
    )
    out = []
    for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
        samples = []
        for k in range(num_samples):
            new = rows[i * num_samples + k, len(ids) : len(ids) + max_new_tokens].tolist()
            finished = tokenizer.eos_id in new
            new = new[: new.index(tokenizer.eos_id)] if finished else [t for t in new if t]
            text = continuation_text(tokenizer, ids, new)
            samples.append(Sample(prompt, k, text, new, finished))
        out.append(samples)
    return out


def continuation_text(tokenizer: Tokenizer, prompt_ids: Sequence[int], new: Sequence[int]) -> str:
    """The text the new ids add to the prompt: decode(prompt + new) minus decode(prompt), so
    that a word-initial piece keeps its space ('▁dog' after 'the' -> ' dog')."""
    head = tokenizer.decode(list(prompt_ids))
    full = tokenizer.decode(list(prompt_ids) + list(new))
    if head and full.startswith(head):
        return full[len(head) :]
    return tokenizer.decode(list(new))
