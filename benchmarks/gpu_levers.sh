#!/usr/bin/env bash
# One call on a lent GPU host: issue 38's levers measured one by one against the code before
# them, in one process each, on one machine (device time is scarce: ~8 minutes on an H100).
#
#   bash benchmarks/gpu_levers.sh OUT_DIR BEFORE_DIR
#
# BEFORE_DIR holds tx_jax, configs and benchmarks at the commit before the levers
# (`git archive COMMIT tx_jax configs benchmarks | tar -x -C BEFORE_DIR`).
# 1. tests/test_gpu.py: the cuDNN paths against float64/XLA before anything is timed.
# 2. benchmarks/gpu_step.py (ms/step of the paper's base and big, bf16, 104 x 256 packed
#    batch, dropout and label smoothing on) in this order, so that a call cut off by its limit
#    keeps the most telling rows: the levers one at a time on base (cuDNN's native masks,
#    dropout's generator, the blocked loss), base at BEFORE_DIR's commit, the fastest dropout
#    generator with the blocked loss on base and big. 2026-11-27's run: BENCHMARKS.md.
# 3. benchmarks/gpu_determinism.py under --xla_gpu_deterministic_ops=true: which part fails;
#    then big before the levers, last.
# Results: OUT_DIR/{gpu_tests.log, levers_*.json, before_*.json, determinism.json}.
set -u
out=${1:?OUT_DIR}
before=${2:?BEFORE_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
# A CPU dry run of this script: BASE=debug BIG=debug PEAK=256 JAX_PLATFORMS=cpu.
B=${BASE:-base} G=${BIG:-big}
quiet() { grep -v "^WARNING\|^I0000\|^W0000\|^E0000"; }
steps=${STEPS:-10}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c 'import jax, jaxlib, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())' 2>&1 | quiet
python3 -c 'from jax._src.lib import cuda_versions as c; print("cudnn", c.cudnn_get_version())' 2>&1 | quiet

timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" | tail -6

step() {  # NAME CASES [DIR]: one gpu_step.py process
  local name=$1 cases=$2 dir=${3:-.}
  (cd "$dir" && PYTHONPATH="${SITE_PACKAGES:-}:$PWD" timeout 400 python3 benchmarks/gpu_step.py --cases "$cases" --steps "$steps" \
    --peak-size "${PEAK:-8192}" --peak-reps 3 --out "$out/$name.json") 2>&1 | quiet | grep -v "^  File\|^    "
}
step levers_base "$B:bfloat16,$B:bfloat16:cudnn_native,$B:bfloat16/model.dropout_bits=packed,$B:bfloat16/model.dropout_bits=rbg,$B:bfloat16/model.loss_impl=blocked"
step before_base "$B:bfloat16" "$before"
bits=$(python3 - "$out/levers_base.json" "$B" <<'EOF'
import json, sys
rows = {r["case"]: r["step_seconds"] for r in json.load(open(sys.argv[1]))["rows"]}
fastest = min(("bernoulli", "packed", "rbg"), key=lambda b: rows.get(
    sys.argv[2] + ":bfloat16" + ("" if b == "bernoulli" else f"/model.dropout_bits={b}"), 1e9))
print(fastest)
EOF
)
echo "fastest dropout bits on base: $bits"
both="model.dropout_bits=$bits/model.loss_impl=blocked"
step levers_both "$B:bfloat16/$both,$G:bfloat16,$G:bfloat16/$both"
XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 90 python3 benchmarks/gpu_determinism.py \
  --steps 3 --out "$out/determinism.json" --cases \
  "debug:bfloat16:xla,debug:bfloat16:xla/model.dropout_rate=0.1,debug:bfloat16:cudnn,debug:bfloat16:xla/model.loss_impl=blocked,debug:bfloat16:cudnn/model.dropout_rate=0.1/model.dropout_bits=rbg" \
  2>&1 | quiet | cut -c1-400
step before_big "$G:bfloat16" "$before"
echo done
