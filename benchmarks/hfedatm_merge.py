"""HFedATM's server merge per global round against +Avg's, and its parts (hfedatm.md §8 A15).

Both servers merge the very same station payloads: S station models (the global model plus a
small random update each, so the OT alignment has real costs to match), each with its active
client count (unequal) and, for HFedATM, one shrunk input Gram per dense layer (a random PSD
matrix of the layer's input width; a diagonal above ``regmean_max_dim``). The parts are the
server's own `timings()`: `grams` (checking the payloads' Grams), `fot` (filter-wise optimal
transport alignment of every station to the reference one), `regmean` (the float64 RegMean
solve of every dense layer), the rest (the γ-weighted mean of every other array) and, apart,
`objective` (the J(RegMean)/J(mean) diagnostic, ours, outside the merge's time). The
`effnet_head` models are the trainable part on cached EfficientNet-Lite0 features of profile
`pacs-effnet-frozen` (the residual adapter of rank 64 and the head; with FedSR clients, its
Linear(1280 → 2·512) and a classifier on z = 512).
Calls alternate between the two servers; medians of the repeats; one thread. Run:

    python benchmarks/hfedatm_merge.py                          # LeNet-5 and ResNet-18, 10 stations
    python benchmarks/hfedatm_merge.py --models effnet_head effnet_head_fedsr --stations 3
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from feddomain.algorithms import resolve_method
from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.fedsr import FedSRHparams, probabilistic_head
from feddomain.algorithms.hfedatm import ACTIVE
from feddomain.federation.messages import Message
from feddomain.federation.training import get_arrays
from feddomain.merging.gram import gram_shapes
from feddomain.models import build_model
from feddomain.models.frozen import head_model

RESOLUTION = {"lenet5": 32, "resnet18": 64}  # only the dense layers' widths depend on it
PARTS = ("merge", "grams", "fot", "regmean", "rest", "objective")  # HFedATM's merge, parts


def seeded_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "effnet_head":
        return head_model(1280, 7, adapter=64)
    if name == "effnet_head_fedsr":
        return probabilistic_head(head_model(1280, 7, adapter=64), FedSRHparams(z_dim=512))
    return build_model(name, 7, resolution=RESOLUTION[name])


def station_payloads(name: str, stations: int, max_dim: int, seed: int = 0) -> list[Message]:
    """``stations`` payloads as a station's uplink holds them: weights, Grams, γ_e."""
    model = seeded_model(name)
    base = get_arrays(model)
    g = torch.Generator().manual_seed(seed + 1)
    payloads = []
    for s in range(stations):
        arrays = {
            k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in base.items()
        }
        for key, shape in gram_shapes(model, max_dim).items():
            x = torch.randn(64, shape[0], generator=g)
            arrays[key] = x.T @ x / 64 if len(shape) == 2 else (x * x).mean(0)
        payloads.append(Message("uplink", arrays, {ACTIVE: 6 + s % 5, "num_examples": 500}))
    return payloads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        nargs="+",
        default=["lenet5", "resnet18"],
        choices=["lenet5", "resnet18", "effnet_head", "effnet_head_fedsr"],
    )
    p.add_argument("--stations", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| model | stations | +Avg merge (s) | HFedATM merge (s) | grams | fot | regmean "
          "| rest | J-ratio diagnostic (not in the merge) | HFedATM / +Avg |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        ctx = ServerContext(
            partial(seeded_model, name), args.stations * 10, 0, 100, stations=args.stations
        )
        servers = {m: resolve_method(m, {}).make_server(ctx) for m in ("hfedavg", "hfedatm")}
        max_dim = servers["hfedatm"].hp.regmean_max_dim
        payloads = station_payloads(name, args.stations, max_dim)
        times: dict[str, list[dict[str, float]]] = {m: [] for m in servers}
        for rnd in range(1, args.repeats + 1):
            for method, server in servers.items():
                server.aggregate(rnd, iter(enumerate(payloads)))
                parts = dict(server.timings())
                parts["rest"] = parts["merge"] - sum(
                    parts.get(k, 0.0) for k in ("grams", "fot", "regmean")
                )
                times[method].append(parts)

        avg = statistics.median(t["merge"] for t in times["hfedavg"])
        atm = {p: statistics.median(t.get(p, 0.0) for t in times["hfedatm"]) for p in PARTS}
        cells = " | ".join(f"{atm[p]:.3f}" for p in PARTS)
        print(f"| {name} | {args.stations} | {avg:.3f} | {cells} | {atm['merge'] / avg:.0f}x |")


if __name__ == "__main__":
    main()
