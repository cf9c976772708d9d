"""`python -m tx_jax.sweep`: run a sweep of configs (experiment.sweep).

Forwards to tx_jax.cli.sweep (the entry point kept where it has always been).
"""

import sys

from tx_jax.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
