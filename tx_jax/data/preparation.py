"""What a run prepares before its first step, on one host or many.

Process 0 prepares the data and tokenizer while the others wait at a barrier (a process with
its own data_dir then prepares its identical copy). A multi-process run first checks that every
process sees the workdir (only it and the data's location are shared) and that nothing
unprepared is larger than `MULTI_HOST_PREPARE_BYTES` or a download: else it stops on every
process, naming `tx_jax prepare`.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from tx_jax.data import datasets

# A run of several processes prepares data itself up to this size (seconds of reading);
# anything larger, or a download, is prepared first with `tx_jax prepare`.
MULTI_HOST_PREPARE_BYTES = 64 << 20
_TOKEN_FILE = ".tx_jax_processes"


def barrier(name: str) -> None:
    """Every process waits for the others here, so what process 0 prepared is complete."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"tx_jax:{name}")


def open_train_splits(
    datas: Sequence[Any], workdir: epath.Path, *, also_prepare: Sequence[Any] = ()
) -> list[datasets.TranslationSource]:
    """The train split of each config.data in `datas`, opened once process 0 created `workdir`
    and prepared every split a run reads of these and `also_prepare` (barrier 'data'), after
    `check_hosts` in a multi-process run."""
    everything = [*datas, *also_prepare]
    if jax.process_count() > 1:
        check_hosts(workdir, everything)
    opened = {}
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(everything):
            for split in datasets.run_splits(data):
                source = datasets.load_split(data, split)
                if i < len(datas) and split == "train":
                    opened[i] = source
    barrier("data")
    return [
        opened[i] if i in opened else datasets.load_split(d, "train") for i, d in enumerate(datas)
    ]


def unprepared(datas: Sequence[Any]) -> list[str]:
    """'dataset split (size)' of each unprepared split too large to prepare at a run's start."""
    found = []
    for data in datas:
        for split in datasets.run_splits(data):
            size = datasets.unprepared_bytes(data, split)
            if size is None or size > MULTI_HOST_PREPARE_BYTES:
                what = "a download" if size is None else f"{size / 2**20:,.0f} MiB"
                found.append(f"{data.dataset} {split} ({what})")
    return found


def check_hosts(workdir: epath.Path, datas: Sequence[Any]) -> None:
    """Stops a multi-process run at its start, on every process, when a process cannot see
    the workdir process 0 writes, or when data the run reads is not prepared and too large to
    prepare without a long wait (`unprepared`). One barrier and one all-gather."""
    token = secrets.randbits(30) + 1
    path = workdir / _TOKEN_FILE
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(str(token))
    barrier("workdir")
    try:
        seen = int(path.read_text())
    except (OSError, ValueError):
        seen = 0
    missing = unprepared(datas)
    mine = np.array([seen, token if jax.process_index() == 0 else 0, len(missing)], np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)
    blind = [i for i, row in enumerate(gathered) if row[0] != gathered[0, 1]]
    if blind:
        raise ValueError(
            f"workdir {workdir}: process(es) {', '.join(map(str, blind))} of "
            f"{jax.process_count()} cannot see what process 0 writes there; every process of a "
            "run reads and writes one workdir: give a gs:// workdir (a local path only when "
            "every process shares that disk)"
        )
    if gathered[:, 2].any():
        raise ValueError(
            f"not prepared: {'; '.join(missing) or 'data another process lacks'}. A run of "
            f"{jax.process_count()} processes does not wait for a long preparation: run "
            f"`{prepare_command()}` once first (with data.data_dir on gs:// when the hosts "
            "share no disk), then launch again"
        )


def prepare_command() -> str:
    """`tx_jax prepare` with this command line's --config and --workdir flags."""
    keep = [a for a in sys.argv[1:] if a.startswith(("--config", "--workdir"))]
    return " ".join(["tx_jax prepare", *keep]) if keep else "tx_jax prepare"
