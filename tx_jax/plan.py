"""`python -m tx_jax.plan`: a run compiled for a TPU/GPU target on this host (tx_jax.planning).

The short command for tx_jax.cli.plan, which holds the flags and the code.
"""

import sys

from tx_jax.cli import plan as _cli
from tx_jax.cli.plan import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    sys.exit(main())
