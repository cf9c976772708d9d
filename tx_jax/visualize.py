"""`python -m tx_jax.visualize`: attention maps and training curves (analysis.visualize).

The short command for tx_jax.cli.visualize, which holds the flags and the code.
"""

import sys

from tx_jax.cli import visualize as _cli
from tx_jax.cli.visualize import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    sys.exit(main())
