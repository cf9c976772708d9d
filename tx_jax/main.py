"""`python -m tx_jax.main`: training: flags -> experiment.loop.train_and_evaluate.

Forwards to tx_jax.cli.train (the entry point kept where it has always been).
"""

from absl import app

from tx_jax.cli.train import main

if __name__ == "__main__":
    app.run(main)
