"""`python -m tx_jax.translate`: translate stdin to stdout (inference.translation).

Forwards to tx_jax.cli.translate (the entry point kept where it has always been).
"""

from tx_jax.cli.translate import main

if __name__ == "__main__":
    main()
