"""The small config's compiled train step as text: is a change the same program before/after?

    python benchmarks/step_hlo.py --library /tmp/old --out /tmp/old.hlo   # a `git archive`
    python benchmarks/step_hlo.py --set kernels=auto --out /tmp/new.hlo   # this tree
    cmp /tmp/old.hlo /tmp/new.hlo

XLA:CPU's optimised HLO of `train_step` (jit, state donated) for benchmarks/train_step.py's
small config (dropout 0.1 at every site), with the metadata (source files and lines, op
names) and the file/stack tables stripped, so two trees that compile to the same program
print the same text whatever their paths. Prints the SHA-256 and XLA's temp bytes. Identical
text means identical speed, which timings on a shared machine cannot show as precisely.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402, F401  (puts this checkout on sys.path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--library", default="", help="import tx_jax from this directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", required=True, help="write the stripped HLO text here")
    args = p.parse_args(argv)
    if args.library:
        sys.path.insert(0, os.path.abspath(args.library))
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import train_step as bench

    from tx_jax.model.transformer import EncoderDecoder
    from tx_jax.training import optim
    from tx_jax.training.state import init_state
    from tx_jax.training.step import train_step

    _, B, S, L, V = bench.SHAPES["small"]
    cfg = bench._model_config("small", bench._parse_args([f"--set={s}" for s in args.set]), V)
    model = EncoderDecoder(cfg)
    tc = bench._train_config()
    tx, schedule = optim.make_optimizer(tc, cfg.d_model)
    state = jax.eval_shape(lambda: nn.meta.unbox(init_state(model, tx, 0)))
    batch = {
        "inputs": jax.ShapeDtypeStruct((B, S), jnp.int32),
        "targets": jax.ShapeDtypeStruct((B, L), jnp.int32),
    }
    step = functools.partial(
        train_step, model=model, tx=tx, schedule=schedule, label_smoothing=tc.label_smoothing
    )
    compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    text = text[re.search(r"^(%|ENTRY)", text, re.M).start() :]  # the computations only
    with open(args.out, "w") as f:
        f.write(text)
    temp = compiled.memory_analysis().temp_size_in_bytes
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    lines = len(text.splitlines())
    where = os.path.dirname(sys.modules["tx_jax"].__file__)
    print(f"{digest}  {lines} lines  temp {temp / 2**20:.0f} MiB  tx_jax from {where}")


if __name__ == "__main__":
    main()
