"""tx_jax.launch's sweeps, local and results: sweep files expand to the expected overrides,
typos fail before anything runs, and the runner trains every point, tabulates them and skips
finished points on rerun."""

import copy
import csv
import json
import pathlib

import pytest
import zygote
from helpers import ROOT

from tx_jax.cli import sweep as sweep_cli
from tx_jax.config import apply_overrides, load_config, load_module
from tx_jax.launch import local, sweeps
from tx_jax.model.config import ModelConfig


def cli_sweep(argv: list[str]) -> int:
    """`tx_jax sweep ARGV...` in this process -> its exit status."""
    return sweep_cli.main(["tx_jax sweep", *argv])


TABLE3 = ROOT / "experiments" / "table3.py"
SMOKE = ROOT / "experiments" / "default_smoke.py"
DEBUG = "configs/default.py:debug"


def test_table3_rows_and_points():
    table3 = sweeps.load_sweep(TABLE3)
    assert table3.name == "table3" and table3.config == "configs/multi30k.py:variant=small"
    rows = load_module(TABLE3, "table3_rows").ROWS
    assert {k: len(v) for k, v in rows.items()} == {"A": 4, "B": 2, "C": 7, "D": 4, "E": 1}
    assert len(table3.points) == 1 + 18 and table3.points[0] == {}  # the base, then the rows
    assert rows["A"][3] == {"model.num_heads": 32}  # d_k = 256 / 32 = 8 (paper: 512 / 32)
    # paper: d_k 16, 32 at d_v 64; here d_k halved, d_v the base's own (256 / 4 heads)
    assert rows["B"] == [
        {"model.head_dim": 16, "model.value_head_dim": 64},
        {"model.head_dim": 32, "model.value_head_dim": 64},
    ]
    assert {"model.num_encoder_layers": 8, "model.num_decoder_layers": 8} in rows["C"]
    assert {"model.d_model": 512} in rows["C"] and {"model.d_ff": 512} in rows["C"]
    assert rows["D"][3] == {"train.label_smoothing": 0.2}
    assert rows["E"] == [{"model.positional": "learned"}]
    names = [sweeps.point_name(p) for p in table3.points]
    assert names[:2] == ["baseline", "model.num_heads=1"] and len(set(names)) == len(names)


def test_table3_keys_exist_in_its_base_config(tmp_path, monkeypatch):
    """Every point's keys are in configs/multi30k.py, and row B keeps the base's d_v while
    d_k shrinks (table3.D_MODEL / NUM_HEADS describe that base)."""
    monkeypatch.chdir(ROOT)
    table3 = sweeps.load_sweep(TABLE3)
    points = sweeps.expand(table3, tmp_path)
    assert points[1].workdir == tmp_path / "01_model.num_heads=1"
    base = load_config(table3.config)
    constants = load_module(TABLE3, "table3_constants")
    assert (base.model.d_model, base.model.num_heads) == (constants.D_MODEL, constants.NUM_HEADS)
    for point in [p for p in points if "model.value_head_dim" in p.overrides]:
        c = copy.deepcopy(base)
        apply_overrides(c, point.overrides)
        cfg = ModelConfig.from_config(c.model)
        assert cfg.value_head_dim == base.model.d_model // base.model.num_heads  # d_v as base
        assert cfg.head_dim < cfg.value_head_dim


