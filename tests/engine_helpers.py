"""Small synthetic federations for engine tests: real pipeline, tiny random images."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import ClientAlgorithm, Hparams, MethodSpec, ServerAlgorithm
from feddomain.algorithms.fedavg import FedAvgHparams
from feddomain.config import ExperimentConfig, validate_config
from feddomain.data.dataset import DomainDataset
from feddomain.data.federated import FederatedData, build_federated_data
from feddomain.data.splits import leave_one_domain_out
from feddomain.federation.simulation import Simulation


def tiny_dataset(
    n_per_domain: int = 40, n_domains: int = 4, n_classes: int = 3, seed: int = 0
) -> DomainDataset:
    """Random 32 px images whose mean colour depends on the class, so models can learn a bit."""
    g = torch.Generator().manual_seed(seed)
    n = n_per_domain * n_domains
    labels = torch.arange(n) % n_classes
    domain_ids = torch.arange(n) // n_per_domain
    base = torch.randint(0, 120, (n, 3, 32, 32), generator=g)
    images = (base + 40 * labels.view(-1, 1, 1, 1) + 10 * domain_ids.view(-1, 1, 1, 1)).clamp(
        0, 255
    )
    return DomainDataset(
        name="tiny",
        domains=tuple(f"d{i}" for i in range(n_domains)),
        classes=tuple(f"c{i}" for i in range(n_classes)),
        images=images.to(torch.uint8),
        labels=labels.long(),
        domain_ids=domain_ids.long(),
    )


def tiny_config(**overrides: object) -> ExperimentConfig:
    raw: dict = {
        "rounds": 3,
        "seed": 0,
        "dataset": {"name": "tiny"},
        "partition": {"n_clients": 3, "d": 1},
        "model": {"name": "lenet5"},
        "train": {"batch_size": 16, "lr": 0.01, "optimizer": "sgd"},
        "eval": {"every": 1},
        "checkpoint": {"every": 0},
    }
    for key, value in overrides.items():
        node = raw
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return validate_config(raw)


def tiny_federation(cfg: ExperimentConfig, dataset: DomainDataset | None = None) -> FederatedData:
    dataset = dataset or tiny_dataset()
    split = leave_one_domain_out(dataset.domains)[0]
    return build_federated_data(cfg, dataset, split)


def run_sim(cfg: ExperimentConfig, out: Path, fed: FederatedData | None = None) -> Simulation:
    out.mkdir(parents=True, exist_ok=True)
    sim = Simulation(cfg, fed or tiny_federation(cfg), out)
    sim.run()
    return sim


@contextmanager
def temporary_method(
    name: str,
    server: type[ServerAlgorithm],
    client: type[ClientAlgorithm],
    hparams: type[Hparams] = FedAvgHparams,
) -> Iterator[None]:
    """Register a method defined by a test for the duration of a ``with`` block."""
    register(MethodSpec(name, server, client, hparams))
    try:
        yield
    finally:
        del METHODS[name]
