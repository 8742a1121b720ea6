"""Images per second delivered to a training loop: feddomain's data path vs torchvision's.

(a) feddomain: PACS from the warm decode cache (memory-mapped uint8); each epoch draws a random
    permutation, slices batches of 64 from memory and augments them as tensors (random resized
    crop + horizontal flip, then /255 and mean/std normalisation) with ``BatchAugment``.
(b) torchvision: ``ImageFolder`` per domain + ``DataLoader(num_workers=2, shuffle=True)``,
    decoding every file every epoch with the same resize, crop, flip and normalisation.

Both deliver float32 [64, 3, R, R] batches plus labels; the loop does nothing else, so the figure
is the data path's ceiling. Run:

    python benchmarks/data_throughput.py --root ../shared/data --resolutions 32 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import ConcatDataset, DataLoader
from torchvision import datasets, transforms

from feddomain.data.augment import AugmentConfig, BatchAugment
from feddomain.data.sources import get_spec, load_dataset, resolve_dataset_dir

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CROP_SCALE = (0.7, 1.0)


def feddomain_epoch(
    images: torch.Tensor,
    labels: torch.Tensor,
    batch: int,
    augment: BatchAugment,
    gen: torch.Generator,
    max_batches: int | None,
) -> int:
    """One shuffled epoch of augmented float batches; returns the number of images delivered."""
    order = torch.randperm(len(images), generator=gen)
    delivered = 0
    for b, start in enumerate(range(0, len(order), batch)):
        if max_batches is not None and b == max_batches:
            break
        idx = order[start : start + batch]
        x, y = augment(images[idx], gen), labels[idx]
        delivered += min(len(x), len(y))
    return delivered


def torchvision_epoch(
    root: Path, resolution: int, batch: int, workers: int, max_batches: int | None
) -> int:
    """One epoch of an ImageFolder/DataLoader pipeline (workers start inside the epoch, as with
    non-persistent workers); returns the number of images delivered."""
    tf = transforms.Compose(
        [
            transforms.Resize((resolution, resolution)),
            transforms.RandomResizedCrop(resolution, scale=CROP_SCALE, antialias=True),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    spec = get_spec("PACS")
    folder = resolve_dataset_dir(root, spec)
    data = ConcatDataset(
        [datasets.ImageFolder(str(folder / d), transform=tf) for d in spec.domains or ()]
    )
    loader = DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers)
    delivered = 0
    for b, (x, y) in enumerate(loader):
        if max_batches is not None and b == max_batches:
            break
        delivered += min(len(x), len(y))
    return delivered


def timed(fn, *args) -> tuple[int, float]:
    start = time.perf_counter()
    n = fn(*args)
    return n, time.perf_counter() - start


def measure(args: argparse.Namespace, res: int, cache_dir: Path) -> tuple:
    augment = BatchAugment(AugmentConfig(hflip=True, random_resized_crop=CROP_SCALE), MEAN, STD)
    start = time.perf_counter()
    load_dataset("PACS", args.root, res, cache_dir)  # decodes, unless cache_dir holds PACS
    first = time.perf_counter() - start
    start = time.perf_counter()
    ds = load_dataset("PACS", args.root, res, cache_dir)
    cached = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    n_a, t_a = timed(
        feddomain_epoch, ds.images, ds.labels, args.batch_size, augment, gen, args.batches
    )
    n_b, t_b = timed(torchvision_epoch, args.root, res, args.batch_size, args.workers, args.batches)
    return res, n_a, first, cached, n_a / t_a, n_b / t_b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding PACS/")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[32, 64])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="decode cache (default: a fresh temporary folder, so the first "
        "load column is a real decode)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers for (b)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for (a); (b)'s workers use 1 each",
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="time this many batches instead of a full epoch"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        rows = [measure(args, res, args.cache_dir or Path(scratch)) for res in args.resolutions]

    print(
        f"\nPACS, batch {args.batch_size}, torch threads {torch.get_num_threads()}, "
        f"DataLoader workers {args.workers}\n"
    )
    print(
        "| resolution | images | first load (s) | cached load (s) | feddomain img/s "
        "| torchvision img/s | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for res, n, first, cached, a, b in rows:
        print(f"| {res} | {n} | {first:.2f} | {cached:.2f} | {a:,.0f} | {b:,.0f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
