"""`python -m tx_jax.import_model`: a Hugging Face translator as a tx_jax workdir (interop/).

The short command for tx_jax.cli.import_model, which holds the flags and the code.
"""

from tx_jax.cli import import_model as _cli
from tx_jax.cli.import_model import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    main()
