"""Write a config's federation as site folders: a rehearsal of a deployment whose data lives
on its sites (partition ``sites``), built from a benchmark dataset.

``<out>/site<i>/<domain>/<class>/<n>.png`` holds client ``i``'s images (its training and
validation share), ``<out>/target/<domain>/<class>/<n>.png`` the unseen domain(s), and
``<out>/sites.yaml`` the same experiment as a sites config. Images are written losslessly at the
config's resolution, so a site loads exactly the pixels the partitioned run trains on. The sites
run is the same experiment, not the same run: each site draws its own validation share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from feddomain.config import ExperimentConfig, validate_config
from feddomain.data.dataset import DomainDataset
from feddomain.data.federated import client_indices, experiment_splits, load_experiment_dataset
from feddomain.data.sources import get_spec
from feddomain.errors import ConfigError


@dataclass(frozen=True)
class SiteExport:
    sites: list[Path]
    target: Path
    config: Path
    counts: list[int]  # images per site
    split: str  # the split written
    others: list[str]  # the config's other splits, not written


def export_sites(cfg: ExperimentConfig, out: Path) -> SiteExport:
    """Write the first split of ``cfg`` (choose another with ``split.targets``) to ``out``."""
    if cfg.partition.name == "sites":
        raise ConfigError("this config's data already lives in site folders")
    if get_spec(cfg.dataset.name).kind != "image":
        raise ConfigError(
            f"site folders hold images per domain; dataset {cfg.dataset.name!r} is "
            f"{get_spec(cfg.dataset.name).kind} (text, or WILDS' pooled official splits)"
        )
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export folder {out} already holds files; choose a new one")
    dataset = load_experiment_dataset(cfg)
    split, *others = experiment_splits(cfg, dataset)
    train, val = client_indices(cfg, dataset, split)
    sites, counts = [], []
    for cid, (tr, va) in enumerate(zip(train, val, strict=True)):
        sites.append(out / f"site{cid}")
        counts.append(_write_images(dataset, np.union1d(tr, va), sites[-1]))
    target = out / "target"
    _write_images(dataset, np.concatenate([dataset.indices_of(d) for d in split.test]), target)
    config = out / "sites.yaml"
    raw = _sites_config(cfg, dataset, [str(s.resolve()) for s in sites], str(target.resolve()))
    raw["split"]["targets"] = list(split.test)
    validate_config(raw, source="exported sites config")
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return SiteExport(sites, target, config, counts, split.name, [o.name for o in others])


def _write_images(dataset: DomainDataset, indices: np.ndarray, root: Path) -> int:
    """``root/<domain>/<class>/<global index>.png`` for each sample, losslessly; the count."""
    images = dataset.images.numpy()
    for i in np.sort(indices).tolist():
        folder = (
            root
            / dataset.domains[int(dataset.domain_ids[i])]
            / dataset.classes[int(dataset.labels[i])]
        )
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i].transpose(1, 2, 0)).save(folder / f"{i:06d}.png")
    return len(indices)


def _sites_config(
    cfg: ExperimentConfig, dataset: DomainDataset, sites: list[str], target: str
) -> dict[str, Any]:
    raw = cfg.to_dict()
    raw["dataset"] = {
        **raw["dataset"],
        "name": "folder",
        "root": None,
        "classes": list(dataset.classes),
    }
    raw["partition"] = {"name": "sites", "n_clients": len(sites), "sites": sites}
    raw["split"] = {
        **raw["split"],
        "scheme": "lodo",
        "official_lists": False,
        "few_shot": 0,
        "target_root": target,
    }
    return raw
