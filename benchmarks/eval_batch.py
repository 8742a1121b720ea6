"""Evaluation time on the CPU by ``eval.batch_size``, for the models of the CPU profiles.

Evaluation is a forward pass in eval mode, batch after batch (``predict_probs``; a frozen
prefix's cached maps, ``FrozenFeatures.compute``, the same): a sample's output does not depend
on the batch it is in, so the batch size is only a matter of speed. On a CPU a large batch is
slower per image: at 512 the first layers' activations (512 x 16 x 32 x 32 floats, 33 MB, for
digits3-bn's CNN) no longer fit the caches, and the element-wise layers and max-pools between
the convolutions run from memory. One thread, channels_last weights (the engine's CPU layout),
random inputs of each profile's shape; blocks of batches alternate between the sizes so that
load from other processes hits all alike; the median time per 1000 images at each size, and
the largest size's against the fastest. Run:

    python benchmarks/eval_batch.py --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from feddomain.models import build_model
from feddomain.models.prefix import split_at

SIZES = (16, 32, 64, 128, 256, 512)
BLOCK = 2048  # images per block (a multiple of every size: each scores whole batches)
PREFIX_BLOCK = 512  # the prefix at 128 px costs about 60x the others per image


def models() -> dict[str, tuple[nn.Module, tuple[int, ...], int]]:
    """name -> (model in eval mode, channels_last; input shape; images a block): each CPU
    profile's scored part, and the tail's prefix (what fills its cache, and FISC's and CCST's
    restyled images')."""
    torch.manual_seed(0)
    lite0 = build_model("efficientnet_lite0", 7, resolution=128, pretrained=False, bn_momentum=0.1)
    chosen = {
        "small_cnn 16/32/64 flatten, 32 px (digits3-bn)": (
            build_model("small_cnn", 10, resolution=32, widths=[16, 32, 64], pool="flatten"),
            (3, 32, 32),
            BLOCK,
        ),
        "hfedf_cnn, 32 px (pacs-hfedf-cnn)": (build_model("hfedf_cnn", 7), (3, 32, 32), BLOCK),
        "Lite0 tail after group 6, 4x4 maps (pacs-effnet-tail, the campaign's cut)": (
            split_at(lite0, 6)[1],
            (192, 4, 4),
            BLOCK,
        ),
        "Lite0 prefix through group 6, 128 px (the tail's cached maps)": (
            split_at(lite0, 6)[0],
            (3, 128, 128),
            PREFIX_BLOCK,
        ),
    }
    return {
        name: (model.eval().to(memory_format=torch.channels_last), shape, images)
        for name, (model, shape, images) in chosen.items()
    }


@torch.no_grad()
def score(model: nn.Module, x: torch.Tensor, batch_size: int) -> None:
    for start in range(0, len(x), batch_size):
        F.softmax(model(x[start : start + batch_size]), dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6, help="blocks per batch size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; ms per 1000 images")
    for name, (model, shape, images) in models().items():
        x = torch.randn(images, *shape, generator=torch.Generator().manual_seed(0))
        for size in SIZES:  # warm-up: first-call allocations and kernel choice
            score(model, x[: 2 * size], size)
        times: dict[int, list[float]] = {size: [] for size in SIZES}
        for block in range(args.repeats):
            for size in SIZES if block % 2 else SIZES[::-1]:
                started = time.perf_counter()
                score(model, x, size)
                times[size].append((time.perf_counter() - started) / images * 1e6)
        median = {size: statistics.median(times[size]) for size in SIZES}
        cells = "  ".join(f"{size}: {median[size]:6.0f}" for size in SIZES)
        fastest = min(SIZES, key=median.__getitem__)
        print(f"{name}\n    {cells}   512 / {fastest}: {median[512] / median[fastest]:4.2f}x",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
