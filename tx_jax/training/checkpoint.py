"""Checkpoints: Orbax's CheckpointManager around the train state and everything a run needs.

A checkpoint at step N is the directory WORKDIR/checkpoints/N with three items:
    state   the TrainState (StandardSave: it restores into this run's shardings, whatever
            the device count that saved it)
    data    the train iterator's state (JSON): resuming continues the same batch sequence
    meta    the resolved config, the SentencePiece model (base64) and the package versions
Saves are asynchronous; `wait()` blocks until the last one is on disk. Retention keeps the
latest `keep` checkpoints plus the best one by a validation metric.

Integrity: Orbax restores flipped bytes silently, so process 0 writes N/checksums.json
(SHA-256 of every file) once a save of this process is final; restores verify it, raising
`CorruptCheckpointError`, and `restore_latest` falls back to the previous good checkpoint. A
step without a manifest is used with a warning (none is written for a save found on disk).
$TX_JAX_GCS_BACKOFF scales TensorStore's Cloud Storage retries (docs/reliability.md).
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as cm

from tx_jax import paths

ITEMS = ("state", "data", "meta")


def _apply_tensorstore_backoff(unit: float | None) -> None:
    """Scale TensorStore's `gcs_request_retries` (1 s doubling to 32 s) by `unit` in the two
    module-level specs Orbax builds its contexts from (a caller cannot pass one)."""
    if unit is None:
        return
    from orbax.checkpoint._src.serialization import tensorstore_utils

    retries = {
        "initial_delay": f"{round(unit * 1e6)}us",
        "max_delay": f"{round(32 * unit * 1e6)}us",
    }
    for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
        spec = getattr(tensorstore_utils, name, None)
        if not isinstance(spec, dict):
            raise RuntimeError(
                f"{paths.BACKOFF_ENV}: this Orbax has no {name} to set TensorStore's "
                "retries in; its back-off cannot be scaled"
            )
        spec["gcs_request_retries"] = dict(retries)


_apply_tensorstore_backoff(paths.gcs_backoff())
MANIFEST = "checksums.json"


class CheckpointSaveError(OSError):
    """A save that failed (disk full, permissions, ...): names the step and the directory."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint whose files do not match its checksums (names the step and the file)."""

    def __init__(self, step: int, path: str, reason: str):
        super().__init__(f"checkpoint step {step} is damaged: {path}: {reason}")
        self.step, self.path, self.reason = step, path, reason


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
        self._unsealed: list[int] = []  # saves of this process still without a manifest
        self._last_started: int | None = None

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
        """Start an (async) save of everything at `step` -> whether one started (not when
        `step` is saved or being saved already). `extra_meta`: more JSON keys for `meta`."""
        if step == self._last_started or step == self.manager.latest_step():
            return False
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
        self.seal()  # the previous async save must be final before its manifest is written
        try:
            started = self.manager.save(step, args=args, metrics=metrics, force=force)
        except Exception as e:  # noqa: BLE001 - Orbax raises many types; say which save failed
            raise CheckpointSaveError(
                f"saving checkpoint step {step} in {self.directory} failed: {e}; the "
                f"checkpoints already there are intact: {self.all_steps()}"
            ) from e
        if started:
            self._unsealed.append(step)
            self._last_started = step
        return started

    def wait(self) -> None:
        self.seal()

    def close(self) -> None:
        self.seal()
        self.manager.close()

    # ------------------------------------------------------------------ integrity
    def seal(self) -> None:
        """Wait for pending saves, then write the checksum manifest of each of them."""
        pending, self._unsealed = self._unsealed, []
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the async save's own error, re-raised here
            raise CheckpointSaveError(
                f"saving checkpoint step(s) {pending} in {self.directory} failed: {e}; the "
                f"checkpoints already there are intact: {self.all_steps()}"
            ) from e
        if jax.process_index() != 0:
            return
        existing = set(self.manager.all_steps())
        for step in pending:
            if step in existing:  # retention may already have removed it
                step_dir = self.directory / str(step)
                try:
                    manifest = {
                        rel: paths.sha256(step_dir / rel, size)
                        for rel, size in _files(step_dir).items()
                    }
                    paths.write_atomic(
                        step_dir / MANIFEST, json.dumps(manifest, indent=0, sort_keys=True)
                    )
                except OSError as e:
                    raise CheckpointSaveError(
                        f"writing the checksums of checkpoint step {step} ({step_dir / MANIFEST})"
                        f" failed: {e}; the checkpoints verified before it are intact"
                    ) from e

    def verify(self, step: int) -> bool:
        """Check step's files against its manifest: True if verified, False if it has none
        (warned); raises CorruptCheckpointError naming the first bad file."""
        step_dir = self.directory / str(step)
        manifest_path = step_dir / MANIFEST
        listing = paths.sizes(step_dir)  # one listing on a store: what exists, and how big
        if MANIFEST not in listing:
            logging.warning("checkpoint step %d has no %s: not verified", step, MANIFEST)
            return False
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise CorruptCheckpointError(step, str(manifest_path), f"unreadable: {e}") from e
        for rel, digest in sorted(manifest.items()):
            path = step_dir / rel
            if rel not in listing:
                raise CorruptCheckpointError(step, str(path), "missing")
            if paths.sha256(path, listing[rel]) != digest:
                raise CorruptCheckpointError(step, str(path), "checksum mismatch")
        extra = sorted(set(_files(step_dir, listing)) - set(manifest))
        if extra:
            raise CorruptCheckpointError(step, str(step_dir / extra[0]), "not in the manifest")
        return True

    def quarantine(self, step: int) -> epath.Path:
        """Move a damaged step out of the manager's way (training would re-save that step)
        into DIRECTORY.damaged/STEP-<n>; nothing is deleted."""
        target_dir = epath.Path(str(self.directory) + ".damaged")
        n = 0
        while (target := target_dir / f"{step}-{n}").exists():
            n += 1
        if jax.process_index() == 0:
            target_dir.mkdir(parents=True, exist_ok=True)
            paths.rename(self.directory / str(step), target)
        self.manager.reload()
        return target

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict, dict] | None:
        """The newest checkpoint that verifies and restores -> (step, state, data, meta);
        damaged ones are reported and skipped. None when there is no checkpoint at all."""
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                return (step, *self.restore(step, abstract_state))
            except CorruptCheckpointError as e:
                moved = self.quarantine(step)
                print(
                    f"warning: {e}; moved to {moved}; falling back to an earlier checkpoint",
                    flush=True,
                )
        if steps:
            raise CorruptCheckpointError(
                steps[0], str(self.directory), f"all {len(steps)} checkpoints are damaged"
            )
        return None

    # ------------------------------------------------------------------ restore
    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """-> (state placed as `abstract_state` says, iterator state, meta), verified."""
        self.verify(step)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        logging.info("restored checkpoint %s", self.directory / str(step))
        return restored["state"], dict(restored["data"] or {}), _decode_meta(restored["meta"])

    def restore_meta(self, step: int) -> dict:
        """The config and tokenizer of a checkpoint, without reading its arrays."""
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return _decode_meta(restored["meta"])

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only `state.params` (verified first), placed as `abstract_params` says; nothing
        else is read."""
        self.verify(step)
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


def _files(step_dir: epath.Path, listing: dict[str, int] | None = None) -> dict[str, int]:
    """Every file under a step directory (relative) -> its size, but the manifest and its
    temporary files. `listing`: the step's `paths.sizes`, when already read."""
    listing = paths.sizes(step_dir) if listing is None else listing
    return {
        rel: size
        for rel, size in listing.items()
        if rel != MANIFEST and not (rel.startswith(f".{MANIFEST}.tmp") or rel == MANIFEST + ".tmp")
    }


absolute = paths.absolute  # Orbax wants absolute paths; gs:// and other URLs as they are


def _decode_meta(meta: dict) -> dict:
    meta = dict(meta)
    meta["tokenizer"] = base64.b64decode(meta["tokenizer"])
    return meta
