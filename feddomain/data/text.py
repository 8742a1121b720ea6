"""Text domains: every sample's text read, tokenised once, and cached as int32 token ids.

Two layouts (``DatasetSpec.reader``):

- ``folder`` (dataset ``text_folder``): ``<root>/<domain>/<class>/<file>.txt``, one sample per
  UTF-8 file, scanned like an image folder (same problems reported, same cache key inputs);
- ``reviews`` (dataset ``AmazonReviews``): the balanced multi-domain sentiment set of Blitzer et
  al. (2007) as ``unprocessed.tar.gz`` unpacks it, ``sorted_data_acl/<domain>/positive.review``
  and ``negative.review``; each ``<review_text>`` element of those pseudo-XML files is one sample
  (1,000 per class and domain). The ``kitchen`` domain's folder is ``kitchen_&_housewares``.

A tokenizer turns texts into ``[N, max_length]`` ids (first token a start token, padded with the
tokenizer's ``pad_id``): the built-in ``bytes`` and ``words`` ones need no download (for
``text_cnn``); a ``transformers`` checkpoint brings its own (``models/transformer.py``). Ids are
stored in the decode-once cache (``data/cache.py``) keyed by the files, the tokenizer's
fingerprint and ``max_length``, so a second run maps them instead of reading and tokenising.
"""

from __future__ import annotations

import hashlib
import html
import logging
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from feddomain.data import cache
from feddomain.data.dataset import DomainDataset
from feddomain.data.sources import (
    DatasetSpec,
    FolderIndex,
    PathLike,
    get_spec,
    resolve_dataset_dir,
    scan_image_folder,
)
from feddomain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ENCODE_CHUNK = 512  # texts tokenised (and written to the cache) at a time
PAD, START = 0, 1  # ids of the built-in tokenizers; real tokens start at 2
REVIEW_FILES = {"negative": "negative.review", "positive": "positive.review"}
REVIEW_FOLDERS = {"kitchen": ("kitchen", "kitchen_&_housewares")}  # domain -> folder names
_REVIEW_TEXT = re.compile(r"<review_text>\s*(.*?)\s*</review_text>", re.DOTALL)
_WORD = re.compile(r"[a-z0-9']+|[^\sa-z0-9']")


class Tokenizer(Protocol):
    """What the text loader needs of a tokenizer."""

    name: str  # short, for the cache file name
    fingerprint: str  # changes whenever the ids of some text would change
    pad_id: int

    def encode(self, texts: Sequence[str], max_length: int) -> np.ndarray:
        """int32 ``[len(texts), max_length]``: truncated, padded with ``pad_id``."""
        ...


def _padded(rows: list[list[int]], max_length: int, pad_id: int) -> np.ndarray:
    out = np.full((len(rows), max_length), pad_id, dtype=np.int32)
    for i, ids in enumerate(rows):
        ids = ids[:max_length]
        out[i, : len(ids)] = ids
    return out


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 2 after a start token; a 258-id vocabulary."""

    name: str = "bytes"
    fingerprint: str = "bytes-v1"
    pad_id: int = PAD
    vocab_size: int = 258

    def encode(self, texts: Sequence[str], max_length: int) -> np.ndarray:
        rows = [[START, *(b + 2 for b in t.encode("utf-8")[: max_length - 1])] for t in texts]
        return _padded(rows, max_length, self.pad_id)


@dataclass(frozen=True)
class WordTokenizer:
    """Lower-cased words and punctuation marks hashed (CRC-32) into ``vocab_size - 2`` buckets:
    no vocabulary to build or download, and the same ids for a word in every domain."""

    vocab_size: int = 2**14
    pad_id: int = PAD

    @property
    def name(self) -> str:
        return f"words{self.vocab_size}"

    @property
    def fingerprint(self) -> str:
        return f"words-crc32-v1-{self.vocab_size}"

    def encode(self, texts: Sequence[str], max_length: int) -> np.ndarray:
        buckets = self.vocab_size - 2
        rows = [
            [START, *(2 + zlib.crc32(w.encode()) % buckets for w in _WORD.findall(t.lower()))]
            for t in texts
        ]
        return _padded(rows, max_length, self.pad_id)


def builtin_tokenizer(kind: str, vocab_size: int) -> ByteTokenizer | WordTokenizer:
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "words":
        if vocab_size < 3:
            raise ConfigError(f"tokenizer 'words': vocab_size={vocab_size} must be >= 3")
        return WordTokenizer(vocab_size)
    raise ConfigError(f"tokenizer {kind!r} is not one of ['bytes', 'words']")


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TextIndex:
    """Every sample of a text dataset: where it comes from and its label, before tokenising."""

    dataset_dir: Path
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    paths: tuple[str, ...]  # "<domain>/<class>/<file>" (folder) or "<domain>/<class>#<k>"
    labels: np.ndarray  # int64 [N]
    domain_ids: np.ndarray  # int64 [N]
    files: tuple[tuple[str, int, int], ...]  # source files (relative path, size, mtime_ns)
    texts: tuple[str, ...] | None  # read already (reviews), or None: read on a cache miss


def read_utf8(path: Path) -> str:
    """A text file's contents; a file that is not UTF-8 is a DataError naming it and the byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"text file {path} is not UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 1]!r}"
            "); convert it, e.g. `iconv -f latin1 -t utf-8`"
        ) from None


