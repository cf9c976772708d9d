"""One plan: a run's programs compiled for a target, and per device its memory against the
chip's (the train state stays resident beside each program's inputs, temporaries, undonated
outputs and code), FLOPs beside the analytic count (custom kernels' FLOPs are invisible to
the cost analysis), collectives, HBM traffic (`traffic`) and a roofline bound on the train
step (docs/planning.md)."""

from __future__ import annotations

import math
from typing import Any

import ml_collections

from tx_jax.analysis import flops
from tx_jax.config import task_of
from tx_jax.model.config import ModelConfig
from tx_jax.planning import chips, targets
from tx_jax.planning import programs as programs_lib

PROGRAMS = ("train", "eval", "greedy", "beam")
# the custom calls the text plan names: attention kernels (Pallas/Mosaic on TPU, cuDNN)
_KERNELS = ("tpu_custom_call", "__cudnn$fmha")
GiB = 1 << 30


def program_total(p: programs_lib.Program, resident: int) -> int:
    """Bytes per device while `p` runs, with `resident` bytes of train state alive."""
    outputs = p.memory["output"] - p.memory["alias"]
    return resident + p.extra_bytes + p.memory["temp"] + outputs + p.memory["code"]


def analytic_flops(built: programs_lib.Built, shapes: dict[str, tuple[int, int]]) -> int:
    """analysis/flops.py's count of one global train step on `shapes` (padding included)."""
    mc = built.model_config
    B, L = shapes["targets"]
    if task_of(built.config) == "lm":
        return flops.decoder_only_flops(mc, B, L).train
    return flops.encoder_decoder_flops(mc, B, shapes["inputs"][1], L).train


def traffic(p: programs_lib.Program) -> float:
    """HBM bytes per step: the smaller of two overcounts, hlo.hbm_traffic (whole operands of
    each top-level operation) and the cost analysis' bytes accessed (traffic inside fusions
    too; on GPU the CPU client's analysis of the GPU module, custom calls added). Where a
    loop body runs more than once, hlo.hbm_traffic alone: the cost analysis counts the body
    once, which made a blocked loss look 4 GB lighter than it is (benchmarks/HISTORY.md, "GPU")."""
    if p.loop_trips > 1 and p.hbm_bytes > 0:
        return p.hbm_bytes
    counts = [x for x in (p.hbm_bytes, p.bytes_accessed) if x > 0]
    return min(counts) if counts else 0.0


def roofline(p: programs_lib.Program, chip, dtype: str) -> dict[str, float]:
    sent = sum(c["sent"] for c in p.collectives.values())
    terms = {
        "compute_s": p.flops / chip.peak(dtype),
        "memory_s": traffic(p) / chip.hbm_bandwidth,
        "interconnect_s": sent / (chip.interconnect / 2),
    }
    bound = max(terms.values())
    return terms | {"step_time_bound_s": bound, "bound_by": max(terms, key=terms.get)[:-2]}


def make_plan(
    config: ml_collections.ConfigDict,
    target: str | targets.Target,
    programs: tuple[str, ...] = PROGRAMS,
    config_name: str = "",
) -> dict[str, Any]:
    """Compile `config`'s run for `target` ('tpu:v5e-16', ...) and return the plan (JSON-able
    dict; `format_plan` prints it). Raises ValueError naming a bad config or target."""
    target = targets.parse(target) if isinstance(target, str) else target
    built = programs_lib.build(config, target, target.devices())
    compiled = programs_lib.compile_all(built, programs)
    chip = target.chip
    state = programs_lib.state_bytes(built)
    resident = sum(state.values())
    rows = [_program_row(p, resident) for p in compiled]
    worst = max(rows, key=lambda row: row["total_bytes"])
    plan: dict[str, Any] = {
        "config": config_name,
        "target": target.spec,
        "chip": chip.name,
        "platform": target.platform,
        "topology": target.topology,
        "num_slices": target.num_slices,
        "num_devices": built.num_devices,
        "num_processes": built.num_processes,
        "mesh": dict(built.strategy.mesh.shape),
        "model": _model_summary(built.model_config),
        "grad_accum_steps": int(built.config.train.grad_accum_steps),
        **_memory_verdict(chip, state, worst),
        "programs": rows,
        "compile_seconds": round(sum(p.compile_seconds for p in compiled), 2),
        "chip_source": chip.source,
        "notes": _notes(built, target),
    }
    trains = [(p, r) for p, r in zip(compiled, rows) if p.kind == "train"]
    if trains:
        plan.update(_train_figures(built, trains, chip, built.model_config.dtype))
    if not plan["fits"]:
        plan["largest_state"] = programs_lib.largest_state_leaves(built)
        plan["advice"] = advice(built, plan)
    return plan


