"""Decode-once cache: one raw array file per (dataset, resolution, data folder).

Decoding JPEG/PNG files dominates the cost of loading an image dataset, so a folder is decoded
once and its pixels are stored as a flat uint8 file that later runs memory-map instead of decode.
Text datasets use the same entries for their token ids (int32 rows, ``resolution`` = the token
length, the tokenizer in the key's ``extra``). An entry is two files in the cache folder:

- ``<stem>.u8``: the rows, C-contiguous ``[rows, *item_shape]`` of the entry's dtype, no header;
- ``<stem>.json``: shape, dtype, byte count, the content key and the files skipped as unreadable.

The content key is a sha256 over the dataset name, the resolution, the domain and class names,
anything else the rows depend on (``extra``: a tokenizer's fingerprint) and every source file's
(relative path, size, mtime_ns), so adding, removing or replacing one file gives a new key and
the entry is rebuilt. Both files are written atomically (temporary file,
fsync, ``os.replace``), the metadata last; a reader trusts an entry only if its metadata matches
the expected key and shape and the image file has exactly the expected byte count. Processes
that miss one entry at once (a sweep's workers after the data changed) build it one at a time
under a lock file beside it (``<stem>.lock``, ``filelock``): the later ones then read the first
one's entry instead of decoding again and replacing it while the first reads it back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from filelock import FileLock

from feddomain.errors import DataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the pixels a given key stands for change (decoder, resize filter)
ENV_VAR = "FEDDOMAIN_CACHE"


def default_cache_dir() -> Path:
    """``$FEDDOMAIN_CACHE`` if set, else ``~/.cache/feddomain``."""
    return Path(os.environ.get(ENV_VAR) or "~/.cache/feddomain").expanduser()


def content_key(
    name: str,
    resolution: int,
    domains: Sequence[str],
    classes: Sequence[str],
    files: Iterable[tuple[str, int, int]],
    extra: dict[str, Any] | None = None,
) -> str:
    """sha256 hex digest identifying the pixels of a decoded folder.

    ``files`` yields (relative path, size in bytes, mtime in ns) per source image, in storage
    order; domain and class names are included because they fix the labels of each row.
    """
    h = hashlib.sha256()
    header = {
        "format": FORMAT_VERSION,
        "name": name,
        "resolution": resolution,
        "domains": list(domains),
        "classes": list(classes),
        **({"extra": extra} if extra else {}),
    }
    h.update(json.dumps(header, sort_keys=True).encode())
    for path, size, mtime_ns in files:
        h.update(f"\n{path}\t{size}\t{mtime_ns}".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    """The two file paths of one cache entry."""

    images: Path
    meta: Path

    @property
    def lock(self) -> Path:
        """The file whose lock a process holds while it builds the entry."""
        return self.meta.with_suffix(".lock")

    @classmethod
    def locate(
        cls,
        cache_dir: str | os.PathLike[str],
        name: str,
        resolution: int,
        source: Path,
        unit: str = "px",
    ) -> CacheEntry:
        """Entry for ``name`` at ``resolution`` decoded from the folder ``source``.

        The folder's absolute path is part of the file name, so two folders loaded under the
        same dataset name (e.g. two generic image folders) never overwrite each other, while a
        changed folder reuses -- and replaces -- its one entry instead of piling up stale ones.
        """
        where = hashlib.sha256(str(Path(source).resolve()).encode()).hexdigest()[:12]
        stem = f"{name}-{resolution}{unit}-{where}"
        base = Path(cache_dir).expanduser()
        return cls(images=base / f"{stem}.u8", meta=base / f"{stem}.json")


@dataclass(frozen=True)
class CachedImages:
    """A cache hit: images backed by the memory-mapped file, plus the files skipped at build."""

    images: torch.Tensor  # [rows, *item_shape] of the entry's dtype (uint8 pixels, int32 tokens)
    skipped: dict[str, str]  # relative path -> why it could not be decoded


def read(
    entry: CacheEntry,
    key: str,
    n_sources: int,
    item_shape: Sequence[int],
    dtype: np.dtype | type = np.uint8,
    *,
    quiet: bool = False,
) -> CachedImages | None:
    """The cached images if ``entry`` is complete and was built for ``key``, else None.

    A missing entry is a plain miss; an entry that exists but is unreadable, stale or truncated is
    reported with a warning naming the file (a debug line if ``quiet``: already reported) and
    treated as a miss, so the caller rebuilds it.
    The file is mapped copy-on-write: the file itself is opened read-only, yet the tensor is
    writable in memory, so downstream code may modify or ``.float()`` it without touching disk.
    """
    if not entry.meta.exists():
        return None
    report = log.debug if quiet else log.warning
    try:
        meta = json.loads(entry.meta.read_text())
    except (OSError, ValueError) as exc:
        report("cache metadata %s is unreadable (%s); rebuilding", entry.meta, exc)
        return None
    if not isinstance(meta, dict) or meta.get("key") != key:
        report("cache entry %s is stale (its image files changed); rebuilding", entry.meta)
        return None
    dtype = np.dtype(dtype)
    problem = _meta_problem(meta, n_sources, tuple(item_shape), dtype)
    if problem is None:
        size = entry.images.stat().st_size if entry.images.exists() else None
        if size != meta["nbytes"]:
            problem = f"it has {size} bytes, expected {meta['nbytes']}"
    if problem is not None:
        report("cache entry %s does not match its metadata (%s); rebuilding", entry.images, problem)
        return None
    shape = tuple(meta["shape"])
    array = np.memmap(entry.images, dtype=dtype, mode="c", shape=shape)
    return CachedImages(images=torch.from_numpy(array), skipped=dict(meta["skipped"]))


def _meta_problem(
    meta: dict[str, Any], n_sources: int, item_shape: tuple[int, ...], dtype: np.dtype
) -> str | None:
    """Why ``meta`` (already matching the key) cannot describe a valid entry, or None."""
    try:
        shape = tuple(int(s) for s in meta["shape"])
        skipped = meta["skipped"]
        if meta["format"] != FORMAT_VERSION or meta["dtype"] != dtype.name:
            return f"format {meta['format']} / dtype {meta['dtype']}"
        if shape[1:] != item_shape or shape[0] != n_sources - len(skipped) or shape[0] < 1:
            return f"shape {shape} for {n_sources} files with {len(skipped)} skipped"
        if meta["nbytes"] != int(np.prod(shape)) * dtype.itemsize:
            return f"nbytes {meta['nbytes']} for shape {shape}"
    except (KeyError, TypeError, ValueError) as exc:
        return f"malformed metadata: {exc!r}"
    return None


class CacheWriter:
    """Builds one entry: rows are appended in order to a temporary file, then committed.

    Use as a context manager; leaving it without ``commit`` (e.g. on an error) deletes the
    temporary file and leaves any previous entry untouched.
    """

    def __init__(
        self, entry: CacheEntry, item_shape: Sequence[int], dtype: np.dtype | type = np.uint8
    ) -> None:
        self.entry = entry
        self.item_shape = tuple(item_shape)
        self.dtype = np.dtype(dtype)
        self.rows = 0
        self._file: Any = None
        self._tmp: Path | None = None

    def __enter__(self) -> CacheWriter:
        folder = self.entry.images.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, self._tmp = _create_tmp(self.entry.images)
        except OSError as exc:
            raise _unwritable(folder, exc) from exc
        self._file = os.fdopen(fd, "wb")
        return self

    def append(self, rows: np.ndarray) -> None:
        """Write ``rows`` ([k, *item_shape] of the entry's dtype) after the rows written so far."""
        if rows.dtype != self.dtype or rows.shape[1:] != self.item_shape:
            raise ValueError(
                f"expected {self.dtype} [k, *{self.item_shape}], got {rows.dtype} {rows.shape}"
            )
        try:
            self._file.write(np.ascontiguousarray(rows).data)
        except OSError as exc:
            raise _unwritable(self.entry.images, exc) from exc
        self.rows += len(rows)

    def commit(self, key: str, n_sources: int, skipped: dict[str, str]) -> None:
        """Publish the rows written so far as the entry for ``key``, atomically."""
        meta = {
            "format": FORMAT_VERSION,
            "key": key,
            "dtype": self.dtype.name,
            "shape": [self.rows, *self.item_shape],
            "nbytes": self.rows * int(np.prod(self.item_shape)) * self.dtype.itemsize,
            "n_sources": n_sources,
            "skipped": dict(sorted(skipped.items())),
        }
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            # Drop the old metadata first: a crash between the two replaces must leave images
            # without metadata (a miss), never old metadata describing new images.
            self.entry.meta.unlink(missing_ok=True)
            os.replace(self._tmp, self.entry.images)
            self._tmp = None
            write_atomic(self.entry.meta, json.dumps(meta, indent=1).encode())
        except OSError as exc:
            raise _unwritable(self.entry.images, exc) from exc

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)


