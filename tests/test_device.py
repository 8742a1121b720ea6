"""``device`` / ``precision`` / ``deterministic``: refused at config time when the machine cannot
honour them, recorded in provenance, and (where CUDA exists) data, model and training on the GPU.

The tests marked ``cuda`` run only where a CUDA device is present; on a CPU machine they skip
with that reason (the only skips CI allows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from feddomain.cli import main
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.device import apply_determinism
from tests.resume_helpers import metrics_of, summary_of, write_config

TINY = {
    "seed": 1,
    "rounds": 2,
    "dataset": {"name": "digits_embedded", "resolution": 32},
    "split": {"scheme": "lodo", "targets": ["grey"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5"},
    "train": {"batch_size": 64, "lr": 0.002, "mean": [0.5] * 3, "std": [0.5] * 3},
    "eval": {"every": 1},
    "checkpoint": {"every": 0},
    "threads": 1,
}
cuda = pytest.mark.cuda


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees no CUDA device, whatever the machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _run(tmp_path: Path, name: str, **overrides) -> Path:
    config = write_config(tmp_path / f"{name}.yaml", {**TINY, **overrides})
    out = tmp_path / name
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0
    return out


def test_cuda_without_cuda_is_refused_at_config_time(no_cuda):
    """Catches a cuda config accepted on a CPU machine (failing, or silently on the CPU, only
    once training starts); the message names the value and the way out."""
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=rf"device '{spec}': no CUDA device is available"):
            load_config(None, [f"device={spec}"])
    with pytest.raises(ConfigError, match="use device: auto or cpu"):
        load_config(None, ["device=cuda"])


def test_a_device_index_past_the_devices_present_is_refused(monkeypatch: pytest.MonkeyPatch):
    """Catches cuda:N accepted for an N the machine does not have."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert load_config(None, ["device=cuda:0"]).device == "cuda:0"
    with pytest.raises(ConfigError, match=r"device 'cuda:1': this machine has 1 CUDA device"):
        load_config(None, ["device=cuda:1"])


def test_malformed_devices_and_bf16_on_the_cpu_are_refused(no_cuda):
    """Catches a typo ('gpu', 'cuda1') reaching torch (or ignored), and bf16 asked for on a
    CPU run, where it would change today's CPU numbers."""
    for spec in ("gpu", "cuda1", "CPU", "cuda:x"):
        with pytest.raises(ConfigError, match=rf"device '{spec}' is not one of auto, cpu, cuda"):
            load_config(None, [f"device={spec}"])
    with pytest.raises(ConfigError, match="precision 'bf16' needs a CUDA device; device 'auto'"):
        load_config(None, ["precision=bf16"])


def test_auto_falls_back_to_the_cpu_and_says_so_in_provenance(no_cuda, tmp_path: Path):
    """Catches auto choosing the CPU without a word (the run's provenance must say why)."""
    out = _run(tmp_path, "auto")
    provenance = yaml.safe_load((out / "provenance.yaml").read_text())
    assert provenance["device"] == "cpu (auto: no CUDA device available)"
    assert yaml.safe_load((out / "config.yaml").read_text())["device"] == "auto"


def test_determinism_is_set_both_ways():
    """Catches ``deterministic: false`` leaving a previous run's setting in place (a sweep
    worker runs many configs in one process)."""
    try:
        apply_determinism(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        apply_determinism(False)
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
    finally:
        apply_determinism(False)


def test_deterministic_mode_leaves_cpu_results_unchanged(tmp_path: Path):
    """Catches deterministic mode changing CPU numbers or refusing a CPU op the training loop
    uses (torch raises for ops without a deterministic implementation)."""
    try:
        strict = _run(tmp_path, "strict", deterministic=True, device="cpu")
    finally:
        apply_determinism(False)
    plain = _run(tmp_path, "plain", device="cpu")
    assert summary_of(strict) == summary_of(plain)
    assert metrics_of(strict) == metrics_of(plain)


# ---------------------------------------------------------------------- CUDA only
@cuda
def test_cuda_run_keeps_data_and_model_on_the_gpu_and_replies_on_the_cpu(tmp_path: Path):
    """Catches data re-sent to the GPU per batch (it must be moved once), and device tensors
    leaking into what the server keeps."""
    from feddomain.data.federated import federations
    from feddomain.federation.simulation import Simulation

    cfg = load_config(write_config(tmp_path / "c.yaml", TINY), ["device=cuda"])
    sim = Simulation(cfg, federations(cfg)[0], tmp_path)
    assert sim.data.train[0].inputs.is_cuda and sim.data.targets["grey"].inputs.is_cuda
    assert all(p.is_cuda for p in sim.model.parameters())
    sim.run()
    assert all(not t.is_cuda for t in sim.server.eval_arrays(0).values())


@cuda
def test_cuda_run_agrees_with_the_cpu_run(tmp_path: Path):
    """Catches a GPU path that trains something else (other batches, other init): after two
    rounds the accuracies agree with the CPU's within float noise."""
    gpu = summary_of(_run(tmp_path, "gpu", device="cuda"))
    cpu = summary_of(_run(tmp_path, "cpu", device="cpu"))
    assert gpu["id_acc"] == pytest.approx(cpu["id_acc"], abs=0.03)
    assert gpu["ood_acc"] == pytest.approx(cpu["ood_acc"], abs=0.03)


@cuda
def test_deterministic_cuda_runs_are_bit_identical(tmp_path: Path):
    """Catches the cuDNN/cuBLAS settings not applied: two deterministic GPU runs must agree
    exactly."""
    try:
        first = _run(tmp_path, "a", device="cuda", deterministic=True)
        second = _run(tmp_path, "b", device="cuda", deterministic=True)
    finally:
        apply_determinism(False)
    assert summary_of(first) == summary_of(second)
    assert metrics_of(first) == metrics_of(second)


@cuda
def test_bf16_run_trains(tmp_path: Path):
    """Catches bf16 autocast breaking training (dtype clashes, non-finite losses)."""
    summary = summary_of(_run(tmp_path, "bf16", device="cuda", precision="bf16"))
    assert summary["id_acc"] > 0.2 and not summary["rejected_updates"]
