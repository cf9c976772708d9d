#!/usr/bin/env bash
# The one entry point on a GPU host: correctness first, then the A/B timing of the GPU default
# against the other values a GPU run may name, in one call (device time is scarce). A kernel
# enters the package, or becomes a GPU default, only after this has shown it correct and faster
# there (docs/design.md, "Implementation choices: one rule"; benchmarks/HISTORY.md, "Removed
# kernels", names the commit each removed candidate can be revived from).
#
#   bash benchmarks/gpu_speed.sh OUT_DIR
#   GPU_SPEED_DRY=1 bash benchmarks/gpu_speed.sh /tmp/out     # CPU smoke check: debug model, 1 case
#
# 0. Versions -> OUT_DIR/versions.txt
# 1. tests/test_gpu.py and the cuDNN lowering tests (cuDNN attention against float64 and XLA,
#    'auto' resolved for the GPU, the bf16 step through cuDNN) -> OUT_DIR/gpu_tests.log.
# 2. benchmarks/gpu_step.py, one process: the chip's ceilings, then the paper's base (and big) in
#    bf16, the default first, then each other value alone on top of it (XLA's attention, the
#    packed dropout bits, the blocked loss) -> OUT_DIR/gpu_step.json (ms/step, tokens/s, MFU,
#    losses, the plan's bound of the same program). CASES=... replaces the list.
# 3. Meanwhile `python -m tx_jax plan --target=gpu:<chip>-1` for base and big on the host's CPU,
#    under the XLA_FLAGS the runs get (none by default) -> OUT_DIR/plan_{base,big}.json.
# Options, each after the above (a call cut off by its limit keeps what ran first):
#   PROFILE=1        benchmarks/gpu_profile.py: a jax.profiler trace of 3 base steps, kernels by
#                    what they compute -> OUT_DIR/{profile.json, hlo.txt.gz, trace.json.gz}
#   ATTENTION=1      benchmarks/attention.py in bf16 (xla, chunked, cudnn), L 1,024-8,192
#   DETERMINISTIC=1  under --xla_gpu_deterministic_ops=true: benchmarks/gpu_determinism.py (the
#                    debug model with XLA and cuDNN attention, with and without dropout, run
#                    twice: which case fails, which repeats bit for bit -> OUT_DIR/determinism.json),
#                    then base with XLA attention (the mode's cost)
#   FLAGS="--xla_gpu_... ..."  base once per XLA flag, one process each (read at JAX's start),
#                    e.g. --xla_gpu_enable_cudnn_layer_norm=true; a flag that pays is set in the
#                    runs, and then in their plans too (the plans above have none)
#   BATCH=1          twice the per-GPU batch (data.tokens_per_batch=53248)
# The Python scripts it runs (gpu_step.py, gpu_profile.py, gpu_determinism.py, attention.py) are its parts: each also runs alone (its docstring), but on a GPU host this
# script is the one command, and the next GPU figures of BENCHMARKS.md come from it.
# Expects tx_jax importable (PYTHONPATH=.) with its dependencies. An image with jax, flax, optax
# and orbax but not tx_jax's data stack needed (2026-11-26, as wheels for its Python 3.12):
# array-record dm-tree docstring-parser googleapis-common-protos grain immutabledict
# importlib-resources ml-collections portpicker promise simple-parsing tensorboardx
# tensorflow-datasets tensorflow-metadata termcolor toml tzdata.
set -u
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/tx_jax_jcc}
if [ "${GPU_SPEED_DRY:-0}" = 1 ]; then  # the script's path on a CPU: tiny and quick
  export JAX_PLATFORMS=cpu
  B=debug G=debug PEAK=${PEAK:-256} STEPS=${STEPS:-2} PLANS=${PLANS:-0}
  CASES=${CASES:-debug:float32,debug:float32/model.dropout_bits=packed}
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
  B=${BASE:-base} G=${BIG:-big}
fi
steps=${STEPS:-10}
quiet() { grep -v "^WARNING\|^I0000\|^W0000\|^E0000\|^  File\|^    "; }

{
  command -v nvidia-smi > /dev/null && nvidia-smi --format=csv,noheader \
    --query-gpu=name,memory.total,driver_version,clocks.max.sm,temperature.gpu | head -1
  python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())' 2>&1 | quiet
  python3 -c 'from jax._src.lib import cuda_versions as c; print("cudnn", c.cudnn_get_version())' 2>&1 | quiet | tail -1
} | tee "$out/versions.txt"

timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  "tests/test_lowering.py::test_cudnn_attention_lowers_for_cuda" \
  "tests/test_lowering.py::test_cudnn_bias_has_every_head" \
  2>&1 | tee "$out/gpu_tests.log" | tail -6

if [ "${PLANS:-1}" = 1 ]; then
  chip=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import gpu_step, jax
print(gpu_step.chip_of(jax.devices()[0])[0])')
  for v in $B $G; do
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 timeout 240 python3 -m tx_jax plan \
      --config=configs/wmt14_ende.py:variant=$v --target=gpu:$chip-1 --programs=train \
      --no_cache --json="$out/plan_$v.json" > "$out/plan_$v.txt" 2>&1
    echo "plan $v exit $?"
  done &
  plans=$!
fi

step() {  # NAME TIMEOUT CASES: one gpu_step.py process
  timeout "$2" python3 benchmarks/gpu_step.py --cases "$3" --steps "$steps" \
    --peak-size "${PEAK:-8192}" --peak-reps 3 --out "$out/$1.json" 2>&1 | quiet
}
m=$B:bfloat16/model
step gpu_step "${STEP_TIMEOUT:-420}" "${CASES:-$B:bfloat16,$m.attention_impl=xla,$m.dropout_bits=packed,$m.loss_impl=blocked,$G:bfloat16}"

if [ "${PROFILE:-0}" = 1 ]; then
  timeout 150 python3 benchmarks/gpu_profile.py --case "$B:bfloat16" --steps 3 --out-dir "$out" 2>&1 | quiet
fi
if [ "${ATTENTION:-0}" = 1 ]; then
  timeout 150 python3 benchmarks/attention.py --dtype bfloat16 --lengths 1024,2048,4096,8192 \
    --reps 20 --name attention_gpu 2>&1 | quiet
  cp benchmarks/results/attention_gpu.json "$out/" 2>/dev/null
fi
if [ "${DETERMINISTIC:-0}" = 1 ]; then
  d="debug:bfloat16"
  XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 120 python3 benchmarks/gpu_determinism.py \
    --cases "$d:xla,$d:xla/model.dropout_rate=0.1,$d:cudnn,$d:cudnn/model.dropout_rate=0.1" \
    --out "$out/determinism.json" 2>&1 | quiet
  XLA_FLAGS=--xla_gpu_deterministic_ops=true step deterministic 130 "$B:bfloat16:xla"
fi
for flag in ${FLAGS:-}; do
  name=$(echo "$flag" | sed 's/^--xla_gpu_//; s/=.*//')
  XLA_FLAGS=$flag step "flag_$name" 130 "$B:bfloat16"
done
if [ "${BATCH:-0}" = 1 ]; then
  step batch 130 "$B:bfloat16/data.tokens_per_batch=53248"
fi
if [ "${PLANS:-1}" = 1 ]; then
  wait "$plans"
  grep -h "BOUND" "$out"/plan_*.txt
fi
echo done
