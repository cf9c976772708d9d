"""The benchmark scripts' own logic (no timing: speed is measured in benchmarks/, not here)."""

import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _common  # noqa: E402
import train_step  # noqa: E402


def test_set_overrides_take_the_model_config_field_types():
    args = train_step._parse_args(
        ["--set", "remat=full", "--set", "share_embeddings=false", "--set", "num_heads=8"]
    )
    cfg = train_step._model_config("small", args, 8192)
    assert (cfg.remat, cfg.share_embeddings, cfg.num_heads) == ("full", False, 8)
    assert (cfg.d_model, cfg.d_ff, cfg.num_encoder_layers, cfg.vocab_size) == (256, 1024, 3, 8192)


@pytest.mark.parametrize("item", ["no_such_field=1", "remat"])
def test_set_names_a_bad_override(item):
    args = train_step._parse_args(["--set", item])
    with pytest.raises(SystemExit, match=item):
        train_step._model_config("small", args, 8192)


def test_table_formats_numbers():
    out = _common.table(["a", "b", "c", "d"], [[1234.5, 12.34, 0.01234, 4096]])
    assert out.splitlines() == [
        "| a | b | c | d |",
        "|---|---|---|---|",
        "| 1,234 | 12.3 | 0.0123 | 4,096 |",
    ]


def test_results_record_paths_relative_to_the_repository(tmp_path):
    assert _common.portable_path(os.path.join(_common.ROOT, "tx_jax")) == "tx_jax"
    assert _common.portable_path(_common.ROOT) == "."
    assert _common.portable_path(str(tmp_path / "lib_abc1234")) == "lib_abc1234"
    assert _common._portable_arg(f"--workdir={tmp_path / 'run'}") == "--workdir=run"
    assert _common._portable_arg("--beam=4") == "--beam=4"


def test_committed_results_hold_no_absolute_path():
    root = pathlib.Path(_common.ROOT)
    files = [*root.glob("benchmarks/results/*.json"), *root.glob("experiments/results/**/*.json")]
    assert files

    def strings(x):
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)

    for path in files:
        absolute = [s for s in strings(json.loads(path.read_text())) if os.path.isabs(s)]
        assert not absolute, (path.name, absolute)


def test_benchmarks_call_only_methods_the_strategy_has():
    """The benchmarks run outside the suite: an API they use that was renamed would only show
    when someone measures. Every `strategy.<name>` they use must exist on parallel.Strategy,
    the interface both strategies have."""
    import ast

    from tx_jax.training.parallel import Strategy

    used = set()
    for path in pathlib.Path(_common.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "strategy"
            ):
                used.add((path.name, node.attr))
    assert len(used) >= 5  # the benchmarks do place batches and compile steps
    missing = sorted((f, a) for f, a in used if not hasattr(Strategy, a))
    assert not missing, missing


def test_gpu_step_floors_count_the_flops_cublas_hides():
    import gpu_step

    from tx_jax.planning.chips import CHIPS

    # XLA:GPU's own cost analysis left cuBLAS/cuDNN out (1.9e12 of 1.08e13 FLOPs on an H100)
    row = {
        "case": "base:bfloat16",
        "step_seconds": 0.05,
        "step_seconds_pipelined": 0.04,
        "target_tokens": 26_624,
        "analytic_flops": 1.0e13,
        "compiled_flops": 2.0e12,
        "hbm_bytes": 5.0e10,
        "attention_impl": "auto (cudnn)",
    }
    ceil = {"matmul_bf16": 5.0e14, "matmul_f32_default": 2.5e14, "copy_bytes_per_s": 2.0e12}
    out = gpu_step.derive(dict(row), ceil, CHIPS["h100"])
    assert out["compute_s"] == pytest.approx(1.0e13 / 989.4e12)
    assert out["memory_s"] == pytest.approx(5.0e10 / 3.35e12)
    assert out["step_time_bound_s"] == out["memory_s"] and out["bound_by"] == "memory"
    assert out["floor_measured_ceilings_s"] == pytest.approx(0.025)  # 5e10 B at 2 TB/s
    assert out["mfu_measured_peak"] == pytest.approx(0.4)  # 1e13 / 0.05 s / 5e14
    assert out["mfu_datasheet"] == pytest.approx(1.0e13 / 0.05 / 989.4e12)
    assert out["tokens_per_second"] == pytest.approx(532_480)
    f32 = gpu_step.derive(dict(row, case="base:float32", compiled_flops=2.0e13), ceil, None)
    assert f32["floor_measured_ceilings_s"] == pytest.approx(0.08)  # 2e13 at 2.5e14: compute
    assert "step_time_bound_s" not in f32  # no chip table entry (a CPU)
    assert "| base:float32 | auto (cudnn) | 50.00 | 40.00 | 532,480 | - | 80.0% |" in (
        gpu_step.table([f32])
    )


