"""The WILDS 2.0 layout (IWildCam): one ``metadata.csv`` names every image, its label, its camera
location (the domain) and its official split.

What the WILDS download (``wilds`` package, ``iwildcam_v2.0``) unpacks to, and what is read::

    <root>/iwildcam_v2.0/metadata.csv     columns used: split, location_remapped, y, filename
    <root>/iwildcam_v2.0/categories.csv   optional: columns y, name (class names; else "class_<y>")
    <root>/iwildcam_v2.0/train/<filename> every image of every split (WILDS keeps them all there)

Each ``location_remapped`` value k is the domain ``location_<k>`` (domains in numeric order); the
classes are 0 .. max(y) (182 for IWildCam). Images are decoded once into the same cache as
folder datasets; each sample keeps its official split (``DomainDataset.official_splits``), which
``split.scheme: wilds`` uses (``data/federated.py``).
"""

from __future__ import annotations

import csv
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from feddomain.data.dataset import DomainDataset
from feddomain.data.sources import DatasetSpec, FolderIndex, load_indexed_images
from feddomain.errors import DataError

METADATA = "metadata.csv"
CATEGORIES = "categories.csv"
IMAGES = "train"  # WILDS stores the images of every split in this folder
COLUMNS = ("split", "location_remapped", "y", "filename")


def wilds_dir(root: str | os.PathLike[str], folder: str) -> Path:
    """``root/<folder>`` (e.g. iwildcam_v2.0), or ``root`` itself if it holds ``metadata.csv``."""
    root = Path(root).expanduser()
    for candidate in (root / folder, root):
        if (candidate / METADATA).is_file():
            return candidate
    raise DataError(
        f"no {METADATA} in {root / folder} (nor in {root}): a WILDS dataset folder holds "
        f"{METADATA} and the images under {IMAGES}/ (download it with the `wilds` package, "
        "docs/datasets.md)"
    )


def read_metadata(path: Path, splits: tuple[str, ...]) -> list[tuple[str, int, int, str]]:
    """(split, location, label, filename) per row of a WILDS ``metadata.csv``, in file order."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(
                    f"{path} lacks the WILDS column(s) {missing}; it has {reader.fieldnames}"
                )
            rows = []
            for line, row in enumerate(reader, start=2):
                if row["split"] not in splits:
                    raise DataError(
                        f"{path}:{line}: split {row['split']!r} is not one of {list(splits)}"
                    )
                try:
                    location, label = int(row["location_remapped"]), int(row["y"])
                except ValueError:
                    raise DataError(
                        f"{path}:{line}: location_remapped {row['location_remapped']!r} and y "
                        f"{row['y']!r} must be integers"
                    ) from None
                if location < 0 or label < 0:
                    raise DataError(f"{path}:{line}: location_remapped and y must be >= 0")
                rows.append((row["split"], location, label, row["filename"]))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if not rows:
        raise DataError(f"{path} lists no images")
    return rows


def class_names(folder: Path, n_classes: int) -> tuple[str, ...]:
    """Names from ``categories.csv`` (columns y, name) where present, else ``class_<y>``."""
    names = [f"class_{y}" for y in range(n_classes)]
    path = folder / CATEGORIES
    if not path.is_file():
        return tuple(names)
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if row.get("y", "").isdigit() and int(row["y"]) < n_classes and row.get("name"):
                names[int(row["y"])] = row["name"]
    return tuple(names)


def load_wilds(
    spec: DatasetSpec,
    root: str | os.PathLike[str],
    resolution: int,
    cache_dir: Path,
    *,
    skip_corrupt: bool,
) -> DomainDataset:
    """A WILDS image dataset with every sample's location domain and official split."""

    folder = wilds_dir(root, spec.folder)
    rows = read_metadata(folder / METADATA, spec.splits)
    locations = sorted({loc for _, loc, _, _ in rows})
    domain_of = {loc: i for i, loc in enumerate(locations)}
    images = folder / IMAGES
    stats, missing = [], []
    for _, _, _, name in rows:
        try:
            st = (images / name).stat()
        except OSError:
            missing.append(name)
            continue
        stats.append((st.st_size, st.st_mtime_ns))
    if missing:
        raise DataError(
            f"{len(missing)} image(s) named in {folder / METADATA} are not in {images}, e.g. "
            f"{images / missing[0]}"
        )
    n_classes = max(label for _, _, label, _ in rows) + 1
    index = FolderIndex(
        dataset_dir=images,
        domains=tuple(f"location_{loc}" for loc in locations),
        classes=class_names(folder, n_classes),
        paths=tuple(name for *_, name in rows),
        labels=np.array([label for _, _, label, _ in rows], dtype=np.int64),
        domain_ids=np.array([domain_of[loc] for _, loc, _, _ in rows], dtype=np.int64),
        sizes=np.array([s for s, _ in stats], dtype=np.int64),
        mtimes_ns=np.array([m for _, m in stats], dtype=np.int64),
    )
    if len(set(index.paths)) != len(index.paths):
        raise DataError(f"{folder / METADATA} names some image file more than once")
    dataset = load_indexed_images(spec, index, resolution, cache_dir, skip_corrupt)
    split_of = {name: split for split, _, _, name in rows}
    return replace(dataset, official_splits=tuple(split_of[p] for p in dataset.paths))
