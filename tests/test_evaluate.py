"""Evaluation from checkpoints: evaluate, translate, averaging, device layouts, clear errors.

One tiny run (checkpoints at steps 30, 60, 90) is trained once for the module; every test
reads it, and the tests that write (averaging) write next to it, never into its checkpoints.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import forked
import jax
import numpy as np
import pytest
import sacrebleu
import zygote
from helpers import ROOT, run_python, tiny_config

from tx_jax.data import datasets
from tx_jax.inference import averaging, evaluation, restore, translation
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.validation import validate_config
from tx_jax.training.checkpoint import Checkpointer

STEPS, EVERY = 90, 30  # checkpoints at 30, 60, 90: enough to translate lines differently


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tfds_dir):
    path = tmp_path_factory.mktemp("evaluate") / "run"
    config = tiny_config(
        tfds_dir, **{"train.num_steps": STEPS, "train.warmup_steps": 10, "checkpoint.every": EVERY}
    )
    train_and_evaluate(config, path)
    return path


@pytest.fixture(scope="module")
def greedy_validation(workdir):
    """The greedy evaluation of the validation split, with its hypotheses and sources."""
    record = evaluation.evaluate(workdir, split="validation", beam_size=1)
    loaded = restore.load(workdir)
    sources = [s for s, _ in datasets.load_split(loaded.config.data, "validation")]
    hyps = pathlib.Path(record["hypotheses"]).read_text().split("\n")
    return record, hyps[:-1], sources


def _cli(verb: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return zygote.run(
        [sys.executable, "-m", "tx_jax", verb, *args],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_evaluate_writes_bleu_with_signature_and_one_line_per_example(workdir):
    record = evaluation.evaluate(workdir, split="test", beam_size=4, length_penalty=0.6)
    saved = json.loads((workdir / "eval_results.jsonl").read_text().splitlines()[-1])
    assert saved == json.loads(json.dumps(record))
    assert saved["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert (saved["step"], saved["split"], saved["beam"], saved["length_penalty"]) == (
        STEPS,
        "test",
        4,
        0.6,
    )
    assert saved["examples"] == 40 and saved["averaged"] is None  # debug config: 40 test pairs
    path = pathlib.Path(saved["hypotheses"])
    assert path == workdir / "eval" / f"test_step{STEPS}_beam4_penalty0.6.txt"
    hyps = path.read_text().split("\n")
    assert len(hyps) == 41 and hyps[-1] == ""  # 40 lines, each ended by a newline
    refs = [t for _, t in datasets.load_split(restore.load(workdir).config.data, "test")]
    assert saved["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps[:-1], [refs]).score)
    assert 0 <= saved["bleu"] <= 100 and 0 <= saved["chrf"] <= 100
    assert saved["perplexity"] == pytest.approx(math.exp(saved["loss"]))
    assert saved["seconds"] >= saved["decode_seconds"] > 0


def test_sweep_scores_each_point_as_evaluate_does(workdir):
    """A sweep reads the split once and decodes it per point: each point's BLEU and chrF
    are evaluate's for that beam and length_penalty (greedy once, whatever the length_penalties)."""
    kw = dict(split="validation", limit=8, write=False)
    swept = evaluation.sweep(workdir, beams=(1, 2), length_penalties=(0.6, 1.0), **kw)
    points = {(p["beam"], p["length_penalty"]): p for p in swept["points"]}
    assert sorted(points, key=str) == [(1, None), (2, 0.6), (2, 1.0)]
    for beam, length_penalty in ((1, 0.6), (2, 1.0)):
        one = evaluation.evaluate(workdir, beam_size=beam, length_penalty=length_penalty, **kw)
        point = points[(beam, length_penalty if beam > 1 else None)]
        assert (point["bleu"], point["chrf"]) == (one["bleu"], one["chrf"])
        assert point["loss"] == pytest.approx(one["loss"])
    assert swept["best"]["bleu"] == max(p["bleu"] for p in swept["points"])


def test_evaluate_loss_matches_training_validation_loss(workdir, greedy_validation):
    record, hyps, _ = greedy_validation
    logged = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in logged if r["split"] == "validation" and r["step"] == STEPS][-1]
    assert record["loss"] == pytest.approx(final["loss"], rel=1e-5)
    assert record["accuracy"] == pytest.approx(final["accuracy"], rel=1e-5)
    assert record["length_penalty"] is None and record["hypotheses"].endswith(
        f"validation_step{STEPS}_beam1.txt"
    )
    assert len(hyps) == record["examples"] == 40


