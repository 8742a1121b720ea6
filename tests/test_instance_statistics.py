"""Instance statistics over fewer than 16 values per channel are noisy and carry the content
(issue 25: FedFD at 64 px mixed them over 2x2 maps): every layer that takes them warns once,
naming itself and its map size."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from feddomain.algorithms import resolve_method
from feddomain.algorithms.fedfd import FedFDHparams, diversify_mode
from feddomain.data.dataset import DomainDataset
from feddomain.models import build_model
from feddomain.models.fedfd_bn import bn_mode
from tests.engine_helpers import run_sim, tiny_config, tiny_dataset, tiny_federation

LOGGER = "feddomain"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_fedfd_layers_warn_once_for_maps_below_16_values(caplog) -> None:
    """Catches a missing warning on small_cnn at 8 px (BatchNorm maps 8x8, 4x4, 2x2: only the
    third is below 16 values), one for a 4x4 map (16 values are enough), or one per forward."""
    torch.manual_seed(0)
    model = resolve_method("fedfd", {}).prepare_model(build_model("small_cnn", 3, resolution=8))
    model.train()
    x = torch.randn(4, 3, 8, 8)
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        bn_mode(model, diversify_mode(FedFDHparams())),
    ):
        model(x)
        model(x)
    said = _warnings(caplog)
    assert len(said) == 1
    assert "BatchNorm layer 'featurizer.2.1'" in said[0] and "2x2 feature map (4 values" in said[0]


def test_mixstyle_warns_naming_the_stage_and_its_map(caplog) -> None:
    """Catches MixStyle mixing 2x2 maps silently: after small_cnn's second block at 8 px the
    map is 2x2; after the first it is 4x4 (no warning)."""
    torch.manual_seed(0)
    spec = resolve_method("mixstyle", {"p": 1.0, "blocks": [1, 2]})
    model = spec.prepare_model(build_model("small_cnn", 3, resolution=8)).train()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        model(torch.randn(4, 3, 8, 8))
    said = _warnings(caplog)
    assert len(said) == 1
    assert "MixStyle after 'featurizer.1'" in said[0] and "2x2 feature map" in said[0]


def _small(dataset: DomainDataset, side: int) -> DomainDataset:
    images = F.interpolate(dataset.images.float(), size=side, mode="area").round().to(torch.uint8)
    return DomainDataset(
        dataset.name, dataset.domains, dataset.classes, images, dataset.labels,
        dataset.domain_ids,
    )  # fmt: skip


def test_style_methods_warn_when_the_style_maps_are_below_16_values(tmp_path, caplog) -> None:
    """Catches FISC (and CCST, the same style phase) computing styles over a 2x2 grid of DCT
    blocks at 16 px without a word; at 32 px (a 4x4 grid, 16 values) nothing is said."""
    for side, expected in ((16, 1), (32, 0)):
        cfg = tiny_config(rounds=1, dataset__resolution=side, algorithm={"name": "fisc"})
        fed = tiny_federation(cfg, _small(tiny_dataset(n_per_domain=12), side))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            run_sim(cfg, tmp_path / str(side), fed)
        said = [m for m in _warnings(caplog) if "feature map" in m]
        assert len(said) == expected, said
    assert "the adain_dct style backend (AdaIN)" in said_16(tmp_path, caplog)


def said_16(tmp_path, caplog) -> str:
    cfg = tiny_config(rounds=1, dataset__resolution=16, algorithm={"name": "ccst"})
    fed = tiny_federation(cfg, _small(tiny_dataset(n_per_domain=12), 16))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run_sim(cfg, tmp_path / "ccst", fed)
    (message,) = [m for m in _warnings(caplog) if "feature map" in m]
    assert "2x2 feature map (4 values" in message
    return message
