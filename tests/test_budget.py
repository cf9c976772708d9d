"""train.time_budget_minutes: the steps fitted once to the budget, the schedule ending there,
the budget clock (training time less the evaluations), and an exact resume that keeps them.

One budgeted run (the module fixture) is shared: its steps are timed, so what the tests assert
is the consistency of what it records, never a speed."""

import contextlib
import io
import json
import re
import shutil

import jax
import numpy as np
import pytest
from helpers import tiny_config, train_losses

from tx_jax.model import ModelConfig, make_model
from tx_jax.runner import budget
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import build_run, size_from_data
from tx_jax.runner.validation import validate_config
from tx_jax.training import logs, optim
from tx_jax.training.checkpoint import Checkpointer
from tx_jax.training.state import init_state

# 12 s: set-up and compilation of the debug model take 2-5 s on 2 busy cores, which leaves
# several hundred updates of about 10 ms (over a thousand on an idle VM); a cold compilation
# cache still fits.
MINUTES = 0.2
EVERY = 100  # log, evaluate and save: the windows of the loss records and the resume points
OVERRIDES = {
    "train.time_budget_minutes": MINUTES,
    "train.num_steps": 8,  # the debug variant's: with cooldown 2 a share of 1/4
    "train.warmup_steps": 4,
    "train.cooldown_steps": 2,
    "train.log_every": EVERY // 4,
    "eval.every": EVERY,
    "checkpoint.every": EVERY,
    "checkpoint.keep": 3,
}


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory, tfds_dir):
    """(workdir, console output, final metrics) of one run with a budget of MINUTES."""
    workdir = tmp_path_factory.mktemp("budget") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        final = train_and_evaluate(tiny_config(tfds_dir, **OVERRIDES), workdir)
    return workdir, out.getvalue(), final


def _records(workdir, split="train") -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _meta(workdir, step=None) -> dict:
    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    return ckpt.restore_meta(step or ckpt.latest_step())


# ------------------------------------------------------------------ the arithmetic


def test_fitted_steps_fill_what_the_set_up_left():
    # 60 s of budget, 20 s spent (set-up, timing and the run's compilation): 40 s / 0.3 s
    assert budget.fitted_steps(60.0, 20.0, 0.3) == 133
    assert budget.fitted_steps(60.0, 20.0, 0.25) == 160  # exact: no update beyond the budget
    assert budget.fitted_steps(60.0, 59.9, 0.3) == 1  # less than one update left: one
    with pytest.raises(ValueError, match=r"train.time_budget_minutes=1: its 60 s are spent by "):
        budget.fitted_steps(60.0, 75.0, 0.3)


def test_the_schedule_keeps_its_warmup_and_its_cooldown_share():
    train = tiny_config("unused").train
    train.update(num_steps=1000, warmup_steps=100, cooldown_steps=200)
    assert budget.schedule_steps(train, 3905) == dict(
        num_steps=3905, warmup_steps=100, cooldown_steps=781
    )
    # warmup at most half the updates (at least 1); the cooldown's share is 1/5 still
    assert budget.schedule_steps(train, 150) == dict(
        num_steps=150, warmup_steps=75, cooldown_steps=30
    )
    assert budget.schedule_steps(train, 1) == dict(num_steps=1, warmup_steps=1, cooldown_steps=0)
    train.cooldown_steps = 0
    assert budget.schedule_steps(train, 3905)["cooldown_steps"] == 0


def test_time_updates_times_the_updates_after_the_untimed_ones():
    """A fake clock that each update advances: the first 5 s (compilation), then 0.5 s."""
    now = [0.0]
    calls = []

    def step(state, batch):
        now[0] += 5.0 if not calls else 0.5
        calls.append(batch)
        return state + 1, {"loss": 0.0}

    timing = budget.time_updates(
        step, 0, iter(range(100)), target_seconds=2.2, clock=lambda: now[0], agree=lambda n: n
    )
    # UNTIMED untimed, then ceil(2.2 / 0.5) = 5 timed (at least MIN_TIMED), batches in order
    assert timing == budget.Timing(first_seconds=5.0, step_seconds=0.5, updates=5)
    assert calls == list(range(budget.UNTIMED + 5))
    short = budget.time_updates(
        step, 0, iter(range(100)), target_seconds=0.1, clock=lambda: now[0], agree=lambda n: n
    )
    assert short.updates == budget.MIN_TIMED and short.first_seconds == 0.5


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_optimizer_state_does_not_depend_on_the_schedule(weight_decay):
    """The timed state is built with the config's schedule, the run's with the fitted one:
    Adam's (and AdamW's) state has the same structure and shapes whatever the steps."""
    config = tiny_config("unused", **{"train.weight_decay": weight_decay})
    model_config = ModelConfig.of_run(config, "cpu", vocab_size=64, bos_id=1)
    model = make_model(model_config, "translation")
    shapes = []
    for steps in [(8, 4, 2), (3905, 100, 781)]:
        config.train.update(dict(zip(budget.FIXED_KEYS, steps)))
        tx, _ = optim.make_optimizer(config.train, model_config.d_model)
        state = jax.eval_shape(lambda tx=tx: init_state(model, tx, 0))
        shapes.append(jax.tree_util.tree_structure(state))
        shapes.append([(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state)])
    assert shapes[0] == shapes[2] and shapes[1] == shapes[3]


