"""One small experiment every registered method can run, on any device: the embedded digits at
32 px, target ``grey`` (5,000 images, so one prediction moves accuracy by 0.02 points), 3 clients
with one source domain each, 2 rounds of at most 15 local steps of plain SGD, evaluation every
round. Shared by the CUDA tests (tests/test_cuda_methods.py) and benchmarks/cuda_methods.py."""

from __future__ import annotations

from pathlib import Path

# methods that refuse a model without BatchNorm layers
BATCHNORM = {"fedbn", "silobn", "fedfd", "fedfd_a"}
# hyper-parameters that keep a method's one-time phases small
CHEAP = {"hfedf_ae_embed": {"ae_epochs": 1, "ae_images": 8}}
ACCURACIES = ("id_acc", "ood_acc")


def method_config(method: str, device: str, precision: str, cache: Path) -> dict:
    """The shared small experiment, adjusted only where the method needs it."""
    raw: dict = {
        "seed": 0,
        "rounds": 2,
        "device": device,
        "precision": precision,
        "dataset": {"name": "digits_embedded", "resolution": 32, "cache_dir": str(cache)},
        "split": {"scheme": "lodo", "targets": ["grey"]},
        "partition": {"n_clients": 3, "d": 1},
        "model": {"name": "small_cnn", "options": {"widths": [8, 16, 32]}}
        if method in BATCHNORM
        else {"name": "lenet5"},
        "train": {"batch_size": 64, "lr": 0.05, "optimizer": "sgd", "max_steps": 15,
                  "mean": [0.5] * 3, "std": [0.5] * 3},
        "eval": {"every": 1},
        "checkpoint": {"every": 0},
        "threads": 1,
        "algorithm": {"name": method, **CHEAP.get(method, {})},
    }
    if method == "mtgc":  # hierarchical only: the 3 clients in one station
        raw["topology"] = {"stations": 1}
    if method.startswith("fedvr"):  # FedVR trains a generated adapter + head on cached features
        raw["model"].update(frozen=True, head_adapter=8)
        raw["split"]["pilot_fraction"] = 0.1
        raw["train"]["drop_last"] = True
    return raw
