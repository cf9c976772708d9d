"""`python -m tx_jax.generate`: sample from a language model (inference.generation).

The short command for tx_jax.cli.generate, which holds the flags and the code.
"""

import sys

from tx_jax.cli import generate as _cli
from tx_jax.cli.generate import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    sys.exit(main())
