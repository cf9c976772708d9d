"""tx_jax.planning: runs compiled for a TPU slice by the TPU compiler (libtpu, the `plan`
extra) on this CPU host, and what the plan reads off them. Needs no TPU; skipped, with the
reason, where libtpu is not installed. GPU targets need jax's CUDA plugin (several GB): their
test runs only with TX_JAX_GPU_PLAN_TESTS=1 (docs/planning.md, "Planning for TPU and GPU").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import ml_collections
import pytest
import zygote
from helpers import ROOT, default_config

from tx_jax.config import apply_overrides, load_config
from tx_jax.planning import hlo, plan, programs, search, targets
from tx_jax.training import parallel

libtpu = pytest.importorskip("libtpu", reason="the TPU compiler (pip install -e '.[plan]')")

TARGET = "tpu:v5e-4"  # four v5e chips: the smallest multi-chip slice


def debug_config(**overrides):
    c = default_config.get_config("debug")
    c.parallel.strategy = "mesh"
    apply_overrides(c, {"parallel.mesh.data": -1} | overrides)
    return c


def _built(**overrides) -> programs.Built:
    target = targets.parse(TARGET)
    return programs.build(debug_config(**overrides), target, target.devices())


# ---------------------------------------------------------------- targets, HLO (no compile)


def test_targets_parse_cloud_names():
    v4 = targets.parse("tpu:v4-8")  # v4 counts TensorCores: 4 chips
    assert (v4.chips_per_slice, v4.topology, v4.num_devices) == (4, "v4:2x2x1", 4)
    v5e = targets.parse("tpu:v5e-256x2")
    assert (v5e.topology, v5e.num_slices, v5e.num_devices) == ("v5e:16x16", 2, 512)
    h100 = targets.parse("gpu:h100-16")
    assert (h100.topology, h100.num_devices, h100.chip.usable) == ("1x2x8", 16, 0.75)
    assert len(targets.parse("tpu:v4-16").devices()) == 8
    assert len(targets.parse("tpu:v5e-1").devices()) == 1  # one chip: a host of one
    with pytest.raises(ValueError, match="no v5e slice of 12"):
        targets.parse("tpu:v5e-12")
    with pytest.raises(ValueError, match="TPU 'v9' unknown"):
        targets.parse("tpu:v9-8")
    with pytest.raises(ValueError, match="PLATFORM:NAME-COUNT"):
        targets.parse("v5e-16")


HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]{0}) parameter(0)
  %x = f32[1024]{0} get-tuple-element(%p), index=1
  %ar = f32[1024]{0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add
  %ag = bf16[8,256]{1,0} all-gather(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %t = (s32[], f32[1024]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[1024]) -> f32[] {
  %x = f32[1024]{0} parameter(0)
  %w = (s32[], f32[1024]{0}) while(%t0), condition=%cond, body=%body, backend_config={TRIP}
  %rs = f32[128]{0} reduce-scatter(%x), replica_groups={}, dimensions={0}, to_apply=%add
  %big = f32[4096,1024]{1,0} broadcast(%x), dimensions={1}, metadata={op_name="jit(step)/big"}
  %cs = ((f32[1024]{0}), f32[256]{0:S(3)}, u32[]) slice-start(%x), slice={[0:256]}
  %sd = f32[256]{0:S(3)} slice-done(%cs)
  %neg = f32[256]{0} negate(%sd)
  ROOT %r = f32[] constant(0)
}
"""


TRIP = '{"known_trip_count":{"n":"3"}}'


