"""The α that FedFD-A's instance feature adapters pick, read from finished runs' kept final
states (``final_checkpoint.pt``, ``checkpoint.keep_final``): FedFD-A's mechanism check.

Each adapter starts at α = 0.5 (zero-initialised output layer, fedfda.md CHOICE F4), so a layer
whose α is still 0.5 on every sample has not learnt to choose; one whose α moves away from it,
and varies between samples, picks per image how far to trust the image's own statistics. For
every run, per BatchNorm layer, the mean and standard deviation of α over the unseen domain's
samples ("target") and over the clients' validation samples ("source"), scored with the shared
global model in the adapter mode (FedFD-A's inference). Nothing is trained; a run is scored at
its last round, which need not be the round its selection chose.

    python benchmarks/fedfd_adapter_alpha.py \\
        results/campaign/pacs-effnet-tail/fedfd_a/confirm/seed=1/lodo-*
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from fedfd_test_modes import TestModeScoring

from feddomain.config import load_config
from feddomain.data.federated import federations
from feddomain.errors import FeddomainError
from feddomain.federation import checkpoint
from feddomain.models.fedfd_bn import BNMode, set_bn_mode


def run_alpha(run_dir: Path, overrides: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per place ("target", "source") and layer, [mean, std] of α in ``run_dir``'s final
    state."""
    cfg = load_config(run_dir / "config.yaml", overrides)
    torch.set_num_threads(cfg.torch_threads)
    (fed,) = federations(cfg)
    state = checkpoint.read(run_dir / checkpoint.FINAL, "rerun the run to read its adapters")
    if state is None:
        raise FeddomainError(
            f"{run_dir}: no {checkpoint.FINAL} (the run kept no final state, or this is a copy "
            "of it without its checkpoints)"
        )
    with tempfile.TemporaryDirectory() as scratch:
        sim = TestModeScoring(cfg, fed, Path(scratch))
        sim._load_training_state(state)
        sim.load_eval_model(0, sim.server.eval_arrays(0))
        set_bn_mode(sim.model, BNMode("adapter"), training=False)
        return sim.adapter_alpha()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="finished FedFD-A run directories")
    parser.add_argument("--data", help="dataset.root, where it differs from the runs' own")
    args = parser.parse_args()
    overrides = [f"dataset.root={args.data}"] if args.data else []
    for run_dir in args.runs:
        alpha = run_alpha(run_dir, overrides)
        print(run_dir)
        for place, layers in alpha.items():
            means = np.array([mean for mean, _ in layers.values()])
            stds = np.array([std for _, std in layers.values()])
            print(f"  {place}: {len(means)} layers, alpha mean per layer "
                  f"{' '.join(f'{m:.3f}' for m in means)}; std over samples "
                  f"{' '.join(f'{s:.3f}' for s in stds)}")  # fmt: skip


if __name__ == "__main__":
    main()
