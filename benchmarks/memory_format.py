"""Training step time on the CPU: convolution weights channels_last vs contiguous
(``model.memory_format``), for the models of the CPU profiles.

One thread, batch 64, SGD with momentum; the inputs stay contiguous in both modes (the engine
converts only the model: a channels_last convolution weight makes the activations follow).
Blocks of steps alternate between the two modes so that load from other processes hits both
alike; the medians per step and their ratio are printed. Run:

    python benchmarks/memory_format.py --repeats 12
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from feddomain.models import build_model
from feddomain.models.prefix import split_at

BATCH = 64


def models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """name -> (model, input shape): the trained part of each CPU profile."""
    torch.manual_seed(0)
    lite0 = build_model("efficientnet_lite0", 7, resolution=128, pretrained=False, bn_momentum=0.1)
    return {
        "small_cnn 16/32/64 flatten, 32 px (digits3-bn)": (
            build_model("small_cnn", 10, resolution=32, widths=[16, 32, 64], pool="flatten"),
            (3, 32, 32),
        ),
        "hfedf_cnn, 32 px (pacs-hfedf-cnn)": (build_model("hfedf_cnn", 7), (3, 32, 32)),
        "Lite0 tail after stage 5, 8x8 maps (pacs-effnet-tail)": (
            split_at(lite0, 5)[1],
            (112, 8, 8),
        ),
        "LeNet-5, 32 px (smoke workload)": (build_model("lenet5", 7), (3, 32, 32)),
    }


def stepper(model: nn.Module, shape: tuple[int, ...], channels_last: bool) -> Callable[[], None]:
    model = copy.deepcopy(model).train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, *shape, generator=g)
    y = torch.randint(0, 7, (BATCH,), generator=g)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12, help="blocks per mode")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, batch {BATCH}")
    for name, (model, shape) in models().items():
        steps = {mode: stepper(model, shape, mode) for mode in (False, True)}
        for step in steps.values():  # warm-up: first-call allocations and kernel choice
            for _ in range(3):
                step()
        times: dict[bool, list[float]] = {False: [], True: []}
        for block in range(args.repeats):
            for mode in (False, True) if block % 2 else (True, False):
                started = time.perf_counter()
                for _ in range(args.steps):
                    steps[mode]()
                times[mode].append((time.perf_counter() - started) / args.steps)
        contiguous, last = (statistics.median(times[m]) * 1e3 for m in (False, True))
        print(f"{name:55s} contiguous {contiguous:7.1f} ms  channels_last {last:7.1f} ms  "
              f"ratio {contiguous / last:4.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
