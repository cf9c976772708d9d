"""What the checkpoint CLIs (evaluate, translate) share: checkpoint flags, `--config.key=value`
overrides of the stored config, and one-line error messages for user errors."""

from __future__ import annotations

import sys

from absl import app, flags, logging

from tx_jax.config import (
    load_config,
    missing_keys,
    new_name,
    parse_assignments,
    unknown_key_message,
)
from tx_jax.inference import compilation, restore
from tx_jax.inference.search import LENGTH_PENALTIES
from tx_jax.ops import backend

# Old flag -> its name now: the decoding length penalty was --alpha, which is LoRA's scale.
RENAMED_FLAGS = {"alpha": "length_penalty", "alphas": "length_penalties"}


def define_checkpoint_flags(search: bool = False) -> None:
    """--workdir, --checkpoint, --step, --average_last; with `search`, the paper's beam
    search as --beam_size and --length_penalty (evaluate and translate)."""
    if search:
        flags.DEFINE_integer("beam_size", 4, "Beam size; 1 is greedy (paper: 4).")
        flags.DEFINE_float(
            "length_penalty", 0.6, "Beam search's length penalty, GNMT's alpha (paper: 0.6)."
        )
    flags.DEFINE_string(
        "workdir", None, "Training run directory (checkpoints in WORKDIR/checkpoints)."
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "A checkpoint directory instead: WORKDIR/averaged/last5, or one step of it.",
    )
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer(
        "average_last",
        None,
        "Average the last K checkpoints (up to --step); saved under "
        "WORKDIR/averaged and reused. evaluate's default: the run's "
        "eval.average_last; 0: the checkpoint itself.",
    )


def renamed_args(argv: list[str]) -> list[str]:
    """The command line under today's names, one warning line on stderr per old one: a
    renamed flag (RENAMED_FLAGS) of this command, `--length_penalty=RULE` (now
    --length_penalty_kind; --length_penalty is the penalty's value) and `--config.KEY=` of
    a key config.RENAMED_KEYS renamed."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        old = name.removeprefix("--")
        new = None
        if name.startswith("--config."):
            key = new_name(name.removeprefix("--config."))
            new = f"config.{key}" if key else None
        elif old in RENAMED_FLAGS and RENAMED_FLAGS[old] in flags.FLAGS:
            new = RENAMED_FLAGS[old]
        elif old == "length_penalty" and value in LENGTH_PENALTIES:
            new = "length_penalty_kind" if "length_penalty_kind" in flags.FLAGS else None
        if name.startswith("--") and new:
            print(f"warning: --{old} is --{new} now", file=sys.stderr, flush=True)
            arg = f"--{new}{eq}{value}"
        out.append(arg)
    return out


def split_config_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separate '--config.key=value' arguments (stored-config overrides) from absl's."""
    rest = [a for a in argv if not a.startswith("--config.")]
    items = [a for a in argv if a.startswith("--config.")]
    return rest, parse_assignments(items, what="config override", prefix="--config.")


def parse_flags(argv: list[str]) -> list[str]:
    """app.run's flag parsing, with the verb's own flags (those of the cli/ modules imported,
    which are the verb's and this module's) shown by --help: absl lists there the flags of
    the module named sys.argv[0], which is `tx_jax VERB`."""
    by_module = flags.FLAGS.flags_by_module_dict()
    for module in [m for m in by_module if m.startswith("tx_jax.cli.")]:
        for flag in by_module[module]:
            flags.FLAGS.register_flag_by_module(sys.argv[0], flag)
    return app.parse_flags_with_usage(argv)


def parse_config_flags(argv: list[str]) -> list[str]:
    """app.run's flag parsing for the commands with --config=FILE (train, prepare): an
    override of a key that FILE's config lacks stops in one line saying why (a renamed key,
    or one a study's config defines), where ml_collections raises a bare AttributeError. An
    old key's name is read as its new one (`renamed_args`); in sys.argv too, where
    ml_collections finds the overrides to define."""
    argv = sys.argv = renamed_args(argv)
    try:
        return parse_flags(argv)
    except (AttributeError, KeyError):
        spec = next((a.partition("=")[2] for a in argv if a.startswith("--config=")), None)
        keys = [a.partition("=")[0].removeprefix("--config.") for a in argv]
        keys = [k for k, a in zip(keys, argv) if a.startswith("--config.")]
        missing = missing_keys(load_config(spec), keys) if spec else []
        if not missing:
            raise
        where = spec.partition(":")[0]
        sys.exit("error: " + "; ".join(unknown_key_message(k, where) for k in missing))


def run_cli(main, argv: list[str] | None = None) -> None:
    """absl's app.run with '--config.*' overrides taken out first; user errors (no such
    checkpoint, step or split, unfit config) exit with a one-line message. JAX's persistent
    compilation cache is on (inference/compilation.py: $JAX_COMPILATION_CACHE_DIR, default
    ~/.cache/tx_jax/jax; '' turns it off)."""
    argv = list(sys.argv if argv is None else argv)
    backend.skip_absent_tpu()
    compilation.use_persistent_cache()
    try:
        argv, overrides = split_config_args(renamed_args(argv))
    except ValueError as e:
        sys.exit(f"error: {e}")

    def guarded(args):
        logging.set_verbosity(logging.ERROR)  # Orbax's read-only notices are noise here
        try:
            main(args, overrides)
        except (restore.CheckpointError, FileNotFoundError, KeyError, ValueError) as e:
            message = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
            if len(message) > 2000:  # e.g. a pytree printed whole by a library
                message = message[:2000] + " ..."
            sys.exit(f"error: {message}")

    app.run(guarded, argv=argv, flags_parser=parse_flags)


def checkpoint_args(argv: list[str], what: str = "") -> dict:
    """The checkpoint flags as restore.load's arguments; a UsageError for stray arguments or
    when neither --workdir nor --checkpoint is given."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}{what}")
    f = flags.FLAGS
    if f.workdir is None and f.checkpoint is None:
        raise app.UsageError("give --workdir (or --checkpoint)")
    return dict(checkpoint=f.checkpoint, step=f.step, average_last=f.average_last)
