r"""`tx_jax plan`: compile a run for the accelerator it targets, on this host, and
print its plan (tx_jax/planning/plan.py has what each figure means).

    tx_jax plan --config=configs/wmt14_ende.py:variant=big --target=tpu:v5e-256 \
        [--config.key=value ...] [--json=PATH] [--programs=train,eval,greedy,beam] [--search]

Targets: tpu:v4-8, tpu:v5e-16, tpu:v5p-128, tpu:v6e-256, tpu:v5e-256x2 (two slices), gpu:h100-8,
gpu:a100-16, gpu:a100_40-8, gpu:h200-8. TPUs need the `plan` extra (libtpu: the TPU compiler),
GPUs the `plan-gpu` extra (jax's CUDA plugin); neither needs the chip.
Exit status: 0 the run fits, 2 it does not (or a bad config/target, named), 1 other errors.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Sequence

from tx_jax import paths
from tx_jax.config import apply_overrides, load_config, parse_assignments


def main(argv: Sequence[str] | None = None) -> int:
    """`tx_jax plan`: argv as sys.argv holds it (the program's name first)."""
    prog, *argv = list(sys.argv if argv is None else argv)
    overrides_argv = [a for a in argv if a.startswith("--config.")]
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="configs/FILE.py[:arg]")
    parser.add_argument("--target", required=True, help="e.g. tpu:v5e-16, gpu:h100-8")
    parser.add_argument(
        "--json", help="write the plan (or the search's plans) as JSON; - for stdout"
    )
    parser.add_argument(
        "--programs", default="train,eval,greedy,beam", help="which programs to compile"
    )
    parser.add_argument("--search", action="store_true", help="search meshes, remat, batches")
    parser.add_argument("--top", type=int, default=5, help="--search: how many plans to print")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="--search: compiles at once"
    )
    parser.add_argument("--cache_dir", help="plan cache (default ~/.cache/tx_jax/plans)")
    parser.add_argument("--no_cache", action="store_true", help="compile even if cached")
    parser.add_argument("--quiet", action="store_true", help="no text plan (with --json=-)")
    args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
    # The compilers run on this host's CPU backend: no TPU/GPU backend is started (libtpu
    # would look for chips).
    import jax

    jax.config.update("jax_platforms", "cpu")
    from tx_jax.planning import search as search_lib
    from tx_jax.planning import targets
    from tx_jax.planning.plan import PROGRAMS, format_plan, make_plan

    cache_dir = (
        None if args.no_cache else pathlib.Path(args.cache_dir or search_lib.default_cache_dir())
    )
    try:
        overrides = parse_assignments(overrides_argv, what="config override", prefix="--config.")
        config = load_config(args.config)
        apply_overrides(config, overrides, from_text=True)
        target = targets.parse(args.target)
        programs = tuple(p.strip() for p in args.programs.split(",") if p.strip())
        unknown = sorted(set(programs) - set(PROGRAMS))
        if unknown:
            raise ValueError(f"--programs: unknown {unknown}; expected some of {PROGRAMS}")
        if args.search:
            return _search(args, config, overrides, target, cache_dir)
        key = search_lib.cache_key(config, target.spec, programs)
        plan = search_lib.cached(cache_dir, key)
        if plan is None:
            plan = make_plan(config, target, programs, config_name=args.config)
            search_lib.store(cache_dir, key, plan)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"tx_jax plan: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(format_plan(plan), file=sys.stderr if args.json == "-" else sys.stdout)
    _write_json(args.json, plan)
    return 0 if plan["fits"] else 2


def _write_json(path: str | None, obj) -> None:
    if not path:
        return
    text = json.dumps(obj, indent=1, default=float)
    if path == "-":
        print(text)
    else:
        paths.Path(path).write_text(text + "\n")  # local or gs://


def _search(args, config, overrides, target, cache_dir) -> int:
    from tx_jax.planning import search as search_lib

    cache_dir = cache_dir or pathlib.Path(search_lib.default_cache_dir())
    print(f"searching {args.config} on {target.spec} ({target.num_devices} devices):", flush=True)
    ranked = search_lib.run_search(
        args.config,
        config,
        overrides,
        target.spec,
        target.num_devices,
        workers=args.workers,
        cache_dir=cache_dir,
        log=lambda line: print(line, flush=True),
    )
    _write_json(args.json, ranked)
    if not ranked:
        print("no candidate fits: see the lines above for each one's memory", file=sys.stderr)
        return 2
    print(f"\nbest {min(args.top, len(ranked))} (by the roofline bound's tokens/s):")
    for i, p in enumerate(ranked[: args.top]):
        print(f"{i + 1}. {search_lib.describe(p).strip()}")
    return 0
