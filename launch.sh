#!/usr/bin/env bash
# tx_jax's one entry point. Sets up .venv on first use (and again when setup.cfg changes).
#
#   ./launch.sh train [WORKDIR] [--config.key=value ...]   default experiment (CPU; offline once .venv is installed)
#   ./launch.sh test [pytest args]                         ruff (lint + format) then pytest
#   ./launch.sh sweep experiments/FILE.py [--parallel N] [--dry-run] [--only 0,3] [--root DIR]
#                     [--test_split_eval] [--override key=value ...]     python -m tx_jax sweep
#   ./launch.sh sweep experiments/FILE.py --tpu NAME[,NAME...] --root gs://B/sweeps/X
#                     [--zone Z] [--recreate] [--no-plan] [--dry-run]    each point on a TPU VM
#   ./launch.sh tpu-create|tpu-setup|tpu-prepare|tpu-run|tpu-logs|tpu-delete NAME [...] [--dry-run]
#                                                          Cloud TPU VMs (scripts/tpu.sh)
#
# Environment: PYTHON (interpreter for the venv, >= 3.11), TX_JAX_EXTRAS (extras installed besides
# a command's own: gpu on an NVIDIA host, docs/gpus.md), TX_JAX_TEST_WORKERS (pytest-xdist),
# JAX_COMPILATION_CACHE_DIR (train/sweep: JAX's persistent compilation cache; default .jax_cache,
# which cuts a rerun's first step from 9.9 to 3.6 s on the default experiment, BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

VENV=.venv

ensure_venv() {
  # $1: the extras this command needs (test needs test,export,plan); a venv that already has
  # them for this setup.cfg is used as it is.
  local extras="${1:-}" py="${PYTHON:-python3}"
  [ -z "${TX_JAX_EXTRAS:-}" ] || extras="${extras:+$extras,}$TX_JAX_EXTRAS"
  if [ ! -x "$VENV/bin/python" ]; then
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
      echo "launch.sh: $py is older than Python 3.11; set PYTHON=python3.11 (or newer)" >&2
      exit 2
    }
    "$py" -m venv "$VENV"
  fi
  local want have="" have_extras="" missing=""
  want=$(cat setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ -f "$VENV/.tx_jax-installed" ]; then
    read -r have have_extras < "$VENV/.tx_jax-installed" || true
  fi
  [ "$want" = "$have" ] || have_extras=""
  for e in ${extras//,/ }; do
    [[ ",$have_extras," == *",$e,"* ]] || missing=1
  done
  if [ "$want" != "$have" ] || [ -n "$missing" ]; then
    [ "$want" = "$have" ] && extras=$(echo "$have_extras,$extras" | tr ',' '\n' | sort -u | grep . | paste -sd, -)
    echo "launch.sh: installing tx_jax${extras:+[$extras]} and its dependencies into $VENV ..." >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".${extras:+[$extras]}"
    echo "$want $extras" > "$VENV/.tx_jax-installed"
  fi
}

cpu_host_platforms() {
  # libtpu (the plan extra, installed by `test`) looks for TPU chips whenever JAX starts and
  # prints errors where there are none: on a host without TPU chips, name the platforms.
  [ -z "${JAX_PLATFORMS:-}" ] || return 0
  compgen -G '/dev/accel*' >/dev/null || compgen -G '/dev/vfio/[0-9]*' >/dev/null && return 0
  [ -d "$VENV/lib" ] && compgen -G "$VENV/lib/python3*/site-packages/libtpu" >/dev/null || return 0
  if [ -e /dev/nvidiactl ]; then export JAX_PLATFORMS=cuda,cpu; else export JAX_PLATFORMS=cpu; fi
}

cmd="${1:-help}"
[ $# -gt 0 ] && shift
case "$cmd" in
  test)
    ensure_venv test,export,plan
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    # --dist loadfile: a file's tests share one worker, so a module's fixtures (a trained
    # run, a server) are built once, not once per worker; files are handed out in the order
    # tests/conftest.py's LONGEST_FIRST gives them, not reordered by their number of tests.
    "$VENV/bin/python" -m pytest -n "${TX_JAX_TEST_WORKERS:-2}" --dist loadfile \
      --no-loadscope-reorder "$@"
    ;;
  train)
    ensure_venv
    cpu_host_platforms
    export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}"
    workdir="runs/default"
    if [ $# -gt 0 ] && [[ "$1" != --* ]]; then workdir="$1"; shift; fi
    exec "$VENV/bin/python" -m tx_jax train --config=configs/default.py --workdir="$workdir" "$@"
    ;;
  sweep)
    # On TPU VMs each point is planned here first: the TPU compiler (plan extra) is needed.
    if [[ " $* " == *" --tpu"* ]]; then ensure_venv plan; else ensure_venv; fi
    cpu_host_platforms
    export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}"
    exec "$VENV/bin/python" -m tx_jax sweep "$@"
    ;;
  tpu-create|tpu-setup|tpu-prepare|tpu-run|tpu-logs|tpu-delete)
    exec bash scripts/tpu.sh "$cmd" "$@"  # no venv here: --dry-run needs nothing installed
    ;;
  help|-h|--help)
    sed -n '2,16p' "$0"
    ;;
  *)
    echo "launch.sh: unknown command '$cmd' (expected train, test, sweep or tpu-*)" >&2
    exit 2
    ;;
esac
