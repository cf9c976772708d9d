"""The train step's loss over given logits: 'dense' (four reads of [B, L, V]) against
'onepass' (one variadic reduction, training/losses.loss_sums), forward and backward.

    python benchmarks/loss.py [--shapes 64x64x8000,32x128x37000] [--reps 7] [--threads 2]

Each case jits the gradient of loss + nll with the sums as aux (what the step computes from
the logits), checks that both give the same sums and gradient, then interleaves the two
(median of --reps). -> benchmarks/results/loss.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def _grad_fn(losses, targets, weights, eps: float, one_pass: bool):
    """jit(grad of loss + nll, the sums as aux) over the logits."""
    import jax

    def total(logits):
        sums = losses.loss_sums(logits, targets, weights, eps, one_pass=one_pass)
        return sums["loss"] + sums["nll"], sums

    return jax.jit(jax.grad(total, has_aux=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="64x64x8000,32x128x37000", help="BxLxV,...")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument("--name", default="loss")
    parser.add_argument("--out", default=None, help="JSON path (default results/NAME.json)")
    args = parser.parse_args(argv)
    threads = _common.pin_threads(args.threads)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tx_jax.training import losses

    rows, records = [], []
    for shape in args.shapes.split(","):
        B, L, V = (int(x) for x in shape.split("x"))
        rng = np.random.default_rng(0)
        z = jnp.asarray(rng.normal(size=(B, L, V)), jnp.float32)
        t = jnp.asarray(rng.integers(1, V, (B, L)))
        w = jnp.asarray(rng.random((B, L)) > 0.1, jnp.float32)

        eps = args.label_smoothing
        fns = {k: _grad_fn(losses, t, w, eps, k == "onepass") for k in ("dense", "onepass")}
        out = {k: jax.block_until_ready(f(z)) for k, f in fns.items()}
        for k in out["dense"][1]:
            np.testing.assert_allclose(
                float(out["onepass"][1][k]), float(out["dense"][1][k]), rtol=1e-5, err_msg=k
            )
        np.testing.assert_allclose(out["onepass"][0], out["dense"][0], atol=1e-6)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.reps):
            for k, f in fns.items():
                times[k].append(_common.time_once(functools.partial(f, z), jax.block_until_ready))
        dense, onepass = _common.median(times["dense"]), _common.median(times["onepass"])
        rows.append((f"{B} x {L} x {V:,}", 1e3 * dense, 1e3 * onepass, dense / onepass))
        records.append({"shape": [B, L, V], "seconds": times})
    print(_common.table(["logits B x L x V", "dense ms", "onepass ms", "dense / onepass"], rows))
    print(f"{threads} threads, jax backend {jax.default_backend()}")
    path = _common.write_json(args.name, {"threads": threads, "cases": records}, args.out)
    print("wrote", _common.portable_path(path))


if __name__ == "__main__":
    main()
