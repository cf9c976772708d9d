"""Dropout masks: an older commit's `keep_mask` against this tree's, alone and in the train step.

    python benchmarks/dropout_ab.py --old 15234f6 [--reps 11] [--threads 2]

Both versions run in one process: the older tx_jax/dropout.py is loaded from git under
another module name and swapped into tx_jax.ops.dropout while the step is traced, so the two
compiled steps differ only in how the masks are drawn. Checks first that both give the same
three losses (the same random stream, bit for bit), then interleaves the two steps (3 steps
per repetition, medians and per-pair ratios) and the masks alone at the small config's
shapes; XLA temp is `memory_analysis()` of each compiled step. Small config of
benchmarks/train_step.py (d_model 256, 3+3 layers, batch 64 x (32+32), vocabulary 8192).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from train_step import SHAPES  # noqa: E402

MASK_SHAPES = [(64, 32, 1024), (64, 4, 32, 32), (64, 32, 256)]  # FFN hidden, weights, residual


def _load_old(rev: str):
    for where in ("tx_jax/ops/dropout.py", "tx_jax/dropout.py"):  # the layered tree, older ones
        show = subprocess.run(
            ["git", "show", f"{rev}:{where}"], cwd=_common.ROOT, capture_output=True, text=True
        )
        if show.returncode == 0:
            break
    else:
        raise SystemExit(f"{rev} has no tx_jax/ops/dropout.py nor tx_jax/dropout.py")
    src = show.stdout
    path = os.path.join(tempfile.mkdtemp(), f"dropout_{rev}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"dropout_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules look their defining module up
    spec.loader.exec_module(module)
    return module


def _interleave(fns: dict, reps: int, run) -> dict[str, list[float]]:
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(run(fn))
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--old", required=True, help="git revision whose dropout.py to compare")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    threads = _common.pin_threads(args.threads or None)

    import flax.linen as nn
    import jax
    import numpy as np

    from tx_jax.model.config import ModelConfig
    from tx_jax.model.transformer import EncoderDecoder
    from tx_jax.ops import dropout as D
    from tx_jax.training import optim
    from tx_jax.training.state import init_state
    from tx_jax.training.step import train_step

    sys.path.insert(0, os.path.join(_common.ROOT, "configs"))
    import default

    variants = {args.old: _load_old(args.old).keep_mask, "this tree": D.keep_mask}
    tc = default.get_config().train
    overrides, B, S, L, V = SHAPES["small"]  # train_step.py's small config
    cfg = ModelConfig(
        **overrides,
        vocab_size=V,
        dropout_rate=0.1,
        attention_dropout_rate=0.1,
        ffn_dropout_rate=0.1,
    )
    model = EncoderDecoder(cfg)
    tx, schedule = optim.make_optimizer(tc, cfg.d_model)
    init = jax.jit(lambda: nn.meta.unbox(init_state(model, tx, 0)))
    rng = np.random.default_rng(0)
    batch = jax.device_put(
        {
            "inputs": rng.integers(3, V, (B, S)).astype(np.int32),
            "targets": rng.integers(3, V, (B, L)).astype(np.int32),
        }
    )
    steps, current = {}, D.keep_mask
    for name, keep_mask in variants.items():
        D.keep_mask = keep_mask  # read when the step is traced
        step = functools.partial(  # a new function object: jit caches traces by identity
            train_step,
            model=model,
            tx=tx,
            schedule=schedule,
            label_smoothing=tc.label_smoothing,
        )
        steps[name] = jax.jit(step, donate_argnums=(0,)).lower(init(), batch).compile()
    D.keep_mask = current

    losses = {}
    for name, step in steps.items():
        state, out = init(), []
        for _ in range(3):
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        losses[name] = out
    same = len({tuple(v) for v in losses.values()}) == 1
    print(f"threads {threads}; losses of 3 steps: {losses} -> identical: {same}")

    states = {name: init() for name in steps}

    def run_step(name):
        start = time.perf_counter()
        for _ in range(3):
            states[name], metrics = steps[name](states[name], batch)
        float(metrics["loss"])
        return (time.perf_counter() - start) / 3

    step_times = _interleave({n: n for n in steps}, args.reps, run_step)
    rows, payload = [], {"losses": losses, "identical_losses": same, "step_s": step_times}
    temp = {n: s.memory_analysis().temp_size_in_bytes / 2**20 for n, s in steps.items()}
    for name in steps:
        rows.append(["train step", name, 1e3 * _common.median(step_times[name]), temp[name]])
    key = jax.random.key(0)
    payload["mask_s"] = {}
    for shape in MASK_SHAPES:
        fns = {n: jax.jit(functools.partial(f, rate=0.1, shape=shape)) for n, f in variants.items()}
        for fn in fns.values():
            fn(key).block_until_ready()

        def run_mask(fn):
            start = time.perf_counter()
            for _ in range(10):
                out = fn(key)
            out.block_until_ready()
            return (time.perf_counter() - start) / 10

        t = _interleave(fns, args.reps, run_mask)
        payload["mask_s"][str(shape)] = t
        rows += [[f"keep_mask {shape}", n, 1e3 * _common.median(t[n]), ""] for n in fns]
    print(_common.table(["what", "dropout.py of", "median ms", "XLA temp MiB"], rows))
    old, new = step_times[args.old], step_times["this tree"]
    pairs = [a / b for a, b in zip(old, new)]
    print(
        f"train step {args.old} / this tree: {_common.median(old) / _common.median(new):.3f} "
        f"(per pair: median {_common.median(pairs):.3f}, {min(pairs):.3f}-{max(pairs):.3f})"
    )
    print("wrote", _common.write_json(f"dropout_ab_{args.old}", payload))


if __name__ == "__main__":
    main()
