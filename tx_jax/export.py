"""`python -m tx_jax.export`: a checkpoint as a Transformers or CTranslate2 model (interop/).

The short command for tx_jax.cli.export, which holds the flags and the code.
"""

from tx_jax.cli import export as _cli
from tx_jax.cli.export import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    main()
