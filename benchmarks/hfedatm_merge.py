"""HFedATM's server merge per global round against +Avg's, and its parts (hfedatm.md §8 A15).

Both servers merge the very same station payloads: S station models (the global model plus a
small random update each, so the OT alignment has real costs to match), each with its active
client count (unequal) and, for HFedATM, one shrunk input Gram per dense layer (a random PSD
matrix of the layer's input width; a diagonal above ``regmean_max_dim``). The parts are the
server's own `timings()`: `grams` (checking the payloads' Grams), `fot` (filter-wise optimal
transport alignment of every station to the reference one), `regmean` (the float64 RegMean
solve of every dense layer) and the rest (the γ-weighted mean of every other array).
Calls alternate between the two servers; medians of the repeats; one thread. Run:

    python benchmarks/hfedatm_merge.py                          # LeNet-5 and ResNet-18, 10 stations
    python benchmarks/hfedatm_merge.py --models lenet5 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from feddomain.algorithms import resolve_method
from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.hfedatm import ACTIVE
from feddomain.federation.messages import Message
from feddomain.federation.training import get_arrays
from feddomain.merging.gram import gram_shapes
from feddomain.models import build_model

RESOLUTION = {"lenet5": 32, "resnet18": 64}  # only the dense layers' widths depend on it
PARTS = ("total", "grams", "fot", "regmean", "rest")  # HFedATM's merge and its parts


def seeded_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
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
    p.add_argument("--models", nargs="+", default=["lenet5", "resnet18"])
    p.add_argument("--stations", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| model | stations | +Avg merge (s) | HFedATM merge (s) | grams | fot | regmean "
          "| rest | HFedATM / +Avg |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
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
                t0 = time.perf_counter()
                server.aggregate(rnd, iter(enumerate(payloads)))
                parts = {**server.timings(), "total": time.perf_counter() - t0}
                parts["rest"] = parts["total"] - sum(
                    parts.get(k, 0.0) for k in ("grams", "fot", "regmean")
                )
                times[method].append(parts)

        avg = statistics.median(t["total"] for t in times["hfedavg"])
        atm = {p: statistics.median(t.get(p, 0.0) for t in times["hfedatm"]) for p in PARTS}
        cells = " | ".join(f"{atm[p]:.3f}" for p in PARTS)
        print(f"| {name} | {args.stations} | {avg:.3f} | {cells} | {atm['total'] / avg:.0f}x |")


if __name__ == "__main__":
    main()
