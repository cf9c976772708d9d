"""Scores during and at the end of training (Evaluator)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import jax

from tx_jax.config import task_of
from tx_jax.inference import quality
from tx_jax.runner import console
from tx_jax.runner.setup import Run
from tx_jax.training.step import eval_step, loss_metrics, model_inputs


class Evaluator:
    """Validation loss/accuracy/perplexity and BLEU (greedy) during training; for a language
    model (config.task == 'lm') loss/accuracy/perplexity only, also on the test split."""

    def __init__(self, run: Run, shardings: Any):
        self.run = run
        fn = functools.partial(eval_step, model=run.model)
        self.p_eval = run.strategy.compile_step(
            fn, donate=False, state_shardings=shardings, returns_state=False
        )

    def _loss_metrics(self, state, batches: Iterable[dict]) -> dict[str, float]:
        strategy = self.run.strategy
        return loss_metrics(
            strategy.fetch_metrics(self.p_eval(state, strategy.place_batch(model_inputs(b))))
            for b in batches
        )

    def evaluate(self, state, step: int, logger, *, bleu: bool) -> dict[str, float]:
        run = self.run
        multiple = run.strategy.local_batch_multiple
        batches = run.task.eval_batches("validation", multiple, one_shape=True)
        metrics = self._loss_metrics(state, batches)
        if bleu and run.config.eval.bleu_examples > 0 and task_of(run.config) != "lm":
            metrics.update(self._bleu(state, "validation", run.config.eval.bleu_examples))
        logger.write(step, "validation", {k: v for k, v in metrics.items() if _is_num(v)})
        console.evaluation(step, metrics)
        return metrics

    def _bleu(
        self, state, split: str, limit: int | None, beam_size: int | None = None
    ) -> dict[str, Any]:
        params = self.run.strategy.for_checkpoint(state).params
        task = self.run.task
        if jax.process_count() > 1:  # the parameters span all processes: decode the same
            task = dataclasses.replace(task, shard_eval=False)  # examples everywhere
        return quality.bleu_metrics(  # multilingual: also bleu/<direction>, chrf/<direction>
            self.run.model_config,
            params,
            task,
            split,
            limit=limit,
            beam_size=beam_size or self.run.config.eval.beam_size,
            length_penalty=self.run.config.eval.length_penalty,
        )

    def test_metrics(self, state, step: int, logger) -> dict[str, Any]:
        """BLEU on the test split, or for a language model its loss and perplexity."""
        if task_of(self.run.config) != "lm":
            split = self.run.config.data.test_split
            result = self._bleu(state, split, None, self.run.config.eval.get("test_beam_size"))
            logger.write(step, split, {k: v for k, v in result.items() if _is_num(v)})
            return {f"test_{k}": v for k, v in result.items()}
        split, multiple = self.run.config.data.test_split, self.run.strategy.local_batch_multiple
        result = self._loss_metrics(
            state, self.run.task.eval_batches(split, multiple, one_shape=True)
        )
        logger.write(step, split, result)
        console.say(f"test  {step:>6}  loss {result['loss']:.4f}  ppl {result['perplexity']:.2f}")
        return {f"test_{k}": v for k, v in result.items()}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float))