def test_loss_batches_restack_rows_in_order_into_one_shape():
    """evaluate's teacher-forced pass: every row once, in order, one [rows, longest] shape."""
    rng = np.random.default_rng(0)
    batches = [
        {
            "inputs": rng.integers(1, 9, (4, n)),
            "targets": rng.integers(1, 9, (4, n)),
            "example_index": np.arange(4),
        }
        for n in (16, 8, 24)
    ]
    out = evaluation.loss_batches(batches, rows=5)
    assert [b["inputs"].shape for b in out] == [(5, 24)] * 3 and set(out[0]) == {
        "inputs",
        "targets",
    }
    for key in ("inputs", "targets"):
        got = np.concatenate([b[key] for b in out])
        for i, b in enumerate(batches):
            n = b[key].shape[1]
            np.testing.assert_array_equal(got[4 * i : 4 * i + 4, :n], b[key])
            assert not got[4 * i : 4 * i + 4, n:].any()
        assert not got[12:].any()  # the filling rows are all padding
    assert evaluation.loss_batches([], rows=5) == []


def test_translate_keeps_line_count_and_alignment(workdir, greedy_validation):
    _, hyps, sources = greedy_validation
    lines = [
        sources[3],
        "",
        "   \t",
        sources[0],
        "ЖЖЖ 中文 ☃ ∮ 𝄞",
        b"\xff\xfe invalid \xc3 utf-8 " + sources[5].encode(),
        sources[7],
        "",
    ]
    out = translation.translate(lines, workdir, beam_size=1, batch_size=16)
    assert len(out) == len(lines)
    assert (out[0], out[3], out[6]) == (hyps[3], hyps[0], hyps[7])  # really aligned:
    assert len({hyps[3], hyps[0], hyps[7]}) == 3  # the three translations differ
    assert out[1] == out[2] == out[7] == ""
    assert all("\n" not in line for line in out)
    # the CLI: bytes in, one line out per line in, messages on stderr only
    stdin = b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n"
    stdin += (" ".join(sources[:20]) + "\n").encode()  # too long: truncated, with a warning
    proc = _cli(
        "translate", f"--workdir={workdir}", "--beam_size=1", "--batch_size=16", stdin=stdin
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    got = proc.stdout.decode().split("\n")
    assert got[:-1][: len(lines)] == out and len(got) == len(lines) + 2 and got[-1] == ""
    assert b"line 9 is longer than 32 tokens; truncated" in proc.stderr
    assert b"6/6 lines" in proc.stderr and b"translate:" not in proc.stdout  # 6 non-blank


def test_the_length_penalty_s_old_names_work_with_one_warning_each(workdir):
    """--alpha was the length penalty (alpha is LoRA's scale too), --length_penalty its rule,
    eval.alpha its key: each old name still works as the new one, saying so in one line."""
    pairs = list(datasets.load_split(restore.load(workdir).config.data, "validation"))
    sources = "".join(s + "\n" for s, _ in pairs[:6])
    beam = ["translate", f"--workdir={workdir}", "--beam_size=3", "--batch_size=8"]
    new = [*beam, "--length_penalty=1.5", "--length_penalty_kind=fairseq"]
    old = [*beam, "--alpha=1.5", "--length_penalty=fairseq", "--config.eval.alpha=0.5"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    (code, out, err), (old_code, old_out, old_err) = forked.run_modules(
        [("tx_jax", new, sources), ("tx_jax", old, sources)], cwd=ROOT, env=env, timeout=600
    )
    assert code == old_code == 0, err + old_err
    assert old_out == out and len(out.splitlines()) == 6
    warnings = [line for line in old_err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: --alpha is --length_penalty now",
        "warning: --length_penalty is --length_penalty_kind now",
        "warning: --config.eval.alpha is --config.eval.length_penalty now",
    ]
    assert not [line for line in err.splitlines() if line.startswith("warning:")]


def test_translations_do_not_depend_on_order_batching_or_padding(workdir, greedy_validation):
    """A split decoded in corpus order, in length order, padded to max_eval_len or to small
    buckets, in batches of 4, 16 or 40: the same hypotheses, greedy and beam, as evaluate's
    (sorted, bucketed) ones; each sentence's output limit is its own (n + 50)."""
    _, hyps, sources = greedy_validation
    loaded = restore.load(workdir)
    lengths = [len(loaded.tokenizer.encode(s)) + 1 for s in sources]
    assert min(lengths) <= 8 and max(lengths) > 16  # several buckets are used
    ways = [
        dict(sort_by_length=False, batch_size=16, length_buckets=()),  # corpus order, padded
        dict(sort_by_length=True, batch_size=4),  # length order, evaluation's buckets
        dict(sort_by_length=False, batch_size=40, length_buckets=(8, 16)),
    ]
    # the batches of the length-ordered way (greedy) are recorded: were they really padded to
    # evaluation's buckets (16, 24, 32: 8 is no longer one)?
    shapes = []
    real = translation.quality.decode_batches

    def spy(config, params, batches, *args, **kwargs):
        batches = list(batches)
        shapes.extend(b["inputs"].shape[1] for b in batches)
        return real(config, params, batches, *args, **kwargs)

    def translate(beam, way):
        if beam != 1 or way is not ways[1]:
            return translation.translate_lines(loaded, sources, beam_size=beam, **way)
        with pytest.MonkeyPatch().context() as m:
            m.setattr(translation.quality, "decode_batches", spy)
            return translation.translate_lines(loaded, sources, beam_size=beam, **way)

    for beam in (1, 3):
        outs = [translate(beam, w) for w in ways]
        assert outs[0] == outs[1] == outs[2], f"beam {beam}"
        if beam == 1:
            assert outs[0] == hyps
        else:
            record = evaluation.evaluate(workdir, split="validation", beam_size=3)
            assert outs[0] == pathlib.Path(record["hypotheses"]).read_text().split("\n")[:-1]
    assert set(shapes) == {16, 24, 32}


def _params(loaded):
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(loaded.params)
    }


def test_averaging_identical_checkpoints_returns_them(workdir, tmp_path):
    ckpt = restore.open_checkpoints(workdir / "checkpoints")
    opened = restore.open_step(ckpt, STEPS)
    state, data_state, meta = ckpt.restore(STEPS, averaging._abstract_state(opened))
    copies = Checkpointer(tmp_path / "checkpoints", async_save=False, best_metric=None)
    for step in (10, 20, 30):
        copies.save(
            step,
            state,
            data_state=data_state,
            config=meta["config"],
            tokenizer_bytes=meta["tokenizer"],
        )
    copies.close()
    averaged = averaging.average_checkpoints(tmp_path, 3)
    assert averaged.path == tmp_path / "averaged" / "last3" / "30"
    assert (averaged.step, averaged.steps) == (30, [10, 20, 30])
    want, got = _params(restore.load(workdir)), _params(restore.load(checkpoint=averaged.path))
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)  # bit for bit
    # a real checkpoint: the ordinary full-state restore reads it, optimizer and all
    full, _, meta = Checkpointer(averaged.path.parent, read_only=True).restore(
        30, averaging._abstract_state(opened)
    )
    assert int(full.step) == STEPS and meta["averaged"]["steps"] == [10, 20, 30]
    np.testing.assert_array_equal(
        jax.tree_util.tree_leaves(full.opt_state)[1], jax.tree_util.tree_leaves(state.opt_state)[1]
    )


