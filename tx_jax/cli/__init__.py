"""The `tx_jax` console script: `tx_jax VERB [flags]`, one module of cli/ per verb.

    tx_jax train --config=configs/default.py --workdir=runs/default
    tx_jax evaluate --workdir=runs/default
    tx_jax VERB --help          the verb's flags
    tx_jax --help               the verbs

Each verb's module holds its flags and forwards to a library function; only the chosen verb's
module is imported, so the absl flags of two verbs never meet. `python -m tx_jax VERB` is the
same command (tx_jax/__main__.py), and `python -m tx_jax.main` is `tx_jax train`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# verb -> (its module in cli/, one line on what it does)
VERBS = {
    "train": ("train", "train a model: --config=FILE --workdir=DIR (runner.loop)"),
    "evaluate": ("evaluate", "decode a checkpoint's split and score it: BLEU, chrF"),
    "translate": ("translate", "translate stdin, or files with --input, with a checkpoint"),
    "score": ("score", "ln p(target | source) of given pairs, one line each"),
    "prepare": ("prepare", "prepare a run's data and tokenizer before it starts"),
    "export": ("export", "a checkpoint to Transformers, CTranslate2 or PEFT directories"),
    "import": ("import_model", "a Hugging Face translator (Marian, M2M100, NLLB) as a workdir"),
    "plan": ("plan", "compile a run for a TPU/GPU target on this host; print its plan"),
    "sweep": ("sweep", "run a sweep of configs (experiments/*.py), here or on TPU VMs"),
    "visualize": ("visualize", "attention maps and training curves as PNG files"),
    "generate": ("generate", "sample continuations from a language-model checkpoint"),
}
HELP = ("-h", "--help", "-help", "--helpfull", "help")


def verbs_text() -> str:
    width = max(map(len, VERBS))
    lines = [f"  {verb:<{width}}  {line}" for verb, (_, line) in VERBS.items()]
    return (
        "usage: tx_jax VERB [flags]   (or python -m tx_jax VERB)\n\nverbs:\n"
        + "\n".join(lines)
        + "\n\n`tx_jax VERB --help` lists a verb's flags.\n"
    )


def run(verb: str, args: Sequence[str]) -> int:
    """Run `tx_jax VERB ARGS...` in this process; returns the exit status."""
    if verb not in VERBS:
        print(f"tx_jax: no verb {verb!r}; the verbs: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"tx_jax.cli.{VERBS[verb][0]}")
    # absl names the program by sys.argv[0] and prints __main__'s docstring as the usage
    sys.argv = [f"tx_jax {verb}", *args]
    sys.modules["__main__"].__doc__ = module.__doc__
    status = module.main(list(sys.argv))
    return status or 0


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: argv is sys.argv's shape (the program's name, the verb, its flags)."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in HELP:
        if len(argv) > 2 and argv[1] == "help":  # tx_jax help VERB: the verb's --help
            return run(argv[2], ["--help"])
        print(verbs_text(), end="")
        return 0 if len(argv) > 1 else 2
    return run(argv[1], argv[2:])
