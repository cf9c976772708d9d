"""`python -m tx_jax.score`: the log-probability of given translations (inference.likelihood).

The short command for tx_jax.cli.score, which holds the flags and the code.
"""

from tx_jax.cli import score as _cli
from tx_jax.cli.score import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    main()
