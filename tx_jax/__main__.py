"""`python -m tx_jax VERB [flags]`: the `tx_jax` console script (tx_jax/cli/__init__.py)."""

import sys

from tx_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["tx_jax", *sys.argv[1:]]))
