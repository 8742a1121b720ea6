"""``feddomain data describe``: what a dataset folder holds and what is wrong with it.

Unlike loading, describing never stops at the first problem: it scans leniently, reads every
image's header (size, mode, format; optionally decodes it fully) and reports all problems, so a
user can fix a folder in one pass before training on it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from PIL import Image
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from feddomain.data.sources import (
    PathLike,
    get_spec,
    load_dataset,
    scan_image_folder,
    split_list_problems,
)
from feddomain.errors import DataError


@dataclass(frozen=True, eq=False)
class DatasetDescription:
    """Counts per domain x class, image geometry and the problems found in one dataset."""

    name: str
    location: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    counts: np.ndarray  # int64 [n_domains, n_classes]
    width: tuple[int, int] | None  # (min, max) over readable images
    height: tuple[int, int] | None
    modes: dict[str, int]  # Pillow mode -> images ("RGB", "L", "P", ...)
    formats: dict[str, int]  # Pillow format -> images ("JPEG", "PNG", ...)
    problems: tuple[str, ...]
    ignored: tuple[str, ...] = ()  # non-image entries found in class folders

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def __rich__(self) -> RenderableType:
        return Group(self._counts_table(), self._summary(), self._problems())

    def _counts_table(self) -> Table:
        # Classes as rows: DomainNet has 345 classes but only 6 domains.
        table = Table(title=f"{self.name}: {self.total} images in {self.location}")
        table.add_column("class")
        for domain in self.domains:
            table.add_column(domain, justify="right")
        table.add_column("total", justify="right", style="bold")
        for c, cls in enumerate(self.classes):
            table.add_row(cls, *map(str, self.counts[:, c]), str(self.counts[:, c].sum()))
        table.add_row(
            "total",
            *map(str, self.counts.sum(axis=1)),
            str(self.total),
            style="bold",
            end_section=True,
        )
        return table

    def _summary(self) -> Text:
        def tally(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"

        size = "-"
        if self.width and self.height:
            size = (
                f"width {self.width[0]}..{self.width[1]}, height {self.height[0]}..{self.height[1]}"
            )
        lines = [
            f"image size: {size}",
            f"modes: {tally(self.modes)}",
            f"formats: {tally(self.formats)}",
        ]
        if self.ignored:
            lines.append(f"ignored {len(self.ignored)} non-image entries, e.g. {self.ignored[0]}")
        return Text("\n".join(lines))

    def _problems(self) -> Text:
        if not self.problems:
            return Text("no problems found", style="green")
        text = Text(f"{len(self.problems)} problem(s):\n", style="bold red")
        text.append("\n".join(f"  - {p}" for p in self.problems), style="red")
        return text


def describe(
    name: str, root: PathLike | None, *, deep: bool = False, resolution: int = 32
) -> DatasetDescription:
    """Describe a registered dataset found under ``root``.

    Reads each image's header; with ``deep`` decodes every image fully, which also catches
    truncated files (slower: about as long as a first load). Official split lists, where the
    dataset has them, are checked too. Generated sources (no folder) are
    built at ``resolution`` and described from the result.
    """
    spec = get_spec(name)
    if spec.kind != "image":
        raise DataError(
            f"`data describe` reads image folders; {spec.name} is a {spec.kind} dataset, whose "
            "problems are reported when it loads (`feddomain run CONFIG --dry-run`)"
        )
    if spec.builtin is not None:
        data = load_dataset(spec.name, root, resolution)
        side = (data.resolution, data.resolution)
        return DatasetDescription(
            name=spec.name,
            location="the package (generated)",
            domains=data.domains,
            classes=data.classes,
            counts=data.counts(),
            width=side,
            height=side,
            modes={"RGB": len(data)},
            formats={},
            problems=(),
        )
    index = scan_image_folder(root, spec, strict=False)
    counts = np.zeros((len(index.domains), len(index.classes)), dtype=np.int64)
    np.add.at(counts, (index.domain_ids, index.labels), 1)
    widths, heights, modes, formats = [], [], Counter(), Counter()
    problems = list(index.problems)
    for rel in index.paths:
        path = index.dataset_dir / rel
        try:
            with Image.open(path) as img:
                if deep:
                    img.load()
                widths.append(img.width)
                heights.append(img.height)
                modes[img.mode] += 1
                formats[img.format or "?"] += 1
        except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
            problems.append(f"unreadable image {path}: {type(exc).__name__}: {exc}")
    problems += split_list_problems(root, spec.name, set(index.paths))
    return DatasetDescription(
        name=spec.name,
        location=str(index.dataset_dir),
        domains=index.domains,
        classes=index.classes,
        counts=counts,
        width=(min(widths), max(widths)) if widths else None,
        height=(min(heights), max(heights)) if heights else None,
        modes=dict(modes),
        formats=dict(formats),
        problems=tuple(problems),
        ignored=index.ignored,
    )


def render(description: DatasetDescription, console: Console | None = None) -> None:
    """Print ``description`` (counts table, image summary, problems) to ``console`` or stdout."""
    (console or Console()).print(description)