def test_hlo_collectives_count_loop_trips_and_group_sizes():
    module = hlo.parse(HLO.replace("{TRIP}", TRIP))
    assert module.entry == "main" and module.multiplicity["body"] == 3
    got = hlo.collectives(module, num_devices=8)
    # all-reduce of 4 KiB in a group of 4, three trips: 2 (g-1)/g of it sent each time
    assert got["all-reduce"] == {
        "count": 3,
        "bytes": 3 * 4096,
        "sent": 3 * 4096 * 1.5,
        "per_iteration": False,
    }
    assert got["all-gather"]["count"] == 3 and got["all-gather"]["bytes"] == 3 * 8 * 256 * 2
    assert got["all-gather"]["sent"] == 3 * 8 * 256 * 2 * 0.5  # group of 2
    # reduce-scatter: the input is the output times the group (all 8 devices)
    assert got["reduce-scatter"] == {
        "count": 1,
        "bytes": 128 * 4 * 8,
        "sent": 128 * 4 * 7,
        "per_iteration": False,
    }
    assert got["all-to-all"]["count"] == 0
    # top-level reads and writes: the loop body's two collectives (x3), then the
    # reduce-scatter and the broadcast; parameters, tuples and constants move nothing; the
    # async slice reads its 1 KiB destination (+ a 4-byte context) from HBM into on-chip
    # memory (S(3)), and the negate reads it there (no HBM) and writes 1 KiB to HBM
    body = (4096 + 4096) + (4096 + 8 * 256 * 2)
    main = (4096 + 512) + (4096 + 4096 * 1024 * 4) + (1024 + 4 + 4) + 1024
    assert hlo.hbm_traffic(module) == 3 * body + main
    assert hlo.loop_trips(module) == 3  # the body runs three times: the cost analysis counts one
    biggest = hlo.largest_buffers(module, 1)[0]
    assert biggest["bytes"] == 4096 * 1024 * 4 and biggest["op"] == "jit(step)/big"


KERNEL_HLO = """HloModule jit_step, entry_computation_layout={()->bf16[64,32]}

%fused (p0: bf16[64,32]) -> bf16[64,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  ROOT %n = bf16[64,32]{1,0} negate(%p0)
}

ENTRY %main (x: bf16[64,32], g: f32[32]) -> bf16[64,32] {
  %x = bf16[64,32]{1,0} parameter(0)
  %g = f32[32]{0} parameter(1)
  %f = bf16[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %k = (bf16[64,32]{1,0}, f32[4,32]{1,0}) custom-call(%f, %x, %g), custom_call_target="{TRITON}"
  %c = bf16[64,32]{1,0} custom-call(%f), custom_call_target="AllocateBuffer"
  ROOT %o = bf16[64,32]{1,0} get-tuple-element(%k), index=0
}
"""


def test_custom_calls_traffic_is_their_operands_and_results():
    """What the cost analysis cannot see into (a Pallas or cuDNN kernel): the planner's count
    of its operands and results, the free calls left out; programs._cost adds it on GPU."""
    module = hlo.parse(KERNEL_HLO.replace("{TRITON}", "__gpu$xla.gpu.triton"))
    kernel = (64 * 32 * 2) * 2 + 32 * 4 + (64 * 32 * 2 + 4 * 32 * 4)
    assert hlo.hbm_traffic(module, custom_calls_only=True) == kernel
    assert hlo.hbm_traffic(module) == kernel + 2 * (64 * 32 * 2)  # and the fusion's read, write


def test_traffic_by_kind_splits_the_count_by_what_moves_it():
    """Each operation's bytes go to one kind (the kernel a custom call names, a matmul fusion,
    an elementwise or reduction fusion, a collective, a slice): the kinds add up to the count,
    loop bodies by their trips, and the heaviest operation comes first with its JAX name."""
    module = hlo.parse(HLO.replace("{TRIP}", TRIP))
    kinds, top = hlo.traffic_split(module, 2)
    assert sum(kinds.values()) == hlo.hbm_traffic(module)
    assert kinds["collectives"] == 3 * ((4096 + 4096) + (4096 + 8 * 256 * 2)) + (4096 + 512)
    assert kinds["slices, gathers, scatters"] == 1024 + 4 + 4
    assert kinds["other"] == (4096 + 4096 * 1024 * 4) + 1024  # an unfused broadcast, negate
    assert list(kinds)[0] == "other"  # largest first
    assert top[0] == {
        "bytes": 4096 + 4096 * 1024 * 4,
        "kind": "other",
        "opcode": "broadcast",
        "op": "jit(step)/big",
    }
    assert top[1]["kind"] == "collectives" and top[1]["bytes"] == 3 * (4096 + 8 * 256 * 2)

    # the same fusion as a matmul: what it computes says so (a dot inside), not its name
    gemm = KERNEL_HLO.replace("negate(%p0)", "dot(%p0, %p0), lhs_contracting_dims={1}")
    for target, kind in (
        ("__gpu$xla.gpu.triton", "Pallas kernels"),
        ("__cudnn$fmhaScaleBiasSoftmax", "attention (cuDNN)"),
        ("tpu_custom_call", "Pallas kernels"),
    ):
        module = hlo.parse(gemm.replace("{TRITON}", target))
        kernel = (64 * 32 * 2) * 2 + 32 * 4 + (64 * 32 * 2 + 4 * 32 * 4)
        assert hlo.traffic_split(module)[0] == {kind: kernel, "matmuls": 2 * 64 * 32 * 2}
    loop = hlo.parse(KERNEL_HLO.replace("{TRITON}", "__gpu$xla.gpu.triton"))
    assert hlo.traffic_split(loop)[0]["elementwise"] == 2 * 64 * 32 * 2


