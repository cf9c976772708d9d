"""Train-step speed: tx_jax against torch.nn.Transformer, tokens/s and MFU, same run.

    python benchmarks/train_step.py                     # small + base + 8 forced devices
    python benchmarks/train_step.py --configs small --reps 3 --steps 2 --no-devices  # quick

Both sides train the same model with the same shapes: shared source/target embedding, tied
output projection (logits = x E^T), sinusoidal positions scaled by sqrt(d_model), post-LN
layers, label-smoothed (0.1) cross-entropy, Adam (0.9, 0.98, 1e-9) with the paper's rsqrt
schedule and global-norm clipping at 1.0, dropout at the same sites (embeddings, residuals,
attention weights and FFN hidden units, the sites torch.nn.Transformer has). tx_jax runs its
real `train_step` (jit, state donated) and `optim.make_optimizer`; PyTorch runs an eager
loop (zero_grad, forward, backward, clip, step). Repetitions are interleaved (jax rep, torch
rep, jax rep, ...) and each rep times `--steps` steps; the table gives medians over reps.

Threads: the process is pinned to `--threads` CPUs (XLA sizes its CPU thread pool from the
affinity mask) and torch.set_num_threads gets the same number.

tokens/s counts target tokens (B x L, what the training log reports); source tokens are as
many again. MFU = tx_jax.analysis.flops train FLOPs per step / step time / peak, where the
peak is the best median of large float32 matmuls (2048^2 and 4096^2, JAX and torch) measured here.

`--devices` also runs the small config on 8 forced CPU devices (a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8): one device (jit), 'pmap' and 'mesh'
(data=8) through tx_jax.training.parallel, tokens/s each. These share the same 2 cores, so
they measure the strategies' overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPES = {
    # name: model overrides, batch rows, source length, target length, vocabulary
    "small": (dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                   num_decoder_layers=3), 64, 32, 32, 8192),
    "base": (dict(), 32, 32, 32, 8192),  # tx_jax.VARIANTS['base']; batch 32 on CPU
}  # fmt: skip


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default="small,base")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions per framework")
    p.add_argument("--steps", type=int, default=3, help="train steps timed per repetition")
    p.add_argument("--threads", type=int, default=0, help="0: every CPU this process may use")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--base-batch", type=int, default=SHAPES["base"][1])
    p.add_argument("--no-torch", action="store_true", help="tx_jax only (profiling)")
    p.add_argument("--devices", dest="devices", action="store_true", default=True)
    p.add_argument("--no-devices", dest="devices", action="store_false")
    p.add_argument("--no-donate", action="store_true", help="do not donate the state")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="tx_jax ModelConfig override, e.g. --set remat=full (repeatable)",
    )
    p.add_argument(
        "--library",
        default="",
        help="import tx_jax from this directory (e.g. `git archive` of an older commit) to "
        "measure a change before/after; the benchmark code stays this one",
    )
    p.add_argument(
        "--omp-wait-policy",
        default="",
        choices=["", "ACTIVE", "PASSIVE"],
        help="OMP_WAIT_POLICY for PyTorch's OpenMP threads (default: libgomp's own, which "
        "spin-waits; PASSIVE is much faster when other processes share the cores)",
    )
    p.add_argument("--name", default="train_step", help="results/NAME.json")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # multi-device subprocess
    return p.parse_args(argv)


# ------------------------------------------------------------------------------- tx_jax


def _model_config(name: str, args, vocab: int):
    import jax

    from tx_jax import config as config_utils
    from tx_jax.model.config import IMPLEMENTATION_FIELDS, VARIANTS, ModelConfig

    overrides, *_ = SHAPES[name]
    base = VARIANTS["base"] if name == "base" else {}
    extra = {}
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in defaults:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY a ModelConfig field")
        extra[key] = config_utils.convert_text(value, defaults[key])
    # as a run resolves them on this platform, unless --set names one
    auto = dict.fromkeys(IMPLEMENTATION_FIELDS, "auto")
    return ModelConfig(
        **{
            **base,
            **overrides,
            **auto,
            "vocab_size": vocab,
            "dropout_rate": args.dropout,
            "attention_dropout_rate": args.dropout,
            "ffn_dropout_rate": args.dropout,
            **extra,
        }
    ).resolved(jax.default_backend(), longest=max(SHAPES[name][2:4]))


def _train_config():
    sys.path.insert(0, os.path.join(_common.ROOT, "configs"))
    import default

    return default.get_config().train  # Adam 0.9/0.98/1e-9, rsqrt, clip 1.0, smoothing 0.1


def _batch(B: int, S: int, L: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.integers(3, vocab, (B, S)).astype(np.int32),
        "targets": rng.integers(3, vocab, (B, L)).astype(np.int32),
    }


def _jax_step(cfg, train_cfg, donate: bool):
    """(jitted step, fresh-state fn) for tx_jax's real train_step and optimizer."""
    import flax.linen as nn
    import jax

    step, init_fn = _step_and_init(cfg, train_cfg)
    init = jax.jit(lambda: nn.meta.unbox(init_fn()))
    return jax.jit(step, donate_argnums=(0,) if donate else ()), init


