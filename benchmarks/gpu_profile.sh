#!/usr/bin/env bash
# One call on a lent GPU host: where the paper's base step spends its time, and what issue 38's
# levers, the per-GPU batch, XLA's GPU flags and deterministic mode do to it, on one machine
# (device time is scarce: ~7 minutes on an H100). Ordered so that a call cut off by its limit
# keeps the most telling results:
# 0. benchmarks/cudnn_bias.py: does cuDNN take the mask as [B, 1, L, S] (an eighth of the bias
#    reads), with the same outputs and gradients as [B, H, L, S]? (~30 s)
# 1. benchmarks/gpu_profile.py on base bf16 (the default): per-kernel times from a jax.profiler
#    trace of 3 steps, sorted into matmuls, attention, dropout bits, reductions, elementwise.
# 2. benchmarks/gpu_step.py, one process: base bf16 as it is by default, with the loss as it was
#    before 'onepass' became the GPU's default (model.loss_impl=dense), dropout's bits as they
#    were before 'hash' became the GPU's default (model.dropout_bits=bernoulli: Threefry bits
#    and a stored mask), cuDNN's backward asked for the mask's bias gradient as jax.nn
#    asks it (model.attention_impl=cudnn_jax; 'cudnn' no longer does), the mask broadcast over
#    heads by cuDNN (model.attention_impl=cudnn_broadcast, where 0. says cuDNN takes it), the
#    post-LN tail as one Pallas kernel each way (model.residual_norm=pallas), the loss with
#    the logits never written (model.loss_impl=fused), the FFN's bias and ReLU inside Pallas
#    matmuls (model.ffn_impl=pallas) and the three together, twice
#    the per-GPU batch, and XLA attention (the reference for 3). Packed and rbg dropout bits and the blocked loss,
#    timed on two H100s without gain (BENCHMARKS.md), are left out for device time.
# 3. base bf16 with XLA attention under --xla_gpu_deterministic_ops=true (train.deterministic).
# 4. base bf16 under each XLA flag in FLAGS, one process each (a flag is read when JAX starts);
#    first the dot merger off: XLA merges the q/k/v projections into one product and copies
#    each slice out for cuDNN, 144 copy kernels a step (BENCHMARKS.md, "XLA's dot merger").
# A process needs ~70 s on an H100 before its first case is timed (start, ceilings, compile).
#
#   bash benchmarks/gpu_profile.sh OUT_DIR
#   BASE=debug PEAK=256 JAX_PLATFORMS=cpu bash benchmarks/gpu_profile.sh /tmp/out   # CPU dry run
#
# Results: OUT_DIR/{cudnn_bias.json, profile.json, hlo.txt.gz, trace.json.gz, levers.json,
# deterministic.json, flag_*.json}.
set -u
out=${1:?OUT_DIR}
mkdir -p "$out"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/tx_jax_jcc}  # base compiled once for 1 and 2
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
B=${BASE:-base}
tokens=${TOKENS:-53248}  # twice the paper's 26,624 per step (debug: 2048)
steps=${STEPS:-10}
quiet() { grep -v "^WARNING\|^I0000\|^W0000\|^E0000\|^  File\|^    "; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader 2>&1
python3 -c 'import jax, jaxlib, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())' 2>&1 | quiet

timeout 90 python3 benchmarks/cudnn_bias.py --out "$out/cudnn_bias.json" 2>&1 | quiet
timeout 120 python3 benchmarks/gpu_profile.py --case "$B:bfloat16" --steps 3 --out-dir "$out" 2>&1 | quiet
step() {  # NAME CASES: one gpu_step.py process
  timeout "${2:-90}" python3 benchmarks/gpu_step.py --cases "$3" --steps "$steps" \
    --peak-size "${PEAK:-8192}" --peak-reps 3 --out "$out/$1.json" 2>&1 | quiet
}
step levers 230 "$B:bfloat16,$B:bfloat16/model.attention_impl=cudnn_jax,$B:bfloat16/model.dropout_bits=bernoulli,$B:bfloat16/model.attention_impl=cudnn_broadcast,$B:bfloat16/model.loss_impl=dense,$B:bfloat16/model.residual_norm=pallas,$B:bfloat16/model.loss_impl=fused,$B:bfloat16/model.ffn_impl=pallas,$B:bfloat16/model.ffn_impl=pallas/model.loss_impl=fused/model.residual_norm=pallas,$B:bfloat16/data.tokens_per_batch=$tokens,$B:bfloat16:xla"
XLA_FLAGS=--xla_gpu_deterministic_ops=true step deterministic 130 "$B:bfloat16:xla"
for flag in ${FLAGS:---xla_gpu_dot_merger_threshold_mb=0 --xla_gpu_enable_cudnn_layer_norm=true --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer=}; do
  name=$(echo "$flag" | sed 's/^--xla_gpu_//; s/=.*//')
  XLA_FLAGS=$flag step "flag_$name" 130 "$B:bfloat16"
done
echo done
