"""Workdir paths, local or on Cloud Storage (gs://): the one place that decides how a file is
opened, listed, appended to and renamed (paths.Path is etils.epath, gcsfs behind gs://).

An object store has no append and no rename, but replacing an object is atomic: on gs:// an
append rewrites the (small) object, an atomic write needs no temporary file, and a rename
copies then deletes. $TX_JAX_GCS_BACKOFF is read once, at import (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import gzip
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import fsspec
from etils import epath
from etils.epath import backend as epath_backend

Path = epath.Path


# Every listing asks the store: gcsfs caches listings for the life of a process, which would
# then miss the checkpoints another process writes.
for _protocol in ("gcs", "gs"):
    fsspec.config.conf.setdefault(_protocol, {})["use_listings_cache"] = False

BACKOFF_ENV = "TX_JAX_GCS_BACKOFF"


def gcs_backoff() -> float | None:
    """The unit of the Cloud Storage clients' retry back-off in seconds, from
    $TX_JAX_GCS_BACKOFF (None when unset: the clients' own, 1 s)."""
    value = os.environ.get(BACKOFF_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{BACKOFF_ENV}={value!r}: expected a positive number of seconds")
    return seconds


class _ScaledSleeps:
    """asyncio for gcsfs's modules, but `sleep` (its retry waits only) lasts `scale` times more."""

    def __init__(self, scale: float):
        self.scale = scale

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float, result: Any = None) -> Any:
        return await asyncio.sleep(delay * self.scale, result)


def _apply_gcsfs_backoff(scale: float | None) -> None:
    """gcsfs hard-codes its back-off (asyncio.sleep in gcsfs.retry and gcsfs.core), so their
    `asyncio` is replaced by one whose sleeps are scaled."""
    if scale is None:
        return
    try:
        import gcsfs.core
        import gcsfs.retry
    except ImportError:  # no gs:// support installed: nothing to configure
        return
    for module in (gcsfs.retry, gcsfs.core):
        current = getattr(module, "asyncio", None)
        if current is not asyncio and not isinstance(current, _ScaledSleeps):
            raise RuntimeError(
                f"{BACKOFF_ENV}: {module.__name__} no longer sleeps through asyncio; "
                "this gcsfs version's back-off cannot be scaled"
            )
        module.asyncio = _ScaledSleeps(scale)


_apply_gcsfs_backoff(gcs_backoff())


def is_remote(path: Any) -> bool:
    """Whether `path` names an object store (a URL such as gs://bucket/run), not a local file."""
    return "://" in str(path)


def absolute(path: Any) -> epath.Path:
    """An absolute path (Orbax wants one); URLs are returned as they are."""
    path = epath.Path(path)
    return path if is_remote(path) else epath.Path(os.path.abspath(path))


def append_text(path: Any, text: str) -> None:
    """Add `text` at the end of a text file (created if missing)."""
    path = epath.Path(path)
    if not is_remote(path):
        with open(path, "a") as f:
            f.write(text)
        return
    old = path.read_text() if path.exists() else ""
    path.write_text(old + text)  # one object, replaced whole


def write_atomic(path: Any, data: str | bytes) -> None:
    """Write a file so that a reader (or a crash) sees the old content or the new, whole."""
    path = epath.Path(path)
    # An object upload replaces the object atomically; a local file is renamed into place.
    target = path if is_remote(path) else path.with_name(f".{path.name}.tmp{os.getpid()}")
    (target.write_bytes if isinstance(data, bytes) else target.write_text)(data)
    if target != path:
        os.replace(target, path)


def rename(src: Any, dst: Any) -> epath.Path:
    """Move a file or a whole directory to `dst` (which must not exist) -> dst."""
    src, dst = epath.Path(src), epath.Path(dst)
    if dst.exists():
        raise FileExistsError(f"cannot move {src} to {dst}: it exists")
    if not is_remote(src):
        os.rename(src, dst)
        return dst
    if not src.is_dir():
        src.rename(dst)
        return dst
    for rel in files(src):  # objects one by one: a store's "directory" is a name prefix
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).copy(dst / rel)
    src.rmtree()
    return dst


