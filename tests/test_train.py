"""End-to-end training: loss goes down, checkpoints, exact resume, devices, grad accumulation."""

import gc
import gzip
import json
import os
import shutil

import jax
import numpy as np
import pytest
from helpers import run_python, tiny_config, train_losses

from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import build_run, size_from_data
from tx_jax.runner.validation import validate_config
from tx_jax.training import logs
from tx_jax.training.checkpoint import Checkpointer

STEPS = 3  # the shared one-device run's steps


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, tfds_dir):
    """One 3-step run on one device, checkpointed at its end and with steps 2-3 traced
    (train.profile_steps): the reference of gradient accumulation and of the 8-device
    layouts, and the profile test's trace. Tracing changes no number it computes."""
    workdir = tmp_path_factory.mktemp("train") / "one"
    config = tiny_config(
        tfds_dir,
        **{"train.num_steps": STEPS, "checkpoint.every": STEPS, "train.profile_steps": (2, 4)},
    )
    train_and_evaluate(config, workdir)
    return workdir


def test_tiny_run_lowers_the_loss_and_writes_a_checkpoint(tmp_path, tfds_dir):
    workdir = tmp_path / "run"
    config = tiny_config(
        tfds_dir, **{"train.num_steps": 30, "train.warmup_steps": 10, "data.packing": True}
    )
    final = train_and_evaluate(config, workdir)
    losses = train_losses(workdir)
    first, last = (
        np.mean([losses[s] for s in (1, 2, 3)]),
        np.mean([losses[s] for s in (28, 29, 30)]),
    )
    assert last < first - 0.5, (first, last)
    assert final["perplexity"] < np.exp(first)
    steps = Checkpointer(workdir / "checkpoints", read_only=True).all_steps()
    assert steps[-1] == 30
    assert (workdir / "tokenizer.model").exists() and (workdir / "config.json").exists()
    versions = json.loads((workdir / "versions.json").read_text())
    assert versions["jax"] == jax.__version__
    assert versions["cpu"] == logs.cpu()
    assert f", {len(os.sched_getaffinity(0))} cores, " in versions["cpu"]
    assert (workdir / "tensorboard").is_dir()
    # tokens/s is measured over the wall time between log lines (not JAX's dispatch time):
    # the windows it implies add up to the time that passed between the records.
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["split"] == "train"]
    windows = sum(r["tokens"] / r["tokens_per_sec"] for r in train_records[1:])
    wall = train_records[-1]["elapsed"] - train_records[0]["elapsed"]
    assert 0.8 * wall - 0.05 <= windows <= wall + 0.05, (windows, wall)


