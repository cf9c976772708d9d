"""`python -m tx_jax.sweep`: run a sweep of configs (experiment.sweep).

The short command for tx_jax.cli.sweep, which holds the flags and the code.
"""

import sys

from tx_jax.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
