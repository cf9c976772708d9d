#!/usr/bin/env bash
# One call on a lent GPU host: what CI's CPU cannot run, in one go (device time is scarce).
#
#   bash benchmarks/gpu_checks.sh OUT_DIR MULTI30K_DIR
#
# 1. experiments/table3_cpu.py's points 0 (base, a cross-check of the CPU's figure) and 12-17
#    (row C's rest), 7 at a time on the one GPU, float32 matmuls at 'highest' precision (the
#    CPU's float32 arithmetic, not TF32); their metrics and logs -> OUT_DIR/table3_gpu.tgz.
# 2. tests/test_gpu.py and the cuDNN lowering test on the GPU (beside the sweep: nothing here is
#    timed) -> OUT_DIR/gpu_tests.log.
# Expects tx_jax importable (PYTHONPATH=.) with its dependencies; prints versions first. An image
# with jax/flax/optax/orbax but not tx_jax's data stack needs (2026-11-26, as wheels for its
# Python 3.12): array-record dm-tree docstring-parser googleapis-common-protos grain
# immutabledict importlib-resources ml-collections portpicker promise simple-parsing
# tensorboardx tensorflow-datasets tensorflow-metadata termcolor toml tzdata.
set -u
out=${1:?OUT_DIR}
data=${2:?MULTI30K_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import jax, flax, optax, orbax.checkpoint as o, tensorflow_datasets as t
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "orbax", o.__version__, "tfds", t.__version__, jax.devices())'

root=/tmp/table3_gpu
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 360 python3 -m tx_jax.sweep \
  experiments/table3_cpu.py --root=$root --only 0,12,13,14,15,16,17 --parallel 7 \
  --override "data.manual_dir=$data" > "$out/sweep.out" 2>&1 &
sweep=$!

XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu timeout 240 \
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  tests/test_lowering.py::test_cudnn_attention_lowers_for_cuda 2>&1 | tee "$out/gpu_tests.log" | tail -25

wait $sweep
echo "sweep exit $?"
tail -12 "$out/sweep.out"
(cd $root && tar czf "$out/table3_gpu.tgz" --exclude=checkpoints --exclude=tensorboard .)
for d in $root/*/; do echo "== $d"; grep -E "^(step +600|eval)" "$d/sweep.log" | tail -2; done
