"""`python -m tx_jax.prepare`: prepare a run's data and tokenizer before it starts.

The short command for tx_jax.cli.prepare, which holds the flags and the code.
"""

from absl import app

from tx_jax.cli import prepare as _cli
from tx_jax.cli.common import parse_config_flags
from tx_jax.cli.prepare import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    app.run(main, flags_parser=parse_config_flags)