def test_gpu_step_batch_has_four_segments_a_row_and_restarting_positions():
    import gpu_step
    import jax
    import numpy as np

    shapes = {k: (2, 10) for k in ("targets", "targets_segmentation", "targets_position")}
    batch = gpu_step._packed_batch(shapes, 50, 0, jax.devices()[0])
    seg, pos = np.asarray(batch["targets_segmentation"]), np.asarray(batch["targets_position"])
    assert seg[0].tolist() == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]
    assert pos[1].tolist() == [0, 1, 0, 1, 0, 1, 0, 1, 2, 3]
    tokens = np.asarray(batch["targets"])
    assert tokens.dtype == np.int32 and tokens.min() >= 3 and tokens.max() < 50


def test_gpu_profile_timelines_take_the_union_of_nested_events():
    import gpu_profile

    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
    ]
    events = [
        {"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": d, "name": n}
        for t, d, n in ((0, 10, "a"), (2, 3, "b"), (20, 5, "a"), (22, 10, "c"))
    ]
    (line,) = gpu_profile.timelines({"traceEvents": meta + events})
    assert (line["process"], line["thread"]) == ("/device:GPU:0", "Stream #7")
    assert line["busy_us"] == 10 + 12  # [0, 10] and [20, 32]
    assert line["span_us"] == 32
    assert {k: (v["us"], v["count"]) for k, v in line["names"].items()} == {
        "a": (15, 2),
        "c": (10, 1),
        "b": (3, 1),
    }


def test_gpu_profile_reads_what_each_instruction_computes_from_compiled_hlo():
    import gpu_profile
    import jax
    import jax.numpy as jnp

    def f(x, w):
        logits = x @ w
        return jax.nn.logsumexp(logits, axis=-1).sum() + jnp.tanh(x).sum()

    x, w = jnp.ones((64, 32)), jnp.ones((32, 48))
    index = gpu_profile.hlo_index(jax.jit(f).lower(x, w).compile().as_text())
    cats = {gpu_profile.category(info, name) for name, info in index.items()}
    assert "matmul" in cats and "softmax / loss (reductions with exp/log)" in cats
    assert gpu_profile.category(None, "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT") == "matmul"
    cudnn = gpu_profile.category(None, "cudnn_generated_fort_native_sdpa_sm90")
    assert cudnn == "attention (cuDNN)"
    op_name = "jit(f)/encoder/layer_0/ffn_dropout/jit(_bernoulli)"
    assert gpu_profile.source({"op_name": op_name}) == "dropout (bits and masks)"


def test_gpu_profile_summarizes_the_committed_h100_profile():
    import gpu_profile

    out = gpu_profile.summarize(os.path.join(_common.ROOT, "benchmarks/results/gpu_profile"))
    assert sum(out["categories_ms"].values()) == pytest.approx(out["total_ms"])
    assert sum(out["sources_ms"].values()) == pytest.approx(out["total_ms"])
    assert 16 < out["categories_ms"]["matmul"] < 17  # BENCHMARKS.md, "Where the base step's time"


def test_gpu_step_records_a_refused_case_and_runs_the_rest(tmp_path):
    """A case the device cannot run (here cuDNN attention on a CPU) is recorded with its
    error; the cases after it are still timed (device time is too scarce to lose them)."""
    import gpu_step

    out = tmp_path / "g.json"
    cases = "debug:float32/model.attention_impl=cudnn,debug:float32"
    quick = ["--steps", "1", "--peak-size", "64", "--peak-reps", "1"]
    gpu_step.main(["--cases", cases, *quick, "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["case"] for r in saved["rows"]] == ["debug:float32"]
    assert saved["rows"][0]["step_seconds"] > 0
    (failed,) = saved["failed"]
    assert failed["case"] == "debug:float32/model.attention_impl=cudnn"
    assert failed["error"].startswith("ValueError: implementation='cudnn'")
    assert "needs bfloat16 or float16 inputs; got float32" in failed["error"]
