"""Plans of the paper's models and a long-context model, compiled for TPU and GPU targets on
this host (tx_jax plan), tabulated for BENCHMARKS.md.

    python benchmarks/plans.py [--out DIR] [--gpu_python PATH] [--only NAME,...] [--search]
    python benchmarks/plans.py --tabulate DIR          # tables from plans already in DIR

Each plan runs as its own `tx_jax plan ... --json=DIR/NAME.json` process, one at a
time (compile times are the host's, so nothing else should share the cores). GPU targets need
an interpreter with the plan-gpu extra (--gpu_python; skipped without it). --search runs
`--search` for every (model, target) pair instead (the plans' cache makes a rerun instant)
and the tables then show the best candidate of each. Writes benchmarks/results/plans.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the machine description must not start libtpu
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

WMT = "configs/wmt14_ende.py"
LONG = "configs/lm.py:variant=long,length={L}"
TARGETS = ("tpu:v5e-16", "tpu:v4-8", "gpu:h100-8")
PLANS = [  # (name, config, target, extra args)
    *[
        (f"{v}_{t.split(':')[1]}", f"{WMT}:variant={v}", t, [])
        for t in TARGETS
        for v in ("base", "big")
    ],
    *[
        (
            f"long{L}_{impl}_v5e-16",
            LONG.format(L=L),
            "tpu:v5e-16",
            ["--programs=train", f"--config.model.attention_impl={impl}"],
        )
        for L in (8192, 32768)
        for impl in ("splash", "chunked", "xla")
    ],
    *[
        (
            f"long8192_{impl}_h100-8",
            LONG.format(L=8192),
            "gpu:h100-8",
            ["--programs=train", f"--config.model.attention_impl={impl}"],
        )
        for impl in ("cudnn", "chunked", "xla")
    ],
]
GiB = 1 << 30


def run(name, config, target, extra, out: pathlib.Path, python: str, search: bool) -> None:
    cmd = [python, "-m", "tx_jax", "plan", f"--config={config}", f"--target={target}", *extra]
    if search:
        cmd += ["--search", "--workers=2", f"--json={out / (name + '.search.json')}"]
    else:
        cmd += ["--no_cache", f"--json={out / (name + '.json')}"]
    env = dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    log = out / (name + (".search" if search else "") + ".txt")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    print(f"{name}{' (search)' if search else ''}: exit {proc.returncode}, log {log}", flush=True)


def _gib(x) -> str:
    return f"{x / GiB:.2f}"


def _bound(p: dict) -> str:
    if "step_time_bound_s" not in p:
        return "-"
    return f"{p['step_time_bound_s'] * 1e3:.1f} ({p['bound_by']})"


def _mesh(p: dict) -> str:
    return "x".join(str(p["mesh"][a]) for a in ("data", "fsdp", "tensor"))


def main_rows(plans: dict[str, dict]) -> list[list]:
    rows = []
    for name, p in plans.items():
        if name.startswith("long"):
            continue
        b = p["bytes_per_device"]
        train = next(r for r in p["programs"] if r["kind"] == "train")
        compile_s = ", ".join(f"{r['kind']} {r['compile_seconds']:.0f}" for r in p["programs"])
        coll = train["collectives"]["all-reduce"]
        rows.append(
            [
                name.split("_")[0],
                p["target"],
                _mesh(p),
                compile_s,
                _gib(b["params"] + b["optimizer"]),
                _gib(train["total_bytes"]),
                f"{_gib(b['total'])} ({b['program']})",
                _gib(p["usable_bytes_per_device"]),
                "yes" if p["fits"] else "NO",
                f"{coll['count']}x {coll['bytes'] / 2**20:.0f} MiB",
                f"{p.get('compiled_over_analytic', 0):.2f}",
                _bound(p),
                f"{p.get('tokens_per_second_bound', 0):,.0f}",
                f"{100 * p.get('mfu_bound', 0):.1f}%",
            ]
        )
    return rows


def long_rows(plans: dict[str, dict]) -> list[list]:
    rows = []
    for name, p in plans.items():
        if not name.startswith("long"):
            continue
        L = int(name[4:].split("_")[0])
        train = p["programs"][0]
        kernels = sorted(
            k for k in train.get("custom_calls", {}) if k.startswith(("tpu_custom", "__cudnn"))
        )
        rows.append(
            [
                L,
                p["target"],
                p["model"]["attention_impl"],
                f"{train['compile_seconds']:.0f}",
                _gib(train["memory"]["temp"]),
                _gib(p["bytes_per_device"]["total"]),
                "yes"
                if p["fits"]
                else f"NO{' (compiler refused)' if train.get('refused') else ''}",
                _bound(p),
                ", ".join(kernels) or "-",
            ]
        )
    return rows


def search_rows(out: pathlib.Path) -> list[list]:
    rows = []
    for path in sorted(out.glob("*.search.json")):
        ranked = json.loads(path.read_text())
        name = path.name.removesuffix(".search.json")
        if not ranked:
            rows.append([name, "no candidate fits", "", "", ""])
            continue
        best = ranked[0]
        overrides = " ".join(
            f"{k}={v}" for k, v in best["candidate"].items() if k != "parallel.strategy"
        )
        rows.append(
            [
                name,
                overrides,
                f"{best['step_time_bound_s'] * 1e3:.1f}",
                f"{best['tokens_per_second_bound']:,.0f}",
                f"{100 * best['mfu_bound']:.1f}%",
            ]
        )
    return rows


def tabulate(out: pathlib.Path) -> dict:
    plans = {
        p.name.removesuffix(".json"): json.loads(p.read_text())
        for p in sorted(out.glob("*.json"))
        if not p.name.endswith(".search.json")
    }
    main = main_rows(plans)
    headers = [
        "model",
        "target",
        "mesh d x f x t",
        "compile s",
        "params+Adam GiB",
        "train total GiB",
        "largest total GiB (program)",
        "usable GiB",
        "fits",
        "train all-reduce",
        "compiled/analytic FLOPs",
        "bound ms (by)",
        "tokens/s bound",
        "MFU bound",
    ]
    print(_common.table(headers, main))
    long = long_rows(plans)
    print()
    print(
        _common.table(
            [
                "L",
                "target",
                "attention",
                "compile s",
                "train temp GiB",
                "total GiB",
                "fits",
                "bound ms (by)",
                "kernels",
            ],
            long,
        )
    )
    searches = search_rows(out)
    if searches:
        print()
        headers = ["search", "best overrides", "bound ms", "tokens/s bound", "MFU bound"]
        print(_common.table(headers, searches))
    return {"plans": plans, "main": main, "long": long, "search": searches}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="/tmp/tx_jax_plans")
    parser.add_argument("--gpu_python", help="an interpreter with the plan-gpu extra")
    parser.add_argument("--only", help="comma-separated plan names")
    parser.add_argument("--search", action="store_true", help="--search each pair instead")
    parser.add_argument("--tabulate", help="only tabulate the plans in this directory")
    args = parser.parse_args()
    if args.tabulate:
        result = tabulate(pathlib.Path(args.tabulate))
    else:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        only = set(args.only.split(",")) if args.only else None
        for name, config, target, extra in PLANS:
            if only and name not in only:
                continue
            python = args.gpu_python if target.startswith("gpu") else sys.executable
            if python is None:
                print(f"{name}: skipped (no --gpu_python)")
                continue
            if not args.search:
                run(name, config, target, extra, out, python, False)
            elif not name.startswith("long"):
                run(name, config, target, extra, out, python, True)
        result = tabulate(out)
    _common.write_json("plans", {k: v for k, v in result.items() if k != "plans"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
