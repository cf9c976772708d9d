r"""Command line: flags -> experiment.loop.train_and_evaluate(config, workdir). Nothing else.

    python -m tx_jax.main --config=configs/default.py --workdir=runs/default \
        --config.train.num_steps=2000 --config.model.d_model=256
"""

from absl import app, flags, logging
from ml_collections import config_flags

from tx_jax.experiment.loop import train_and_evaluate
from tx_jax.ops import backend

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and the tokenizer.")
config_flags.DEFINE_config_file(
    "config", None, "Config file; 'file.py:arg' passes arg to get_config.", lock_config=True
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    backend.skip_absent_tpu()
    train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