def test_averaging_different_checkpoints_gives_their_mean(workdir):
    steps = [30, 60, 90]
    assert Checkpointer(workdir / "checkpoints", read_only=True).all_steps() == steps
    averaged = averaging.average_checkpoints(workdir, 3)
    assert averaged.path == workdir / "averaged" / "last3" / str(STEPS)
    mtime = os.stat(averaged.path / "_CHECKPOINT_METADATA").st_mtime_ns
    assert averaging.average_checkpoints(workdir, 3) == averaged  # reused, not redone
    assert os.stat(averaged.path / "_CHECKPOINT_METADATA").st_mtime_ns == mtime
    each = [_params(restore.load(workdir, step=s)) for s in steps]
    got = _params(restore.load(checkpoint=averaged.path))
    key = "['encoder']['layer_0']['ffn']['wi_kernel']"
    a, b, c = (p[key].astype(np.float64) for p in each)
    np.testing.assert_array_equal(got[key], ((a + b + c) / 3).astype(np.float32))
    assert not np.array_equal(each[0][key], each[2][key])  # the steps really differ
    # evaluate --average_last=3 picks it up and says so
    record = evaluation.evaluate(workdir, average_last=3, split="validation", beam_size=1, limit=8)
    assert (record["averaged"], record["averaged_steps"], record["step"]) == (3, steps, STEPS)
    assert record["hypotheses"].endswith(f"validation_step{STEPS}_avg3_beam1_first8.txt")
    assert averaging.average_checkpoints(workdir, 2, until=60).steps == [30, 60]


def test_average_last_in_the_config_drives_the_test_score_and_evaluate(tmp_path, tfds_dir):
    """eval.average_last: the end-of-training test BLEU and `evaluate` (by default) score the
    mean of the last K checkpoints; average_last=0 scores the latest checkpoint itself."""
    config = tiny_config(
        tfds_dir,
        **{
            "train.num_steps": 20,
            "train.warmup_steps": 10,
            "checkpoint.every": 10,
            "eval.score_test": True,
            "eval.test_beam_size": 1,
            "eval.average_last": 2,
        },
    )
    final = train_and_evaluate(config, tmp_path / "run")
    assert final["test_average_last"] == 2
    record = evaluation.evaluate(tmp_path / "run", split="test", beam_size=1)
    assert record["averaged"] == 2 and record["averaged_steps"] == [10, 20]
    assert record["bleu"] == pytest.approx(final["test_bleu"])
    single = evaluation.evaluate(tmp_path / "run", split="test", beam_size=1, average_last=0)
    assert single["averaged"] is None and single["step"] == 20
    assert single["loss"] != pytest.approx(record["loss"])

    config.eval.average_last = 4  # more than checkpoint.keep=3 could keep
    with pytest.raises(
        ValueError, match=r"eval.average_last=4 must be in \[0, checkpoint.keep=3\]"
    ):
        validate_config(config)


