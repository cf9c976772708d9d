"""`python -m tx_jax.evaluate`: score a checkpoint (inference.evaluation).

The short command for tx_jax.cli.evaluate, which holds the flags and the code.
"""

from tx_jax.cli import evaluate as _cli
from tx_jax.cli.evaluate import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    main()