def _program_row(p: programs_lib.Program, resident: int) -> dict[str, Any]:
    """The plan's entry for one compiled program, `resident` bytes of train state alive."""
    return {
        "name": p.name,
        "kind": p.kind,
        "shapes": {k: list(v) for k, v in p.shapes.items()},
        "compile_seconds": round(p.compile_seconds, 2),
        "memory": p.memory,
        "inputs_bytes": p.extra_bytes,
        "total_bytes": program_total(p, resident),
        "flops_per_device": p.flops,
        "hbm_traffic_bytes_per_device": p.hbm_bytes,
        "compiler_bytes_accessed_per_device": p.bytes_accessed,
        "loop_trips": p.loop_trips,
        "collectives": p.collectives,
        "largest_buffers": p.largest_buffers,
        "traffic_by_kind": p.traffic_by_kind,
        "top_traffic": p.top_traffic,
        "custom_calls": p.custom_calls,
        "refused": p.refused,
    }


def _model_summary(mc: ModelConfig) -> dict[str, Any]:
    """The model choices a plan depends on (dtype, attention, the step-speed levers, size)."""
    return {
        "dtype": mc.dtype,
        "attention_impl": mc.attention_impl,
        "remat": mc.remat,
        # the implementation fields, as resolved for the target's platform
        "kernels": mc.kernels,
        "loss_impl": mc.loss_impl,
        "dropout_bits": mc.dropout_bits,
        "d_model": mc.d_model,
        "layers": [mc.num_encoder_layers, mc.num_decoder_layers],
    }


def _memory_verdict(
    chip: chips.Chip, state: dict[str, int], worst: dict[str, Any]
) -> dict[str, Any]:
    """Whether the run fits: the bytes per device of the program that needs most (`worst`,
    its plan entry; `state`: the train state's, by part) against the chip's usable memory."""
    usable = chip.usable_hbm
    total = worst["total_bytes"]
    return {
        "hbm_bytes_per_device": chip.hbm,
        "usable_bytes_per_device": usable,
        "bytes_per_device": {
            **state,
            "inputs": worst["inputs_bytes"],
            "temp": worst["memory"]["temp"],
            "total": total,
            "program": worst["name"],
        },
        "fits": total <= usable,
        "headroom_bytes": usable - total,
    }


def _notes(built: programs_lib.Built, target: targets.Target) -> list[str]:
    """The build's notes, and what the bound leaves out when collectives cross slices."""
    notes = list(built.notes)
    if target.num_slices > 1:
        notes.append(
            "collectives that cross slices go over the data-center network, far slower than "
            "ICI; the bound's interconnect term counts every byte at ICI speed (a looser bound)"
        )
    return notes