def test_unknown_trip_count_is_per_iteration():
    text = HLO.replace(", backend_config={TRIP}", "")
    got = hlo.collectives(hlo.parse(text), num_devices=8)
    assert got["all-reduce"]["count"] == 1 and got["all-reduce"]["per_iteration"]
    assert not got["reduce-scatter"]["per_iteration"]


# ---------------------------------------------------------------- compiled for a TPU slice


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_usable_memory_is_what_the_tpu_compiler_makes_available(generation):
    spec = {"v4": "tpu:v4-8", "v5p": "tpu:v5p-8"}.get(generation, f"tpu:{generation}-4")
    target = targets.parse(spec)
    assert programs.available_memory(target) == target.chip.available
    assert target.chip.usable_hbm == int(target.chip.available * 2**30) < target.chip.hbm * 1.01


def test_parameter_bytes_halve_when_fsdp_doubles():
    one = programs.state_bytes(_built(**{"parallel.mesh.fsdp": 1}))
    two = programs.state_bytes(_built(**{"parallel.mesh.fsdp": 2}))
    four = programs.state_bytes(_built(**{"parallel.mesh.fsdp": 4}))
    for key in ("params", "optimizer"):
        # everything with an 'embed' axis splits; norm scales and biases without it do not
        assert 0.5 <= two[key] / one[key] <= 0.56, (key, one, two)
        assert 0.5 <= four[key] / two[key] <= 0.6, (key, two, four)


@pytest.fixture(scope="module")
def debug_plan():
    return plan.make_plan(debug_config(), TARGET, config_name="configs/default.py:debug")


