"""`python -m tx_jax.evaluate`: score a checkpoint (inference.evaluation).

The short command for tx_jax.cli.evaluate, which holds the flags and the code.
"""

from tx_jax.cli.evaluate import main

if __name__ == "__main__":
    main()