def test_exact_resume_and_its_control(tmp_path, tfds_dir):
    """2N steps in one run == N steps + restart + N steps, to the last bit. The control's
    first segment is the resumed run's (a copy of its workdir after N steps): the same run."""
    n = 2
    cfg = lambda steps, **kw: tiny_config(
        tfds_dir,
        **{"train.num_steps": steps, "checkpoint.every": n, "model.dropout_rate": 0.1, **kw},
    )
    train_and_evaluate(cfg(2 * n), tmp_path / "straight")
    train_and_evaluate(cfg(n), tmp_path / "resumed")
    shutil.copytree(tmp_path / "resumed", tmp_path / "control")
    train_and_evaluate(cfg(2 * n), tmp_path / "resumed")
    train_and_evaluate(cfg(2 * n, **{"train.restore_data_iterator": False}), tmp_path / "control")
    straight = train_losses(tmp_path / "straight")
    resumed = train_losses(tmp_path / "resumed")
    control = train_losses(tmp_path / "control")
    assert [straight[s] for s in range(1, 2 * n + 1)] == [resumed[s] for s in range(1, 2 * n + 1)]
    # without the iterator state the second half sees other batches: the losses differ
    assert [control[s] for s in range(1, n + 1)] == [straight[s] for s in range(1, n + 1)]
    assert all(control[s] != straight[s] for s in range(n + 1, 2 * n + 1))
    # train_seconds sums the segments: the second one starts from the checkpoint's time
    saved = Checkpointer(tmp_path / "resumed" / "checkpoints", read_only=True).restore_meta(n)
    records = [
        json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    ]
    first = [r for r in records if r["step"] <= n]
    second = [r for r in records if r["step"] > n]
    assert first and second and 0 < first[-1]["train_seconds"] <= saved["train_seconds"]
    assert all(r["train_seconds"] - r["elapsed"] >= saved["train_seconds"] for r in second)
    assert all(r["train_seconds"] >= r["elapsed"] for r in first)
    # segments.jsonl: each process's steps, its training time so far and its CPU
    lines = (tmp_path / "resumed" / "segments.jsonl").read_text().splitlines()
    segments = [json.loads(x) for x in lines]
    assert [(r["event"], r["step"]) for r in segments] == [
        ("start", 0),
        ("stop", n),
        ("start", n),
        ("stop", 2 * n),
    ]
    # the second process starts from the checkpoint's time; each stop follows its last save
    seconds = [r["train_seconds"] for r in segments]
    assert seconds[0] < saved["train_seconds"] <= seconds[1]
    assert saved["train_seconds"] < seconds[2] < seconds[3]
    assert {r["cpu"] for r in segments} == {logs.cpu()}


def _memory_mappings() -> int:
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux mappings")
def test_several_experiments_in_one_process(tmp_path, tfds_dir):
    """train_and_evaluate again and again in one process, as a notebook or a sweep does: a
    run of the default (mesh), a pmap run with packing, the first run resumed further. Each
    finishes its own steps, and a finished run's programs are freed: jax.pmap's cache keeps
    them for the process's life unless the run releases them (Strategy.release), and a process
    that ran enough passed the kernel's limit on memory mappings, 65530, where XLA:CPU aborts."""
    mesh_cfg = lambda steps: tiny_config(
        tfds_dir, **{"train.num_steps": steps, "checkpoint.every": 3, "eval.every": 3}
    )
    pmap_cfg = tiny_config(
        tfds_dir,
        **{"train.num_steps": 2, "parallel.strategy": "pmap", "data.packing": True},
    )
    first = train_and_evaluate(mesh_cfg(3), tmp_path / "a")
    gc.collect()
    mappings = _memory_mappings()
    other = train_and_evaluate(pmap_cfg, tmp_path / "b")
    resumed = train_and_evaluate(mesh_cfg(6), tmp_path / "a")  # from checkpoint 3
    gc.collect()
    # a debug run's programs take about 460 mappings; kept, the pmap run's were here
    assert _memory_mappings() - mappings < 200, (mappings, _memory_mappings())

    a, b = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and sorted(b) == [1, 2]
    assert all(np.isfinite(v) for v in [*a.values(), *b.values()])
    assert np.mean([a[5], a[6]]) < np.mean([a[1], a[2]])
    segments = [json.loads(x) for x in (tmp_path / "a" / "segments.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in segments] == [
        ("start", 0),
        ("stop", 3),
        ("start", 3),
        ("stop", 6),
    ]
    assert Checkpointer(tmp_path / "a" / "checkpoints", read_only=True).all_steps() == [3, 6]
    assert Checkpointer(tmp_path / "b" / "checkpoints", read_only=True).all_steps() == [2]
    for final in (first, other, resumed):  # each run's own validation at its last step
        assert np.isfinite(final["loss"]) and final["perplexity"] == pytest.approx(
            np.exp(final["loss"]), rel=1e-5
        )
    assert resumed["loss"] < first["loss"]
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("a", "b")]
    assert [c["parallel"]["strategy"] for c in configs] == ["mesh", "pmap"]