def _train_figures(built, trains, chip, dtype: str) -> dict[str, Any]:
    """The headline train step (the longest bucket): FLOPs, collectives, the bound."""
    trains = [(p, row) for p, row in trains if not p.refused]
    if not trains:
        return {}
    for p, row in trains:
        row.update(roofline(p, chip, dtype))
        row["analytic_flops"] = analytic_flops(built, p.shapes)
    p, row = max(trains, key=lambda pr: pr[0].shapes["targets"][1])
    B, L = p.shapes["targets"]
    n = built.num_devices
    bound = row["step_time_bound_s"]
    return {
        "train_program": row["name"],
        "flops_per_step_per_device": p.flops,
        "analytic_flops_per_step": row["analytic_flops"],
        "compiled_over_analytic": p.flops * n / max(row["analytic_flops"], 1),
        "collectives": p.collectives,
        "bound_terms": {k: row[k] for k in ("compute_s", "memory_s", "interconnect_s")},
        "bound_by": row["bound_by"],
        "step_time_bound_s": bound,
        "target_tokens_per_step": B * L,
        "tokens_per_second_bound": B * L / bound if bound else math.inf,
        # MFU <= 1 whatever the counts: the compiled step can count fewer FLOPs than the
        # analytic formula (which counts the whole L x S score matrices)
        "mfu_bound": min(1.0, row["analytic_flops"] / (n * chip.peak(dtype) * bound))
        if bound
        else 0.0,
        "peak_flops_per_device": chip.peak(dtype),
    }


def advice(built: programs_lib.Built, plan: dict[str, Any]) -> list[str]:
    """What would make a plan that does not fit fit, as --config overrides."""
    out = []
    b = plan["bytes_per_device"]
    mesh, n = plan["mesh"], plan["num_devices"]
    worst = next(r for r in plan["programs"] if r["name"] == b["program"])
    if worst["kind"] in ("greedy", "beam"):
        # every device decodes the whole eval batch (quality.py): its rows set the caches
        size = built.config.data.eval_batch_size
        out.append(
            f"decoding {worst['name']} needs {b['temp'] / GiB:.2f} GiB of temporaries (KV "
            f"caches of every row and beam): --config.data.eval_batch_size={max(1, size // 2)}"
        )
    state = b["params"] + b["optimizer"]
    if mesh["fsdp"] < n and state > 0.25 * plan["usable_bytes_per_device"]:
        f = min(n, mesh["fsdp"] * 4)
        out.append(
            f"shard parameters and Adam moments over more devices (state {state / GiB:.2f} "
            f"GiB per device): --config.parallel.mesh.fsdp={f} --config.parallel.mesh.data=-1"
        )
    if worst["kind"] in ("train", "eval") and b["temp"] > 0.25 * plan["usable_bytes_per_device"]:
        if plan["model"]["remat"] == "none":
            out.append(
                f"recompute activations in the backward pass (temporaries {b['temp'] / GiB:.2f} "
                "GiB): --config.model.remat=dots (or full)"
            )
        k = plan["grad_accum_steps"] * 2
        out.append(
            f"a smaller per-device batch, same global batch: --config.train.grad_accum_steps={k}"
        )
        out.append(
            "or a smaller global batch: --config.data.tokens_per_batch="
            f"{built.config.data.tokens_per_batch // 2}"
        )
    return out or ["no single change is clearly enough; try --search"]


def _short(op_name: str) -> str:
    """'jit(f)/Encoder/layer_0/.../dot_general' -> its last two parts."""
    return "/".join(op_name.split("/")[-2:])


