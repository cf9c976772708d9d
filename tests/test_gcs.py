"""Workdirs on Cloud Storage: training, SIGTERM, kill -9, resume, evaluate, translate, export and
averaging on gs://, against a local GCS server (tests/gcs_server.py: gcp-storage-emulator behind
a proxy that fills its gaps and injects faults), compared with the same run on local disk.

The trainers run in subprocesses (they are signalled and killed); the server is one process for
the module, on 127.0.0.1, stopping with pytest or after its lifetime.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import gcs_server
import jax
import numpy as np
import pytest
import zygote
from etils import epath
from helpers import ROOT, tiny_config, train_losses

from tx_jax import paths
from tx_jax.inference import evaluation, restore, translation
from tx_jax.interop import huggingface
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.training.checkpoint import Checkpointer

STEPS = 8
BUCKET = "gs://tx-jax-test"
# Saves every 2 steps, asynchronous as in the default experiment: signals and kills land
# next to saves in flight.
OVERRIDES = {
    "train.num_steps": STEPS,
    "checkpoint.every": 2,
    "checkpoint.async_save": True,
    "checkpoint.keep": 10,
}
# faulty_run: faults at rates the clients' retries absorb (each request fails with 429 or 503
# with probability `rate`, has its connection reset with probability `reset`, and one in five
# is delayed up to `delay` s); the server goes at the save of step OUTAGE_AT.
FAULTS = dict(rate=0.04, reset=0.02, delay=0.05, slow=0.2)
OUTAGE_AT = 6


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tfds_dir):
    """The reference: the same run on local disk, uninterrupted."""
    workdir = tmp_path_factory.mktemp("local") / "run"
    train_and_evaluate(tiny_config(tfds_dir, **OVERRIDES), workdir)
    return workdir


def _launch(workdir: str, tfds_dir, steps: int = STEPS, **extra) -> subprocess.Popen:
    """`tx_jax train` (what a user runs) on the tiny config."""
    overrides = {**OVERRIDES, "train.num_steps": steps, **extra}
    config = pathlib.Path(str(tfds_dir)).parent / f"gcs_config_{abs(hash(repr(overrides)))}.py"
    config.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from helpers import tiny_config\n\n\ndef get_config():\n"
        f"    return tiny_config({str(tfds_dir)!r}, **{overrides!r})\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return zygote.Popen(
        [sys.executable, "-m", "tx_jax.main", f"--config={config}", f"--workdir={workdir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _losses(workdir) -> dict[int, float]:
    """step -> train loss from WORKDIR/metrics.jsonl (local or gs://; the last record wins)."""
    path = epath.Path(workdir) / "metrics.jsonl"
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        if r["split"] == "train":
            out[r["step"]] = r["loss"]
    return out


def _wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 300) -> str:
    """Read the trainer's output until its progress line for `step` -> what it printed."""
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            return "".join(seen)
        if time.time() > deadline:
            break
    proc.kill()
    raise AssertionError(f"no step {step}: {''.join(seen)[-3000:]}")


def _steps(out: str) -> list[int]:
    """The steps of the trainer's progress lines in its output, in order."""
    return [int(x.split()[1].split("/")[0]) for x in out.splitlines() if x.startswith("step ")]


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def _params(workdir) -> dict[str, np.ndarray]:
    loaded = restore.load(workdir, average_last=None)
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(loaded.params)
    }


def _assert_same_params(a, b) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


@pytest.fixture(scope="module")
def gs_run(gcs, tfds_dir, local_run):
    """The run on gs://, stopped by SIGTERM after step 3, killed (-9) after the first odd step
    it logs once resumed (no save starts at an odd step: the steps since the last one are
    redone), resumed to the end -> (workdir, the three segments' outputs)."""
    workdir = f"{BUCKET}/preempted"
    outs = []
    first = _launch(workdir, tfds_dir)
    outs.append(_wait_for_step(first, 3))
    first.send_signal(signal.SIGTERM)
    outs[-1] += _finish(first)
    assert first.returncode == 0, outs[-1][-3000:]
    stopped = max(_steps(outs[-1]))
    second = _launch(workdir, tfds_dir)
    outs.append(_wait_for_step(second, stopped + 1 + stopped % 2))
    second.kill()
    outs[-1] += _finish(second)
    third = _launch(workdir, tfds_dir)
    outs.append(_finish(third))
    assert third.returncode == 0, outs[-1][-3000:]
    return workdir, outs


