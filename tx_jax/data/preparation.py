"""What one process prepares for all: in a multi-process run process 0 prepares the TFDS data
(and the tokenizer, run_tokenizer.py) and the others wait at a barrier, so that no process
reads files another one is still writing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from etils import epath
from jax.experimental import multihost_utils

from tx_jax.data import datasets


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (nothing in a one-process run):
    what process 0 prepares (data, tokenizer) is complete before the others read it."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"tx_jax:{name}")


def open_train_splits(
    datas: Sequence[Any], workdir: epath.Path, *, also_prepare: Sequence[Any] = ()
) -> list[datasets.TranslationSource]:
    """The train split of each config.data in `datas`, opened once every process may read
    it: process 0 creates `workdir` and prepares the data (those of `also_prepare` too, which
    are not opened here), then every process passes the barrier 'data'."""
    opened = {}
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate([*datas, *also_prepare]):
            source = datasets.load_split(data, "train")
            if i < len(datas):
                opened[i] = source
    barrier("data")
    return [
        opened[i] if i in opened else datasets.load_split(d, "train") for i, d in enumerate(datas)
    ]
