"""`python -m tx_jax.evaluate`: score a checkpoint (inference.evaluation).

Forwards to tx_jax.cli.evaluate (the entry point kept where it has always been).
"""

from tx_jax.cli.evaluate import main

if __name__ == "__main__":
    main()
