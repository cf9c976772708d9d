"""The train step on the accelerator in hand: measured time, tokens/s and MFU beside the plan's
roofline bound for the same compiled program (tx_jax.planning), and the chip's ceilings
measured in the same run.

    python benchmarks/gpu_step.py                                   # on a GPU host
    python benchmarks/gpu_step.py --cases base:bfloat16,base:bfloat16:xla,big:bfloat16
    python benchmarks/gpu_step.py --cases debug:float32 --peak-size 256 --steps 2   # CPU check

A case is VARIANT:DTYPE[:ATTENTION][/KEY=VALUE...] of configs/wmt14_ende.py (the paper's runs:
one 104 x 256 packed batch, 26,624 target tokens a step; e.g.
base:bfloat16/model.dropout_rate=0.0): the run is built exactly as the planner builds it
(tx_jax.planning.programs.build, here over this host's first device), its train step compiled
for this device, a roofline bound read off that compiled program (`derive`: the chip table's
datasheet peak and HBM bandwidth, as plan.roofline), then that executable run on a real state
and a random packed batch. Time per step is the median of --steps steps each synchronised, and
also the mean over --steps steps issued back to back (what a training loop sees). MFU = the
analytic train FLOPs (tx_jax.analysis.flops) / step time / peak, against the datasheet peak
and against the matmul peak measured here (an 8192^3 product, random operands).

Ceilings measured first: matmul TFLOP/s (bf16, float32 at JAX's default precision, float32 at
'highest') and a device-to-device copy's bandwidth (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

CONFIG = "configs/wmt14_ende.py"
DEFAULT_CASES = "base:bfloat16,base:bfloat16:xla,base:float32,big:bfloat16"


def chip_of(device):
    """The chips.py entry of a device (None for a CPU or an unknown kind)."""
    from tx_jax.planning.chips import CHIPS

    kind = device.device_kind.lower()
    for name in ("h200", "h100", "a100"):
        if name in kind:
            if name == "a100" and "40gb" in kind:
                return "a100_40", CHIPS["a100_40"]
            return name, CHIPS[name]
    return None, None


def _timed(fn, args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return _common.median(times)


def ceilings(n: int, reps: int) -> dict[str, float]:
    """Matmul FLOP/s of an n^3 product (random operands) and copy bytes/s on device 0."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(1))
    out = {}
    for name, dtype, precision in (
        ("matmul_bf16", jnp.bfloat16, None),
        ("matmul_f32_default", jnp.float32, None),
        ("matmul_f32_highest", jnp.float32, "highest"),
    ):
        a = jax.random.normal(ka, (n, n), dtype)
        b = jax.random.normal(kb, (n, n), dtype)
        f = jax.jit(lambda a, b, p=precision: jnp.dot(a, b, precision=p))
        out[name] = 2 * n**3 / _timed(f, (a, b), reps)
    x = jax.random.normal(ka, (n * n * 4,), jnp.float32)  # 1 GiB at n = 8192
    copy = jax.jit(lambda x: x + 1.0)
    out["copy_bytes_per_s"] = 2 * x.nbytes / _timed(copy, (x,), reps)
    return out


def _packed_batch(shapes: dict, vocab: int, seed: int, sharding) -> dict:
    """Random tokens in packed rows of four segments each (segment ids 1..4, positions
    restarting per segment), as the packing pipeline makes them."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    batch = {}
    for key, (B, L) in shapes.items():
        seg_len = max(1, L // 4)
        segment = np.minimum(np.arange(L) // seg_len, 3) + 1
        if key.endswith("_segmentation"):
            value = np.broadcast_to(segment, (B, L))
        elif key.endswith("_position"):
            starts = np.searchsorted(segment, segment, side="left")
            value = np.broadcast_to(np.arange(L) - starts, (B, L))
        else:
            value = rng.integers(3, vocab, size=(B, L))
        batch[key] = jax.device_put(np.ascontiguousarray(value, dtype=np.int32), sharding)
    return batch


def case_config(case: str):
    """VARIANT:DTYPE[:ATTENTION][/KEY=VALUE...] -> configs/wmt14_ende.py's config for it."""
    from tx_jax.config import apply_overrides, load_config

    spec, *assignments = case.split("/")
    variant, dtype, *rest = spec.split(":")
    config = load_config(f"{CONFIG}:variant={variant}")
    overrides = {"model.dtype": dtype}
    if rest and rest[0]:
        overrides["model.attention_impl"] = rest[0]
    overrides.update(a.split("=", 1) for a in assignments)
    apply_overrides(config, overrides, from_text=True)
    return config


