r"""Command line: flags -> runner.loop.train_and_evaluate(config, workdir). Nothing else.

    tx_jax train --config=configs/default.py --workdir=runs/default \
        --config.train.num_steps=2000 --config.model.d_model=256
"""

import os
import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from tx_jax.cli import common
from tx_jax.ops import backend
from tx_jax.runner.loop import train_and_evaluate

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and the tokenizer.")
config_flags.DEFINE_config_file(
    "config", None, "Config file; 'file.py:arg' passes arg to get_config.", lock_config=True
)
flags.mark_flags_as_required(["config", "workdir"])


def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    backend.skip_absent_tpu()
    if FLAGS.config.train.get("deterministic"):  # before JAX starts its backends
        backend.require_deterministic_ops()
    try:
        train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except ValueError as e:  # a config the run cannot use, CheckpointError's included: the
        sys.exit(f"error: {e}")  # user's to fix, said in one line (as cli/common.run_cli does)
    except OSError as e:  # the workdir's storage failed (CheckpointSaveError is one)
        traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Stop now: a checkpoint save still retrying in the background (TensorStore gives an
        # unreachable store 32 tries, about 15 minutes) would hold the process until it gives
        # up, and nothing it could still write would count (a checkpoint counts once its
        # checksums are written); the next launch resumes from the last complete one.
        os._exit(1)


def main(argv: list[str]) -> None:
    """`tx_jax train`: argv as sys.argv holds it (the program's name first)."""
    app.run(_main, argv=argv, flags_parser=common.parse_config_flags)
