"""Sites federations (partition ``sites``): each client's data is its own folder.

The exported folders are checked against the partition they came from (every image, label and
domain, exactly), a sites run against the partitioned run it was exported from (equal where the
sample orders agree), and every misconfiguration against its message.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from feddomain.cli import main, run_experiment
from feddomain.config import ExperimentConfig, load_config
from feddomain.data.export import SiteExport, export_sites
from feddomain.data.federated import (
    build_site_data,
    client_indices,
    experiment_splits,
    federations,
    load_experiment_dataset,
)
from feddomain.data.sources import load_site
from feddomain.errors import ConfigError, DataError

PROJECT = Path(__file__).resolve().parents[1]
DEMO = PROJECT / "configs" / "demo.yaml"
BASE = ["rounds=2", "split.targets=[grey]", "train.batch_size=128", "eval.every=1"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[ExperimentConfig, SiteExport]:
    cfg = load_config(DEMO, BASE)
    return cfg, export_sites(cfg, tmp_path_factory.mktemp("export") / "sites")


def sites_config(export: SiteExport, cache: Path, *overrides: str) -> ExperimentConfig:
    return load_config(export.config, [f"dataset.cache_dir={cache}", *overrides])


def rows(images: torch.Tensor, labels: torch.Tensor, domains: list[str]) -> Counter:
    """A multiset of (pixels, label, domain) samples."""
    samples = zip(images, labels, domains, strict=True)
    return Counter((img.numpy().tobytes(), int(y), d) for img, y, d in samples)


def test_exported_sites_hold_exactly_the_partitioned_clients_and_the_target(
    exported: tuple[ExperimentConfig, SiteExport], cache_dir: Path
) -> None:
    cfg, export = exported
    dataset = load_experiment_dataset(cfg)
    (split,) = experiment_splits(cfg, dataset)
    train, val = client_indices(cfg, dataset, split)
    names = [dataset.domains[int(d)] for d in dataset.domain_ids]
    for cid, site in enumerate(export.sites):
        loaded = load_site(site, dataset.classes, 32, cache_dir)
        held = np.union1d(train[cid], val[cid])
        assert export.counts[cid] == len(loaded) == len(held)  # conserved
        expected = rows(dataset.images[held], dataset.labels[held], [names[i] for i in held])
        site_domains = [loaded.domains[int(d)] for d in loaded.domain_ids]
        assert rows(loaded.images, loaded.labels, site_domains) == expected  # lossless, labelled
    target = load_site(export.target, dataset.classes, 32, cache_dir)
    grey = dataset.indices_of("grey")
    assert target.domains == ("grey",)
    assert rows(target.images, target.labels, ["grey"] * len(target)) == rows(
        dataset.images[grey], dataset.labels[grey], ["grey"] * len(grey)
    )


def test_a_sites_run_reproduces_the_partitioned_run_when_sample_orders_agree(
    exported: tuple[ExperimentConfig, SiteExport], cache_dir: Path, tmp_path: Path
) -> None:
    """A site lists its images by (domain, class, file name); the partitioned client keeps
    dataset order. With one domain per client and the embedded digits stored class by class
    (checked below), the two orders are the same, so each site draws the same validation share
    and the same batches: the two runs must be identical."""
    cfg, export = exported
    dataset = load_experiment_dataset(cfg)
    (split,) = experiment_splits(cfg, dataset)
    train, val = client_indices(cfg, dataset, split)
    for part in (np.union1d(t, v) for t, v in zip(train, val, strict=True)):
        assert len(set(dataset.domain_ids[part].tolist())) == 1
        assert np.all(np.diff(dataset.labels[part].numpy()) >= 0)
    (reference,) = run_experiment(cfg, tmp_path / "partitioned", quiet=True)
    (sites,) = run_experiment(sites_config(export, cache_dir), tmp_path / "sites", quiet=True)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (reference, sites))
    for key in ("id_acc", "ood_acc", "per_client", "per_domain", "rounds", "selected_round"):
        assert a[key] == b[key], key
    assert sorted(a["source_domains"]) == b["source_domains"] == ["inverted", "mnistm", "sketch"]


def test_a_site_lacking_classes_keeps_the_federation_label_order(
    tmp_path: Path, cache_dir: Path
) -> None:
    site = tmp_path / "clinic"
    pixels = {"3": 30, "7": 70}
    for cls, value in pixels.items():
        (site / "ward" / cls).mkdir(parents=True)
        Image.new("RGB", (8, 8), (value,) * 3).save(site / "ward" / cls / "a.png")
    classes = tuple(str(c) for c in range(10))
    loaded = load_site(site, classes, 8, cache_dir)
    assert loaded.classes == classes and loaded.domains == ("ward",)
    samples = zip(loaded.images, loaded.labels, strict=True)
    by_label = {int(y): int(img[0, 0, 0]) for img, y in samples}
    assert by_label == {3: 30, 7: 70}
    (site / "ward" / "cat").mkdir()
    with pytest.raises(DataError, match=r"class folders \['cat'\] that are not among"):
        load_site(site, classes, 8, cache_dir)


def test_only_the_clients_whose_folders_are_here_get_samples(
    exported: tuple[ExperimentConfig, SiteExport], cache_dir: Path
) -> None:
    """What a SuperNode builds: its own site and the target set; the other clients empty."""
    _, export = exported
    cfg = sites_config(export, cache_dir)
    everything = build_site_data(cfg, [str(s) for s in export.sites], str(export.target))
    mine = build_site_data(cfg, [None, str(export.sites[1]), None], None)
    assert [len(d) for d in mine.train] == [0, len(everything.train[1]), 0]
    assert torch.equal(mine.train[1].inputs, everything.train[1].inputs)
    assert torch.equal(mine.val[1].labels, everything.val[1].labels)
    assert mine.train[0].inputs.shape[1:] == everything.train[0].inputs.shape[1:]
    assert mine.targets == {} and set(everything.targets) == {"grey"}
    assert mine.split.train == (mine.domains[int(np.flatnonzero(mine.client_domain_counts[1])[0])],)


def test_sites_misconfigurations_are_named(
    exported: tuple[ExperimentConfig, SiteExport], cache_dir: Path
) -> None:
    _, export = exported
    with pytest.raises(ConfigError, match=r"n_clients=2 but 'sites' lists 3 folder"):
        sites_config(export, cache_dir, "partition.n_clients=2")
    with pytest.raises(ConfigError, match=r"'sites' is empty: list one folder per client"):
        sites_config(export, cache_dir, "partition.sites=[]")
    with pytest.raises(ConfigError, match=r"needs split.targets"):
        sites_config(export, cache_dir, "split.targets=null")
    with pytest.raises(ConfigError, match=r"split.few_shot cannot be set with partition 'sites'"):
        sites_config(export, cache_dir, "split.few_shot=2")
    with pytest.raises(ConfigError, match=r"dataset.classes applies to partition 'sites' only"):
        load_config(DEMO, ["dataset.classes=[a,b]"])
    with pytest.raises(ConfigError, match=r"needs partition.sites .* and split.target_root"):
        federations(sites_config(export, cache_dir, "split.target_root=null"))
    with pytest.raises(DataError, match=r"has no domain folder\(s\) \['paintings'\]"):
        federations(sites_config(export, cache_dir, "split.targets=[paintings]"))
    with pytest.raises(ConfigError, match=r"split.targets \['sketch'\] must be unseen"):
        federations(sites_config(export, cache_dir, "split.targets=[sketch]"))
    with pytest.raises(ConfigError, match="already holds files"):
        export_sites(load_config(DEMO, BASE), export.config.parent)


def test_data_export_command_writes_every_partitioned_image_once_and_a_sites_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches `feddomain data export` losing, duplicating or misplacing images (per-site and
    target counts not conserved against the partition), or writing a sites.yaml that does not
    name the folders it wrote."""
    out = tmp_path / "sites"
    assert main(["data", "export", str(DEMO), *BASE, "--out", str(out)]) == 0
    printed = "".join(capsys.readouterr().out.split())  # Rich wraps long paths

    cfg = load_config(DEMO, BASE)
    dataset = load_experiment_dataset(cfg)
    (split,) = experiment_splits(cfg, dataset)
    train, val = client_indices(cfg, dataset, split)
    written: list[int] = []
    for cid, (tr, va) in enumerate(zip(train, val, strict=True)):
        site = out / f"site{cid}"
        files = sorted(site.rglob("*.png"))
        held = np.union1d(tr, va)
        # file names are the global indices, in <domain>/<class>/ folders
        assert sorted(int(f.stem) for f in files) == held.tolist()
        for f in files[:: max(1, len(files) // 50)]:
            i = int(f.stem)
            assert f.parent.name == dataset.classes[int(dataset.labels[i])]
            assert f.parent.parent.name == dataset.domains[int(dataset.domain_ids[i])]
        assert f"client{cid}:{len(held)}imagesin{site}" in printed
        written += held.tolist()
    target_files = sorted((out / "target").rglob("*.png"))
    assert sorted(int(f.stem) for f in target_files) == dataset.indices_of("grey").tolist()
    assert {f.parent.parent.name for f in target_files} == {"grey"}
    # conserved: every image of the dataset is in exactly one site or in the target set
    assert sorted(written + [int(f.stem) for f in target_files]) == list(range(len(dataset)))

    raw = yaml.safe_load((out / "sites.yaml").read_text())
    assert raw["partition"] == {
        "name": "sites",
        "n_clients": 3,
        "sites": [str((out / f"site{c}").resolve()) for c in range(3)],
    }
    assert raw["split"]["target_root"] == str((out / "target").resolve())
    assert raw["split"]["targets"] == ["grey"]
    assert f"sitesconfig:{out / 'sites.yaml'}" in printed
    assert load_config(out / "sites.yaml").partition.name == "sites"

    assert main(["data", "export", str(DEMO), *BASE, "--out", str(out)]) == 2  # never overwrites
    assert "already holds files" in capsys.readouterr().err
