"""What a person sees of a training run on the console (logs.MetricLogger prints progress)."""

from __future__ import annotations

from typing import Any

import jax
from etils import epath

from tx_jax.config import task_of


def say(line: str) -> None:
    """Print `line` once: on process 0."""
    if jax.process_index() == 0:
        print(line, flush=True)


def evaluation(step: int, metrics: dict[str, Any]) -> None:
    """One line per validation: loss, accuracy, perplexity, BLEU (and BLEU per direction)."""
    say(
        f"eval  {step:>6}  loss {metrics['loss']:.4f}  acc {metrics['accuracy']:.3f}  "
        f"ppl {metrics['perplexity']:.2f}"
        + (f"  bleu {metrics['bleu']:.2f}" if "bleu" in metrics else "")
        + "".join(f"  {k} {v:.2f}" for k, v in metrics.items() if k.startswith("bleu/"))
    )


def stopped(signal_name: str, step: int, directory: epath.Path) -> None:
    print(
        f"{signal_name} at step {step}: checkpoint saved in {directory}; "
        "rerun the same command to resume",
        flush=True,
    )


def summary(run: Any, final: dict[str, Any], budget_clock: float | None = None) -> None:
    """Where the checkpoints and logs are, the final scores, and for a run with a time
    budget (run.budget) the budget clock after its last update (`budget_clock`)."""
    if jax.process_index() != 0:
        return
    if run.budget and budget_clock is not None:
        seconds = 60 * run.budget["minutes"]
        print(
            f"time budget {run.budget['minutes']:g} min ({seconds:,.0f} s): {budget_clock:,.0f} s "
            f"of training at the last update ({budget_clock / seconds:.0%}; set-up, "
            "compilation, updates and saves; evaluations not counted)"
        )
    print(f"checkpoints: {run.workdir / 'checkpoints'}")
    print(
        f"logs:        {run.workdir / 'metrics.jsonl'} (TensorBoard: {run.workdir / 'tensorboard'})"
    )
    for key in ("perplexity", "test_perplexity"):
        if key in final and task_of(run.config) == "lm":
            print(f"{key}: {final[key]:.2f}")
    for key in ("bleu", "test_bleu"):
        if key in final:
            print(f"{key}: {final[key]:.2f}  {final.get(key + '_signature', '')}")
