"""`python -m tx_jax.main`: training: flags -> runner.loop.train_and_evaluate.

The short command for tx_jax.cli.train, which holds the flags and the code.
"""

from absl import app

from tx_jax.cli import train as _cli
from tx_jax.cli.common import parse_config_flags
from tx_jax.cli.train import main

__doc__ = _cli.__doc__  # `--help` shows the command's usage, which the CLI module holds

if __name__ == "__main__":
    app.run(main, flags_parser=parse_config_flags)
