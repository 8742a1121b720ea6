"""Training and inference cost per image of FedFD and FedFD-A against FedAvg (fedfda.md §5, §8
check 10), and their parameter counts.

Training: one client step (every forward/backward path and optimiser step of the method's loss)
on a fixed random batch, divided by the batch size; the three methods alternate step by step so
that load from other processes hits them alike, and the median of each is reported with its ratio
to FedAvg's. FedAvg's step is plain cross-entropy on the same BatchNorm model (SiloBN's step is
the same computation). Inference: eval-mode forward of single images (batch 1; FedFD's test mode
"global", FedFD-A's "adapter"), median per image. Threads: 1 unless --threads. Run:

    python benchmarks/fedfd_cost.py                                  # small_cnn at 32 px
    python benchmarks/fedfd_cost.py --model efficientnet_lite0 --resolution 64
    python benchmarks/fedfd_cost.py --model resnet18 --resolution 64 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from feddomain.algorithms import resolve_method
from feddomain.federation.training import cross_entropy_loss
from feddomain.models import build_model
from feddomain.models.fedfd_bn import adapter_parameters

Step = Callable[[], None]


def method_model(method: str, name: str, resolution: int) -> nn.Module:
    """``name`` with the method's model hook applied (FedAvg: none)."""
    torch.manual_seed(0)
    model = build_model(name, 7, resolution=resolution)
    return resolve_method(method, {}).prepare_model(model)


def train_step(method: str, name: str, x: torch.Tensor, y: torch.Tensor) -> tuple[Step, nn.Module]:
    """One local step of ``method``: its loss, one backward, its optimisers' steps."""
    model = method_model(method, name, x.shape[-1]).train()
    resolved = resolve_method(method, {})
    client = resolved.make_client(model)
    loss_fn = cross_entropy_loss if method == "fedavg" else client.loss_fn(None, None)
    adapters = {id(p) for p in adapter_parameters(model)}
    optimizers = [
        torch.optim.SGD([p for p in model.parameters() if id(p) not in adapters], lr=1e-3)
    ]
    if adapters:
        optimizers.append(torch.optim.SGD(adapter_parameters(model), lr=1e-2, momentum=0.9))

    def step() -> None:
        loss = loss_fn(model, x, y)
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in optimizers:
            o.step()

    return step, model


def infer_step(model: nn.Module, x: torch.Tensor) -> Step:
    model.eval()

    def step() -> None:
        with torch.no_grad():
            model(x)

    return step


def alternate(steps: dict[str, Step], repeats: int) -> dict[str, float]:
    """Median seconds per call of each step, calls interleaved; one warm-up call each."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--images", type=int, default=100, help="batch-1 inference calls")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(args.batch, 3, args.resolution, args.resolution, generator=g)
    y = torch.randint(0, 7, (args.batch,), generator=g)
    methods = ("fedavg", "fedfd", "fedfd_a")
    built = {m: train_step(m, args.model, x, y) for m in methods}
    train = alternate({m: s for m, (s, _) in built.items()}, args.steps)
    infer = alternate({m: infer_step(model, x[:1]) for m, (_, model) in built.items()}, args.images)
    print(f"{args.model} @ {args.resolution} px, batch {args.batch}, {args.threads} thread(s)")
    print("method   | params     | train ms/image | x FedAvg | infer ms/image (batch 1) | x FedAvg")
    for m in methods:
        params = sum(p.numel() for p in built[m][1].parameters())
        t, i = train[m] / args.batch * 1e3, infer[m] * 1e3
        print(
            f"{m:8} | {params:10,} | {t:14.3f} | {train[m] / train['fedavg']:8.2f} | "
            f"{i:24.3f} | {infer[m] / infer['fedavg']:8.2f}"
        )


if __name__ == "__main__":
    main()
