"""FISC's costs against FedAvg's (fisc.md §5 "computation time", §8 check 15): the one-time
style phase (every client's style, then the server's FINCH and median), and the local training
time of one client round, FISC, CCST and FedAvg on the *same* clients of the same rounds, run
alternately client by client so that load from other processes hits them alike. Also the style
transfer alone (re-rendering the client's batches, no training), so FISC can be read against
"FedAvg + style transfer" as the paper does (within ±30%).

    python benchmarks/fisc_cost.py --root /data                  # configs/fisc/pacs_lambda_cpu.yaml
    python benchmarks/fisc_cost.py --root /data --rounds 5 model.name=small_cnn

Prints one JSON object: seconds per client round (mean and median over clients), the ratios to
FedAvg, and the style phase's client and server seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from feddomain.algorithms.styled import MEAN, STD
from feddomain.config import load_config
from feddomain.data.federated import (
    build_federated_data,
    experiment_splits,
    load_experiment_dataset,
)
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import CLIENT_TRAIN, derive_seed, generator

CONFIG = Path(__file__).resolve().parents[1] / "configs/fisc/pacs_lambda_cpu.yaml"
METHODS = ("fedavg", "fisc", "ccst")


def simulations(args: argparse.Namespace, out: Path) -> dict[str, Simulation]:
    """One simulator per method over one shared federation (same partition and clients)."""
    base = [f"dataset.root={args.root}", *args.overrides]
    cfg = load_config(args.config, base)
    dataset = load_experiment_dataset(cfg)
    data = build_federated_data(cfg, dataset, experiment_splits(cfg, dataset)[0])
    sims = {}
    for m in METHODS:
        cfg_m = load_config(args.config, [*base, f"algorithm={m}"] if m != "fisc" else base)
        sims[m] = Simulation(cfg_m, data, out / m)
    return sims


def style_transfer_seconds(sim: Simulation, cid: int, rnd: int) -> float:
    """Re-rendering one client's batches of one round in FISC's style, without training."""
    client, ctx = (
        sim.client,
        sim._context(cid, rnd, generator(sim.cfg.seed, CLIENT_TRAIN, rnd, cid)),
    )
    kept = client.kept(ctx)
    t0 = time.perf_counter()
    for x, _ in ctx.train.batches(ctx.batch_size, ctx.generator):
        client.restyle(x, ctx, kept[MEAN], kept[STD])
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="data root (the folder holding PACS/)")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sims = simulations(args, Path(tmp))
        for sim in sims.values():
            sim.out.mkdir(parents=True)
        t0 = time.perf_counter()
        sims["fisc"]._collect()
        style_phase = time.perf_counter() - t0
        sims["ccst"]._collect()
        phase = sims["fisc"].round_log[0]["time"]
        times: dict[str, list[float]] = {m: [] for m in (*METHODS, "style_transfer")}
        for rnd in range(1, args.rounds + 1):
            for cid in sims["fedavg"].schedule[rnd - 1]:
                for m, sim in sims.items():
                    msg = sim.server.configure(rnd, [cid])[cid]
                    torch.manual_seed(derive_seed(sim.cfg.seed, CLIENT_TRAIN, rnd, cid))
                    t = time.perf_counter()
                    sim.execute(cid, rnd, msg)
                    times[m].append(time.perf_counter() - t)
                times["style_transfer"].append(style_transfer_seconds(sims["fisc"], cid, rnd))
    mean = {m: statistics.fmean(v) for m, v in times.items()}
    plus_style = [a + s for a, s in zip(times["fedavg"], times["style_transfer"], strict=True)]
    print(
        json.dumps(
            {
                "config": str(args.config),
                "overrides": args.overrides,
                "client_rounds": len(times["fedavg"]),
                "seconds_per_client_round": {
                    m: {"mean": mean[m], "median": statistics.median(v)} for m, v in times.items()
                },
                "fisc_over_fedavg": mean["fisc"] / mean["fedavg"],
                "ccst_over_fedavg": mean["ccst"] / mean["fedavg"],
                "fisc_over_fedavg_plus_style_transfer": mean["fisc"] / statistics.fmean(plus_style),
                "style_phase_seconds": {
                    "total": style_phase,
                    "clients": phase["train"],
                    "server": phase["aggregate"],
                    "n_clients": sims["fisc"].data.n_clients,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
