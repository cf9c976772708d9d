"""`python -m tx_jax.translate`: translate stdin to stdout (inference.translation).

The short command for tx_jax.cli.translate, which holds the flags and the code.
"""

from tx_jax.cli.translate import main

if __name__ == "__main__":
    main()