def test_table3_cpu_scales_the_rows_to_its_base_and_base_is_under_every_point(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(ROOT)
    small = sweeps.load_sweep(ROOT / "experiments" / "table3_cpu.py")
    assert small.base["model.d_model"] == 128 and small.base["train.num_steps"] == 600
    assert small.points[0] == {} and {"model.num_heads": 4} not in small.points  # = the base
    assert small.points[1:3] == [  # row B first: d_k = d_v / 4, d_v / 2 at the base's d_v 32
        {"model.head_dim": 8, "model.value_head_dim": 32},
        {"model.head_dim": 16, "model.value_head_dim": 32},
    ]
    assert {"model.d_model": 64} in small.points and {"model.d_ff": 1024} in small.points
    points = sweeps.expand(small, tmp_path)
    assert points[0].name == "baseline" and points[0].overrides == small.base
    d64 = next(p for p in points if p.name == "model.d_model=64")
    assert d64.overrides["model.d_model"] == 64 and d64.overrides["model.d_ff"] == 512  # own wins
    bad = tmp_path / "bad.py"
    bad.write_text("CONFIG = 'configs/default.py'\nBASE = [1]\ndef sweep():\n    return [{}]\n")
    with pytest.raises(ValueError, match="BASE is a dict"):
        sweeps.load_sweep(bad)


def test_unknown_key_is_an_error_naming_it_and_the_point(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = sweeps.Sweep("bad", DEBUG, [{"model.dropout_rate": 0.0}, {"model.num_hedas": 2}])
    with pytest.raises(ValueError, match=r"point 1 \(model.num_hedas=2\).*'model.num_hedas'"):
        sweeps.expand(bad, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
    assert cli_sweep([str(SMOKE), f"--root={tmp_path}", "--override=train.num_stpes=2"]) == 2


def test_command_quotes_values_and_routes_lists_through_a_config_file(tmp_path):
    point = sweeps.Point(
        0,
        "x",
        {
            "data.data_dir": "/a b/$c",
            "data.bucket_boundaries": [32],
            "model.share_embeddings": False,
        },
        tmp_path / "p",
    )
    argv, wrapper = sweeps.command(point, DEBUG, python="python")
    assert argv[4] == f"--config={tmp_path / 'p' / 'sweep_config.py'}"
    assert argv[6:] == ["--config.data.data_dir=/a b/$c", "--config.model.share_embeddings=False"]
    assert "{'data.bucket_boundaries': [32]}" in wrapper and "default.py:debug" in wrapper
    assert sweeps.parse_overrides(["a.b=3", "c=/x y", "d=[1, 2]", "e=None"]) == {
        "a.b": 3,
        "c": "/x y",
        "d": [1, 2],
        "e": None,
    }


def test_runner_trains_both_points_tabulates_and_skips_them_on_rerun(
    tmp_path, tfds_dir, monkeypatch
):
    monkeypatch.setattr(local, "run_process", zygote.run)  # real processes, started by a fork
    root = tmp_path / "sweep"
    tiny = {
        "data.data_dir": str(tfds_dir),
        "data.bucket_boundaries": [32],
        "data.max_train_len": 32,
        "data.max_eval_len": 32,
        "data.packing": False,
        "train.num_steps": 2,
        "train.log_every": 1,
        "eval.every": 2,
        "eval.bleu_examples": 4,
        "checkpoint.async_save": False,
    }
    args = [str(SMOKE), f"--root={root}", "--parallel=2", "--test_split_eval", "--beam_size=2"]
    args += [f"--override={k}={v}" for k, v in tiny.items()]
    assert cli_sweep(args) == 0
    with open(root / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == ["model.dropout_rate=0.0", "model.dropout_rate=0.1"]
    for row in rows:
        assert row["status"] == "ok" and int(row["steps"]) == 2
        for key in ("wall_s", "val_bleu", "val_loss", "test_bleu"):
            float(row[key])  # numeric
        # --test_split_eval: test_bleu is tx_jax evaluate's beam-2 score of the final checkpoint,
        # recorded in the point's DONE file, not the greedy score written during training.
        evaluated = json.loads(
            (pathlib.Path(row["workdir"]) / "eval_results.jsonl").read_text().splitlines()[-1]
        )
        assert (evaluated["split"], evaluated["beam"], evaluated["step"]) == ("test", 2, 2)
        assert float(row["test_bleu"]) == evaluated["bleu"]
        done = json.loads((pathlib.Path(row["workdir"]) / local.DONE_FILE).read_text())
        assert done["test_eval"]["bleu"] == evaluated["bleu"] and done["test_eval"]["beam"] == 2
    md = (root / "results.md").read_text().splitlines()
    assert len(md) == 4 and "| 1 | model.dropout_rate=0.1 | ok | 2 |" in md[3]
    assert (root / "curves.png").stat().st_size > 1000
    metrics = sorted(root.glob("*/metrics.jsonl"))
    assert len(metrics) == 2
    mtimes = [m.stat().st_mtime_ns for m in metrics]

    lines = []
    assert local.run_sweep(SMOKE, root, overrides=tiny, echo=lines.append)
    assert [m.stat().st_mtime_ns for m in metrics] == mtimes  # no new training
    assert sum("skipped (done)" in line for line in lines if line.startswith("[")) == 2


def test_launch_sh_sweep_dry_run(tmp_path):
    import subprocess

    out = subprocess.run(
        ["./launch.sh", "sweep", str(SMOKE), "--dry-run", "--root", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--config.model.dropout_rate=0.1" in out.stdout
    assert not list(pathlib.Path(tmp_path).iterdir())


def test_table3_cpu_table_names_every_point_and_marks_what_did_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    module = load_module(ROOT / "experiments" / "table3_cpu.py", "table3_cpu_table")
    names = [sweeps.point_name(p) for p in module.sweep()]
    assert set(names) == set(module.PAPER)
    done = tmp_path / "00_baseline"  # one finished point, the rest never ran
    done.mkdir()
    (done / local.DONE_FILE).write_text("{}")
    record = {"step": 600, "split": "validation", "perplexity": 27.2, "bleu": 10.03}
    (done / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    lines = module.table(str(tmp_path)).splitlines()
    assert lines[2].startswith("| baseline | base: N 6,")
    assert lines[2].endswith("| 4.92 | 25.8 | 27.20 | 10.03 |")
    assert sum("not run | not run" in line for line in lines) == len(names) - 1
