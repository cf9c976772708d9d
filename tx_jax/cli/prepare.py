r"""Command line: prepare what a run reads before it starts, and say what was made.

    tx_jax prepare --config=configs/text.py --workdir=gs://bucket/runs/mine \
        --config.data.train=gs://bucket/corpus/train --config.data.validation=... \
        --config.data.data_dir=gs://bucket/tfds

The dataset (every split the run reads) goes into data.data_dir, local or gs:// (prepared
here, then published there for every host), and the tokenizer into WORKDIR/tokenizer.model
(trained on the train split, or data.tokenizer_path's, or train.init_from's). A config that
leaves sizes to the data (configs/text.py) gets them here as a run would, printed in one line
and as --config flags (for tx_jax plan and tpu-run, which read no data). A run started
afterwards with the same --config and --workdir finds both and starts at once; a multi-host
run needs this first when its data is large (tx_jax/data/preparation.py).
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from tx_jax.cli import common
from tx_jax.data import datasets
from tx_jax.ops import backend
from tx_jax.runner import setup, sizing
from tx_jax.training import checkpoint as ckpt_lib
from tx_jax.training import parallel

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The run's directory: its tokenizer.model goes there.")
config_flags.DEFINE_config_file(
    "config", None, "Config file; 'file.py:arg' passes arg to get_config.", lock_config=True
)
flags.mark_flags_as_required(["config", "workdir"])


def report(config) -> list[str]:
    """What a run of `config` reads, prepared: one line per split, then the tokenizer."""
    data = config.data
    lines = []
    for split in dict.fromkeys(
        [*datasets.run_splits(data), data.get("eval_split"), data.get("test_split")]
    ):
        if not split:
            continue
        try:
            source = datasets.load_split(data, split)
        except ValueError:  # a split this dataset does not have (a test split is optional)
            continue
        where = data.data_dir or "TFDS's default data dir"
        lines.append(f"data: {data.dataset} {split}: {len(source):,} pairs in {where}")
    return lines


def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    backend.skip_absent_tpu()
    config, workdir = FLAGS.config, ckpt_lib.absolute(FLAGS.workdir)
    try:
        # this host's devices, as a run's (no jax.distributed: prepare runs on one host)
        strategy = parallel.make_strategy(config.parallel)
        sized = setup.size_from_data(config, workdir, strategy)
        lines = report(sized.config)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    for line in lines:
        print(line)
    print(f"tokenizer: {workdir / 'tokenizer.model'} ({sized.task.tokenizer.vocab_size:,} pieces)")
    if sized.chosen:  # what tx_jax plan, tpu-run and sweeps need to build this run without data
        chosen = {k: sizing.get(sized.config, k) for k in sized.chosen}
        print(f"as flags: {sizing.as_flags(chosen)}")


def main(argv: list[str]) -> None:
    """`tx_jax prepare`: argv as sys.argv holds it (the program's name first)."""
    app.run(_main, argv=argv, flags_parser=common.parse_config_flags)
