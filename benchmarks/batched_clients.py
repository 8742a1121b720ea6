"""Clients trained together vs one after another: one round's local training, per round.

The same simulator object runs the round both ways on the same messages and generators: the
sequential path (``Simulation.execute`` per client: the shared model, torch.optim) and the
batched one (``Simulation.execute_batch``: vmap over stacked parameters, ``federation/batched.py``).
FedAvg, LeNet-5 or the hFedF CNN at 32 px, random images (the cost does not depend on their
content), about
``--images`` images per client (the partition divides each source domain's images among its
clients, so sizes differ: partial batches and early finishers are part of the timing). Repeats
alternate the two paths so that load from other processes hits both alike; the median of each
is reported, and their ratio, side by side. The hFedF CNN's dropout (p = 0.2), which the
batched path refuses (its masks come from torch's global generator), is set to 0 in both paths:
the timing is that of the same network without the mask multiply.

    python benchmarks/batched_clients.py                         # 10 and 100 clients, CPU
    python benchmarks/batched_clients.py --device cuda --clients 10 100
    python benchmarks/batched_clients.py --device cuda --model hfedf_cnn
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from feddomain.config import validate_config
from feddomain.data.dataset import DomainDataset
from feddomain.data.federated import build_federated_data
from feddomain.data.splits import leave_one_domain_out
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation


def synthetic(
    n_images: int, n_domains: int = 4, n_classes: int = 7, resolution: int = 32
) -> DomainDataset:
    """Random uint8 images in ``n_domains`` domains (PACS's 7 classes)."""
    g = torch.Generator().manual_seed(0)
    n = n_images * n_domains
    return DomainDataset(
        name="synthetic",
        domains=tuple(f"d{i}" for i in range(n_domains)),
        classes=tuple(f"c{i}" for i in range(n_classes)),
        images=torch.randint(
            0, 256, (n, 3, resolution, resolution), generator=g, dtype=torch.uint8
        ),
        labels=torch.arange(n) % n_classes,
        domain_ids=torch.arange(n) // n_images,
    )


def simulation(n_clients: int, images: int, args: argparse.Namespace, out: Path) -> Simulation:
    cfg = validate_config(
        {
            "rounds": 1,
            "device": args.device,
            "dataset": {"name": "synthetic"},
            "partition": {"n_clients": n_clients, "d": 1},
            "model": {"name": args.model},
            "train": {
                "batch_size": args.batch_size,
                "optimizer": "sgd",
                "lr": 0.01,
                "momentum": 0.9,
                "local_epochs": args.epochs,
                # on: refused for the hFedF CNN's dropout, which is switched off below
                "batched_clients": "on" if args.model == "lenet5" else "off",
            },
            "checkpoint": {"every": 0},
        }
    )
    # each of the 3 source domains holds its clients' images; the target domain is not used
    per_domain = -(-n_clients // 3) * images
    fed = build_federated_data(
        cfg, synthetic(per_domain), leave_one_domain_out(("d0", "d1", "d2", "d3"))[0]
    )
    sim = Simulation(cfg, fed, out)
    for module in sim.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return sim


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round(sim: Simulation, batched: bool) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one round's client training. On a shared
    machine the CPU time is the steadier figure of the work done (with one thread)."""
    items = [(c, Message("fit", sim.server.global_arrays)) for c in range(sim.data.n_clients)]
    sync(sim.device)
    t0, c0 = time.perf_counter(), time.process_time()
    if batched:
        sim.execute_batch(1, items)
    else:
        for cid, msg in items:
            sim.execute(cid, 1, msg)
    sync(sim.device)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--images", type=int, default=64, help="training images per client")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", choices=("lenet5", "hfedf_cnn"), default="lenet5")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"device {args.device}, threads {args.threads}, {args.model} 32 px, FedAvg, SGD momentum, "
        f"~{args.images} images/client, batch {args.batch_size}, {args.epochs} epoch(s); "
        f"median of {args.repeats} rounds each"
    )
    print(
        f"{'clients':>8} {'sequential s':>13} {'batched s':>10} {'ratio':>7}"
        f" | {'seq CPU s':>10} {'bat CPU s':>10} {'ratio':>7}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.clients:
            sim = simulation(n, args.images, args, Path(tmp) / str(n))
            sizes = [len(t) for t in sim.data.train]
            time_round(sim, True), time_round(sim, False)  # warm-up (allocations, kernels)
            seq, bat = [], []
            for _ in range(args.repeats):
                seq.append(time_round(sim, False))
                bat.append(time_round(sim, True))
            (s, sc), (b, bc) = (
                tuple(statistics.median(t[k] for t in runs) for k in (0, 1)) for runs in (seq, bat)
            )
            print(
                f"{n:>8} {s:>13.3f} {b:>10.3f} {s / b:>6.2f}x | {sc:>10.3f} {bc:>10.3f} "
                f"{sc / bc:>6.2f}x   (client sizes {min(sizes)}-{max(sizes)})"
            )


if __name__ == "__main__":
    main()
