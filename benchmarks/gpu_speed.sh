#!/usr/bin/env bash
# One call on a lent GPU host: the speed figures a CPU cannot give, in one go (device time is
# scarce; benchmarks/gpu_checks.sh holds the correctness checks and Table 3's GPU points).
#
#   bash benchmarks/gpu_speed.sh OUT_DIR
#
# 1. benchmarks/gpu_step.py: the chip's ceilings (matmul, copy), then the paper's base and big
#    train steps in bf16, each of issue 38's levers against the default in one process: the
#    default ('onepass' loss, 'hash' dropout bits, 'cudnn' attention without the mask's bias
#    gradient); jax.nn's cuDNN call (cudnn_jax), the four-pass loss (dense) and Threefry masks
#    (bernoulli) they replaced; the Pallas levers, opt-in until measured: the post-LN tail in one
#    kernel (residual_norm=pallas), the loss with the logits never written (loss_impl=fused),
#    the FFN's bias and ReLU inside matmuls (ffn_impl=pallas), and the three together; big as
#    it is and with the three. ms/step, tokens/s, MFU and the losses, beside the plan's roofline
#    bound of the same compiled program -> OUT_DIR/gpu_step.json. Alone on the host while it
#    times. CASES=... replaces the list (float32 and 'xla' attention were measured before:
#    base:float32, base:bfloat16:xla).
# 2. Meanwhile `python -m tx_jax.plan --target=gpu:<chip>-1` for base and big compiles on the
#    host's CPU as a CPU-only host would -> OUT_DIR/plan_{base,big}.json; with ATTENTION=1,
#    benchmarks/attention.py in bfloat16 (xla, chunked, cudnn), L 1024-8192 (measured on two
#    GPUs already) -> OUT_DIR/attention_gpu.json.
# 3. tests/test_gpu.py (cuDNN attention against float64, the bf16 step through cuDNN, the
#    Triton-compiled Pallas kernels of the three levers against their references).
# Expects tx_jax importable (PYTHONPATH=.) with its dependencies (gpu_checks.sh lists what an
# image with jax/flax/optax/orbax but not the data stack needs).
set -u
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
chip=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import gpu_step, jax
print(gpu_step.chip_of(jax.devices()[0])[0])')

JAX_PLATFORMS=cuda,cpu timeout ${STEP_TIMEOUT:-360} python3 benchmarks/gpu_step.py \
  --cases "${CASES:-base:bfloat16,base:bfloat16/model.attention_impl=cudnn_jax,base:bfloat16/model.loss_impl=dense,base:bfloat16/model.dropout_bits=bernoulli,base:bfloat16/model.residual_norm=pallas,base:bfloat16/model.loss_impl=fused,base:bfloat16/model.ffn_impl=pallas,base:bfloat16/model.ffn_impl=pallas/model.loss_impl=fused/model.residual_norm=pallas,big:bfloat16,big:bfloat16/model.ffn_impl=pallas/model.loss_impl=fused/model.residual_norm=pallas}" \
  --out "$out/gpu_step.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
echo "gpu_step exit ${PIPESTATUS[0]}"

for v in base big; do
  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 timeout 240 python3 -m tx_jax.plan \
    --config=configs/wmt14_ende.py:variant=$v --target=gpu:$chip-1 --programs=train \
    --no_cache --json="$out/plan_$v.json" > "$out/plan_$v.txt" 2>&1
  echo "plan $v exit $?"
done &
plans=$!
if [ "${ATTENTION:-0}" = 1 ]; then
  JAX_PLATFORMS=cuda,cpu timeout 150 python3 benchmarks/attention.py --dtype bfloat16 \
    --lengths 1024,2048,4096,8192 --reps 20 --name attention_gpu 2>&1 | grep -v "^W0000\|^I0000"
  cp benchmarks/results/attention_gpu.json "$out/" 2>/dev/null
fi
JAX_PLATFORMS=cuda,cpu timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  2>&1 | tail -4
wait $plans
grep -h "BOUND" "$out"/plan_*.txt
