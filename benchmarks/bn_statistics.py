"""How good are the BatchNorm statistics a client is evaluated with?

For every client at every evaluated round, the id accuracy (its own validation split) of the
model it would use, twice: with the BatchNorm statistics the method gives it, and with statistics
re-estimated under that model's weights over the client's training data (PreciseBN, no labels).
A large gap means the statistics do not belong to the weights: under FedBN/SiloBN a client's
statistics were computed under its pre-aggregation weights, and it is evaluated with the averaged
ones. Run on one target, e.g.:

    python benchmarks/bn_statistics.py configs/baselines/fedbn.yaml dataset.root=../shared/data \
        'split.targets=[art_painting]' rounds=40 eval.every=2
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from feddomain.config import load_config
from feddomain.data.federated import federations
from feddomain.federation.simulation import Simulation
from feddomain.federation.training import recalibrate_batchnorm


def accuracy(sim: Simulation, cid: int) -> float:
    """id accuracy (%) of the model now loaded in the simulator's shared model object."""
    result = sim.score_id(cid)
    return float("nan") if result is None else 100 * result.acc


def gaps(sim: Simulation, rnd: int, record: dict[str, Any] | None) -> None:
    if record is None:
        return
    cells = []
    for cid in range(sim.data.n_clients):
        sim.load_eval_model(cid, sim.server.eval_arrays(cid))
        kept = accuracy(sim, cid)
        generator = torch.Generator().manual_seed(rnd)
        recalibrate_batchnorm(sim.model, sim.data.train[cid], sim.cfg.train.batch_size, generator)
        cells.append(f"{kept:5.1f} -> {accuracy(sim, cid):5.1f}")
    print(f"round {rnd:3d}  " + "   ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, [*args.overrides, "checkpoint.every=0"])
    torch.set_num_threads(cfg.threads or 1)
    data = federations(cfg)[0]
    print(
        f"{cfg.algorithm.name} on {data.split.name}: client id accuracy (%), the method's "
        "BatchNorm statistics -> statistics re-estimated under the evaluated weights"
    )
    with tempfile.TemporaryDirectory() as out:
        sim = Simulation(cfg, data, Path(out))
        sim.progress = lambda rnd, record: gaps(sim, rnd, record)
        sim.run()


if __name__ == "__main__":
    main()