def test_debug_model_fits_a_small_slice(debug_plan):
    p = debug_plan
    assert p["fits"] and p["target"] == TARGET and p["num_devices"] == 4
    assert p["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert [r["kind"] for r in p["programs"]] == ["train", "eval", "greedy", "beam"]
    b = p["bytes_per_device"]
    assert b["params"] == programs.state_bytes(_built())["params"] > 0
    assert b["total"] >= b["params"] + b["optimizer"] + b["inputs"] + b["temp"]
    assert p["headroom_bytes"] == p["usable_bytes_per_device"] - b["total"]
    assert p["hbm_bytes_per_device"] == 16 * 2**30
    assert p["usable_bytes_per_device"] == int(15.75 * 2**30)  # the TPU compiler's figure
    # the train step's donated state is written in place: the aliased bytes hold the state
    train = p["programs"][0]
    assert train["memory"]["alias"] >= b["params"] + b["optimizer"]
    assert all(r["compile_seconds"] > 0 for r in p["programs"])


def test_compiled_flops_match_the_analytic_count(debug_plan):
    """The compiled train step's FLOPs (all devices) against analysis/flops.py: the analytic
    count has matmuls only; the compiler also counts softmax, norms, dropout and Adam, a few
    percent at d_model 32 and less for larger models. Tolerance: 0.9 to 1.3."""
    p = debug_plan
    ratio = p["flops_per_step_per_device"] * p["num_devices"] / p["analytic_flops_per_step"]
    assert ratio == pytest.approx(p["compiled_over_analytic"])
    assert 0.9 <= ratio <= 1.3, ratio


def test_roofline_bound_is_the_largest_term(debug_plan):
    p = debug_plan
    terms = p["bound_terms"]
    assert p["step_time_bound_s"] == max(terms.values()) > 0
    chip = targets.parse(TARGET).chip
    assert terms["compute_s"] == pytest.approx(p["flops_per_step_per_device"] / chip.peak_f32)
    train = p["programs"][0]
    assert "tpu_custom_call" not in train["custom_calls"]  # L 64: no Pallas attention kernel
    traffic = train["hbm_traffic_bytes_per_device"]
    assert train["loop_trips"] == 1  # no loop in the train step: both counts apply
    counted = min(traffic, train["compiler_bytes_accessed_per_device"])
    assert terms["memory_s"] == pytest.approx(counted / chip.hbm_bandwidth)
    # every parameter and Adam moment is read and written by the update at least once
    assert traffic >= 2 * (p["bytes_per_device"]["params"] + p["bytes_per_device"]["optimizer"])
    tokens = 8 * 64  # the debug config's packed batch: 512 tokens of 64
    assert p["target_tokens_per_step"] == tokens
    assert p["tokens_per_second_bound"] == pytest.approx(tokens / p["step_time_bound_s"])
    assert 0 < p["mfu_bound"] <= 1.0
    # where the traffic goes: the kinds add up to the count; the matmuls are there (their
    # operands on chip at this size: the TPU compiler's S(1) layouts) and the optimizer's
    # elementwise update; the plan's text says it
    kinds = train["traffic_by_kind"]
    assert sum(kinds.values()) == traffic and "matmuls" in kinds and kinds["elementwise"] > 0
    top = [x["bytes"] for x in train["top_traffic"]]
    assert len(top) == 10 and top == sorted(top, reverse=True) and top[0] <= traffic
    assert f"HBM traffic of {train['name']} per device" in plan.format_plan(p)


def test_data_parallel_all_reduces_and_fsdp_gathers(debug_plan):
    dp = debug_plan  # data=4: its train step's collectives are the plan's
    fsdp = plan.make_plan(
        debug_config(**{"parallel.mesh.data": 1, "parallel.mesh.fsdp": 4}),
        TARGET,
        programs=("train",),
    )
    c = dp["collectives"]
    assert c["all-reduce"]["count"] >= 1 and c["all-gather"]["count"] == 0
    # the gradient all-reduce moves at least every parameter's gradient once (float32)
    assert c["all-reduce"]["bytes"] >= dp["bytes_per_device"]["params"]
    f = fsdp["collectives"]
    assert f["all-gather"]["count"] >= 1  # parameters gathered for the matmuls
    assert f["reduce-scatter"]["count"] + f["all-reduce"]["count"] >= 1
    assert fsdp["bytes_per_device"]["params"] < dp["bytes_per_device"]["params"]


def test_the_wmt14_config_takes_its_tensor_axis_on_tpu_only():
    """configs/wmt14_ende.py: data=8 tensor=2 on a v5e-16 (--search's best for base), all
    data-parallel on this host's CPU devices; --config.parallel.mesh.tensor=1 gives data=16."""
    config = load_config(str(ROOT / "configs/wmt14_ende.py") + ":variant=base")

    def mesh(spec, **overrides):
        c = ml_collections.ConfigDict(config.to_dict())
        apply_overrides(c, overrides)
        target = targets.parse(spec)
        return dict(programs.build(c, target, target.devices()).strategy.mesh.shape)

    assert mesh("tpu:v5e-16") == {"data": 8, "fsdp": 1, "tensor": 2}
    assert mesh("tpu:v5e-16", **{"parallel.mesh.tensor": 1}) == {"data": 16, "fsdp": 1, "tensor": 1}
    here = dict(parallel.make_strategy(config.parallel).mesh.shape)
    assert here == {"data": len(jax.devices()), "fsdp": 1, "tensor": 1}


def test_two_slices_plan_as_one_mesh():
    """Multi-slice (Cloud TPU Multislice): the devices of both slices in one mesh, the
    data axis across them; each slice's hosts are processes of their own."""
    p = plan.make_plan(debug_config(), "tpu:v5e-4x2", programs=("train",))
    assert (p["num_devices"], p["num_slices"], p["num_processes"]) == (8, 2, 2)
    assert p["fits"] and p["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert p["collectives"]["all-reduce"]["count"] >= 1


def _plan_cli(*args, cache_dir) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tx_jax", "plan", "--config=configs/default.py:debug"]
    cmd += [f"--target={TARGET}", f"--cache_dir={cache_dir}", *args]
    return zygote.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_absurd_batch_does_not_fit_and_exits_2(tmp_path):
    out = _plan_cli(
        "--programs=train",
        "--config.data.tokens_per_batch=268435456",  # 4M rows of 64 tokens
        f"--json={tmp_path / 'plan.json'}",
        cache_dir=tmp_path / "cache",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "DOES NOT FIT" in out.stdout
    assert "would help: recompute activations" in out.stdout
    assert "--config.train.grad_accum_steps=2" in out.stdout
    assert "the compiler: Ran out of memory" in out.stdout  # the TPU compiler refuses it
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert not saved["fits"] and saved["bytes_per_device"]["total"] > 16 * 2**30
    assert saved["advice"] and saved["largest_state"]
    assert search.rank([saved]) == []  # the search drops it


def test_bad_target_and_key_are_named(tmp_path):
    out = _plan_cli("--config.model.no_such=1", cache_dir=tmp_path)
    assert out.returncode == 2 and "model.no_such" in out.stderr
    out = zygote.run(
        [
            sys.executable,
            "-m",
            "tx_jax",
            "plan",
            "--config=configs/default.py:debug",
            "--target=tpu:v5e-3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 2 and "no v5e slice of 3" in out.stderr


def test_search_returns_fitting_plans_best_first_and_caches(tmp_path):
    # the candidates: v5e-4 and 2 heads give (data, fsdp, tensor) in (4,1,1) (2,2,1) (1,4,1)
    # (2,1,2) (1,2,2); tensor splits heads, so 1 head leaves the first three (compiled below)
    as_tuples = lambda ms: {(m["data"], m["fsdp"], m["tensor"]) for m in ms}
    assert as_tuples(search.meshes(4, 2, None)) == {
        (4, 1, 1),
        (2, 2, 1),
        (1, 4, 1),
        (2, 1, 2),
        (1, 2, 2),
    }
    assert as_tuples(search.meshes(4, 2, 1)) == {(4, 1, 1), (2, 2, 1), (1, 4, 1)}
    one_head = "--config.model.num_heads=1"  # 3 candidates to compile, not 5
    cache = tmp_path / "cache"
    out = _plan_cli(
        "--search", "--workers=2", one_head, f"--json={tmp_path / 's.json'}", cache_dir=cache
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ranked = json.loads((tmp_path / "s.json").read_text())
    assert len(ranked) == 3 and all(p["fits"] for p in ranked)
    bounds = [p["tokens_per_second_bound"] for p in ranked]
    assert bounds == sorted(bounds, reverse=True)
    meshes = {tuple(p["mesh"].values()) for p in ranked}
    assert meshes == as_tuples(search.meshes(4, 1, None)) == {(4, 1, 1), (2, 2, 1), (1, 4, 1)}
    assert all(p["model"]["d_model"] == 32 for p in ranked)  # the debug model, 1 head
    assert all(p["overrides"]["model.num_heads"] == "1" for p in ranked)
    assert "best 3" in out.stdout and "--config.parallel.mesh.data=" in out.stdout
    cached = sorted(cache.iterdir())
    again = _plan_cli("--search", "--workers=2", one_head, cache_dir=cache)
    assert again.returncode == 0 and sorted(cache.iterdir()) == cached  # nothing new compiled
    assert again.stdout.splitlines()[-3:] == out.stdout.splitlines()[-3:]


@pytest.mark.skipif(
    os.environ.get("TX_JAX_GPU_PLAN_TESTS") != "1",
    reason="GPU planning needs jax's CUDA plugin (pip install -e '.[plan-gpu]', several GB); "
    "set TX_JAX_GPU_PLAN_TESTS=1",
)
def test_gpu_plan_compiles_for_h100():
    config = debug_config(**{"model.dtype": "bfloat16"})  # 'auto' attention: cuDNN in bf16
    p = plan.make_plan(config, "gpu:h100-8", programs=("train", "greedy"))
    assert p["fits"] and p["num_devices"] == 8 and p["platform"] == "gpu"
    assert p["usable_bytes_per_device"] == int(80 * 2**30 * 0.75)
    assert p["collectives"]["all-reduce"]["count"] >= 1
    kernels = p["programs"][0]["custom_calls"]
    assert any(k.startswith("__cudnn$fmha") and "Backward" in k for k in kernels), kernels
    # the cost analysis cannot see into cuDNN's kernel: its attention FLOPs are missing
    compiled = p["flops_per_step_per_device"] * 8 / p["analytic_flops_per_step"]
    assert 0.7 <= compiled <= 1.0, compiled


def test_traffic_of_a_looped_program_is_counted_by_trips():
    """The compiler's bytes accessed count a loop body once: where a body runs several times
    the plan's traffic is hlo.hbm_traffic's count by trips, else the smaller of the two."""
    from tx_jax.planning import plan as plan_lib
    from tx_jax.planning.programs import Program

    def program(trips: int) -> Program:
        return Program("train", "train", {}, 0.0, {}, 1.0, 10.0, 40.0, {}, [], 0, loop_trips=trips)

    assert plan_lib.traffic(program(1)) == 10.0
    assert plan_lib.traffic(program(4)) == 40.0
