"""Server cost per round of FedGMA and FedDG-GA against FedAvg, on the same client replies.

Each method's server part aggregates the very same replies: N LeNet-5 models (PACS: 7 classes,
32 px) near a common global model, each with its sample count and, for FedDG-GA, its two losses.
FedDG-GA is timed in rounds where the weights are adjusted (every client has a previous local
loss). Calls alternate between the methods so that load from other processes hits them alike;
the median of each is reported, with its ratio to FedAvg's median. One thread. Run:

    python benchmarks/server_cost.py                     # 10 and 100 clients
    python benchmarks/server_cost.py --clients 10 100 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from feddomain.algorithms import resolve_method
from feddomain.algorithms.base import ServerAlgorithm, ServerContext
from feddomain.federation.messages import Message
from feddomain.federation.training import get_arrays
from feddomain.models import build_model

METHODS = {
    "fedavg": {},
    "fedgma": {"tau": 0.4},
    "feddg_ga": {"d0": 1 / 3},
}


def make_replies(n_clients: int, seed: int = 0) -> tuple[Callable, list[tuple[int, Message]]]:
    """A model factory and ``n_clients`` replies: the global model plus small random updates."""

    def factory() -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model("lenet5", 7, resolution=32)

    base = get_arrays(factory())
    g = torch.Generator().manual_seed(seed + 1)
    replies = []
    for cid in range(n_clients):
        arrays = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        losses = torch.rand(2, generator=g, dtype=torch.float64)
        scalars = {
            "num_examples": 50 + cid % 7 * 10,
            "loss": float(losses[1]),
            "global_loss": 1.0 + float(losses[0]),
            "local_loss": 1.0 + float(losses[1]),
        }
        replies.append((cid, Message("fit", arrays, scalars)))
    return factory, replies


def build_server(name: str, factory: Callable, n_clients: int) -> ServerAlgorithm:
    method = resolve_method(name, METHODS[name])
    return method.make_server(ServerContext(factory, n_clients, seed=0, rounds=1000))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| clients | " + " | ".join(f"{m} (ms)" for m in METHODS) + " | fedgma / fedavg "
          "| feddg_ga / fedavg |")  # fmt: skip
    print("|---:|" + "---:|" * (len(METHODS) + 2))
    for n in args.clients:
        factory, replies = make_replies(n)
        servers = {name: build_server(name, factory, n) for name in METHODS}
        for server in servers.values():  # warm-up; FedDG-GA learns every client's local loss
            server.aggregate(1, iter(replies))
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        for r in range(args.repeats):
            for name, server in servers.items():
                t0 = time.perf_counter()
                server.aggregate(2 + r, iter(replies))
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1000 for name, t in times.items()}
        cells = " | ".join(f"{med[m]:.1f}" for m in METHODS)
        ratios = f"{med['fedgma'] / med['fedavg']:.2f} | {med['feddg_ga'] / med['fedavg']:.2f}"
        print(f"| {n} | {cells} | {ratios} |")


if __name__ == "__main__":
    main()
