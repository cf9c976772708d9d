"""Where a train step's time goes on the accelerator in hand: one case of gpu_step.py traced with
jax.profiler over a few steps, the device's kernels summed by the HLO instruction they run,
and each instruction sorted into what it computes by reading the optimized HLO.

    python benchmarks/gpu_profile.py --case base:bfloat16 --out-dir OUT      # on a GPU host
    python benchmarks/gpu_profile.py --summarize OUT                         # anywhere, later
    JAX_PLATFORMS=cpu python benchmarks/gpu_profile.py --case debug:float32 --out-dir /tmp/p

OUT gets profile.json (per timeline of the device: busy time, and per event name the total
time, count and the first event's args), hlo.txt.gz (the step's optimized HLO, which names
each fusion's contents) and, when small enough to keep, trace.json.gz (the Perfetto trace).
--summarize prints the time per category (matmuls, attention, dropout's random bits, softmax
and other reductions, elementwise, copies) and the heaviest instructions.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step  # noqa: E402


def trace_case(case: str, steps: int, out_dir: str) -> None:
    import jax

    device = jax.devices()[0]
    chip_name, _ = gpu_step.chip_of(device)
    row, step, state, batch, s = gpu_step.prepare_case(case, device, chip_name)
    os.makedirs(out_dir, exist_ok=True)
    with gzip.open(os.path.join(out_dir, "hlo.txt.gz"), "wt") as f:
        f.write(step.as_text())
    with s.context():
        for _ in range(3):  # warm-up
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        tmp = tempfile.mkdtemp()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            wall = (time.perf_counter() - start) / steps
    (path,) = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
    if os.path.getsize(path) < 15 * 2**20:  # what the device tool brings back
        shutil.copy(path, os.path.join(out_dir, "trace.json.gz"))
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    summary = {
        "case": case,
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "steps_traced": steps,
        "step_seconds_traced": wall,
        "static": {k: row[k] for k in ("attention_impl", "hbm_bytes", "temp_bytes", "shapes")},
        "timelines": timelines(trace),
    }
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(summary, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{case}: {wall * 1e3:.2f} ms/step under the profiler; wrote {out_dir}")


def timelines(trace) -> list[dict]:
    """Complete events grouped by (process, thread) name: busy time (the union of intervals),
    and per event name total microseconds, count and the first event's args."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    lines = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            lines[(e["pid"], e["tid"])].append(e)
    out = []
    for (pid, tid), evs in lines.items():
        evs.sort(key=lambda e: e["ts"])
        busy, end = 0.0, float("-inf")
        for e in evs:  # union of intervals: nested events count once
            s, f = e["ts"], e["ts"] + e["dur"]
            if f > end:
                busy += f - max(s, end)
                end = f
        names: dict[str, dict] = {}
        for e in evs:
            n = names.setdefault(e["name"], {"us": 0.0, "count": 0, "args": e.get("args", {})})
            n["us"] += e["dur"]
            n["count"] += 1
        out.append(
            {
                "process": procs.get(pid, str(pid)),
                "thread": threads.get((pid, tid), str(tid)),
                "span_us": evs[-1]["ts"] + evs[-1]["dur"] - evs[0]["ts"],
                "busy_us": busy,
                "events": len(evs),
                "names": dict(sorted(names.items(), key=lambda kv: -kv[1]["us"])),
            }
        )
    return sorted(out, key=lambda t: -t["busy_us"])


_FIELDS = (
    ("calls", r"calls=%?([\w.\-]+)"),
    ("target", r'custom_call_target="([^"]+)"'),
    ("kind", r"kind=(\w+)"),
    ("backend", r"backend_config=(\{.*\})"),
    ("op_name", r'op_name="([^"]+)"'),
)


def hlo_index(text: str) -> dict[str, dict]:
    """Instruction name -> {opcode, comp, ops: the opcodes it runs (a fusion's whole body,
    nested calls included), target: a custom call's target, kind: a fusion's kind, op_name},
    read with the planner's HLO reader."""
    from tx_jax.planning import hlo

    module = hlo.parse(text)
    instrs = {}
    for comp, body in module.computations.items():
        for i in body:
            info = {"opcode": i.opcode, "comp": comp}
            for key, pat in _FIELDS:
                m = re.search(pat, i.rest)
                if m:
                    info[key] = m.group(1)[:400]
            instrs[i.name] = info

    def body_ops(comp, seen):
        ops = collections.Counter()
        for i in module.computations.get(comp, []):
            ops[i.opcode] += 1
            callee = instrs[i.name].get("calls")
            if callee and callee not in seen:
                seen.add(callee)
                ops.update(body_ops(callee, seen))
        return ops

    for info in instrs.values():
        if "calls" in info:
            info["ops"] = body_ops(info["calls"], {info["calls"]})
    return instrs


