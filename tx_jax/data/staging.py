"""A TFDS dataset prepared in Cloud Storage, read from a verified local copy.

array_record's C++ reader does not go through gcsfs, so the version directory a run reads is
copied to CACHE/<the URL without '://'>/<same relative path> (`stage_prepared`): checked
against the store's sizes and MD5s, renamed into place whole with a manifest, and reused while
the store's listing matches. CACHE is data.data_cache_dir, $TX_JAX_DATA_CACHE or
~/.cache/tx_jax/data: one copy per host, shared by its processes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
from typing import Any

import fsspec

MANIFEST = ".tx_jax_staged.json"


def local_data_dir(remote: str, cache_dir: str | None) -> str:
    """Where the remote data_dir `remote` is mirrored: CACHE/gs/bucket/path (keyed by URL)."""
    root = cache_dir or os.environ.get("TX_JAX_DATA_CACHE") or "~/.cache/tx_jax/data"
    scheme, _, rest = remote.rstrip("/").partition("://")
    parts = [p for p in rest.split("/") if p]
    return os.path.join(os.path.abspath(os.path.expanduser(root)), scheme, *parts)


def _md5(path: str) -> str:
    with open(path, "rb") as f:
        return base64.b64encode(hashlib.file_digest(f, "md5").digest()).decode()


def _listing(remote_dir: str) -> dict[str, list]:
    """rel path -> [size, base64 MD5 or None] of every object under `remote_dir` (one listing;
    fsspec's details carry the checksums GCS keeps, which epath does not expose)."""
    fs, root = fsspec.core.url_to_fs(remote_dir)
    found = fs.find(root, detail=True) if fs.isdir(root) else {}
    out = {}
    for path, info in found.items():
        rel = path[len(root) :].lstrip("/")
        if rel and info.get("type", "file") == "file":
            out[rel] = [int(info["size"]), info.get("md5Hash")]
    return out


def _complete(local: str, listing: dict[str, list]) -> bool:
    """Whether `local` holds a whole copy of `listing` (its manifest and every file's size)."""
    try:
        with open(os.path.join(local, MANIFEST)) as f:
            if json.load(f)["files"] != listing:
                return False
    except (OSError, ValueError, KeyError):
        return False
    return all(
        os.path.isfile(p := os.path.join(local, rel)) and os.path.getsize(p) == size
        for rel, (size, _) in listing.items()
    )


def _copy(remote_dir: str, listing: dict[str, list], tmp: str) -> None:
    """Every object of `listing` into `tmp`, each checked against its size and MD5."""
    fs, root = fsspec.core.url_to_fs(remote_dir)
    for rel, (size, md5) in sorted(listing.items()):
        dst = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        fs.get_file(f"{root}/{rel}", dst)
        got = os.path.getsize(dst)
        if got != size:
            raise OSError(f"staging {remote_dir}/{rel}: {got} bytes copied, the store lists {size}")
        if md5 is not None and _md5(dst) != md5:
            raise OSError(f"staging {remote_dir}/{rel}: MD5 differs from the store's ({md5})")
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"remote": remote_dir, "files": listing}, f)


def stage_prepared(remote: str, relative: str, cache_dir: str | None = None) -> str:
    """Copies `remote`/`relative` (a prepared TFDS version directory) to the cache unless a
    complete copy is there -> the local data_dir to give TFDS. FileNotFoundError naming what to
    upload when the store has none (array_record cannot write to gs:// either)."""
    remote = remote.rstrip("/")
    remote_dir = f"{remote}/{relative}"
    local_root = local_data_dir(remote, cache_dir)
    local = os.path.join(local_root, relative)
    listing = _listing(remote_dir)
    if "dataset_info.json" not in listing:
        raise FileNotFoundError(
            f"data.data_dir={remote!r}: no prepared dataset at {remote_dir} (no dataset_info"
            ".json). Prepare it with a local data_dir and copy that directory's "
            f"{relative} there (gcloud storage cp -r), or give the local data_dir"
        )
    if _complete(local, listing):
        return local_root
    logging.info("staging %s (%d files) to %s", remote_dir, len(listing), local)
    parent, name = os.path.split(local)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.staging-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _copy(remote_dir, listing, tmp)
        if _complete(local, listing):  # another process of this host finished first: keep its
            return local_root
        if os.path.exists(local):  # an old or damaged copy: moved aside, then removed
            old = os.path.join(parent, f".{name}.old-{os.getpid()}")
            os.rename(local, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, local)
        except OSError:  # another process of this host renamed its copy first
            if not _complete(local, listing):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local_root


def is_published(remote: str, relative: str) -> bool:
    """Whether `remote`/`relative` holds prepared data (the dataset_info.json written last)."""
    fs, root = fsspec.core.url_to_fs(f"{remote.rstrip('/')}/{relative}/dataset_info.json")
    return fs.exists(root)


def publish(local_dir: str, remote_dir: str) -> None:
    """Copies a prepared version directory to the store, dataset_info.json last: a reader
    (`stage_prepared`, `is_published`) never takes a half-copied directory for prepared data."""
    fs, root = fsspec.core.url_to_fs(remote_dir)
    names = sorted(
        os.path.relpath(os.path.join(d, n), local_dir)
        for d, _, files in os.walk(local_dir)
        for n in files
    )
    names.sort(key=lambda rel: rel == "dataset_info.json")
    logging.info("publishing %s (%d files) to %s", local_dir, len(names), remote_dir)
    for rel in names:
        fs.put_file(os.path.join(local_dir, rel), f"{root}/{rel}")


def builder_relative_dir(builder: Any, local_root: str) -> str:
    """The version directory of a TFDS builder made on `local_root`, relative to it."""
    return os.path.relpath(os.fspath(builder.data_dir), local_root)
