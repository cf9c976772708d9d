"""`python -m tx_jax.visualize`: attention maps and training curves (analysis.visualize).

The short command for tx_jax.cli.visualize, which holds the flags and the code.
"""

import sys

from tx_jax.cli.visualize import main

if __name__ == "__main__":
    sys.exit(main())