def files(root: Any) -> list[str]:
    """Every file under `root`, as paths relative to it ('a/b.txt'), sorted."""
    if is_remote(root):
        return sorted(sizes(root))
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    return sorted(out)


def sizes(root: Any) -> dict[str, int]:
    """Every file under `root` (a path relative to it, 'a/b.txt') -> its size in bytes."""
    if not is_remote(root):
        return {rel: os.path.getsize(os.path.join(root, rel)) for rel in files(root)}
    # one listing of every name under the prefix (sizes included), not one per "directory"
    root = epath.Path(root)
    fs = epath_backend.fsspec_backend.fs(str(root))
    prefix = fsspec.core.strip_protocol(str(root)).rstrip("/") + "/"
    found = fs.find(str(root), detail=True)
    return {k[len(prefix) :]: int(v["size"]) for k, v in found.items() if k.startswith(prefix)}


_HASH_BLOCK = 1 << 26  # 64 MiB


def sha256(path: Any, size: int | None = None) -> str:
    """The SHA-256 of a file's bytes (hex), in 64 MiB blocks; on a store one ranged read each,
    and with `size` (from `sizes`) no metadata request."""
    block, h = _HASH_BLOCK, hashlib.sha256()
    if not is_remote(path):
        with open(path, "rb") as f:
            for data in iter(lambda: f.read(block), b""):
                h.update(data)
        return h.hexdigest()
    fs = epath_backend.fsspec_backend.fs(str(path))
    size = fs.size(str(path)) if size is None else size
    for start in range(0, size, block):
        data = fs.cat_file(str(path), start=start, end=min(start + block, size))
        if len(data) != min(block, size - start):
            raise OSError(f"{path}: read {len(data)} bytes at {start}, expected a size of {size}")
        h.update(data)
    return h.hexdigest()


def glob(pattern: str) -> list[str]:
    """The files `pattern` names, sorted: itself when it has no wildcard (*, ?, [...]); else
    the files of its directory whose names match (wildcards in the last component only, as
    one listing of a bucket prefix gives them)."""
    if not any(c in pattern for c in "*?["):
        return [pattern]
    parent, name = pattern.rsplit("/", 1) if "/" in pattern else (".", pattern)
    if any(c in parent for c in "*?["):
        raise ValueError(f"{pattern}: wildcards may only be in the file name, not in {parent}")
    root = epath.Path(parent)
    if not root.is_dir():
        return []
    found = [c for c in root.iterdir() if fnmatch.fnmatchcase(c.name, name) and not c.is_dir()]
    return sorted(f"{parent}/{c.name}" for c in found)


def read_bytes(path: Any) -> bytes:
    """The bytes of a file, decompressed when its name ends in .gz."""
    data = epath.Path(path).read_bytes()
    return gzip.decompress(data) if str(path).endswith(".gz") else data


def upload_tree(local: Any, dst: Any) -> None:
    """Copy every file under the local directory `local` to `dst` (files there replaced)."""
    dst = epath.Path(dst)
    for rel in files(local):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(os.path.join(local, rel), "rb") as f:
            (dst / rel).write_bytes(f.read())


@contextlib.contextmanager
def staged_dir(out: Any) -> Iterator[str]:
    """A local directory for code that writes only local files: `out` itself when local, else
    a temporary one copied to `out` when the block ends without an error."""
    if not is_remote(out):
        os.makedirs(out, exist_ok=True)
        yield os.fspath(out)
        return
    local = tempfile.mkdtemp(prefix="tx_jax_staged_")
    try:
        yield local
        upload_tree(local, out)
    finally:
        shutil.rmtree(local, ignore_errors=True)