def _gib(x: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{x / GiB:.2f} GiB" if abs(x) >= GiB else f"{x / 2**20:.1f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _program_line(r: dict[str, Any]) -> str:
    """One program's row of `format_plan`'s table: compile time, inputs, temporaries and total
    bytes per device, collectives, attention kernels."""
    coll = ", ".join(
        f"{k} {v['count']}x {v['bytes'] / 2**20:.1f} MiB"
        + (" per step" if v["per_iteration"] else "")
        for k, v in r["collectives"].items()
        if v["count"]
    )
    kernels = ", ".join(f"{k} x{v}" for k, v in r["custom_calls"].items() if k.startswith(_KERNELS))
    return (
        f"{r['name']:<24}{r['compile_seconds']:>8.1f}s{_gib(r['inputs_bytes']):>12}"
        f"{_gib(r['memory']['temp']):>12}{_gib(r['total_bytes']):>12}  {coll or 'none'}"
        + (f"; kernels: {kernels}" if kernels else "")
    )


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a person reads it."""
    m = plan["mesh"]
    slices = f" x {plan['num_slices']} slices" if plan["num_slices"] > 1 else ""
    lines = [
        f"plan: {plan['config'] or 'config'} on {plan['target']} ({plan['chip']}, topology "
        f"{plan['topology']}{slices}, {plan['num_devices']} devices, "
        f"{plan['num_processes']} hosts)",
        f"mesh data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}; model "
        f"{plan['model']['dtype']}, attention {plan['model']['attention_impl']}, "
        f"remat {plan['model']['remat']}, grad_accum_steps {plan['grad_accum_steps']}",
        *[f"note: {n}" for n in plan["notes"]],
        "",
        f"{'program':<24}{'compile':>9}{'inputs':>12}{'temp':>12}{'total':>12}  collectives",
    ]
    lines += [_program_line(r) for r in plan["programs"]]
    b = plan["bytes_per_device"]
    verdict = "FITS" if plan["fits"] else "DOES NOT FIT"
    lines += [
        "",
        f"memory per device ({b['program']}): params {_gib(b['params'])} + optimizer "
        f"{_gib(b['optimizer'])} + inputs {_gib(b['inputs'])} + temp {_gib(b['temp'])} + rest "
        f"= {_gib(b['total'])} of {_gib(plan['usable_bytes_per_device'])} usable "
        f"({_gib(plan['hbm_bytes_per_device'])} HBM): {verdict}, headroom "
        f"{_gib(plan['headroom_bytes'])}",
    ]
    if "step_time_bound_s" in plan:
        t = plan["bound_terms"]
        lines += [
            f"train step {plan['train_program']}: compiled {plan['flops_per_step_per_device']:.3e} "
            f"FLOP per device, analytic {plan['analytic_flops_per_step']:.3e} per step "
            f"(compiled x devices / analytic = {plan['compiled_over_analytic']:.2f})",
            f"roofline BOUND, not a measurement: step >= {_ms(plan['step_time_bound_s'])} "
            f"(compute {_ms(t['compute_s'])}, HBM {_ms(t['memory_s'])}, interconnect "
            f"{_ms(t['interconnect_s'])}; {plan['bound_by']}-bound) -> at most "
            f"{plan['tokens_per_second_bound']:,.0f} target tokens/s, MFU <= "
            f"{100 * plan['mfu_bound']:.1f}%",
        ]
        train = next(r for r in plan["programs"] if r["name"] == plan["train_program"])
        if train.get("traffic_by_kind"):
            total = train["hbm_traffic_bytes_per_device"] or 1
            shares = ", ".join(
                f"{kind} {b / 1e9:.2f} GB ({100 * b / total:.0f}%)"
                for kind, b in train["traffic_by_kind"].items()
                if b >= 0.005 * total
            )
            lines.append(
                f"HBM traffic of {train['name']} per device (the planner's count, "
                f"{total / 1e9:.2f} GB): {shares}"
            )
    lines.append(f"compile time: {plan['compile_seconds']:.1f} s in all")
    if not plan["fits"]:
        arrays = ", ".join(
            f"{r['name']} {r['bytes'] / 2**20:.1f} MiB" for r in plan["largest_state"][:3]
        )
        lines.append(f"largest state arrays per device: {arrays}")
        worst = next(r for r in plan["programs"] if r["name"] == b["program"])
        if worst["refused"]:
            lines.append(f"{worst['name']}: {worst['refused']}")
        if worst["largest_buffers"]:
            buffers = ", ".join(
                f"{x['shape']} {x['bytes'] / 2**20:.1f} MiB ({_short(x['op'])})"
                for x in worst["largest_buffers"][:3]
            )
            lines.append(f"largest buffers of {b['program']}: {buffers}")
        lines += [f"would help: {a}" for a in plan["advice"]]
    return "\n".join(lines)