def test_eight_device_checkpoint_evaluates_on_one_device(tmp_path, tfds_dir):
    overrides = {
        "train.num_steps": 60,
        "train.warmup_steps": 10,
        "checkpoint.every": 60,
        "parallel.strategy": "mesh",
        "parallel.mesh": {"data": 2, "fsdp": 2, "tensor": 2},
    }
    workdir = tmp_path / "mesh"
    code = f"""
import json, jax
jax.config.update("jax_disable_most_optimizations", True)  # as conftest.py: same numerics
from helpers import tiny_config
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.inference import evaluation
assert jax.device_count() == 8
train_and_evaluate(tiny_config({str(tfds_dir)!r}, **{overrides!r}), {str(workdir)!r})
print(json.dumps(evaluation.evaluate({str(workdir)!r}, split="validation", beam_size=4)))
"""
    eight = json.loads(run_python(code, devices=8).strip().splitlines()[-1])
    eight_hyps = pathlib.Path(eight["hypotheses"]).read_text()
    assert jax.device_count() == 1
    one = evaluation.evaluate(workdir, split="validation", beam_size=4)
    assert one["bleu"] == eight["bleu"] and one["loss"] == pytest.approx(eight["loss"], rel=1e-5)
    assert pathlib.Path(one["hypotheses"]).read_text() == eight_hyps
    assert len(eight_hyps.splitlines()) == 40 and len(set(eight_hyps.splitlines())) >= 5


def test_clear_errors(workdir, tmp_path):
    with pytest.raises(restore.CheckpointError, match=r"no checkpoint: .*/nothing.* not exist"):
        evaluation.evaluate(tmp_path / "nothing")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(restore.CheckpointError, match=r"no checkpoint in .*empty/checkpoints"):
        evaluation.evaluate(tmp_path / "empty")
    with pytest.raises(
        restore.CheckpointError, match=r"no checkpoint for step 5 .*available steps: \[30, 60, 90\]"
    ):
        evaluation.evaluate(workdir, step=5)
    with pytest.raises(restore.CheckpointError, match=r"model\.d_model \(32 in the checkpoint, 64"):
        evaluation.evaluate(workdir, overrides={"model.d_model": "64"})
    with pytest.raises(restore.CheckpointError, match=r"model\.d_ff \(64 in the checkpoint, 128 n"):
        translation.translate(["a"], workdir, overrides={"model.d_ff": 128})
    with pytest.raises(restore.CheckpointError, match=r"model\.d_model \(32 in the checkpoint, 99"):
        evaluation.evaluate(workdir, overrides={"model.d_model": "999"})  # not even valid
    with pytest.raises(restore.CheckpointError, match=r"no key 'model\.colour'"):
        evaluation.evaluate(workdir, overrides={"model.colour": "blue"})
    with pytest.raises(restore.CheckpointError, match=r"average the last 5 .*only 3"):
        evaluation.evaluate(workdir, average_last=5)
    # the command line says it in one line, without a traceback
    proc = _cli("evaluate", f"--workdir={workdir}", "--step=7", "--config.data.max_train_len=9")
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err
    assert (
        f"error: no checkpoint for step 7 in {workdir}/checkpoints; available steps: [30, 60, 90]"
        in err
    )


def test_profile_traces_a_compiled_decode_and_names_its_operations(workdir):
    from tx_jax.analysis import trace_summary
    from tx_jax.inference import compilation

    compilation.clear()  # another test of this process may have built the same program
    record = evaluation.evaluate(workdir, split="test", beam_size=2, limit=8, profile=True)
    assert record["profile"] == str(workdir / "tensorboard")
    assert record["compiled_programs"] >= 1 and record["compile_seconds"] > 0
    rows = trace_summary.top_ops(record["profile"], n=10)
    assert rows and all(ms > 0 and runs >= 1 for _, ms, runs in rows)
    names = " ".join(name for name, _, _ in rows)
    assert "fusion" in names or "dot" in names  # XLA's operations, not Python frames
    assert "np.asarray" not in names and "PjitFunction" not in names
    assert not any(name.startswith("while") for name, _, _ in rows)  # loops enclose their ops
    table = trace_summary.format_rows(rows, wall=record["decode_seconds"])
    assert table.splitlines()[0].split()[:3] == ["operation", "ms", "runs"]
