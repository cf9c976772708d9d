"""Hosts that share no disk, as a pod's workers: 2 processes (jax.distributed on 127.0.0.1),
each with its own HOME, TFDS_DATA_DIR, TMPDIR and working directory; only the workdir and the
text corpus are common, on gs:// (tests/gcs_server.py).

One launch of the pair: a local workdir (a relative path: another directory on each "host")
is refused on both processes; data too large to prepare at a multi-host start is refused
with the command that prepares it; then the real run on gs://, each process preparing its own
copy of the corpus, stops on SIGTERM after a checkpoint. A second launch resumes it. Its losses
are the 1-process run's. `tx_jax prepare` then publishes the data to a gs:// data_dir, which
another "host" reads from its own staged copy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import portpicker
import pytest
import zygote
from etils import epath
from helpers import ROOT, process_env

from tx_jax.config import apply_overrides, load_config
from tx_jax.data import datasets
from tx_jax.runner.loop import train_and_evaluate

pytestmark = [pytest.mark.slow]

BUCKET = "gs://tx-jax-test"
STEPS, STOP_AFTER = 8, 3
TIMEOUT = 300
WORDS = [("red", "rot"), ("blue", "blau"), ("cat", "Katze"), ("dog", "Hund"), ("house", "Haus")]


def _overrides(corpus: str) -> dict:
    return {
        "data.train": f"{corpus}/train-*",
        "data.validation": f"{corpus}/dev.tsv",
        "data.vocab_size": 40,
        "data.packing": True,
        "train.num_steps": STEPS,
        "checkpoint.every": 2,
        "checkpoint.async_save": False,
        "eval.every": 1000,
        "eval.bleu_examples": 0,
        "eval.score_test": False,
        "train.log_every": 1,
    }


def _write_corpus(corpus: epath.Path) -> None:
    """Two gzip-free shards of train pairs and a TSV validation split, on gs://."""
    pairs = [
        (
            " ".join(WORDS[(i + k) % 5][0] for k in range(i % 4 + 2)),
            " ".join(WORDS[(i + k) % 5][1] for k in range(i % 4 + 2)),
        )
        for i in range(80)
    ]
    for shard, part in enumerate((pairs[:40], pairs[40:])):
        (corpus / f"train-{shard}.en").write_text("".join(a + "\n" for a, _ in part))
        (corpus / f"train-{shard}.de").write_text("".join(b + "\n" for _, b in part))
    (corpus / "dev.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in pairs[:12]))


def _code(overrides: dict, workdir: str, refusals: bool) -> str:
    """A process's program: (with `refusals`) the two runs that must be refused, then the run
    in `workdir`, which sends itself SIGTERM once step STOP_AFTER is logged in the first
    launch (the loop saves and stops at the agreed step)."""
    return "\n".join(
        [
            "import os, signal, sys, time",
            "from tx_jax.config import apply_overrides, load_config",
            "from tx_jax.data import preparation",
            "from tx_jax.runner.loop import train_and_evaluate",
            "from tx_jax.training import logs",
            f"config = load_config({str(ROOT / 'configs' / 'text.py')!r} + ':debug')",
            f"apply_overrides(config, {overrides!r})",
            f"if {refusals!r}:",
            "    write = logs.MetricLogger.write",
            "    def signalling_write(self, step, split, scalars):",
            "        write(self, step, split, scalars)",
            f"        if split == 'train' and step == {STOP_AFTER}:",
            "            os.kill(os.getpid(), signal.SIGTERM)",
            "            time.sleep(1.0)  # the coordination service agrees on the step",
            "    logs.MetricLogger.write = signalling_write",
            "    for label, workdir, limit in (('local', 'run', None), ('large', "
            f"{workdir + '-large'!r}, 0)):",
            "        if limit is not None:",
            "            preparation.MULTI_HOST_PREPARE_BYTES = limit",
            "        try:",
            "            train_and_evaluate(config, workdir)",
            "            print('NOT REFUSED', label, flush=True)",
            "        except ValueError as e:",
            "            print('REFUSED', label, e, flush=True)",
            "    preparation.MULTI_HOST_PREPARE_BYTES = 64 << 20",
            f"print('RESULT', train_and_evaluate(config, {workdir!r}), flush=True)",
        ]
    )


def _launch(base, overrides: dict, workdir: str, refusals: bool, name: str) -> list[str]:
    """2 processes, each a "host" with its own directories; their outputs once both exit 0."""
    port = portpicker.pick_unused_port()
    procs = []
    try:
        for i in range(2):
            host = base / f"host{i}"
            for sub in ("home", "tfds", "tmp"):
                (host / sub).mkdir(parents=True, exist_ok=True)
            env = process_env(
                i,
                2,
                port,
                1,
                HOME=str(host / "home"),
                TFDS_DATA_DIR=str(host / "tfds"),
                TMPDIR=str(host / "tmp"),
            )
            with open(base / f"{name}_process{i}.log", "w") as log:
                procs.append(
                    zygote.Popen(
                        [sys.executable, "-c", _code(overrides, workdir, refusals)],
                        cwd=host,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [(base / f"{name}_process{i}.log").read_text() for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(o[-4000:] for o in outs)
    return outs


def _losses(workdir) -> dict[int, float]:
    lines = (epath.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}


def test_two_hosts_without_a_shared_disk_train_stop_resume_and_match_one_process(gcs, tmp_path):
    corpus = epath.Path(f"{BUCKET}/hosts/corpus")
    _write_corpus(corpus)
    overrides = _overrides(str(corpus))
    workdir = f"{BUCKET}/hosts/run"
    first = _launch(tmp_path, overrides, workdir, True, "1_stopped")
    for out in first:
        refused = [line for line in out.splitlines() if "REFUSED" in line]
        assert len(refused) == 2 and all(line.startswith("REFUSED") for line in refused), out
        assert "REFUSED local workdir " in refused[0] and (
            "process(es) 1 of 2 cannot see what process 0 writes there" in refused[0]
        )
        assert "give a gs:// workdir" in refused[0]
        assert refused[1].startswith("REFUSED large not prepared: text train (0 MiB)")
        assert "run `tx_jax prepare` once first" in refused[1]
    # each host prepared its own copy of the corpus, in its own TFDS_DATA_DIR
    for i in range(2):
        assert list((tmp_path / f"host{i}" / "tfds" / "text_translation").glob("train-*"))
    stopped = _losses(workdir)
    assert STOP_AFTER <= max(stopped) < STEPS, first[0][-3000:]
    second = _launch(tmp_path, overrides, workdir, False, "2_resumed")
    assert all("RESULT" in out for out in second)
    got = _losses(workdir)
    assert sorted(got) == list(range(1, STEPS + 1))

    config = load_config("configs/text.py:debug")
    apply_overrides(config, {**overrides, "data.data_dir": str(tmp_path / "one" / "tfds")})
    train_and_evaluate(config, tmp_path / "one" / "run")
    want = _losses(tmp_path / "one" / "run")
    steps = range(1, STEPS + 1)
    print("2 hosts:  ", [round(got[s], 6) for s in steps])
    print("1 process:", [round(want[s], 6) for s in steps])
    # Equal to what float32 reductions in another order allow: two processes all-reduce the
    # gradients of two half batches where one process sums one batch, each sum a few ulps
    # apart, carried on by eight updates; a batch read twice or skipped moves a loss far more.
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-4)
    tokenizer = epath.Path(workdir) / "tokenizer.model"
    assert tokenizer.read_bytes() == (tmp_path / "one" / "run" / "tokenizer.model").read_bytes()


def test_prepare_publishes_to_a_gs_data_dir_that_another_host_stages(gcs, tmp_path):
    corpus = epath.Path(f"{BUCKET}/publish/corpus")
    _write_corpus(corpus)
    config = load_config("configs/text.py:debug")
    apply_overrides(
        config,
        {
            **_overrides(str(corpus)),
            "data.data_dir": f"{BUCKET}/publish/tfds",
            "data.data_cache_dir": str(tmp_path / "host0_cache"),
        },
    )
    assert datasets.unprepared_bytes(config.data, "train") == sum(
        (corpus / f"train-{i}.{lang}").stat().length for i in (0, 1) for lang in ("en", "de")
    )
    train = list(datasets.load_split(config.data, "train"))  # prepared, published, staged
    assert len(train) == 80
    published = epath.Path(f"{BUCKET}/publish/tfds/text_translation")
    assert [p.name.split("-")[0] for p in published.iterdir()] == ["train"]
    assert datasets.unprepared_bytes(config.data, "train") == 0
    config.data.data_cache_dir = str(tmp_path / "host1_cache")  # another host: its own copy
    assert list(datasets.load_split(config.data, "train")) == train
    assert list((tmp_path / "host1_cache").rglob("dataset_info.json"))
