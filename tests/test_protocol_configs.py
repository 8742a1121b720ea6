"""The four shipped profiles (configs/protocols/, ../shared/protocols.md): each loads and
resolves, states the protocol's budget, clients and model, and partitions as the protocol
says (dry run on stand-in datasets with the real domains and sizes: no image is read)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from feddomain.config import load_config
from feddomain.data.dataset import DomainDataset
from feddomain.data.federated import client_indices, experiment_splits
from feddomain.models import build_model, configured_skeleton
from feddomain.models.prefix import split_at

PROFILES = Path(__file__).resolve().parents[1] / "configs" / "protocols"
DOMAIN_SIZES = {
    "pacs": {"art_painting": 2048, "cartoon": 2344, "photo": 1670, "sketch": 3929},
    "digits3": {"mnist": 10000, "mnist_m": 9001, "usps": 9298},
}


def profile(name: str, *overrides: str):
    return load_config(PROFILES / f"{name}.yaml", ["dataset.root=/data", *overrides])


def stand_in(name: str, n_classes: int) -> DomainDataset:
    """A dataset with the real domains and sizes and 1-pixel images (partitions read labels and
    domains only)."""
    sizes = DOMAIN_SIZES[name]
    n = sum(sizes.values())
    domain_ids = torch.repeat_interleave(
        torch.arange(len(sizes)), torch.tensor(list(sizes.values()))
    )
    return DomainDataset(
        name,
        tuple(sizes),
        tuple(str(c) for c in range(n_classes)),
        torch.zeros(n, 3, 1, 1, dtype=torch.uint8),
        torch.arange(n) % n_classes,
        domain_ids,
    )


def test_the_profile_folder_holds_exactly_the_four_profiles() -> None:
    """Catches a profile renamed or missing (the campaign's commands name these files)."""
    assert sorted(p.stem for p in PROFILES.glob("*.yaml")) == [
        "digits3-bn",
        "pacs-effnet-frozen",
        "pacs-effnet-tail",
        "pacs-hfedf-cnn",
    ]


def _partition(cfg, dataset: DomainDataset) -> list[tuple[np.ndarray, np.ndarray, str]]:
    out = []
    for split in experiment_splits(cfg, dataset):
        train, val = client_indices(cfg, dataset, split)
        out.append((train, val, split))
    return out


def _check_covers_the_sources(dataset: DomainDataset, train, val, split) -> None:
    """Every source image is in exactly one client's train or validation part."""
    everything = np.concatenate([*train, *val])
    assert len(everything) == len(np.unique(everything))
    sources = np.concatenate([dataset.indices_of(d) for d in split.train])
    assert np.array_equal(np.sort(everything), np.sort(sources))


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_digits3_bn_profile(lam: float) -> None:
    """Catches a digits3-bn profile off its protocol: Digits3 at 32 px, 3 targets, 10 lambda
    clients over the 2 sources (lambda 1.0: each client's count of a domain within 1 of n_d/10),
    all taking part, small_cnn with BatchNorm momentum 0.1 from scratch, batch 64, 1 epoch, and
    a round budget between FedAvg's measured plateau (source validation 98.3% at round 8) and
    the protocol's 50."""
    cfg = profile("digits3-bn", f"partition.lam={lam}")
    assert (cfg.dataset.name, cfg.dataset.resolution, cfg.split.scheme) == ("digits3", 32, "lodo")
    assert (cfg.partition.name, cfg.partition.n_clients, cfg.topology.sample_fraction) == (
        "lambda", 10, 1.0,
    )  # fmt: skip
    assert (cfg.train.local_epochs, cfg.train.batch_size) == (1, 64) and 20 <= cfg.rounds <= 50
    assert not cfg.train.augment.hflip and cfg.train.augment.random_resized_crop is None
    model = build_model(cfg.model.name, 10, resolution=32, **cfg.model.options)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 3 and {b.momentum for b in bns} == {0.1}
    dataset = stand_in("digits3", 10)
    parts = _partition(cfg, dataset)
    assert len(parts) == 3
    for train, val, split in parts:
        assert len(train) == 10 and all(len(t) > 0 for t in train)
        _check_covers_the_sources(dataset, train, val, split)
        if lam == 1.0:
            for d in split.train:
                mine = set(dataset.indices_of(d).tolist())
                counts = [
                    len(mine & set(np.concatenate([t, v]).tolist()))
                    for t, v in zip(train, val, strict=True)
                ]
                assert max(counts) - min(counts) <= 1
    fisc = profile(
        "digits3-bn", "algorithm=fisc", "algorithm.freeze_bn=false", "topology.sample_fraction=0.5"
    )
    assert fisc.topology.sample_fraction == 0.5


@pytest.mark.parametrize("name", ["pacs-effnet-frozen", "pacs-effnet-tail", "pacs-hfedf-cnn"])
def test_pacs_profiles_have_three_single_domain_clients(name: str) -> None:
    """Catches a PACS profile whose clients are not one source domain each (d = 1), or whose
    targets are not the protocol's (all 4; hFedF's: sketch and photo)."""
    cfg = profile(name)
    dataset = stand_in("pacs", 7)
    parts = _partition(cfg, dataset)
    targets = sorted(s.test[0] for _, _, s in parts)
    want = ["photo", "sketch"] if name == "pacs-hfedf-cnn" else sorted(DOMAIN_SIZES["pacs"])
    assert targets == want
    for train, val, split in parts:
        assert len(train) == 3
        _check_covers_the_sources(dataset, train, val, split)
        held = [
            sorted({int(dataset.domain_ids[i]) for i in np.concatenate([t, v])})
            for t, v in zip(train, val, strict=True)
        ]
        assert sorted(h[0] for h in held) == sorted(dataset.domains.index(d) for d in split.train)
        assert all(len(h) == 1 for h in held)


def test_pacs_effnet_frozen_profile() -> None:
    """Catches FedVR's budget or head drifting: frozen Lite0 features at 128 px, a rank-64
    residual adapter + linear head, 200 rounds x 2 epochs, batch 64, pilot sets of 10%."""
    cfg = profile("pacs-effnet-frozen")
    assert cfg.model.frozen and cfg.model.head_adapter == 64 and cfg.dataset.resolution == 128
    assert (cfg.rounds, cfg.train.local_epochs, cfg.train.batch_size) == (200, 2, 64)
    assert cfg.split.pilot_fraction == 0.1 and cfg.eval.selection == "source_val"
    for method in ("fedvr", "hfedf", "pfedhn", "fedsr", "fediir", "fpl", "hfedatm"):
        profile("pacs-effnet-frozen", f"algorithm={method}")
    profile("pacs-effnet-frozen", "algorithm=scaffold", "train.momentum=0")


@pytest.mark.parametrize("cut", [(), ("model.frozen_prefix=6",)], ids=["default", "campaign"])
def test_pacs_effnet_tail_profile(efficientnet_extra, cut) -> None:
    """Catches a tail profile off its protocol, at its own cut and at the campaign's (after
    group 6): Lite0 at 128 px, every BatchNorm momentum 0.1, a frozen, cached prefix, every
    trained BatchNorm layer on maps of at least 4x4 (16 values), no augmentation; MixStyle after
    stage 6 (the campaign's row), a trained stage or the cut."""
    cfg = profile("pacs-effnet-tail", *cut)
    assert cfg.dataset.resolution == 128 and cfg.model.prefix_cache
    assert cfg.model.frozen_prefix is not None and cfg.train.augment.hflip is False
    torch.manual_seed(0)
    options = {**cfg.model.options, "pretrained": False}
    whole = build_model("efficientnet_lite0", 7, resolution=128, **options)
    assert {m.momentum for m in whole.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.1}
    prefix, tail = split_at(whole, cfg.model.frozen_prefix)
    skeleton = configured_skeleton(cfg)  # what config-time checks see: the same tail
    assert [n for n, _ in skeleton.named_modules()] == [n for n, _ in tail.named_modules()]
    seen: dict[str, tuple[int, int]] = {}
    for name, module in tail.named_modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.register_forward_pre_hook(
                lambda m, x, n=name: seen.__setitem__(n, tuple(x[0].shape[-2:]))
            )
    with torch.no_grad():
        tail.eval()(prefix(torch.randn(1, 3, 128, 128)))
    assert len(seen) >= 4 and all(h * w >= 16 for h, w in seen.values()), seen
    for method in ("fedbn", "silobn", "fedfd", "fedfd_a", "fedsam", "feddg_ga"):
        profile("pacs-effnet-tail", *cut, f"algorithm={method}")
    profile("pacs-effnet-tail", *cut, "algorithm=mixstyle", "algorithm.blocks=[6]")


def test_pacs_hfedf_cnn_profile() -> None:
    """Catches hFedF's regime drifting: its CNN (928,199 parameters for 7 classes) at 32 px,
    inputs in [0, 1], 100 rounds x 1 epoch, batch 64, no augmentation."""
    cfg = profile("pacs-hfedf-cnn")
    model = build_model(cfg.model.name, 7, resolution=cfg.dataset.resolution, **cfg.model.options)
    assert sum(p.numel() for p in model.parameters()) == 928_199
    assert (cfg.rounds, cfg.train.local_epochs, cfg.train.batch_size) == (100, 1, 64)
    assert cfg.train.mean is None and cfg.train.std is None and not cfg.train.augment.hflip
    for method in ("hfedf", "pfedhn", "fedprox", "fedsr", "fedgma", "local", "central"):
        profile("pacs-hfedf-cnn", f"algorithm={method}")