def index_text_folder(root: PathLike, spec: DatasetSpec) -> TextIndex:
    """A ``<domain>/<class>/<file>.txt`` tree, scanned without reading (like an image folder)."""
    folder: FolderIndex = scan_image_folder(root, spec)
    return TextIndex(
        folder.dataset_dir,
        folder.domains,
        folder.classes,
        folder.paths,
        folder.labels,
        folder.domain_ids,
        tuple(folder.files()),
        None,
    )


def _review_folder(dataset_dir: Path, domain: str) -> Path:
    names = REVIEW_FOLDERS.get(domain, (domain,))
    for name in names:
        if (dataset_dir / name).is_dir():
            return dataset_dir / name
    raise DataError(
        f"missing domain folder {dataset_dir / names[-1]} (AmazonReviews expects "
        f"{dataset_dir}/<domain>/positive.review and negative.review)"
    )


def read_reviews(path: Path) -> list[str]:
    """The ``<review_text>`` of every review in a Blitzer ``.review`` file (HTML entities
    decoded). The 2007 files are mostly ASCII; a file that is not UTF-8 is read as Latin-1, with
    a warning naming it."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        log.warning("%s is not UTF-8; reading it as Latin-1", path)
        text = data.decode("latin-1")
    reviews = [html.unescape(t) for t in _REVIEW_TEXT.findall(text)]
    if not reviews:
        hint = (
            " (it looks like processed_acl's word:count features, which hold no text: use "
            "sorted_data_acl from unprocessed.tar.gz)"
            if "#label#:" in text
            else ""
        )
        raise DataError(f"review file {path} has no <review_text> elements{hint}")
    return reviews


def index_reviews(root: PathLike, spec: DatasetSpec) -> TextIndex:
    """The Blitzer review files: each file read (cheap) to count and hold its reviews."""
    dataset_dir = resolve_dataset_dir(root, spec)
    domains, classes = spec.domains or (), spec.classes or ()
    paths, labels, domain_ids, files, texts = [], [], [], [], []
    for d, domain in enumerate(domains):
        folder = _review_folder(dataset_dir, domain)
        for c, cls in enumerate(classes):
            path = folder / REVIEW_FILES[cls]
            if not path.is_file():
                raise DataError(f"missing review file {path}")
            reviews = read_reviews(path)
            st = path.stat()
            files.append((str(path.relative_to(dataset_dir)), st.st_size, st.st_mtime_ns))
            paths += [f"{domain}/{cls}#{k}" for k in range(len(reviews))]
            labels += [c] * len(reviews)
            domain_ids += [d] * len(reviews)
            texts += reviews
    return TextIndex(
        dataset_dir,
        tuple(domains),
        tuple(classes),
        tuple(paths),
        np.array(labels, dtype=np.int64),
        np.array(domain_ids, dtype=np.int64),
        tuple(files),
        tuple(texts),
    )


# --------------------------------------------------------------------------- loading


def load_text_dataset(
    name: str,
    root: PathLike | None,
    tokenizer: Tokenizer,
    max_length: int,
    cache_dir: PathLike | None = None,
) -> DomainDataset:
    """A text dataset as int32 token ids ``[N, max_length]``, tokenised at most once per
    (files, tokenizer, max_length)."""
    spec = get_spec(name)
    if not spec.is_text:
        raise DataError(f"dataset {spec.name} is not a text dataset")
    if root is None:
        raise DataError(
            f"dataset {spec.name} needs a data root (the folder holding "
            f"{spec.folder or 'its domain folders'})"
        )
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"max_length must be an integer >= 2, got {max_length!r}")
    index = index_reviews(root, spec) if spec.reader == "reviews" else index_text_folder(root, spec)
    ids = _cached_ids(
        spec, index, tokenizer, max_length, Path(cache_dir or cache.default_cache_dir())
    )
    return DomainDataset(
        name=spec.name,
        domains=index.domains,
        classes=index.classes,
        images=ids,
        labels=torch.from_numpy(index.labels),
        domain_ids=torch.from_numpy(index.domain_ids),
        paths=index.paths,
        pad_id=tokenizer.pad_id,
    )


def _cached_ids(
    spec: DatasetSpec, index: TextIndex, tokenizer: Tokenizer, max_length: int, cache_dir: Path
) -> torch.Tensor:
    extra = {"tokenizer": tokenizer.fingerprint, "samples": _digest(index.paths)}
    key = cache.content_key(spec.name, max_length, index.domains, index.classes, index.files, extra)
    entry = cache.CacheEntry.locate(
        cache_dir, f"{spec.name}-{tokenizer.name}", max_length, index.dataset_dir, unit="tok"
    )

    def tokenise(writer: cache.CacheWriter) -> dict[str, str]:
        if not index.paths:
            raise DataError(f"{index.dataset_dir} holds no text samples")
        log.info("tokenising %d texts of %s", len(index.paths), index.dataset_dir)
        for start in range(0, len(index.paths), ENCODE_CHUNK):
            texts = _texts(index, start, start + ENCODE_CHUNK)
            writer.append(tokenizer.encode(texts, max_length).astype(np.int32, copy=False))
        return {}

    shape = (max_length,)
    return cache.read_or_build(entry, key, len(index.paths), shape, tokenise, np.int32).images


def _texts(index: TextIndex, start: int, stop: int) -> list[str]:
    if index.texts is not None:
        return list(index.texts[start:stop])
    return [read_utf8(index.dataset_dir / rel) for rel in index.paths[start:stop]]


def _digest(paths: Sequence[str]) -> str:
    """The sample list (reviews are several per file, so the files alone do not fix it)."""
    return hashlib.sha256("\n".join(paths).encode()).hexdigest()
