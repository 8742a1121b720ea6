"""One round of client training on the CPU against the same round on a CUDA device.

FedAvg, 3 clients with one source domain each (PACS's d = 1), random images (the cost does not
depend on their content), ``--images`` per client, one local epoch of SGD with momentum, batch
``--batch-size``: the hFedF CNN at 32 px (hFedF's Table 2 setting) and ResNet-18 at 128 px (the
resolution ``../shared/data`` holds PACS at). The round's clients train one after another
(``Simulation.execute``), as a run does; each device gets a warm-up round, then the median of
``--repeats`` rounds. The CPU uses ``--threads`` torch threads.

    python benchmarks/device_round.py --threads 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from batched_clients import synthetic

from feddomain.config import validate_config
from feddomain.data.federated import build_federated_data
from feddomain.data.splits import leave_one_domain_out
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation

WORKLOADS = {"hfedf_cnn": 32, "resnet18": 128}  # model -> resolution


def simulation(model: str, device: str, args: argparse.Namespace, out: Path) -> Simulation:
    resolution = WORKLOADS[model]
    cfg = validate_config(
        {
            "rounds": 1,
            "device": device,
            "threads": args.threads,
            "dataset": {"name": "synthetic"},
            "partition": {"n_clients": 3, "d": 1},
            "model": {"name": model},
            "train": {"batch_size": args.batch_size, "optimizer": "sgd", "lr": 0.01,
                      "momentum": 0.9, "local_epochs": 1},
            "checkpoint": {"every": 0},
        }
    )
    data = synthetic(args.images, resolution=resolution)
    fed = build_federated_data(cfg, data, leave_one_domain_out(data.domains)[0])
    return Simulation(cfg, fed, out)


def time_round(sim: Simulation) -> float:
    items = [(c, Message("fit", sim.server.global_arrays)) for c in range(sim.data.n_clients)]
    if sim.device.type == "cuda":
        torch.cuda.synchronize(sim.device)
    t0 = time.perf_counter()
    for cid, msg in items:
        sim.execute(cid, 1, msg)
    if sim.device.type == "cuda":
        torch.cuda.synchronize(sim.device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--images", type=int, default=512, help="training images per client")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--devices", nargs=2, default=["cpu", "cuda"])
    args = ap.parse_args()
    print(f"FedAvg, 3 clients x ~{args.images} images, batch {args.batch_size}, 1 epoch, "
          f"CPU threads {args.threads}; median of {args.repeats} rounds after a warm-up")
    print(f"{'model':>10} {'px':>4} {args.devices[0] + ' s':>9} {args.devices[1] + ' s':>9} "
          f"{'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            medians = []
            for device in args.devices:
                sim = simulation(model, device, args, Path(tmp) / f"{model}-{device}")
                time_round(sim)  # warm-up: allocations, cuDNN's kernel choice
                medians.append(statistics.median(time_round(sim) for _ in range(args.repeats)))
            a, b = medians
            print(f"{model:>10} {WORKLOADS[model]:>4} {a:>9.3f} {b:>9.3f} {a / b:>6.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
