"""`python -m tx_jax.translate`: translate stdin to stdout (inference.translation).

The short command for tx_jax.cli.translate, which holds the flags and the code.
"""

from tx_jax.cli import translate as _cli
from tx_jax.cli.translate import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    main()