def test_a_negative_budget_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"train.time_budget_minutes=-1.0 must be >= 0"):
        validate_config(tiny_config("unused", **{"train.time_budget_minutes": -1.0}))


def test_the_logger_keeps_evaluation_out_of_the_budget_clock(tmp_path):
    logger = logs.MetricLogger(tmp_path, 10, train_seconds=30.0, eval_seconds=4.0)
    logger.count_eval(1.5)
    assert logger.eval_seconds() == 5.5
    clock = logger.budget_clock()
    assert 24.5 <= clock <= logger.train_seconds() - 5.5 + 1e-6
    logger.write(1, "train", {"loss": 1.0})
    logger.segment("stop", 1)
    logger.close()
    (record,) = _records(tmp_path)
    (segment,) = [json.loads(x) for x in (tmp_path / "segments.jsonl").read_text().splitlines()]
    assert record["eval_seconds"] == segment["eval_seconds"] == 5.5
    assert record["train_seconds"] >= 30.0


# ------------------------------------------------------------------ one budgeted run


def test_the_steps_are_fixed_once_and_recorded(budgeted):
    workdir, out, _ = budgeted
    fixed = _meta(workdir)["budget"]
    n = fixed["num_steps"]
    (line,) = [x for x in out.splitlines() if x.startswith("time budget") and "measured" in x]
    assert re.fullmatch(
        rf"time budget {MINUTES:g} min: [0-9.e-]+ s/update measured over {fixed['timed_updates']}"
        rf" updates after [\d.,]+ s of set-up, compilation and timing \(\+[\d.,]+ s to compile the "
        rf"run's step\) -> {n:,} updates \(warmup 4, cooldown {round(n / 4):,}\)",
        line,
    ), line
    assert fixed["timed_updates"] >= budget.MIN_TIMED and fixed["minutes"] == MINUTES
    # the schedule's keys: fitted once, the same in config.json and in every checkpoint
    want = dict(num_steps=n, warmup_steps=4, cooldown_steps=round(n / 4))
    assert {k: fixed[k] for k in budget.FIXED_KEYS} == want
    config = json.loads((workdir / "config.json").read_text())
    assert {k: config["train"][k] for k in budget.FIXED_KEYS} == want
    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    assert ckpt.all_steps()[-1] == n and len(ckpt.all_steps()) >= 2
    for step in ckpt.all_steps():
        meta = ckpt.restore_meta(step)
        assert meta["budget"] == fixed
        assert {k: meta["config"]["train"][k] for k in budget.FIXED_KEYS} == want
    # the run took them: its last update is the n-th
    assert max(train_losses(workdir)) == n and n > EVERY


def test_the_schedule_ends_at_the_budget(budgeted, tfds_dir):
    workdir, out, _ = budgeted
    fixed = _meta(workdir)["budget"]
    n, cooldown = fixed["num_steps"], fixed["cooldown_steps"]
    # the fit's arithmetic: set-up + compilation + n updates fill the budget to one update
    spent = fixed["setup_seconds"] + fixed["compile_seconds"]
    planned = spent + n * fixed["step_seconds"]
    assert planned <= 60 * MINUTES + 1e-9 < planned + fixed["step_seconds"]
    # the last update's rate is the schedule's end: 1/cooldown of the rate before the ramp,
    # and the schedule reaches 0 at update n
    config = tiny_config(tfds_dir, **OVERRIDES)
    config.train.update({k: fixed[k] for k in budget.FIXED_KEYS})
    schedule = optim.make_schedule(config.train, 32)
    base = optim.rsqrt_schedule(32, 4, config.train.lr_scale)
    train = _records(workdir)
    assert train[-1]["step"] == n
    assert train[-1]["lr"] == pytest.approx(float(schedule(n - 1)), rel=1e-6)
    assert train[-1]["lr"] == pytest.approx(float(base(n - 1)) / cooldown, rel=1e-5)
    assert float(schedule(n)) == 0.0
    # the budget clock (train_seconds - eval_seconds) at the last update: the timing ended
    # before the first update and every evaluation is out of it; the clock lands near the
    # budget (loose: the updates' speed on shared cores is not the timing's exactly)
    clocks = [r["train_seconds"] - r["eval_seconds"] for r in train]
    assert fixed["setup_seconds"] < clocks[0] and clocks == sorted(clocks)
    evals = _records(workdir, "validation")
    assert [r["step"] for r in evals] == [*range(EVERY, n, EVERY), n]
    assert 0 < train[-1]["eval_seconds"] < _meta(workdir, n)["eval_seconds"]  # + the last
    assert 0.5 * 60 * MINUTES <= clocks[-1] <= 1.6 * 60 * MINUTES, clocks[-1]
    (summary,) = [x for x in out.splitlines() if x.startswith("time budget") and "at the" in x]
    assert summary.startswith(f"time budget {MINUTES:g} min ({60 * MINUTES:.0f} s): ")
    assert f"{clocks[-1]:,.0f} s of training at the last update" in summary


