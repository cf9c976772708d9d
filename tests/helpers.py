"""Tiny training configs and run helpers shared by the end-to-end tests."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import ml_collections
import zygote

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "configs"))

import default as default_config  # noqa: E402

from tx_jax.config import apply_overrides  # noqa: E402


def tiny_config(data_dir: str | os.PathLike, **overrides) -> ml_collections.ConfigDict:
    """configs/default.py:debug with one bucket shape, no BLEU, and `overrides` (dotted)."""
    c = default_config.get_config("debug")
    c.data.data_dir = str(data_dir)
    c.data.bucket_boundaries = [32]  # one static shape: one compilation
    c.data.tokens_per_batch = 512  # 16 rows of 32: divisible by 8 devices
    c.data.max_train_len = 32
    c.data.max_eval_len = 32
    c.data.packing = False  # the bucketed path; tests that want packing say so
    c.eval.bleu_examples = 0
    c.eval.score_test = False
    c.eval.every = 1000
    c.checkpoint.async_save = False
    c.train.log_every = 1
    apply_overrides(c, overrides)
    return c


def train_losses(workdir: str | os.PathLike) -> dict[int, float]:
    """step -> train loss from WORKDIR/metrics.jsonl (the last record of each step wins)."""
    out = {}
    for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            out[record["step"]] = record["loss"]
    return out


def forced_devices(devices: int) -> str:
    """XLA_FLAGS for `devices` CPU devices in one process. XLA:CPU aborts a collective whose
    participants (one thread per device) do not all arrive within 40 s, which a participant
    starved on 2 cores shared with another test worker can miss: the tests wait 10 minutes."""
    return (
        f"--xla_force_host_platform_device_count={devices} "
        "--xla_cpu_collective_call_terminate_timeout_seconds=600 "
        "--xla_cpu_use_fusion_emitters=false"  # conftest.TEST_XLA_FLAGS: faster compiles
    )


def process_env(process_id: int, num_processes: int, port: int, devices: int, **extra) -> dict:
    """The environment of one of `num_processes` jax.distributed processes on 127.0.0.1:port,
    each with `devices` forced CPU devices; `extra` (HOME, TMPDIR, ...) added."""
    return dict(
        os.environ,
        XLA_FLAGS=forced_devices(devices),
        JAX_PLATFORMS="cpu",
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(num_processes),
        JAX_PROCESS_ID=str(process_id),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        PYTHONUNBUFFERED="1",
        **extra,
    )


def run_python(code: str, *, devices: int = 8, timeout: int = 600, env=None) -> str:
    """Run `code` in a fresh interpreter with `devices` forced CPU devices; return stdout."""
    full_env = dict(os.environ, **(env or {}))
    full_env["XLA_FLAGS"] = forced_devices(devices)
    full_env["JAX_PLATFORMS"] = "cpu"
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    # A hang prints every thread's stack and exits before the timeout: the failure says where.
    limit = max(timeout - 30, 1)
    dump = f"import faulthandler\nfaulthandler.dump_traceback_later({limit}, exit=True)\n"
    proc = zygote.run(  # a fresh process, forked from tests/zygote.py's
        [sys.executable, "-c", dump + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stderr[-12000:]}")
    return proc.stdout


def state_and_step(model, tx, lr: float, params=None, grad_accum_steps: int = 1):
    """A TrainState at step 0 (dropout key 5) of `params` (default: the encoder-decoder
    `model` initialised on a [1, 8] batch, key 0) and the jitted train_step with a constant
    rate `lr` and label smoothing 0.1: the tiny update the loss and kernel tests compare."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from tx_jax.training.state import TrainState
    from tx_jax.training.step import train_step

    if params is None:
        x = jnp.ones((1, 8), jnp.int32)
        params = nn.meta.unbox(model.init(jax.random.key(0), x, x)["params"])
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(zero, params, tx.init(params), jax.random.PRNGKey(5), zero, zero)
    step = jax.jit(
        lambda state, batch: train_step(
            state,
            batch,
            model=model,
            tx=tx,
            schedule=lambda s: lr,
            label_smoothing=0.1,
            grad_accum_steps=grad_accum_steps,
        )
    )
    return state, step