def category(info: dict | None, name: str) -> str:
    if info is None:
        low = name.lower()
        if "gemm" in low or "xmma" in low or "nvjet" in low or "cutlass" in low:
            return "matmul"
        if "sdpa" in low or "fmha" in low or "flash" in low or "cudnn" in low:
            return "attention (cuDNN)"
        if "memcpy" in low or "memset" in low:
            return "memcpy/memset"
        return "other"
    ops = info.get("ops", collections.Counter({info["opcode"]: 1}))
    target = info.get("target", "") + info.get("backend", "")
    if info["opcode"] == "custom-call" or "__cublas" in target or "__cudnn" in target:
        if "fmha" in target or "cudnn$fmha" in target or "sdpa" in target:
            return "attention (cuDNN)"
        if "cublas" in target or "gemm" in target.lower():
            return "matmul"
    if "__triton_gemm" in target or "triton_gemm" in target or ops.get("dot"):
        return "matmul"
    if "fmha" in target or "cudnn" in target:
        return "attention (cuDNN)"
    if ops.get("rng-bit-generator") or (ops.get("shift-right-logical", 0) >= 4 and ops.get("xor")):
        return "dropout bits"
    if ops.get("all-reduce") or ops.get("reduce-scatter") or ops.get("all-gather"):
        return "collectives"
    if ops.get("reduce"):
        if ops.get("exponential") or ops.get("log"):
            return "softmax / loss (reductions with exp/log)"
        return "other reductions (layer norm, sums, norms)"
    if set(ops) <= {"copy", "transpose", "bitcast", "parameter", "tuple", "get-tuple-element"}:
        return "copies / transposes"
    if ops.get("dynamic-update-slice") or ops.get("scatter") or ops.get("gather"):
        return "gather / scatter / slices"
    return "elementwise"


# Where in the model an instruction comes from, by its op_name (the jax name stack), first match.
SOURCES = (
    ("optimizer update", r"/cond/|optax|adam"),
    ("dropout (bits and masks)", r"Dropout|_dropout|_bernoulli"),
    ("layer norm", r"_norm/"),
    ("attention sublayers (projections, masks)", r"attention"),
    ("feed-forward", r"/ffn/"),
    ("embeddings", r"embed"),
    ("output layer and loss, the rest", r"."),
)


def source(info: dict | None) -> str:
    op_name = (info or {}).get("op_name", "")
    if not op_name:
        return "library kernels (cuBLAS, cuDNN): source not named"
    return next(label for label, pat in SOURCES if re.search(pat, op_name))


def summarize(out_dir: str, top: int = 25) -> dict:
    with open(os.path.join(out_dir, "profile.json")) as f:
        prof = json.load(f)
    with gzip.open(os.path.join(out_dir, "hlo.txt.gz"), "rt") as f:
        index = hlo_index(f.read())
    steps = prof["steps_traced"]
    print(
        f"{prof['case']} on {prof['device_kind']} (jax {prof['jax']}): "
        f"{prof['step_seconds_traced'] * 1e3:.2f} ms/step under the profiler"
    )
    for t in prof["timelines"][:8]:
        print(
            f"  {t['process']} / {t['thread']}: busy {t['busy_us'] / steps / 1e3:.2f} ms/step, "
            f"{t['events'] / steps:.0f} events/step"
        )
    # The timeline of HLO ops on the device (xprof's "XLA Ops"), else the busiest device line.
    device = [
        t
        for t in prof["timelines"]
        if t["process"].startswith("/device:") and "CUSTOM" not in t["process"]
    ] or prof["timelines"]
    ops_lines = (
        [t for t in device if "XLA Ops" in t["thread"]]
        or [t for t in device if "Stream" in t["thread"]]
        or device[:1]
    )
    cats, sources = collections.Counter(), collections.Counter()
    rows = []
    for line in ops_lines:
        for name, n in line["names"].items():
            # A kernel XLA emits is named after its fusion ('.' -> '_'); a library's kernel
            # (cuBLAS, cuDNN) only by its hlo_op, which is the CUDA graph's when one runs.
            op = n["args"].get("hlo_op", "") if isinstance(n["args"], dict) else ""
            keys = (name, re.sub(r"_(\d+)$", r".\1", name), op)
            known = [k for k in keys if k in index and not k.startswith("command_buffer")]
            info = index[known[0]] if known else None
            c = category(info, name)
            cats[c] += n["us"] / steps
            sources[source(info)] += n["us"] / steps
            rows.append((n["us"] / steps, n["count"] // steps, name, c))
    total = sum(cats.values())
    print(
        f"time by category (timelines: {', '.join(t['thread'] for t in ops_lines)}; "
        f"{total / 1e3:.2f} ms/step in all):"
    )
    for c, us in cats.most_common():
        print(f"  {c:45s} {us / 1e3:7.2f} ms  {100 * us / total:5.1f}%")
    print(
        "time by source in the model (XLA's kernels by op_name; a deduplicated kernel counts "
        "under its first instance's):"
    )
    for c, us in sources.most_common():
        print(f"  {c:45s} {us / 1e3:7.2f} ms  {100 * us / total:5.1f}%")
    print(f"heaviest {top}:")
    for us, count, name, c in sorted(rows, reverse=True)[:top]:
        print(f"  {us / 1e3:7.3f} ms x{count:<3d} {name[:70]:70s} {c}")
    return {
        "categories_ms": {c: us / 1e3 for c, us in cats.items()},
        "sources_ms": {c: us / 1e3 for c, us in sources.items()},
        "total_ms": total / 1e3,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", default="base:bfloat16", help="as gpu_step.py's --cases, one")
    p.add_argument("--steps", type=int, default=3, help="steps traced")
    p.add_argument("--out-dir", help="where profile.json, hlo.txt.gz and trace.json.gz go")
    p.add_argument("--summarize", metavar="DIR", help="only summarize a profile made earlier")
    args = p.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return
    if not args.out_dir:
        p.error("--out-dir is required unless --summarize")
    trace_case(args.case, args.steps, args.out_dir)
    summarize(args.out_dir)


if __name__ == "__main__":
    main()
