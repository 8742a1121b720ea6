"""Local-training throughput inside the simulator vs a bare PyTorch loop on the same batches.

Both train the same freshly initialised model on the same client tensor with the same batch
order, normalisation and optimiser; the simulator adds its round machinery (message copies,
state-dict load/save, optimiser creation per round, NaN checks, phase timing). Runs alternate so
load from other processes hits both alike; the median of each is reported. Run:

    python benchmarks/simulator_throughput.py                       # embedded digits, LeNet-5
    python benchmarks/simulator_throughput.py --dataset pacs --root ../shared/data
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from feddomain.config import load_config
from feddomain.data.federated import (
    build_federated_data,
    experiment_splits,
    load_experiment_dataset,
)
from feddomain.federation.simulation import Simulation, make_optimizer_factory
from feddomain.federation.topology import CLIENT_TRAIN, INIT, derive_seed
from feddomain.models import build_model


def bare_loop(cfg, data, n_classes: int, rounds: int) -> float:
    """Seconds for ``rounds`` epochs of a plain loop (fresh optimiser per epoch, like FedAvg)."""
    torch.manual_seed(derive_seed(cfg.seed, INIT))
    model = build_model(cfg.model.name, n_classes, resolution=cfg.dataset.resolution)
    make_opt = make_optimizer_factory(cfg)
    bs = cfg.train.batch_size
    start = time.perf_counter()
    for rnd in range(1, rounds + 1):
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, CLIENT_TRAIN, rnd, 0, 0))
        opt = make_opt(list(model.parameters()), cfg.train.lr)
        model.train()
        order = torch.randperm(len(data), generator=gen)
        for s in range(0, len(data), bs):
            idx = order[s : s + bs]
            x = data.transform(data.inputs[idx], gen)
            loss = F.cross_entropy(model(x), data.labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return time.perf_counter() - start


def simulator(cfg, fed) -> float:
    """Seconds of local training the simulator records over the run (evaluation excluded)."""
    with tempfile.TemporaryDirectory() as out:
        sim = Simulation(cfg, fed, Path(out))
        sim.run()
    return sum(r["time"]["train"] for r in sim.round_log)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="digits_embedded")
    p.add_argument("--root", default=None)
    p.add_argument("--model", default="lenet5")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    overrides = [
        f"dataset.name={args.dataset}",
        f"model.name={args.model}",
        f"rounds={args.rounds}",
        f"eval.every={args.rounds}",
        "checkpoint.every=0",
        "partition.n_clients=1",
        "train.batch_size=32",
        "train.mean=[0.5,0.5,0.5]",
        "train.std=[0.5,0.5,0.5]",
    ]
    if args.root:
        overrides.append(f"dataset.root={args.root}")
    cfg = load_config(None, overrides)
    dataset = load_experiment_dataset(cfg)
    split = experiment_splits(cfg, dataset)[0]
    cfg = load_config(None, [*overrides, f"partition.d={len(split.train)}"])
    fed = build_federated_data(cfg, dataset, split)
    n_images = args.rounds * len(fed.train[0])
    bare, sim = [], []
    for _ in range(args.repeats):
        bare.append(n_images / bare_loop(cfg, fed.train[0], len(dataset.classes), args.rounds))
        sim.append(n_images / simulator(cfg, fed))
    b, s = statistics.median(bare), statistics.median(sim)
    print(
        f"{args.dataset} {args.model} @{cfg.dataset.resolution}px, {len(fed.train[0])} images "
        f"x {args.rounds} epochs, {args.repeats} alternating repeats, {args.threads} thread(s)"
    )
    print("| loop | images/s (median) | all repeats |")
    print("|---|---:|---|")
    print(f"| bare PyTorch | {b:,.0f} | {', '.join(f'{v:,.0f}' for v in bare)} |")
    print(f"| simulator | {s:,.0f} | {', '.join(f'{v:,.0f}' for v in sim)} |")
    print(f"\nsimulator / bare = {s / b:.3f}")


if __name__ == "__main__":
    main()