def test_the_timing_leaves_the_run_as_it_was(budgeted, tfds_dir, tmp_path, capsys):
    """A run given the fitted schedule's keys and no budget trains the same: the timing took
    its batches from its own iterator and a copy of the state. Its loss records are the
    budgeted run's to the bit (the same schedule: a shorter one, or none, compiles to another
    program, whose float rounding differs); that run resumed with a budget keeps its steps
    and says so."""
    workdir, _, _ = budgeted
    fixed = _meta(workdir)["budget"]
    steps = fixed["num_steps"]
    plain = dict(OVERRIDES, **{"train.time_budget_minutes": 0.0, "train.num_steps": steps})
    plain.update({f"train.{k}": fixed[k] for k in ("warmup_steps", "cooldown_steps")})
    train_and_evaluate(tiny_config(tfds_dir, **plain), tmp_path)
    assert train_losses(tmp_path) == train_losses(workdir)
    capsys.readouterr()
    plain["train.time_budget_minutes"] = MINUTES
    train_and_evaluate(tiny_config(tfds_dir, **plain), tmp_path)
    out = capsys.readouterr().out
    assert (
        f"train.time_budget_minutes={MINUTES:g} not applied: this run started without a budget"
        in out
    )
    assert "measured over" not in out
    assert json.loads((tmp_path / "config.json").read_text())["train"]["num_steps"] == steps


def test_a_resumed_run_keeps_its_steps_to_the_bit(budgeted, tfds_dir, tmp_path, capsys):
    """The budgeted run restarted from its checkpoint before the last (a copy), under another
    budget: it takes the stored steps (not timed again), says the budget is not applied, and
    its losses and final parameters are the uninterrupted run's; the clock continues."""
    workdir, _, _ = budgeted
    fixed = _meta(workdir)["budget"]
    n = fixed["num_steps"]
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    restart = Checkpointer(workdir / "checkpoints", read_only=True).all_steps()[-2]
    shutil.rmtree(copy / "checkpoints" / str(n))
    capsys.readouterr()
    config = tiny_config(tfds_dir, **dict(OVERRIDES, **{"train.time_budget_minutes": 5.0}))
    train_and_evaluate(config, copy)
    out = capsys.readouterr().out
    assert f"train.time_budget_minutes=5 not applied: this run's budget of {MINUTES:g} min" in out
    assert "measured over" not in out and "resuming from step" not in out  # no change listed
    saved = json.loads((copy / "config.json").read_text())["train"]
    assert saved["time_budget_minutes"] == MINUTES and saved["num_steps"] == n
    ours, theirs = train_losses(copy), train_losses(workdir)
    assert max(ours) == n
    logged = [r["step"] for r in _records(copy) if r["step"] > restart]
    assert logged == 2 * [r["step"] for r in _records(workdir) if r["step"] > restart]
    assert [ours[s] for s in range(restart + 25, n, 25)] == [
        theirs[s] for s in range(restart + 25, n, 25)
    ]
    assert ours[n] == theirs[n]
    meta = _meta(copy, n)
    assert meta["budget"] == fixed
    assert meta["train_seconds"] > _meta(workdir, restart)["train_seconds"]
    run = build_run(size_from_data(tiny_config(tfds_dir, **OVERRIDES), workdir))
    abstract = run.strategy.abstract_state(run.init_fn)
    params = [
        Checkpointer(d / "checkpoints", read_only=True).restore(n, abstract)[0].params
        for d in (workdir, copy)
    ]
    leaves = [jax.tree_util.tree_leaves(p) for p in params]
    assert len(leaves[0]) == len(leaves[1]) > 0
    for a, b in zip(*leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_cadence_the_data_chose_is_chosen_again_for_the_fitted_steps():
    both = ("eval.every", "checkpoint.every")
    assert budget.refit_cadence(both, 911, 1000) == {"eval.every": 100, "checkpoint.every": 50}
    assert budget.refit_cadence(both, 4321, 1000) == {"eval.every": 500, "checkpoint.every": 250}
    # the config set eval.every: kept, and the checkpoints follow it
    assert budget.refit_cadence(("checkpoint.every",), 911, 300) == {"checkpoint.every": 150}
    assert budget.refit_cadence((), 911, 300) == {}