def prepare_case(case: str, device, chip_name):
    """A case's run as the planner builds it, its train step compiled for `device`, a real
    state and a random packed batch: (row of static figures, step executable, state, batch,
    strategy)."""
    from tx_jax.data.tokenizer import BOS_ID
    from tx_jax.planning import plan as plan_lib
    from tx_jax.planning import programs
    from tx_jax.planning.targets import Target
    from tx_jax.runner.setup import build_model

    config = case_config(case)
    platform = device.platform
    target = Target(f"{platform}:{chip_name or platform}-1", platform, chip_name or "", 1)
    built = programs.build(config, target, [device])
    shapes = programs.train_batches(built)[-1]  # the longest bucket, as the plan's headline
    program = programs.compile_train(built, shapes)
    impl = built.model_config.attention_impl
    if impl == "auto":  # what 'auto' chose for this device, as the compiled program shows
        impl += " (cudnn)" if any("cudnn" in c for c in program.custom_calls) else " (not cudnn)"
    row = {
        "case": case,
        "dtype": built.model_config.dtype,
        "attention_impl": impl,
        "shapes": {k: list(v) for k, v in shapes.items()},
        "target_tokens": shapes["targets"][0] * shapes["targets"][1],
        "compile_seconds": program.compile_seconds,
        "analytic_flops": plan_lib.analytic_flops(built, shapes),
        "compiled_flops": program.flops,
        "hbm_bytes": plan_lib.traffic(program),
        "custom_calls": program.custom_calls,
        "temp_bytes": program.memory["temp"],
    }

    # The same compiled program, run: the real state, a random packed batch, state donated.
    _, _, _, _, init_fn = build_model(config, config.data.vocab_size, BOS_ID, built.target.platform)
    s = built.strategy
    state = s.init_state(init_fn)
    batch = _packed_batch(shapes, config.data.vocab_size, config.seed, s.batch_sharding())
    return row, program.executable, state, batch, s


def measure_case(case: str, steps: int, device, chip_name, chip) -> dict:
    import jax

    row, step, state, batch, s = prepare_case(case, device, chip_name)
    losses = []
    with s.context():
        for _ in range(3):  # warm-up
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
            losses.append(float(metrics["loss"]))
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the last step
        pipelined = (time.perf_counter() - start) / steps
    row.update(
        step_seconds=_common.median(times),
        step_seconds_pipelined=pipelined,
        step_times=times,
        losses=losses,  # warm-up, each timed step, the last pipelined step
    )
    return row


def derive(row: dict, ceil: dict, chip) -> dict:
    """The figures that follow from a row's measurements: tokens/s, MFU, and two floors on the
    step time, each max(FLOPs / peak, HBM bytes / bandwidth): the plan's (chips.py datasheet:
    plan.roofline's terms) and one at the ceilings measured in this run. FLOPs are the larger
    of the compiled and the analytic count: XLA:GPU's cost analysis of the device's own
    executable leaves out cuBLAS and cuDNN custom calls (base: 1.9e12 of 1.08e13)."""
    low = row.get("dtype", row["case"].split(":")[1]) in ("bfloat16", "float16")
    peak_here = ceil["matmul_bf16" if low else "matmul_f32_default"]
    t = row["step_seconds"]
    flops = max(row["compiled_flops"], row["analytic_flops"])
    row["tokens_per_second"] = row["target_tokens"] / t
    row["mfu_measured_peak"] = row["analytic_flops"] / t / peak_here
    floor = {
        "compute_s": flops / peak_here,
        "memory_s": row["hbm_bytes"] / ceil["copy_bytes_per_s"],
    }
    row["floor_measured_ceilings_s"] = max(floor.values())
    if chip is not None:
        peak = chip.peak("bfloat16" if low else "float32")
        terms = {"compute_s": flops / peak, "memory_s": row["hbm_bytes"] / chip.hbm_bandwidth}
        row.update(terms)
        row["step_time_bound_s"] = max(terms.values())
        row["bound_by"] = max(terms, key=terms.get)[:-2]
        row["mfu_datasheet"] = row["analytic_flops"] / t / peak
        row["measured_over_bound"] = t / row["step_time_bound_s"]
    return row


