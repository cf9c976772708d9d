#!/usr/bin/env bash
# Run by `./launch.sh tpu-setup` on every worker of a TPU VM, in ~/tx_jax (the copied tree):
#
#   bash scripts/tpu_worker_setup.sh [EXTRAS]
#
# Google's TPU images are Ubuntu 22.04, whose python3 is 3.10, and tx_jax needs 3.11 or newer:
# uv (astral.sh) provides the interpreter, a CPython 3.11 already on the worker or else a
# managed one it downloads (python-build-standalone, into ~/.local/share/uv/python); the image's
# python3 is never used. .venv is made from it with the standard venv module (pip included),
# then tx_jax is installed with jax[tpu] and EXTRAS (comma-separated, e.g. export), and the
# worker prints its JAX devices. Run again, it keeps a .venv of the right Python and updates it.
set -euo pipefail

PYTHON_VERSION=3.11  # the version the project's CI tests
extras="${1:-}"
export PATH="$HOME/.local/bin:$PATH"  # where uv's installer puts uv
say() { echo "tpu-setup [$(hostname)]: $*"; }

if ! command -v uv >/dev/null 2>&1; then
  say "installing uv into ~/.local/bin (astral.sh/uv)"
  curl -LsSf https://astral.sh/uv/install.sh | env UV_NO_MODIFY_PATH=1 sh >/dev/null
fi
if ! python=$(uv python find --system "$PYTHON_VERSION" 2>/dev/null); then
  say "installing CPython $PYTHON_VERSION (uv python install; the image's python3 is $(
    python3 --version 2>&1 | cut -d' ' -f2))"
  uv python install "$PYTHON_VERSION"
  python=$(uv python find --system "$PYTHON_VERSION")
fi
have=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
if [ "$have" != "$PYTHON_VERSION" ]; then
  rm -rf .venv
  "$python" -m venv .venv
fi
say "installing tx_jax${extras:+[$extras]} and jax[tpu] into .venv ($(.venv/bin/python --version))"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}" "jax[tpu]"
.venv/bin/python -c 'import jax; print(f"tpu-setup [process {jax.process_index()}]:", jax.devices())'
