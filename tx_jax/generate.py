"""`python -m tx_jax.generate`: sample from a language model (inference.generation).

Forwards to tx_jax.cli.generate (the entry point kept where it has always been).
"""

import sys

from tx_jax.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
