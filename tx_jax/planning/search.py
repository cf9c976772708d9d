"""`--search` (docs/planning.md): mesh factorisations of the device count, then remat and
smaller per-device batches for the meshes that do not fit, each train step compiled for the
target and the fitting ones ranked by the roofline's tokens/s. Plans are cached on disk by
what determines them (resolved config, target, programs, compiler versions, tx_jax's source).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import hashlib
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import ml_collections

SEARCH_PROGRAMS = ("train",)
REMATS = ("dots", "full")
ACCUM_FACTORS = (2, 4)
_SOURCE = pathlib.Path(__file__).resolve().parent.parent


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(os.environ.get("TX_JAX_PLAN_CACHE", os.path.join(base, "tx_jax", "plans")))


def _versions() -> dict[str, str]:
    out = {}
    for name in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(_SOURCE.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(config: ml_collections.ConfigDict, target: str, programs: tuple[str, ...]) -> str:
    what = {
        "config": config.to_dict(),
        "target": target,
        "programs": list(programs),
        "versions": _versions(),
        "source": _source_hash(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def cached(cache_dir: pathlib.Path | None, key: str) -> dict | None:
    if cache_dir is None:
        return None
    path = cache_dir / f"{key}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def store(cache_dir: pathlib.Path | None, key: str, plan: dict) -> None:
    if cache_dir is None:
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"{key}.json.{os.getpid()}"
    tmp.write_text(json.dumps(plan, default=float))
    tmp.replace(cache_dir / f"{key}.json")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(num_devices: int, num_heads: int, num_kv_heads: int | None) -> list[dict[str, int]]:
    """Every (data, fsdp, tensor) with data x fsdp x tensor = num_devices and tensor dividing
    the heads (tensor parallelism splits heads; K/V heads too)."""
    heads = num_kv_heads or num_heads
    out = []
    for t in divisors(num_devices):
        if num_heads % t or heads % t:
            continue
        for f in divisors(num_devices // t):
            out.append({"data": num_devices // (t * f), "fsdp": f, "tensor": t})
    return out


def mesh_overrides(mesh: dict[str, int]) -> dict[str, str]:
    return {f"parallel.mesh.{k}": str(v) for k, v in mesh.items()}


def first_stage(config: ml_collections.ConfigDict, num_devices: int) -> list[dict[str, str]]:
    m = config.model
    meshes_ = meshes(num_devices, m.num_heads, m.get("num_kv_heads"))
    return [{"parallel.strategy": "mesh", **mesh_overrides(x)} for x in meshes_]


def second_stage(config: ml_collections.ConfigDict, misfits: list[dict[str, str]]):
    """remat and gradient accumulation for the meshes that did not fit."""
    accum = int(config.train.grad_accum_steps)
    out = []
    for base in misfits:
        out += [{**base, "model.remat": r} for r in REMATS if r != config.model.get("remat")]
        out += [{**base, "train.grad_accum_steps": str(accum * f)} for f in ACCUM_FACTORS]
        out.append({**base, "model.remat": "full", "train.grad_accum_steps": str(accum * 2)})
    return out


def plan_in_subprocess(
    config_spec: str, overrides: dict[str, str], target: str, cache_dir: pathlib.Path
) -> dict[str, Any]:
    """One candidate's plan (train step only) in a fresh process, through the cache; a
    candidate the config refuses comes back as {'error': ...}."""
    cmd = [sys.executable, "-m", "tx_jax", "plan", f"--config={config_spec}", f"--target={target}"]
    cmd += ["--programs=train", f"--cache_dir={cache_dir}", "--json=-", "--quiet"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 2):
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}", "overrides": overrides}
    plan = json.loads(proc.stdout)
    plan["overrides"] = overrides
    return plan


def cached_candidate(
    config: ml_collections.ConfigDict,
    overrides: dict[str, str],
    target: str,
    cache_dir: pathlib.Path | None,
) -> dict[str, Any] | None:
    """A candidate's cached plan, looked up here as its process would look it up (`config`
    with the candidate's overrides applied as text): a rerun starts no process. None where
    it is not cached or the config refuses the overrides (its process says why)."""
    from tx_jax.config import apply_overrides

    c = copy.deepcopy(config)
    try:
        apply_overrides(c, overrides, from_text=True)
    except (KeyError, ValueError):
        return None
    return cached(cache_dir, cache_key(c, target, SEARCH_PROGRAMS))


def run_search(
    config_spec: str,
    config: ml_collections.ConfigDict,
    base_overrides: dict[str, str],
    target: str,
    num_devices: int,
    *,
    workers: int,
    cache_dir: pathlib.Path,
    log=print,
) -> list[dict[str, Any]]:
    """Every candidate's plan; the fitting ones first, best bound first."""
    results: list[dict[str, Any]] = []

    def run(stage: list[dict[str, str]]) -> list[dict[str, Any]]:
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            # a cached candidate needs no process; `config` has base_overrides applied
            plans = [cached_candidate(config, c, target, cache_dir) for c in stage]
            futures = [
                None
                if plan is not None
                else pool.submit(
                    plan_in_subprocess, config_spec, base_overrides | c, target, cache_dir
                )
                for plan, c in zip(plans, stage)
            ]
            out = []
            for c, plan, f in zip(stage, plans, futures):
                if f is not None:
                    plan = f.result()
                else:
                    plan["overrides"] = base_overrides | c  # as its process records them
                plan["candidate"] = c
                log(describe(plan))
                out.append(plan)
            return out

    results += run(first_stage(config, num_devices))
    misfits = [p["candidate"] for p in results if "error" not in p and not p["fits"]]
    misfits.sort(
        key=lambda c: next(p["bytes_per_device"]["total"] for p in results if p["candidate"] is c)
    )
    if misfits:
        results += run(second_stage(config, misfits[:3]))
    return rank(results)


def rank(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    fits = [p for p in results if "error" not in p and p["fits"]]
    return sorted(fits, key=lambda p: -p["tokens_per_second_bound"])


def overrides_text(candidate: dict[str, str]) -> str:
    return " ".join(f"--config.{k}={v}" for k, v in candidate.items() if k != "parallel.strategy")


def describe(plan: dict[str, Any]) -> str:
    text = overrides_text(plan["candidate"])
    if "error" in plan:
        return f"  refused  {text}: {plan['error']}"
    b = plan["bytes_per_device"]["total"] / (1 << 30)
    if not plan["fits"]:
        return f"  no fit   {text}: {b:.2f} GiB per device"
    return (
        f"  fits     {text}: {b:.2f} GiB, step >= {plan['step_time_bound_s'] * 1e3:.1f} ms, "
        f"<= {plan['tokens_per_second_bound']:,.0f} tokens/s, MFU <= {100 * plan['mfu_bound']:.1f}%"
    )
