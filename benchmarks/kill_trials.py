"""kill -9 at random moments during training (saves included), then resume; count what is lost.

    python benchmarks/kill_trials.py --trials 20 --out /tmp/kill_trials.json

Each trial starts a tiny training run (a checkpoint every 2 steps, async saves), waits until
a random step has been logged, waits a random 0-1 s more (so the kill lands inside a step or
a save), sends SIGKILL, relaunches to the target step, and checks: the relaunch
resumes from the newest complete checkpoint, no temporary checkpoint directory is left,
and the train losses after the restart equal an uninterrupted reference run bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import train_losses  # noqa: E402

STEPS = 24


def launch(workdir: pathlib.Path, tfds_dir: pathlib.Path, steps: int) -> subprocess.Popen:
    overrides = {"train.num_steps": steps, "checkpoint.every": 2, "checkpoint.async_save": True}
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "from helpers import tiny_config; from tx_jax.runner.loop import train_and_evaluate;"
        f"train_and_evaluate(tiny_config({str(tfds_dir)!r}, **{overrides!r}), "
        f"{str(workdir)!r})"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def complete_steps(workdir: pathlib.Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def tmp_dirs(workdir: pathlib.Path) -> list[str]:
    d = workdir / "checkpoints"
    return [p.name for p in d.iterdir() if "tmp" in p.name] if d.exists() else []


def reference(base: pathlib.Path, tfds_dir: pathlib.Path) -> dict[int, float]:
    proc = launch(base / "reference", tfds_dir, STEPS)
    _, err = proc.communicate(timeout=600)
    if proc.returncode:
        raise RuntimeError(err)
    return train_losses(base / "reference")


def trial(
    base: pathlib.Path, tfds_dir: pathlib.Path, i: int, at_step: int, jitter: float, ref: dict
) -> dict:
    workdir = base / f"trial{i}"
    proc = launch(workdir, tfds_dir, STEPS)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (workdir / "metrics.jsonl").exists() and max(
            train_losses(workdir), default=0
        ) >= at_step:
            break
        time.sleep(0.02)
    time.sleep(jitter)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    logged = max(train_losses(workdir), default=0) if (workdir / "metrics.jsonl").exists() else 0
    before = complete_steps(workdir)
    newest = max(before, default=0)
    tmp_after_kill = len(tmp_dirs(workdir))  # counted before the resume cleans them
    relaunch = launch(workdir, tfds_dir, STEPS)
    _, err = relaunch.communicate(timeout=600)
    if relaunch.returncode:
        raise RuntimeError(err)
    losses = train_losses(workdir)
    exact = all(losses[s] == ref[s] for s in range(newest + 1, STEPS + 1))
    return {
        "trial": i,
        "kill_at_step": at_step,
        "jitter_s": round(jitter, 2),
        "last_logged_step": logged,
        "newest_complete_checkpoint": newest,
        "steps_lost": max(logged - newest, 0),
        "tmp_dirs_after_kill": tmp_after_kill,
        "tmp_dirs_after_resume": len(tmp_dirs(workdir)),
        "resumed_exactly": exact,
        "finished": max(losses) == STEPS,
    }


def run_trials(n: int, seed: int, base: pathlib.Path, tfds_dir: pathlib.Path) -> list[dict]:
    ref = reference(base, tfds_dir)
    rng = random.Random(seed)
    return [
        trial(base, tfds_dir, i, rng.randint(1, STEPS - 4), rng.uniform(0.0, 1.0), ref)
        for i in range(n)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp)
        results = run_trials(args.trials, args.seed, base, base / "tfds")
    for r in results:
        print(json.dumps(r))
    lost = [r["steps_lost"] for r in results]
    print(
        f"{len(results)} trials: exact resume in {sum(r['resumed_exactly'] for r in results)}, "
        f"steps lost max {max(lost)} mean {sum(lost) / len(lost):.2f}, "
        f"tmp dirs left after resume {sum(r['tmp_dirs_after_resume'] for r in results)}"
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