def test_gradient_accumulation_equals_the_full_batch(tmp_path, tfds_dir, one_device):
    four = tiny_config(tfds_dir, **{"train.num_steps": STEPS, "train.grad_accum_steps": 4})
    train_and_evaluate(four, tmp_path / "four")
    a, b = train_losses(one_device), train_losses(tmp_path / "four")
    np.testing.assert_allclose([a[s] for s in (1, 2, 3)], [b[s] for s in (1, 2, 3)], rtol=1e-5)


def test_bf16_training_best_checkpoint_retention_and_tokens_per_second(tmp_path, tfds_dir):
    """bf16 compute trains (finite, decreasing loss, float32 params); retention keeps the
    latest `keep` checkpoints plus the best by the validation metric. And tokens/s leaves out
    evaluation: a train record's window starts after the evaluation (and its save) before it,
    so it is at most the time from that validation record to this one."""
    config = tiny_config(
        tfds_dir,
        **{
            "model.dtype": "bfloat16",
            "train.num_steps": 8,
            "train.log_every": 2,
            "eval.every": 2,
            "checkpoint.every": 2,
            "checkpoint.keep": 1,
            "checkpoint.best_metric": "loss",
            # 'max' keeps the *worst* loss: a step that differs from the latest one
            "checkpoint.best_mode": "max",
        },
    )
    train_and_evaluate(config, tmp_path)
    losses = train_losses(tmp_path)
    assert sorted(losses) == [2, 4, 6, 8]  # logged every 2 steps
    assert all(np.isfinite(v) for v in losses.values()) and losses[8] < losses[2]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    validation = {r["step"]: r["elapsed"] for r in records if r["split"] == "validation"}
    train = [r for r in records if r["split"] == "train"]
    assert sorted(validation) == [2, 4, 6, 8] and [r["step"] for r in train] == [2, 4, 6, 8]
    for r in train[1:]:
        window = 2 * r["tokens"] / r["tokens_per_sec"]  # "tokens": the mean of the 2 steps
        assert 0 < window <= r["elapsed"] - validation[r["step"] - 2] + 0.01, r
    val_loss = {r["step"]: r["loss"] for r in records if r["split"] == "validation"}
    worst = max(val_loss, key=val_loss.get)
    assert worst != 8
    ckpt = Checkpointer(tmp_path / "checkpoints", read_only=True)
    assert ckpt.all_steps() == [worst, 8]
    run = build_run(size_from_data(config, tmp_path))
    state, _, _ = ckpt.restore(8, run.strategy.abstract_state(run.init_fn))
    dtypes = {x.dtype for x in jax.tree_util.tree_leaves(state.params)}
    assert dtypes == {np.dtype("float32")}  # bf16 is the compute dtype only


