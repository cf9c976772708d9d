"""Input pipeline against the train step: is the grain pipeline ever the bottleneck?

    python benchmarks/pipeline.py [--batches 300] [--steps 60]

Everything is configs/default.py (the synthetic language pair, 2,048-token batches, packing
on; `--bucketed` also measures the length-bucketed variant). Four rates, batches/s and target
tokens/s (real, non-padding target tokens):

  pipeline, cold   the first --batches batches of a fresh iterator (SentencePiece encodes each
                   pair on first read; grain shuffling, filtering, packing)
  pipeline, warm   --batches batches after a whole epoch (tokens cached in memory)
  train step       the jitted step alone on one placed batch (tx_jax.training.parallel, the config's
                   strategy, state donated), i.e. what the model can consume
  train loop       next(iterator) + placement + step with at most one step in flight, as in
                   runner.loop.train_and_evaluate (the pipeline and the step share
                   the CPU cores)

The data (TFDS synthetic builder) and tokenizer are prepared once in --workdir.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

sys.path.insert(0, os.path.join(_common.ROOT, "configs"))


def _task(config, workdir: str):
    from tx_jax.data import tasks

    return tasks.prepare_task(config.data, workdir, seed=config.seed)


def _iterator(config, task, packing: bool):
    from tx_jax.data import shards

    options = shards.train_options(config.data, seed=config.seed, batch_multiple=1)
    options = dataclasses.replace(options, packing=packing)
    return shards.make_train_iterator(shards.Stream(task.train_pairs()), task.tokenizer, options)


def _tokens(batch) -> int:
    return int((batch["targets"] > 0).sum())


def time_pipeline(it, n: int) -> dict:
    tokens, start = 0, time.perf_counter()
    for _ in range(n):
        tokens += _tokens(next(it))
    seconds = time.perf_counter() - start
    return {
        "batches": n,
        "seconds": seconds,
        "batches_per_s": n / seconds,
        "tokens_per_s": tokens / seconds,
    }


def _step(config, task):
    return _common.config_train_step(config, task.tokenizer.vocab_size, task.tokenizer.bos_id)


def time_step(strategy, compiled, state, batch, n: int):
    import jax

    placed = strategy.place_batch(batch)
    for _ in range(3):  # compile, first runs
        state, metrics = compiled(state, placed)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(n):
        state, metrics = compiled(state, placed)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    tokens = _tokens(batch) * n
    return state, {
        "batches": n,
        "seconds": seconds,
        "batches_per_s": n / seconds,
        "tokens_per_s": tokens / seconds,
    }


def time_loop(strategy, compiled, state, it, n: int):
    import jax

    pending, tokens = [], 0
    start = time.perf_counter()
    for _ in range(n):
        batch = next(it)
        tokens += _tokens(batch)
        state, metrics = compiled(state, strategy.place_batch(batch))
        pending.append(metrics)
        if len(pending) > 1:  # at most one step in flight, as train_and_evaluate does
            jax.block_until_ready(pending.pop(0))
    jax.block_until_ready(pending)
    seconds = time.perf_counter() - start
    return state, {
        "batches": n,
        "seconds": seconds,
        "batches_per_s": n / seconds,
        "tokens_per_s": tokens / seconds,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, default=300, help="batches timed per pipeline rate")
    p.add_argument("--steps", type=int, default=60, help="train steps timed (step and loop)")
    p.add_argument("--bucketed", action="store_true", help="also packing=False (buckets)")
    p.add_argument("--workdir", default="/tmp/tx_jax_bench_pipeline")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--name", default="pipeline")
    args = p.parse_args(argv)
    threads = _common.pin_threads(args.threads)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import default
    import jax

    config = default.get_config()
    print(
        f"{threads} threads, load {_common.load_average():.2f}; preparing data in {args.workdir}",
        flush=True,
    )
    task = _task(config, args.workdir)
    results = []
    for packing in [True, False] if args.bucketed else [True]:
        label = "packed" if packing else "bucketed"
        it = _iterator(config, task, packing)
        cold = time_pipeline(it, args.batches)
        print(f"  {label}: pipeline cold {cold['batches_per_s']:.1f} batches/s", flush=True)
        while it.stats()["epoch"] < 1:  # finish the first epoch: every pair now cached
            next(it)
        warm = time_pipeline(it, args.batches)
        print(f"  {label}: pipeline warm {warm['batches_per_s']:.1f} batches/s", flush=True)
        strategy, compiled, state = _step(config, task)
        state, step = time_step(strategy, compiled, state, next(it), args.steps)
        print(f"  {label}: train step {step['batches_per_s']:.1f} batches/s", flush=True)
        loop_it = _iterator(config, task, packing)  # a fresh one: cold cache, as at start
        for _ in range(2):  # compile every batch shape in the loop first (buckets)
            for _ in range(len(loop_it.batch_shapes) * 8):
                state, _ = compiled(state, strategy.place_batch(next(loop_it)))
        jax.block_until_ready(state)  # else the timed loop starts by waiting for these steps
        state, loop = time_loop(strategy, compiled, state, loop_it, args.steps)
        print(f"  {label}: train loop {loop['batches_per_s']:.1f} batches/s", flush=True)
        shapes = [list(s) for s in it.batch_shapes]
        # real target tokens / padded target positions, over the warm batches
        filled = warm["tokens_per_s"] / warm["batches_per_s"] / config.data.tokens_per_batch
        results.append(
            {
                "packing": packing,
                "batch_shapes": shapes,
                "pipeline_cold": cold,
                "pipeline_warm": warm,
                "train_step": step,
                "train_loop": loop,
                "real_token_fraction": filled,
            }
        )
    rows = []
    for r in results:
        label = "packed" if r["packing"] else "bucketed"
        for key, what in [
            ("pipeline_cold", "pipeline alone, cold (tokenizing)"),
            ("pipeline_warm", "pipeline alone, warm (tokens cached)"),
            ("train_step", "train step alone (one placed batch)"),
            ("train_loop", "train loop (pipeline + step)"),
        ]:
            rows.append([label, what, r[key]["batches_per_s"], r[key]["tokens_per_s"]])
    print(f"\nconfigs/default.py, {config.data.tokens_per_batch}-token batches, {threads} threads")
    print(_common.table(["batches", "what", "batches/s", "target tokens/s"], rows))
    for r in results:
        print(
            f"{'packed' if r['packing'] else 'bucketed'}: {len(r['batch_shapes'])} batch "
            f"shape(s) {r['batch_shapes']}; real target tokens fill "
            f"{r['real_token_fraction']:.1%} of the {config.data.tokens_per_batch}-token "
            "budget"
        )
    for r in results:
        label = "packed" if r["packing"] else "bucketed"
        margin = r["pipeline_cold"]["batches_per_s"] / r["train_step"]["batches_per_s"]
        loss = 1 - r["train_loop"]["batches_per_s"] / r["train_step"]["batches_per_s"]
        verdict = "IS" if margin < 1 else "is not"
        print(
            f"{label}: the pipeline {verdict} the bottleneck: even cold it makes batches "
            f"{margin:.1f}x as fast as the step consumes them; the full loop runs "
            f"{loss:.1%} below the step alone."
        )
        r["pipeline_over_step"] = margin
        r["loop_slowdown"] = loss
    path = _common.write_json(args.name, {"threads": threads, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
