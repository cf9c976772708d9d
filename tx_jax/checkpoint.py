"""Checkpoints: Orbax's CheckpointManager around the train state and everything a run needs.

A checkpoint at step N is the directory WORKDIR/checkpoints/N with three items:
    state   the TrainState (params, optimizer state, step, rng, counters): StandardSave,
            so it restores into an abstract state carrying this run's shardings, whatever
            the device count that saved it
    data    the train iterator's state (JSON): resuming continues the same batch sequence
    meta    the resolved config, the SentencePiece model (base64) and the package versions
Saves are asynchronous; `wait()` blocks until the last one is on disk. Retention keeps the
latest `keep` checkpoints plus the best one by a validation metric.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as cm

ITEMS = ("state", "data", "meta")


class Checkpointer:
    """Save and restore a run's checkpoints under `directory` (local path or gs://)."""

    def __init__(
        self,
        directory: str | epath.Path,
        *,
        keep: int = 3,
        best_metric: str | None = "bleu",
        best_mode: str = "max",
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = absolute(directory)
        policies: list = [cm.LatestN(n=keep)]
        if best_metric:
            policies.append(
                cm.BestN(
                    get_metric_fn=lambda m: m[best_metric],
                    reverse=best_mode == "min",
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=cm.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    # ------------------------------------------------------------------ queries
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        state: Any,
        *,
        data_state: dict | None,
        config: dict,
        tokenizer_bytes: bytes,
        versions: dict | None = None,
        metrics: dict[str, float] | None = None,
        force: bool = True,
        extra_meta: dict | None = None,
    ) -> bool:
        """Start an (async) save of everything at `step`; returns whether a save started.

        `extra_meta` adds JSON keys to `meta` (e.g. 'averaged': the steps an average holds)."""
        meta = {
            "config": config,
            "tokenizer": base64.b64encode(tokenizer_bytes).decode("ascii"),
            "versions": versions or {},
            **(extra_meta or {}),
        }
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state or {}),
            meta=ocp.args.JsonSave(meta),
        )
        return self.manager.save(step, args=args, metrics=metrics, force=force)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # ------------------------------------------------------------------ restore
    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """-> (state placed as `abstract_state` says, iterator state, meta)."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        logging.info("restored checkpoint %s", self.directory / str(step))
        return restored["state"], dict(restored["data"] or {}), decode_meta(restored["meta"])

    def restore_meta(self, step: int) -> dict:
        """The config and tokenizer of a checkpoint, without reading its arrays."""
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return decode_meta(restored["meta"])

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only `state.params`, placed as `abstract_params` says: the optimizer moments and
        the other items are not read (evaluation and decoding need nothing else)."""
        target = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        )
        # A handler of its own: the manager's 'state' item is registered for StandardRestore.
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
            restored = reader.restore(self.directory / str(step) / "state", args=args)
        return restored["params"]

    def state_metadata(self, step: int) -> dict:
        """The `state` item as a tree of Orbax ArrayMetadata (shape, dtype), reading no array."""
        handler = ocp.PyTreeCheckpointHandler()
        return handler.metadata(self.directory / str(step) / "state").tree


def absolute(path: str | epath.Path) -> epath.Path:
    """Orbax wants absolute paths; gs:// and other URLs are left alone."""
    path = epath.Path(path)
    return path if "://" in str(path) else epath.Path(os.path.abspath(path))


def decode_meta(meta: dict) -> dict:
    meta = dict(meta)
    meta["tokenizer"] = base64.b64decode(meta["tokenizer"])
    return meta
