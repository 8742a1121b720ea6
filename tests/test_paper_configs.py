"""Each seed paper's own full-budget configuration (the GPU settings under ``configs/<method>/``)
runs one round on the CPU at a tiny size, so a user with a GPU can launch it as shipped.

Tiny means: images of at most 64 px (ResNets' last BatchNorm layers need 2x2 maps for FedFD's
instance statistics) on a stand-in dataset with the paper dataset's real domains and
classes (a few images per class and domain), one optimiser step per client, one round, and
randomly initialised weights saved where the config expects its local ImageNet file. Every other
setting is the paper's: model, method and its hyper-parameters, clients, sampling, stations,
splits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torchvision

from feddomain.config import ExperimentConfig, load_config
from feddomain.data.dataset import DomainDataset
from feddomain.data.federated import build_federated_data, experiment_splits
from feddomain.data.sources import get_spec
from tests.engine_helpers import run_sim

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_CONFIGS = [
    "fedfd/officehome_resnet18", "fedfd/pacs_resnet18", "fedfd/vlcs_resnet18",
    "fedfd/pacs_effnet64",
    "fedvr/pacs_resnet50_paper",
    "fisc/pacs_lodo", "fisc/pacs_ltdo", "fisc/pacs_ablation", "fisc/pacs_clients",
    "fisc/pacs_heterogeneity", "fisc/officehome_lodo", "fisc/officehome_ltdo",
    "iwildcam/fisc_lambda",
    "hfedatm/pacs_paper", "hfedatm/officehome_paper", "hfedatm/terrainc_paper",
    "hfedatm/pacs_fig2_baselines",
    "pacs/hfedf_d1", "pacs/hfedf_d2", "officehome/hfedf_d1", "officehome/hfedf_d2",
    "vlcs/hfedf_d1", "vlcs/hfedf_d2",
]  # fmt: skip
SIDE = 64  # the largest tiny side; a config at a smaller one keeps its own
TERRA_CLASSES = 10  # TerraIncognita's classes are read from its folders
IWILDCAM = {"classes": 182, "train_locations": 243}


def stand_in(cfg: ExperimentConfig) -> DomainDataset:
    """Random images of the config's dataset with its real domain and class names, as many per
    (domain, class) as give every client a full batch or 8 images (a lambda split is uneven);
    IWildCam: 243 training locations of 2 images, one location each for WILDS' pooled val and
    test sets."""
    spec = get_spec(cfg.dataset.name)
    g = torch.Generator().manual_seed(0)
    if spec.kind == "wilds":
        n_train = IWILDCAM["train_locations"]
        held_out = [torch.full((8,), n_train), torch.full((8,), n_train + 1)]  # val, test
        domain_ids = torch.cat([torch.arange(n_train).repeat_interleave(2), *held_out])
        splits = ("train",) * (2 * n_train) + ("val",) * 8 + ("test",) * 8
        domains = tuple(f"location_{i}" for i in range(n_train + 2))
        classes = tuple(str(c) for c in range(IWILDCAM["classes"]))
        labels = torch.arange(len(domain_ids)) % len(classes)
    else:
        domains = spec.domains
        classes = spec.classes or tuple(f"class_{c}" for c in range(TERRA_CLASSES))
        per_client = cfg.train.batch_size + 8 if cfg.train.drop_last else 8
        per_domain = 1.25 * per_client * cfg.partition.n_clients / (len(domains) - 1)
        per_cell = max(3, math.ceil(per_domain / len(classes)))
        cells = len(domains) * len(classes) * per_cell
        domain_ids = torch.arange(cells) // (len(classes) * per_cell)
        labels = torch.arange(cells) % len(classes)
        splits = ()
    side = cfg.dataset.resolution
    images = torch.randint(0, 256, (len(labels), 3, side, side), generator=g, dtype=torch.uint8)
    return DomainDataset(
        spec.name, tuple(domains), tuple(classes), images, labels.long(), domain_ids.long(),
        official_splits=splits,
    )  # fmt: skip


def _weights_file(cfg: ExperimentConfig, tmp_path: Path) -> list[str]:
    """Where the config asks for local ImageNet ResNet weights: a torchvision state dict of
    the same architecture (random values) and the override pointing at it."""
    if "weights_path" not in cfg.model.options:
        return []
    path = tmp_path / f"{cfg.model.name}.pth"
    torch.save(getattr(torchvision.models, cfg.model.name)().state_dict(), path)
    return [f"model.options.weights_path={path}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_a_papers_own_configuration_runs_one_round_on_the_cpu(name: str, tmp_path: Path):
    """Catches a shipped full-budget configuration that validates but fails when it runs
    (weights it cannot load, a partition its clients or stations cannot fill, a method and
    model that do not fit together, WILDS splits): one round trains every sampled client and
    scores the held-out domain."""
    path = CONFIGS / f"{name}.yaml"
    shipped = load_config(path, ["dataset.root=/data"])
    side = min(SIDE, shipped.dataset.resolution)
    tiny = [
        "dataset.root=/data", f"dataset.resolution={side}", f"dataset.cache_dir={tmp_path}",
        "rounds=1", "train.max_steps=1", "eval.batch_size=64", "checkpoint.every=0",
        "split.official_lists=false",  # the stand-in has no list files
        *_weights_file(shipped, tmp_path),
    ]  # fmt: skip
    if shipped.model.backbone_resolution:
        tiny.append(f"model.backbone_resolution={side}")
    cfg = load_config(path, tiny)
    dataset = stand_in(cfg)
    split = experiment_splits(cfg, dataset)[0]
    sim = run_sim(cfg, tmp_path / "run", build_federated_data(cfg, dataset, split))
    (record,) = sim.records
    assert record["round"] == 1 and 0.0 <= record["ood_acc"] <= 1.0
    assert (cfg.algorithm.name, cfg.model.name) == (shipped.algorithm.name, shipped.model.name)
    assert cfg.partition.n_clients == shipped.partition.n_clients
