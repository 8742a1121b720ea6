"""Time per local epoch with a frozen prefix: cached maps vs the prefix recomputed per batch.

EfficientNet-Lite0 (ImageNet weights, BatchNorm momentum 0.1) at 128 px on one PACS domain's
images, cut after stage ``--stage`` (``model.frozen_prefix``): both modes train the same tail
and head (SGD, lr 1e-2, momentum 0.9, batch 64) over the same batches; ``cached`` reads the
prefix's maps from the cache (``prefix_features``), ``recomputed`` runs the prefix on every
batch (``model.prefix_cache: false``). Epochs alternate between the modes so that load from
other processes hits both alike; the medians and their ratio are printed, with the one-time
cost of filling the cache. Run:

    FEDDOMAIN_DATA=/data python benchmarks/prefix_cache.py --stage 4 --epochs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from feddomain.config import validate_config
from feddomain.data.federated import (
    PrefixTransform,
    backbone_normalization,
    frozen_prefix,
    load_experiment_dataset,
    prefix_features,
)
from feddomain.federation.data import ClientData
from feddomain.federation.training import train_epochs
from feddomain.models import build_model
from feddomain.models.prefix import split_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.environ.get("FEDDOMAIN_DATA", "../shared/data"))
    parser.add_argument("--domain", default="photo")
    parser.add_argument("--stage", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per mode")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    cfg = validate_config(
        {
            "dataset": {"name": "pacs", "root": args.data, "resolution": args.resolution},
            "model": {
                "name": "efficientnet_lite0",
                "frozen_prefix": args.stage,
                "options": {"bn_momentum": 0.1},
            },
        }
    )
    dataset = load_experiment_dataset(cfg)
    idx = dataset.indices_of(args.domain)
    images, labels = dataset.images[idx].contiguous(), dataset.labels[idx].clone()
    n_classes = len(dataset.classes)
    cfg = cfg.model_copy(
        update={"dataset": cfg.dataset.model_copy(update={"cache_dir": str(cache)})}
    )

    t0 = time.perf_counter()
    maps = prefix_features(cfg, images, n_classes)
    fill = time.perf_counter() - t0
    recompute = PrefixTransform(frozen_prefix(cfg, n_classes), *backbone_normalization(cfg))
    data = {
        "cached": ClientData(maps, labels),
        "recomputed": ClientData(images, labels, recompute),
    }
    torch.manual_seed(0)
    whole = build_model(
        "efficientnet_lite0", n_classes, resolution=args.resolution, bn_momentum=0.1
    )
    tail = split_at(whole, args.stage)[1]
    optimizer = torch.optim.SGD(tail.parameters(), lr=1e-2, momentum=0.9)
    times: dict[str, list[float]] = {mode: [] for mode in data}
    for epoch in range(args.epochs):
        for mode, client in data.items():
            gen = torch.Generator().manual_seed(epoch)
            t0 = time.perf_counter()
            train_epochs(
                tail, client, optimizer, epochs=1, batch_size=args.batch, generator=gen
            )
            times[mode].append(time.perf_counter() - t0)
    cached, recomputed = (statistics.median(times[m]) for m in ("cached", "recomputed"))
    print(
        f"efficientnet_lite0 @ {args.resolution} px, frozen_prefix {args.stage} "
        f"(maps {tuple(maps.shape[1:])}), PACS {args.domain}: {len(images)} images, batch "
        f"{args.batch}, {args.threads} thread(s), {args.epochs} epochs per mode"
    )
    print(f"  filling the cache once: {fill:.1f} s")
    for mode in data:
        print(f"  {mode:>10}: {statistics.median(times[mode]):.2f} s/epoch  {times[mode]}")
    print(f"  ratio recomputed / cached: {recomputed / cached:.2f}x")


if __name__ == "__main__":
    main()