@pytest.mark.slow
def test_pmap_and_mesh_on_8_devices_match_one_device(tmp_path, tfds_dir, one_device):
    steps = STEPS
    base = {"train.num_steps": steps, "checkpoint.every": steps}
    code = f"""
import jax, numpy as np
from helpers import tiny_config
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import build_run, size_from_data
from tx_jax.runner.validation import validate_config
assert jax.device_count() == 8
base = {base!r}
layouts = {{
    "pmap": {{"parallel.strategy": "pmap"}},
    "mesh_data": {{"parallel.strategy": "mesh"}},
    "mesh_222": {{"parallel.strategy": "mesh",
                  "parallel.mesh": {{"data": 2, "fsdp": 2, "tensor": 2}}}},
}}
for name, overrides in layouts.items():
    train_and_evaluate(tiny_config({str(tfds_dir)!r}, **base, **overrides),
                       {str(tmp_path)!r} + "/" + name)
# what the 8 devices hold at the end, to compare with a 1-device restore
from tx_jax.training.checkpoint import Checkpointer
run = build_run(size_from_data(tiny_config({str(tfds_dir)!r}, **base, **layouts["mesh_222"]),
                               {str(tmp_path)!r} + "/mesh_222"))
ckpt = Checkpointer({str(tmp_path)!r} + "/mesh_222/checkpoints", read_only=True)
state, _, _ = ckpt.restore({steps}, run.strategy.abstract_state(run.init_fn))
assert any(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(state.params))
np.savez({str(tmp_path)!r} + "/mesh_222_params.npz", **{{
    jax.tree_util.keystr(p): np.asarray(x)
    for p, x in jax.tree_util.tree_leaves_with_path(state.params)}})
"""
    run_python(code, devices=8)
    want = train_losses(one_device)
    for name in ("pmap", "mesh_data", "mesh_222"):
        got = train_losses(tmp_path / name)
        np.testing.assert_allclose(
            [got[s] for s in range(1, steps + 1)],
            [want[s] for s in range(1, steps + 1)],
            rtol=1e-5,
            err_msg=name,
        )
    # the (data, fsdp, tensor) = (2, 2, 2) checkpoint restores on 1 device, bit for bit
    saved = np.load(tmp_path / "mesh_222_params.npz")
    run = build_run(size_from_data(tiny_config(tfds_dir, **base), tmp_path / "mesh_222"))
    ckpt = Checkpointer(tmp_path / "mesh_222" / "checkpoints", read_only=True)
    state, data_state, _ = ckpt.restore(steps, run.strategy.abstract_state(run.init_fn))
    assert int(state.step) == steps and data_state["input_shards"] == 1
    assert data_state["shards"]["0"]["version"] == 1
    leaves = jax.tree_util.tree_leaves_with_path(state.params)
    assert len(leaves) == len(saved.files)
    for path, leaf in leaves:
        assert leaf.sharding.device_set == {jax.devices()[0]}
        np.testing.assert_array_equal(leaf, saved[jax.tree_util.keystr(path)])


def test_profile_steps_write_a_trace_tensorboard_reads(one_device):
    """train.profile_steps: a jax.profiler trace of the chosen steps in WORKDIR/tensorboard
    (the shared run traces steps 2 and 3)."""
    runs = list((one_device / "tensorboard" / "plugins" / "profile").iterdir())
    assert len(runs) == 1  # one trace, started once
    xplane = list(runs[0].glob("*.xplane.pb"))
    assert len(xplane) == 1 and xplane[0].stat().st_size > 10_000
    (trace,) = runs[0].glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("pmap" in n or "jit" in n for n in names), sorted(names)[:20]


@pytest.mark.parametrize(
    "value, match",
    [
        ((0, 2), r"1 <= start < stop"),
        ((3, 3), r"1 <= start < stop"),
        ((2, 9), r"train.num_steps \+ 1 = 5"),
        ((1, 2, 3), r"expected \(start, stop\)"),
    ],
)
def test_profile_steps_are_checked_before_anything_runs(tmp_path, tfds_dir, value, match):
    config = tiny_config(tfds_dir, **{"train.num_steps": 4, "train.profile_steps": value})
    with pytest.raises(ValueError, match=r"train.profile_steps=.*" + match):
        validate_config(config)


def test_metric_logger_writes_tensorboard_without_importing_torch(tmp_path):
    """tensorboardX imports torch when it can (seconds of every training process's start); the
    logger writes its scalars without it, and torch still imports afterwards."""
    out = run_python(
        "import sys, glob\n"
        "from tx_jax.training import logs\n"
        f"m = logs.MetricLogger({str(tmp_path)!r}, 10)\n"
        "m.write(1, 'train', {'loss': 1.5}); m.close()\n"
        "print('torch loaded:', 'torch' in sys.modules)\n"
        f"print('events:', len(glob.glob({str(tmp_path / 'tensorboard' / '*tfevents*')!r})))\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('torch') is not None:\n"
        "    import torch; print('torch imports after:', torch.tensor([2.0]).item() == 2.0)\n",
        devices=1,
    )
    assert "torch loaded: False" in out and "events: 1" in out, out
    assert "torch imports after: False" not in out, out
