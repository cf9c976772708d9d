"""`python -m tx_jax.generate`: sample from a language model (inference.generation).

The short command for tx_jax.cli.generate, which holds the flags and the code.
"""

import sys

from tx_jax.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
