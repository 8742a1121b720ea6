"""Peak memory of a FedAvg run with 100 simulated clients vs 3, on the same data.

Each client count runs in its own process (so peaks do not mix) and reports its peak resident
set size (``ru_maxrss``) after the run. The data are the same samples either way (lambda
partition of the source domains); the simulator reuses one model object for all clients and
FedAvg folds replies into a running mean, so the peak should not grow with the client count. Run:

    python benchmarks/memory_scaling.py                     # embedded digits, LeNet-5
    python benchmarks/memory_scaling.py --model hfedf_cnn   # a 0.93 M-parameter model
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def child(n_clients: int, model: str, rounds: int) -> None:
    import torch

    from feddomain.config import load_config
    from feddomain.data.federated import (
        build_federated_data,
        experiment_splits,
        load_experiment_dataset,
    )
    from feddomain.federation.simulation import Simulation

    torch.set_num_threads(1)
    cfg = load_config(
        None,
        [
            "dataset.name=digits_embedded",
            f"model.name={model}",
            f"rounds={rounds}",
            f"eval.every={rounds}",
            "checkpoint.every=0",
            "partition.name=lambda",
            "partition.lam=0.1",
            f"partition.n_clients={n_clients}",
            "split.targets=[grey]",
        ],
    )
    dataset = load_experiment_dataset(cfg)
    fed = build_federated_data(cfg, dataset, experiment_splits(cfg, dataset)[0])
    with tempfile.TemporaryDirectory() as out:
        Simulation(cfg, fed, Path(out)).run()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"n_clients": n_clients, "peak_mib": peak_kib / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet5")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, nargs="+", default=[3, 100])
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.model, args.rounds)
        return
    peaks = {}
    for n in args.clients:
        res = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(n),
                "--model",
                args.model,
                "--rounds",
                str(args.rounds),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[n] = json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]
    base = peaks[args.clients[0]]
    print(f"FedAvg, {args.model}, embedded digits (3,750 source images), {args.rounds} rounds")
    print("| clients | peak RSS (MiB) | ratio to first |")
    print("|---:|---:|---:|")
    for n, mib in peaks.items():
        print(f"| {n} | {mib:,.0f} | {mib / base:.3f} |")


if __name__ == "__main__":
    main()
