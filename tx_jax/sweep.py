"""`python -m tx_jax.sweep`: run a sweep of configs (experiment.sweep).

The short command for tx_jax.cli.sweep, which holds the flags and the code.
"""

import sys

from tx_jax.cli import sweep as _cli
from tx_jax.cli.sweep import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    sys.exit(main())