def test_training_on_gs_survives_sigterm_and_kill_9_and_matches_local_disk(gs_run, local_run):
    workdir, (first, second, third) = gs_run
    assert "SIGTERM at step" in first and f"checkpoints: {workdir}/checkpoints" not in first
    stopped = int(first.split("SIGTERM at step ")[1].split(":")[0])
    assert stopped >= 3
    # the relaunches resumed (no step 1 again) and the last one finished
    assert "step      1/" not in second and "step      1/" not in third
    assert f"checkpoints: {workdir}/checkpoints" in third
    # the interrupted run ends where the uninterrupted one does, bit for bit
    _assert_same_params(workdir, local_run)
    # metrics.jsonl kept every segment's records (appends on an object store), and the losses
    # of the resumed steps are the uninterrupted run's
    gs_losses, local_losses = _losses(workdir), _losses(local_run)
    assert sorted(gs_losses) == list(range(1, STEPS + 1)) == sorted(local_losses)
    assert gs_losses == local_losses
    records = (epath.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    assert len(records) > STEPS  # steps redone after the kill are logged again
    # every checkpoint left is complete and verifies against its checksums
    ckpt = Checkpointer(f"{workdir}/checkpoints", read_only=True)
    steps = ckpt.all_steps()
    assert steps[-1] == STEPS and stopped in steps
    assert all(ckpt.verify(s) for s in steps)
    # the run's other files, and TensorBoard events from each segment that logged
    run = epath.Path(workdir)
    for name in ("config.json", "versions.json", "tokenizer.model"):
        assert (run / name).exists(), name
    events = [p for p in (run / "tensorboard").iterdir() if "tfevents" in p.name]
    assert len(events) >= 2 and all(p.stat().length > 0 for p in events)
    for out in (first, second, third):  # nothing failed quietly at exit
        assert "Exception ignored" not in out and "already exists" not in out, out[-3000:]


def test_evaluate_translate_average_and_export_from_gs(gs_run, local_run, tmp_path):
    workdir, _ = gs_run
    record = evaluation.evaluate(workdir, split="validation", beam_size=1)
    reference = evaluation.evaluate(local_run, split="validation", beam_size=1)
    assert record["bleu"] == reference["bleu"] and record["loss"] == reference["loss"]
    hyps = epath.Path(record["hypotheses"])
    assert str(hyps).startswith(f"{workdir}/eval/")
    assert hyps.read_text() == epath.Path(reference["hypotheses"]).read_text()
    # averaging writes its checkpoint into the gs:// workdir and reads it back
    averaged = evaluation.evaluate(workdir, split="validation", beam_size=1, average_last=2)
    # its record is appended to the first evaluation's, on the store as on disk
    results = (epath.Path(workdir) / evaluation.RESULTS_FILE).read_text().splitlines()
    assert [json.loads(r)["averaged"] for r in results] == [None, 2]
    assert json.loads(results[1])["averaged_steps"] == [STEPS - 2, STEPS]
    local_avg = evaluation.evaluate(local_run, split="validation", beam_size=1, average_last=2)
    assert averaged["averaged_steps"] == [STEPS - 2, STEPS] == local_avg["averaged_steps"]
    assert averaged["loss"] == local_avg["loss"]
    assert (epath.Path(workdir) / "averaged" / "last2" / str(STEPS)).exists()
    # translate reads the gs:// run like a local one
    lines = ["a small test", "", "another line to translate"]
    assert translation.translate(lines, workdir, beam_size=1) == translation.translate(
        lines, str(local_run), beam_size=1
    )
    # export from the gs:// workdir to gs:// as `tx_jax export --out=gs://...` does
    # it (the checkpoint loaded, the files written locally and copied up; the command line
    # itself is tests/test_export.py's): the same files as the local run's export
    out = f"{BUCKET}/exported/hf"
    with paths.staged_dir(out) as local:
        huggingface.export(restore.load(workdir), local)
    huggingface.export(restore.load(local_run), tmp_path / "hf")
    local_files = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert {p.name: p.read_bytes() for p in epath.Path(out).iterdir()} == local_files
    assert "model.safetensors" in local_files


@contextlib.contextmanager
def _faults(port: int, **faults):
    """The proxy injects `faults` inside the block -> {kind: count injected}, filled at its end
    (a request refused while the server is down is counted as 'refused', not as a fault)."""
    before = gcs_server.stats(port)
    gcs_server.set_faults(port, **faults)
    injected = {}
    try:
        yield injected
    finally:
        gcs_server.set_faults(port, rate=0, reset=0, delay=0, slow=1, down=0, down_on="")
        after = gcs_server.stats(port)
        injected.update({k: after[k] - before[k] for k in after})


def _flip_a_byte(step_dir: str) -> list[str]:
    """Flip a byte in the middle of the step's largest array data file -> the step's files."""
    step_dir = epath.Path(step_dir)
    names = paths.files(step_dir)
    victim = max((step_dir / n for n in names if "/d/" in n), key=lambda p: p.stat().length)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return names


@pytest.fixture(scope="module")
def faulty_run(gcs, tfds_dir):
    """The run on gs:// in two segments, both under FAULTS (which the clients' retries absorb):
    the server goes at the first request of the save of step OUTAGE_AT and the trainer stops
    with an error; then, a byte of the newest checkpoint's data flipped, the relaunch (server
    back) reports that step, moves it away, resumes from the one before and finishes -> dict:
    workdir; each segment's (exit status, output, faults injected); the checkpoints the outage
    left (step -> verified); the damaged step and its files."""
    workdir = f"{BUCKET}/faulty"
    outage = f"{workdir.split('/', 3)[3]}/checkpoints/{OUTAGE_AT}"  # the object names' prefix
    with _faults(gcs.port, seed=3, down_on=outage, **FAULTS) as gone_faults:
        gone = _launch(workdir, tfds_dir)
        gone_out = _finish(gone)
    ckpt = Checkpointer(f"{workdir}/checkpoints", read_only=True)
    left = {s: ckpt.verify(s) for s in ckpt.all_steps()}  # raises if one is damaged
    names = _flip_a_byte(f"{workdir}/checkpoints/{max(left)}")
    with _faults(gcs.port, **FAULTS) as resumed_faults:
        resumed = _launch(workdir, tfds_dir)
        resumed_out = _finish(resumed)
    return dict(
        workdir=workdir,
        gone=(gone.returncode, gone_out, gone_faults),
        resumed=(resumed.returncode, resumed_out, resumed_faults),
        left=left,
        damaged=(max(left), names),
    )


def test_faults_the_clients_retry_leave_the_run_unchanged(faulty_run, local_run):
    """429s, 503s, reset connections and slow replies at rates the clients' retries absorb, in
    both segments of the run (the first until the outage, the second from its resume, restore
    and quarantine included, to the end): the run finishes with the uninterrupted local run's
    parameters and losses."""
    workdir = faulty_run["workdir"]
    (_, gone_out, gone_faults), (code, out, faults) = faulty_run["gone"], faulty_run["resumed"]
    for injected in (gone_faults, faults):
        assert min(injected[k] for k in ("failed", "reset", "delayed")) > 0, injected
    print(f"faults injected and absorbed: {gone_faults} until the outage, then {faults}")
    # nothing failed before the outage: every step up to its save was trained and logged
    assert _steps(gone_out) == list(range(1, OUTAGE_AT + 1)), gone_out[-3000:]
    assert code == 0, out[-3000:]
    _assert_same_params(workdir, local_run)
    assert _losses(workdir) == _losses(local_run)


def test_server_gone_mid_run_stops_with_a_clear_error_and_resumes(faulty_run, local_run):
    """The server disappears while a checkpoint is being saved: the trainer stops with an
    error naming the workdir, the checkpoints saved before are intact (every one verifies),
    and the next launch (server back) resumes from one of them and finishes like the local
    run."""
    workdir, left = faulty_run["workdir"], faulty_run["left"]
    (gone_code, gone_out, _), (code, out, _) = faulty_run["gone"], faulty_run["resumed"]
    assert gone_code == 1, gone_out[-3000:]
    error = [line for line in gone_out.splitlines() if line.startswith("error: ")]
    assert error and "failed" in error[-1] and workdir in error[-1], gone_out[-3000:]
    print(error[-1][:300])
    every = OVERRIDES["checkpoint.every"]
    assert left == {step: True for step in range(every, OUTAGE_AT, every)}
    assert code == 0, out[-3000:]
    assert _steps(out)[0] - 1 in left  # resumed, not started again
    _assert_same_params(workdir, local_run)


def test_damaged_checkpoint_on_gs_is_quarantined_and_training_falls_back(faulty_run, local_run):
    """A flipped byte in the newest checkpoint's data on gs:// (the one faulty_run's outage
    left): the relaunch reports it, moves the step to checkpoints.damaged/ (every object,
    nothing deleted), resumes from the previous step and ends with the local run's parameters."""
    workdir, (step, names) = faulty_run["workdir"], faulty_run["damaged"]
    code, out, _ = faulty_run["resumed"]
    assert code == 0, out[-3000:]
    moved = epath.Path(f"{workdir}/checkpoints.damaged/{step}-0")
    assert "checksum mismatch" in out and f"moved to {moved}" in out, out[-3000:]
    assert paths.files(moved) == names
    assert _steps(out)[0] == max(s for s in faulty_run["left"] if s < step) + 1
    assert _losses(workdir)[STEPS] == _losses(local_run)[STEPS]
    _assert_same_params(workdir, local_run)


def test_backoff_setting_scales_the_retry_waits_of_both_clients(gcs, monkeypatch):
    """TX_JAX_GCS_BACKOFF (which gcs_server.env gives the trainers above) reaches gcsfs and
    Orbax's TensorStore: with 0.01, a request that always fails is tried gcsfs's 6 times and
    given up in a fraction of the 31 s that gcsfs's own waits add up to at the least, and
    TensorStore's contexts wait 10 ms doubling to 320 ms."""
    import gcsfs.core
    import gcsfs.retry
    from orbax.checkpoint._src.serialization import tensorstore_utils

    from tx_jax.training import checkpoint

    monkeypatch.setenv(paths.BACKOFF_ENV, "0.01")
    assert paths.gcs_backoff() == 0.01
    for module in (gcsfs.retry, gcsfs.core):  # restored when the test ends
        monkeypatch.setattr(module, "asyncio", module.asyncio)
    for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
        monkeypatch.setattr(tensorstore_utils, name, dict(getattr(tensorstore_utils, name)))
    paths._apply_gcsfs_backoff(paths.gcs_backoff())
    checkpoint._apply_tensorstore_backoff(paths.gcs_backoff())

    before = gcs_server.stats(gcs.port)
    gcs_server.set_faults(gcs.port, rate=1, codes=[503])
    start = time.time()
    try:
        with pytest.raises(gcsfs.retry.HttpError, match="injected by the proxy"):
            epath.Path(f"{BUCKET}/backoff/never.txt").write_text("x")
    finally:
        gcs_server.set_faults(gcs.port, rate=0, codes=[429, 503])
    elapsed = time.time() - start
    assert gcs_server.stats(gcs.port)["failed"] - before["failed"] == 6  # every try was made
    assert elapsed < 10, elapsed  # unscaled, the 5 waits alone are 1 + 2 + 4 + 8 + 16 s or more
    for use_ocdbt in (True, False):
        spec = tensorstore_utils.get_ts_context(use_ocdbt=use_ocdbt).spec.to_json()
        assert spec["gcs_request_retries"] == {"initial_delay": "10ms", "max_delay": "320ms"}
    monkeypatch.setenv(paths.BACKOFF_ENV, "soon")
    with pytest.raises(ValueError, match="TX_JAX_GCS_BACKOFF='soon'"):
        paths.gcs_backoff()


def test_sweep_with_a_gs_root_writes_its_logs_and_tables_there(gcs, tfds_dir):
    """A sweep point trains in ROOT/<point> on gs:// (a list override goes through a generated
    config, loaded from a local copy); its log, results tables and curves land in ROOT."""
    from tx_jax.launch import local

    root = f"{BUCKET}/sweep"
    tiny = {
        "data.data_dir": str(tfds_dir),
        "data.bucket_boundaries": [32],
        "data.max_train_len": 32,
        "data.max_eval_len": 32,
        "data.packing": False,
        "train.num_steps": 2,
        "eval.every": 2,
        "eval.bleu_examples": 0,  # no decoding: this test is about where the files go
        "eval.score_test": False,
        "checkpoint.async_save": False,
    }
    smoke = ROOT / "experiments" / "default_smoke.py"
    rows = local.run_sweep(smoke, root, only=[0], overrides=tiny, echo=lambda _: None)
    assert [(r["status"], r["steps"]) for r in rows] == [("ok", 2)]
    base = epath.Path(root)
    table = (base / "results.csv").read_text().splitlines()
    assert len(table) == 2 and table[1].startswith("0,model.dropout_rate=0.0,ok,")
    assert "| 0 | model.dropout_rate=0.0 | ok | 2 |" in (base / "results.md").read_text()
    assert (base / "curves.png").stat().length > 1000
    point = base / "00_model.dropout_rate=0.0"
    log = (point / local.LOG_FILE).read_text()
    assert log.startswith("$ ") and "--config=" in log and "step      2/2" in log
    assert "bucket_boundaries" in (point / "sweep_config.py").read_text()
    assert (point / local.DONE_FILE).exists() and (point / "checkpoints" / "2").exists()


def test_gs_data_dir_is_staged_to_a_verified_local_cache(gcs, tfds_dir, tmp_path, monkeypatch):
    """TFDS data prepared locally, uploaded, then trained and evaluated from gs:// through the
    staged copy: the same losses as from the local directory; the copy is reused, a damaged
    one copied again, a checksum mismatch refused, and a bucket without the data named."""
    from tx_jax.data import datasets, staging

    cfg = lambda data_dir, **kw: tiny_config(  # noqa: E731
        data_dir,
        **{
            "train.num_steps": 3,
            "eval.every": 3,
            "eval.score_test": True,
            "eval.test_beam_size": 1,
            **kw,
        },
    )
    datasets.load_split(cfg(tfds_dir).data, "train")  # prepared locally (once per pytest session)
    remote = f"{BUCKET}/tfds"
    paths.upload_tree(str(tfds_dir), remote)
    cache = tmp_path / "cache"
    final = train_and_evaluate(
        cfg(remote, **{"data.data_cache_dir": str(cache)}), tmp_path / "from_gs"
    )
    local = train_and_evaluate(cfg(tfds_dir), tmp_path / "from_local")
    assert train_losses(tmp_path / "from_gs") == train_losses(tmp_path / "from_local")
    assert final["loss"] == local["loss"]
    tests = {k: v for k, v in final.items() if k.startswith("test_")}  # the test split's score
    assert tests and tests == {k: local[k] for k in tests}

    root = pathlib.Path(staging.local_data_dir(remote, str(cache)))
    assert root == cache / "gs" / "tx-jax-test" / "tfds"
    (manifest,) = root.rglob(staging.MANIFEST)
    version = manifest.parent
    relative = str(version.relative_to(root))
    for rel in json.loads(manifest.read_text())["files"]:
        assert (version / rel).read_bytes() == (
            pathlib.Path(tfds_dir) / relative / rel
        ).read_bytes()
    # reused when complete: nothing is copied again
    monkeypatch.setattr(staging, "_copy", lambda *a: pytest.fail("copied again"))
    assert staging.stage_prepared(remote, relative, str(cache)) == str(root)
    monkeypatch.undo()
    # a damaged copy (a short file) is copied again, whole
    shard = next(p for p in version.iterdir() if "array_record" in p.name)
    good = shard.read_bytes()
    shard.write_bytes(good[:10])
    staging.stage_prepared(remote, relative, str(cache))
    assert shard.read_bytes() == good
    assert not [p for p in version.parent.iterdir() if ".staging-" in p.name or ".old-" in p.name]
    # a checksum that does not match is refused; the good copy stays
    listing = staging._listing(f"{remote}/{relative}")
    assert all(md5 for _, md5 in listing.values())  # the store keeps MD5s: they are checked
    bad = {k: [n, "AAAAAAAAAAAAAAAAAAAAAA=="] for k, (n, _) in listing.items()}
    monkeypatch.setattr(staging, "_listing", lambda _: bad)
    with pytest.raises(OSError, match="MD5 differs from the store's"):
        staging.stage_prepared(remote, relative, str(cache))
    assert shard.read_bytes() == good
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=r"no prepared dataset at gs://tx-jax-test/none/"):
        staging.stage_prepared(f"{BUCKET}/none", relative, str(cache))