def _step_and_init(cfg, train_cfg):
    """(train_step bound to the model and optimizer, init_state bound likewise)."""
    from tx_jax.model.transformer import EncoderDecoder
    from tx_jax.training import optim
    from tx_jax.training.state import init_state
    from tx_jax.training.step import train_step

    model = EncoderDecoder(cfg)
    tx, schedule = optim.make_optimizer(train_cfg, cfg.d_model)
    step = functools.partial(
        train_step,
        model=model,
        tx=tx,
        schedule=schedule,
        label_smoothing=train_cfg.label_smoothing,
    )
    return step, functools.partial(init_state, model, tx, 0)


class JaxRunner:
    def __init__(self, cfg, train_cfg, batch, donate=True):
        import jax

        self.jax = jax
        self.step, init = _jax_step(cfg, train_cfg, donate)
        self.batch = jax.device_put(batch)
        self.state = init()
        t0 = time.perf_counter()
        self.compiled = self.step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        m = self.compiled.memory_analysis()
        self.memory = {
            k: int(getattr(m, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp")
        }
        # live at once: arguments + outputs not written in place (donation) + temporaries
        self.memory["peak_estimate"] = (
            self.memory["argument"]
            + self.memory["output"]
            - self.memory["alias"]
            + self.memory["temp"]
        )
        self.run(2)  # first executions (allocations)

    def run(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            self.state, metrics = self.compiled(self.state, self.batch)
        loss = float(metrics["loss"])  # waits for the last step
        assert math.isfinite(loss), loss
        return (time.perf_counter() - start) / n


# -------------------------------------------------------------------------------- torch


def _import_torch():
    try:
        import torch
    except ImportError:
        sys.exit(
            "benchmarks/train_step.py compares against PyTorch, which is not installed.\n"
            "Install the 'bench' extra: pip install -e '.[bench]', or pass --no-torch."
        )
    return torch


def _torch_model(torch, cfg, dropout: float):
    nn = torch.nn

    class Seq2Seq(nn.Module):
        """Shared embedding, sinusoidal positions, nn.Transformer, tied output projection."""

        def __init__(self):
            super().__init__()
            M = cfg.d_model
            self.scale = math.sqrt(M)
            self.embed = nn.Embedding(cfg.vocab_size, M)
            nn.init.normal_(self.embed.weight, std=M**-0.5)
            self.drop = nn.Dropout(dropout)
            self.transformer = nn.Transformer(
                d_model=M,
                nhead=cfg.num_heads,
                num_encoder_layers=cfg.num_encoder_layers,
                num_decoder_layers=cfg.num_decoder_layers,
                dim_feedforward=cfg.d_ff,
                dropout=dropout,
                batch_first=True,
                norm_first=False,
                layer_norm_eps=cfg.norm_epsilon,
            )
            pos = torch.arange(512, dtype=torch.float32)[:, None]
            inv = 10_000.0 ** (-torch.arange(0, M, 2, dtype=torch.float32) / M)
            pe = torch.stack([torch.sin(pos * inv), torch.cos(pos * inv)], -1).reshape(512, M)
            self.register_buffer("pe", pe)

        def embed_tokens(self, tokens):
            return self.drop(self.embed(tokens) * self.scale + self.pe[: tokens.shape[1]])

        def forward(self, src, tgt_in):
            L = tgt_in.shape[1]
            causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
            src_pad, tgt_pad = src == 0, tgt_in == 0
            y = self.transformer(
                self.embed_tokens(src),
                self.embed_tokens(tgt_in),
                tgt_mask=causal,
                src_key_padding_mask=src_pad,
                tgt_key_padding_mask=tgt_pad,
                memory_key_padding_mask=src_pad,
                tgt_is_causal=True,
            )
            return y @ self.embed.weight.T  # tied output projection (section 3.4)

    return Seq2Seq()


class TorchRunner:
    def __init__(self, torch, cfg, train_cfg, batch, dropout):
        self.torch = torch
        torch.manual_seed(0)
        self.model = _torch_model(torch, cfg, dropout)
        self.model.train()
        self.opt = torch.optim.Adam(
            self.model.parameters(),
            lr=1.0,
            betas=(train_cfg.beta1, train_cfg.beta2),
            eps=train_cfg.eps,
        )
        d, w, s = cfg.d_model, train_cfg.warmup_steps, train_cfg.lr_scale
        rsqrt = lambda c: s * d**-0.5 * min((c + 1) ** -0.5, (c + 1) * w**-1.5)  # noqa: E731
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, rsqrt)
        self.clip = train_cfg.clip_grad_norm
        self.smoothing = train_cfg.label_smoothing
        self.src = torch.from_numpy(batch["inputs"]).long()
        self.tgt = torch.from_numpy(batch["targets"]).long()
        bos = torch.full_like(self.tgt[:, :1], cfg.bos_id)
        self.tgt_in = torch.cat([bos, self.tgt[:, :-1]], 1)
        self.run(1)  # warm-up

    def _step(self):
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.src, self.tgt_in)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            self.tgt.reshape(-1),
            ignore_index=0,
            label_smoothing=self.smoothing,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        return loss

    def run(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = self._step()
        assert math.isfinite(float(loss))
        return (time.perf_counter() - start) / n


# --------------------------------------------------------------------------- peak FLOP/s


def _median_time(fn, sync, reps: int) -> float:
    sync(fn())  # warm-up (compiles)
    return _common.median([_common.time_once(fn, sync) for _ in range(reps)])


def measure_peak(torch, sizes=(2048, 4096), reps=5) -> dict[str, float]:
    """Median FLOP/s of float32 n x n matmuls, JAX and torch; 'peak' is the best."""
    import jax
    import jax.numpy as jnp

    out = {}
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        mm = jax.jit(lambda x, y: x @ y)
        out[f"jax_matmul_{n}"] = (
            2 * n**3 / _median_time(functools.partial(mm, a, a), jax.block_until_ready, reps)
        )
        if torch is not None:
            ta = torch.randn(n, n)
            out[f"torch_matmul_{n}"] = (
                2
                * n**3
                / _median_time(functools.partial(torch.matmul, ta, ta), lambda x: None, reps)
            )
    out["peak"] = max(out.values())
    return out


# ------------------------------------------------------------------------ one comparison


def compare(name: str, args, torch, peak: float) -> dict:
    from tx_jax.analysis import flops

    overrides, B, S, L, vocab = SHAPES[name]
    if name == "base":
        B = args.base_batch
    cfg = _model_config(name, args, vocab)
    train_cfg = _train_config()
    batch = _batch(B, S, L, vocab)
    step_flops = flops.encoder_decoder_flops(cfg, B, S, L).train
    jr = JaxRunner(cfg, train_cfg, batch, donate=not args.no_donate)
    tr = None if torch is None else TorchRunner(torch, cfg, train_cfg, batch, args.dropout)
    times = {"jax": [], "torch": []}
    for rep in range(args.reps):
        times["jax"].append(jr.run(args.steps))
        if tr is not None:
            times["torch"].append(tr.run(args.steps))
        print(
            f"  {name} rep {rep}: jax {times['jax'][-1]:.3f} s/step"
            + (f", torch {times['torch'][-1]:.3f} s/step" if tr else ""),
            flush=True,
        )
    result = {
        "config": name,
        "batch": B,
        "source_len": S,
        "target_len": L,
        "vocab": vocab,
        "model": {
            k: getattr(cfg, k)
            for k in (
                "d_model",
                "num_heads",
                "d_ff",
                "num_encoder_layers",
                "num_decoder_layers",
                "dropout_rate",
                "attention_dropout_rate",
                "ffn_dropout_rate",
                "attention_impl",
                "remat",
            )
        },
        "train_flops_per_step": step_flops,
        "jax_compile_s": jr.compile_s,
        "jax_memory_bytes": jr.memory,
        "step_times": times,
    }
    for fw in ("jax", "torch"):
        if times[fw]:
            t = _common.median(times[fw])
            result[fw] = {
                "step_s": t,
                "tokens_per_s": B * L / t,
                "mfu": step_flops / t / peak,
                "achieved_flops": step_flops / t,
            }
    if times["torch"]:
        result["speedup"] = result["torch"]["step_s"] / result["jax"]["step_s"]
        # each jax rep against the torch rep right after it: robust to slow load drifts
        pairs = [t / j for j, t in zip(times["jax"], times["torch"])]
        result["speedup_paired_median"] = _common.median(pairs)
        result["speedup_paired_range"] = [min(pairs), max(pairs)]
    return result


# -------------------------------------------------------------------------- multi-device


def device_worker(args) -> None:
    """Runs in the 8-device subprocess: 1 device, pmap, mesh tokens/s; prints one JSON line."""
    import jax
    import ml_collections

    from tx_jax.training import parallel

    _, B, S, L, vocab = SHAPES["small"]
    cfg = _model_config("small", args, vocab)
    train_cfg = _train_config()
    batch = _batch(B, S, L, vocab)
    step_fn, init_fn = _step_and_init(cfg, train_cfg)
    runners = {"1 device (jit)": JaxRunner(cfg, train_cfg, batch)}
    for kind in ("pmap", "mesh"):
        par = ml_collections.ConfigDict(
            dict(
                strategy=kind,
                mesh=dict(data=-1, fsdp=1, tensor=1),
                rules=[list(r) for r in parallel.DEFAULT_RULES],
            )
        )
        strategy = parallel.make_strategy(par)
        shardings = strategy.step_shardings(init_fn)
        compiled = strategy.compile_step(step_fn, donate=True, state_shardings=shardings)
        runners[f"{kind} (8 devices)"] = _StrategyRunner(strategy, compiled, init_fn, batch)
    times = {k: [] for k in runners}
    for _ in range(args.reps):
        for k, r in runners.items():
            times[k].append(r.run(args.steps))
    rows = {
        k: {"step_s": _common.median(v), "tokens_per_s": B * L / _common.median(v), "times": v}
        for k, v in times.items()
    }
    print("RESULT " + json.dumps({"devices": jax.device_count(), "batch": B, "rows": rows}))


class _StrategyRunner:
    def __init__(self, strategy, compiled, init_fn, batch):
        self.strategy, self.compiled = strategy, compiled
        self.state = strategy.init_state(init_fn)
        self.batch = strategy.place_batch(batch)
        self.run(1)

    def run(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            self.state, metrics = self.compiled(self.state, self.batch)
        loss = self.strategy.fetch_metrics(metrics)["loss"]
        assert math.isfinite(loss)
        return (time.perf_counter() - start) / n


def run_devices(args) -> dict:
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "devices",
        "--reps",
        str(args.reps),
        "--steps",
        str(args.steps),
        "--dropout",
        str(args.dropout),
        "--threads",
        str(args.threads),
    ] + [f"--set={s}" for s in args.set]
    if args.library:
        cmd += ["--library", args.library]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"multi-device subprocess failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


# --------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = _parse_args(argv)
    threads = _common.pin_threads(args.threads)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    if args.library:
        sys.path.insert(0, os.path.abspath(args.library))
    import tx_jax

    print(f"tx_jax from {os.path.dirname(tx_jax.__file__)}", flush=True)
    # the package directory as the results record it: tx_jax, or LIBRARY/tx_jax for --library
    tx_jax_root = os.path.dirname(os.path.dirname(os.path.abspath(tx_jax.__file__)))
    tx_jax_dir = os.path.normpath(os.path.join(_common.portable_path(tx_jax_root), "tx_jax"))
    if args.worker == "devices":
        return device_worker(args)
    torch = None if args.no_torch else _import_torch()
    if torch is not None:
        torch.set_num_threads(threads)
    import jax

    print(f"threads {threads}; load average {_common.load_average():.2f}", flush=True)
    peak = measure_peak(torch)
    print(
        "peak float32 matmul: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peak.items()),
        flush=True,
    )
    results = []
    for name in args.configs.split(","):
        results.append(compare(name, args, torch, peak["peak"]))
    headers = [
        "config",
        "batch x (S+L)",
        "framework",
        "step (ms)",
        "target tok/s",
        "MFU",
        "GFLOP/step",
        "tx_jax / torch",
        "XLA temp MiB",
    ]
    rows = []
    for r in results:
        for fw in ("jax", "torch"):
            if fw in r:
                rows.append(
                    [
                        r["config"],
                        f"{r['batch']} x ({r['source_len']}+{r['target_len']})",
                        "tx_jax" if fw == "jax" else f"torch {torch.__version__}",
                        r[fw]["step_s"] * 1e3,
                        r[fw]["tokens_per_s"],
                        f"{r[fw]['mfu']:.1%}",
                        r["train_flops_per_step"] / 1e9,
                        f"{r['speedup']:.2f}x" if fw == "jax" and "speedup" in r else "",
                        r["jax_memory_bytes"]["temp"] / 2**20 if fw == "jax" else "",
                    ]
                )
    print()
    print(f"peak (best float32 matmul median): {peak['peak'] / 1e9:.1f} GFLOP/s, {threads} threads")
    print(_common.table(headers, rows))
    for r in results:
        if "speedup_paired_median" in r:
            lo, hi = r["speedup_paired_range"]
            print(
                f"{r['config']}: tx_jax / torch per interleaved pair of reps: median "
                f"{r['speedup_paired_median']:.2f}x, range {lo:.2f}x-{hi:.2f}x "
                f"({len(r['step_times']['jax'])} pairs)"
            )
    devices = None
    if args.devices:
        devices = run_devices(args)
        print()
        print(
            _common.table(
                ["small config, 8 forced CPU devices", "step (ms)", "target tok/s"],
                [[k, v["step_s"] * 1e3, v["tokens_per_s"]] for k, v in devices["rows"].items()],
            )
        )
    path = _common.write_json(
        args.name,
        {
            "threads": threads,
            "jax_backend": jax.default_backend(),
            "peak": peak,
            "tx_jax": tx_jax_dir,
            "omp_wait_policy": args.omp_wait_policy,
            "donate": not args.no_donate,
            "overrides": args.set,
            "reps": args.reps,
            "steps_per_rep": args.steps,
            "results": results,
            "devices": devices,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
