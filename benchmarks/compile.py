"""Compile time of the train step: the persistent compilation cache, and pmap vs mesh.

    python benchmarks/compile.py [--library DIR]

Each measurement is a fresh Python process (configs/default.py's model and optimizer, a
packed [32, 64] batch, the config's parallel strategy or 'mesh'), timing the first three
calls of the compiled step: call 1 traces, compiles and runs; call 2 should only run (it
compiles again if the state it gets back is placed differently from the one it was given);
call 3 is a plain step. Three cache settings:

  no cache     JAX's persistent compilation cache off (JAX's default)
  cold cache   JAX_COMPILATION_CACHE_DIR set to an empty directory (compiles and writes)
  warm cache   the same directory again, in a new process (reads the executable back)

`--library DIR` imports tx_jax from DIR (e.g. a `git archive` of an older commit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def worker(strategy_kind: str) -> None:
    import jax
    import numpy as np

    sys.path.insert(0, os.path.join(_common.ROOT, "configs"))
    import default

    t0 = time.perf_counter()
    config = default.get_config()
    config.parallel.strategy = strategy_kind
    strategy, step, state = _common.config_train_step(config, vocab_size=512, bos_id=2)
    jax.block_until_ready(state)
    setup = time.perf_counter() - t0
    B, L = 32, 64
    rng = np.random.default_rng(0)
    seg = np.repeat(np.arange(1, 5, dtype=np.int32), L // 4)[None].repeat(B, 0)
    pos = np.tile(np.arange(L // 4, dtype=np.int32), 4)[None].repeat(B, 0)
    batch = {
        "inputs": rng.integers(3, 512, (B, L)).astype(np.int32),
        "targets": rng.integers(3, 512, (B, L)).astype(np.int32),
        "inputs_segmentation": seg,
        "targets_segmentation": seg,
        "inputs_position": pos,
        "targets_position": pos,
    }
    calls = []
    for _ in range(3):
        start = time.perf_counter()
        state, metrics = step(state, strategy.place_batch(batch))
        jax.block_until_ready(metrics)
        calls.append(time.perf_counter() - start)
    print("RESULT " + json.dumps({"setup_s": setup, "calls_s": calls}))


def run(strategy: str, cache_dir: str | None, library: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for key in (
        "JAX_COMPILATION_CACHE_DIR",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    ):
        env.pop(key, None)
    if cache_dir:
        env.update(
            JAX_COMPILATION_CACHE_DIR=cache_dir,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    if library:
        env["PYTHONPATH"] = os.path.abspath(library)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", strategy],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker failed:\n{proc.stdout}\n{proc.stderr}")
    return {**json.loads(lines[-1][7:]), "process_wall_s": wall}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategies", default="pmap,mesh")
    p.add_argument("--library", default="")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--name", default="compile")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    threads = _common.pin_threads(args.threads)
    if args.worker:
        if os.environ.get("PYTHONPATH"):
            sys.path.insert(0, os.environ["PYTHONPATH"])
        return worker(args.worker)
    rows = []
    for strategy in args.strategies.split(","):
        with tempfile.TemporaryDirectory() as cache:
            for label, cache_dir in [
                ("no cache", None),
                ("cold cache", cache),
                ("warm cache", cache),
            ]:
                r = run(strategy, cache_dir, args.library)
                rows.append({"strategy": strategy, "cache": label, **r})
                print(
                    f"  {strategy:5s} {label:10s} calls "
                    + ", ".join(f"{c:.2f}" for c in r["calls_s"])
                    + f" s; process {r['process_wall_s']:.1f} s",
                    flush=True,
                )
    print(
        f"\nconfigs/default.py train step, {threads} threads"
        + (f", tx_jax from {args.library}" if args.library else "")
    )
    print(
        _common.table(
            ["strategy", "cache", "call 1 (s)", "call 2 (s)", "call 3 (s)", "process wall (s)"],
            [[r["strategy"], r["cache"], *r["calls_s"], r["process_wall_s"]] for r in rows],
        )
    )
    library = _common.portable_path(args.library) if args.library else ""
    path = _common.write_json(args.name, {"threads": threads, "library": library, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
