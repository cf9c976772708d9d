"""`python -m tx_jax.visualize`: attention maps and training curves (analysis.visualize).

Forwards to tx_jax.cli.visualize (the entry point kept where it has always been).
"""

import sys

from tx_jax.cli.visualize import main

if __name__ == "__main__":
    sys.exit(main())
