"""`tx_jax sweep`: flags -> launch.local.run_sweep (its docstring has the details).

tx_jax sweep experiments/table3.py --root=runs/sweeps/table3 [--parallel=2]
    [--dry_run] [--only=0,3] [--test_split_eval] [--override=train.num_steps=100 ...]
tx_jax sweep experiments/table3.py --tpu=NAME[,NAME...] --root=gs://B/sweeps/table3
    [--zone=Z] [--project=P] [--recreate] [--no_plan] [--dry_run] [--only=0,3] [--override=...]
    (launch.tpu_queue: each point on a free TPU VM)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tx_jax.launch import local, results, sweeps, tpu_queue
from tx_jax.launch.local import LOG_FILE, run_sweep
from tx_jax.launch.sweeps import parse_overrides


def main(argv: Sequence[str] | None = None) -> int:
    """`tx_jax sweep`: argv as sys.argv holds it (the program's name first)."""
    prog, *argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog=prog,
        description="\n".join(m.__doc__ for m in (local, sweeps, results, tpu_queue)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sweep_file", help="experiments/<file>.py")
    parser.add_argument("--root", help="output root (default runs/sweeps/<NAME>)")
    parser.add_argument("--parallel", type=int, default=1, help="points run at a time")
    parser.add_argument(
        "--dry_run",
        "--dry-run",
        action="store_true",
        help="print every point's command; run nothing",
    )
    parser.add_argument("--only", help="comma-separated point indices, e.g. 0,3")
    parser.add_argument(
        "--test_split_eval",
        "--test-split-eval",
        action="store_true",
        help="score the test split with tx_jax evaluate after each run",
    )
    parser.add_argument("--beam_size", type=int, default=4, help="--test_split_eval's beam")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted override added to every point (repeatable)",
    )
    tpu = parser.add_argument_group("TPU VMs (launch.tpu_queue)")
    tpu.add_argument("--tpu", help="TPU VM names, comma-separated: each point on a free one")
    tpu.add_argument("--zone", default=os.environ.get("TPU_ZONE"), help="(default $TPU_ZONE)")
    tpu.add_argument("--project", default=os.environ.get("TPU_PROJECT"), help="($TPU_PROJECT)")
    tpu.add_argument(
        "--recreate", action="store_true", help="recreate a preempted spot or queued VM"
    )
    tpu.add_argument(
        "--no_plan", "--no-plan", action="store_true", help="start points without planning them"
    )
    args = parser.parse_args(argv)
    try:
        only = [int(i) for i in args.only.split(",") if i.strip()] if args.only else None
        if args.tpu:
            if args.parallel != 1 or args.test_split_eval:
                raise ValueError(
                    "--tpu runs one point per VM (no --parallel) and scores the test split "
                    "in training (eval.score_test), not with --test_split_eval"
                )
            rows = tpu_queue.run_tpu_sweep(
                args.sweep_file,
                args.root,
                args.tpu.split(","),
                zone=args.zone,
                project=args.project,
                only=only,
                dry_run=args.dry_run,
                recreate=args.recreate,
                plan=not args.no_plan,
                overrides=parse_overrides(args.override),
            )
            return _exit_status(rows)
        if args.recreate or args.no_plan:
            raise ValueError("--recreate and --no-plan are for a sweep on TPU VMs (--tpu NAME,...)")
        rows = run_sweep(
            args.sweep_file,
            args.root,
            parallel=args.parallel,
            only=only,
            dry_run=args.dry_run,
            test_split_eval=args.test_split_eval,
            beam_size=args.beam_size,
            overrides=parse_overrides(args.override),
        )
    except ValueError as e:
        print(f"tx_jax sweep: {e}", file=sys.stderr)
        return 2
    return _exit_status(rows)


def _exit_status(rows) -> int:
    """1 (and the list on stderr) if a point failed or was not run, else 0."""
    failed = [r for r in rows if r["status"].startswith(("failed", "not run", "does not fit"))]
    if failed:
        print(
            f"tx_jax sweep: {len(failed)} point(s) failed or not run: "
            + ", ".join(
                f"[{r['index']}] {r['name']} ({r['status']}; {r['workdir']}/{LOG_FILE})"
                for r in failed
            ),
            file=sys.stderr,
        )
    return 1 if failed else 0