def table(rows: list[dict]) -> str:
    headers = [
        "case",
        "attention",
        "ms/step",
        "pipelined ms",
        "target tok/s",
        "MFU (sheet)",
        "MFU (measured peak)",
        "plan bound ms",
        "bound by",
        "measured / bound",
        "floor at measured ceilings ms",
    ]
    out = []
    for r in rows:
        out.append(
            [
                r["case"],
                r["attention_impl"],
                f"{r['step_seconds'] * 1e3:.2f}",
                f"{r['step_seconds_pipelined'] * 1e3:.2f}",
                f"{r['tokens_per_second']:,.0f}",
                f"{100 * r['mfu_datasheet']:.1f}%" if "mfu_datasheet" in r else "-",
                f"{100 * r['mfu_measured_peak']:.1f}%",
                f"{r['step_time_bound_s'] * 1e3:.2f}" if "step_time_bound_s" in r else "-",
                r.get("bound_by", "-"),
                f"{r['measured_over_bound']:.2f}" if "measured_over_bound" in r else "-",
                f"{r['floor_measured_ceilings_s'] * 1e3:.2f}",
            ]
        )
    return _common.table(headers, out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--cases", default=DEFAULT_CASES, help="VARIANT:DTYPE[:ATTENTION][/KEY=VALUE...],..."
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak-size", type=int, default=8192, help="n of the n^3 matmul")
    p.add_argument("--peak-reps", type=int, default=10)
    p.add_argument("--name", default="gpu_step")
    p.add_argument("--out", help="JSON path (default benchmarks/results/NAME.json)")
    p.add_argument("--tabulate", help="only print the table of this JSON (derived figures anew)")
    args = p.parse_args(argv)
    if args.tabulate:
        from tx_jax.planning.chips import CHIPS

        with open(args.tabulate) as f:
            saved = json.load(f)
        chip = CHIPS.get(saved["chip"] or "")
        print(table([derive(r, saved["ceilings"], chip) for r in saved["rows"]]))
        return
    import jax

    device = jax.devices()[0]
    chip_name, chip = chip_of(device)
    print(f"{device.device_kind} ({jax.default_backend()}), chip table: {chip_name}", flush=True)
    ceil = ceilings(args.peak_size, args.peak_reps)
    print(
        "ceilings: "
        + ", ".join(
            f"{k} {v / 1e12:.1f} T{'B' if k.startswith('copy') else 'FLOP'}/s"
            for k, v in ceil.items()
        ),
        flush=True,
    )
    rows, failed = [], []
    payload = {"device_kind": device.device_kind, "chip": chip_name, "ceilings": ceil}
    for case in args.cases.split(","):
        try:
            row = derive(measure_case(case, args.steps, device, chip_name, chip), ceil, chip)
        except Exception as e:  # noqa: BLE001  (a case the device refuses: the rest still run)
            failed.append({"case": case, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            print(f"  {case}: FAILED {failed[-1]['error'][:300]}", flush=True)
        else:
            rows.append(row)
            ms, rate = row["step_seconds"] * 1e3, row["tokens_per_second"]
            losses = row["losses"]
            print(f"  {case}: {ms:.2f} ms/step, {rate:,.0f} tok/s, losses {losses}", flush=True)
        # after every case: a call cut off by its time limit keeps the cases it finished
        path = _common.write_json(args.name, payload | {"rows": rows, "failed": failed}, args.out)
    print(table(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
