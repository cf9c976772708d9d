"""`python -m tx_jax.main`: `tx_jax train` under the name flax's examples give it.

python -m tx_jax.main --config=configs/default.py --workdir=runs/default
"""

import sys

from tx_jax.cli import run

if __name__ == "__main__":
    sys.exit(run("train", sys.argv[1:]))