def read_or_build(
    entry: CacheEntry,
    key: str,
    n_sources: int,
    item_shape: Sequence[int],
    build: Callable[[CacheWriter], dict[str, str]],
    dtype: np.dtype | type = np.uint8,
) -> CachedImages:
    """The entry for ``key``, read, or built by ``build`` (it appends every row to the writer
    and returns the source files it skipped as unreadable) when missing or stale. The build
    runs under the entry's lock, and the entry is read once more once the lock is held: a
    process that waited for another's build reads that one instead of building its own."""
    hit = read(entry, key, n_sources, item_shape, dtype)
    if hit is not None:
        return hit
    with _building(entry):
        hit = read(entry, key, n_sources, item_shape, dtype, quiet=True)
        if hit is None:
            with CacheWriter(entry, item_shape, dtype) as writer:
                writer.commit(key, n_sources, build(writer))
            hit = read(entry, key, n_sources, item_shape, dtype)
    if hit is None:
        raise DataError(f"the cache entry {entry.images} could not be read back after writing")
    return hit


@contextlib.contextmanager
def _building(entry: CacheEntry) -> Iterator[None]:
    """Hold the entry's lock: one process at a time builds it."""
    try:
        entry.lock.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(entry.lock)
        lock.acquire()
    except OSError as exc:
        raise _unwritable(entry.lock.parent, exc) from exc
    try:
        yield
    finally:
        lock.release()


def _create_tmp(target: Path) -> tuple[int, Path]:
    """A new, uniquely named file beside ``target``; unlike ``mkstemp`` (always 0600) its
    permissions follow the umask, so a cache folder shared by a group stays readable."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = _create_tmp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the renames durable (not supported for directories on every platform)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _unwritable(path: Path, exc: OSError) -> DataError:
    return DataError(
        f"cannot write the image cache at {path}: {exc}; pass a writable cache_dir or set {ENV_VAR}"
    )
