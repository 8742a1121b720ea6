"""Batched augmentation of uint8 image batches, with independent random parameters per sample.

Training batches are slices of the in-memory uint8 dataset. Augmenting each batch with a few tensor
ops, instead of per image in Python, keeps simulated clients fast on a CPU. Every op follows
torchvision's semantics for one image; the parameters are drawn per sample from the caller's
``torch.Generator``, so a run is reproducible and resumable from the generator's state.

Pipeline order (as in the usual torchvision recipe): random resized crop, horizontal flip, colour
jitter (brightness, contrast, saturation, hue), random grayscale, random inversion, then ``/255``
and mean/std.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from feddomain.errors import ConfigError, DataError

_CROP_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before its fallback
_GREY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale (ITU-R 601-2 luma)
# HSV -> RGB weights w_c = clamp(offset + slope * |hue - centre|) per channel (R, G, B)
_HUE_WEIGHTS = ((3.0, 2.0, 4.0), (-1.0, 1.0, 1.0), (2.0, -1.0, -1.0))


@dataclass(frozen=True)
class AugmentConfig:
    """Which augmentations to apply; all off by default (the eval / no-augmentation setting).

    ``random_resized_crop`` is the crop's area range as a fraction of the image, e.g. (0.7, 1.0),
    with aspect ratios drawn log-uniformly from ``crop_ratio``. ``color_jitter`` is torchvision's
    (brightness, contrast, saturation, hue).
    """

    hflip: bool = False
    random_resized_crop: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    color_jitter: tuple[float, float, float, float] | None = None
    grayscale_p: float = 0.0
    invert_p: float = 0.0

    def __post_init__(self) -> None:
        if self.random_resized_crop is not None:
            low, high = _pair("random_resized_crop", self.random_resized_crop)
            if not 0 < low <= high <= 1:
                raise ConfigError(
                    f"random_resized_crop must be (low, high) with 0 < low <= high <= 1, "
                    f"got {self.random_resized_crop!r}"
                )
        low, high = _pair("crop_ratio", self.crop_ratio)
        if not 0 < low <= high:
            raise ConfigError(
                f"crop_ratio must be (low, high) with 0 < low <= high, got {self.crop_ratio!r}"
            )
        if self.color_jitter is not None:
            jitter = tuple(self.color_jitter)
            if len(jitter) != 4 or any(not math.isfinite(v) or v < 0 for v in jitter):
                raise ConfigError(
                    "color_jitter must be four non-negative numbers (brightness, contrast, "
                    f"saturation, hue), got {self.color_jitter!r}"
                )
            if jitter[3] > 0.5:
                raise ConfigError(f"color_jitter hue must be <= 0.5, got {jitter[3]!r}")
        for name in ("grayscale_p", "invert_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")


class BatchAugment:
    """Callable turning a uint8 [B,3,H,W] batch into an augmented, normalised float32 batch."""

    def __init__(
        self, cfg: AugmentConfig, mean: Sequence[float] | None, std: Sequence[float] | None
    ) -> None:
        if (mean is None) != (std is None):
            raise ConfigError("normalisation needs both mean and std, or neither")
        self.cfg = cfg
        self._mean = self._std = None
        if mean is not None and std is not None:
            if len(mean) != 3 or len(std) != 3:
                raise ConfigError(
                    f"mean and std need 3 values (RGB), got {list(mean)} and {list(std)}"
                )
            if any(s <= 0 for s in std):
                raise ConfigError(f"std values must be positive, got {list(std)}")
            self._mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
            self._std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def __call__(self, images_u8: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Augment a training batch; ``generator`` supplies every random draw (None: global RNG)."""
        x = _to_unit(images_u8)
        n, cfg = len(x), self.cfg
        if cfg.random_resized_crop is not None:
            boxes = sample_crop_boxes(
                n, x.shape[-2:], cfg.random_resized_crop, cfg.crop_ratio, generator, x.device
            )
            x = resized_crop(x, boxes)
        if cfg.hflip:
            flip = (_rand((n,), generator, x.device) < 0.5).nonzero().squeeze(1)
            x[flip] = x[flip].flip(-1)  # x is this call's own tensor; 6-12x faster than where()
        if cfg.color_jitter is not None:
            x = _color_jitter(x, cfg.color_jitter, generator)
        if cfg.grayscale_p > 0:
            grey = _rand((n,), generator, x.device) < cfg.grayscale_p
            x = torch.where(grey.view(n, 1, 1, 1), to_grayscale(x).expand_as(x), x)
        if cfg.invert_p > 0:  # torchvision's RandomInvert: 1 - x
            invert = (_rand((n,), generator, x.device) < cfg.invert_p).nonzero().squeeze(1)
            x[invert] = 1 - x[invert]
        return self._standardize(x)

    def normalize(self, images_u8: torch.Tensor) -> torch.Tensor:
        """The evaluation path: ``/255`` and mean/std only, no randomness."""
        return self._standardize(_to_unit(images_u8))

    def _standardize(self, x: torch.Tensor) -> torch.Tensor:
        if self._mean is None or self._std is None:
            return x
        return x.sub_(self._mean.to(x.device)).div_(self._std.to(x.device))


# Batched ops on float images in [0,1]; ``factor`` tensors hold one value per sample.


def to_grayscale(x: torch.Tensor) -> torch.Tensor:
    """[B,3,H,W] -> [B,1,H,W] luma with torchvision's weights and operation order."""
    r, g, b = x.unbind(1)
    wr, wg, wb = _GREY_WEIGHTS
    return r.mul(wr).add_(g, alpha=wg).add_(b, alpha=wb).unsqueeze(1)


def adjust_brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Scale intensities by ``factor`` (0 gives black), clamped to [0,1]."""
    return x.mul(_per_sample(factor)).clamp_(0, 1)


def adjust_contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Blend with the image's mean grey level (0 gives a flat grey image)."""
    mean = to_grayscale(x).mean(dim=(1, 2, 3), keepdim=True)
    return _blend(x, mean, _per_sample(factor))


def adjust_saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Blend with the image's own grayscale version (0 gives grayscale)."""
    return _blend(x, to_grayscale(x), _per_sample(factor))


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate hue by ``shift`` turns in [-0.5, 0.5] in HSV space, as torchvision does.

    An HSV hue shift keeps each pixel's max and min channel, so RGB -> HSV -> RGB collapses to
    ``rgb = max - (max - min) * w(h)`` with the hue ``h`` in sextants [0, 6) and piecewise-linear
    weights ``w_R = 2 - |h-3|``, ``w_G = |h-2| - 1``, ``w_B = |h-4| - 1``, each clamped to [0,1]:
    branch-free, one expression for the whole batch.
    """
    r, g, b = x.unbind(1)
    maxc = torch.maximum(torch.maximum(r, g), b)
    minc = torch.minimum(torch.minimum(r, g), b)
    spread = maxc - minc
    r_max = maxc == r
    g_max = (maxc == g) & ~r_max  # ties go to R, then G, as in torchvision
    rise = torch.where(r_max, g - b, torch.where(g_max, b - r, r - g))
    sector = 4.0 - 4.0 * r_max - 2.0 * g_max  # R: 0, G: 2, B: 4
    hue = rise / torch.where(spread > 0, spread, 1.0)  # grey pixels: rise is 0
    hue = (hue + sector + 6 * _per_sample(shift).squeeze(1)).remainder_(6).unsqueeze(1)
    centre, slope, offset = (
        torch.tensor(v, dtype=x.dtype, device=x.device).view(1, 3, 1, 1) for v in _HUE_WEIGHTS
    )
    weight = (hue - centre).abs_().mul_(slope).add_(offset).clamp_(0, 1)
    return maxc.unsqueeze(1) - spread.unsqueeze(1) * weight


def sample_crop_boxes(
    n: int,
    size: torch.Size | tuple[int, int],
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Per-sample crop boxes as [n, 4] (width, height, centre x, centre y) in [-1,1] units.

    Follows torchvision's RandomResizedCrop: up to 10 attempts of (area, log-uniform aspect
    ratio), the first that fits wins, else a centre crop clamped to the ratio range. Unlike
    torchvision, box sizes and positions are continuous (sub-pixel) rather than rounded.
    """
    h, w = int(size[0]), int(size[1])
    area = scale[0] + (scale[1] - scale[0]) * _rand((n, _CROP_ATTEMPTS), generator, device)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * _rand((n, _CROP_ATTEMPTS), generator, device))
    width = torch.sqrt(area * aspect * (h / w))  # fraction of the image width
    height = torch.sqrt(area / aspect * (w / h))
    fits = (width <= 1) & (height <= 1)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # argmax returns the first maximum
    fallback_w, fallback_h = _fallback_crop(h, w, ratio)
    found = fits.any(1)
    width = torch.where(found, width.gather(1, first).squeeze(1), fallback_w)
    height = torch.where(found, height.gather(1, first).squeeze(1), fallback_h)
    centre = (2 * _rand((n, 2), generator, device) - 1) * (1 - torch.stack([width, height], 1))
    return torch.cat([width.unsqueeze(1), height.unsqueeze(1), centre], 1)


def resized_crop(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Crop each image to its box and resize it back to H x W, in one bilinear ``grid_sample``."""
    n = len(x)
    theta = torch.zeros(n, 2, 3, dtype=x.dtype, device=x.device)
    theta[:, 0, 0], theta[:, 1, 1] = boxes[:, 0], boxes[:, 1]
    theta[:, 0, 2], theta[:, 1, 2] = boxes[:, 2], boxes[:, 3]
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _color_jitter(
    x: torch.Tensor, strengths: tuple[float, float, float, float], generator: torch.Generator | None
) -> torch.Tensor:
    """torchvision's ColorJitter with per-sample factors, applied in the fixed order brightness,
    contrast, saturation, hue (torchvision shuffles the order per call; one fixed order keeps the
    batch a handful of tensor ops)."""
    brightness, contrast, saturation, hue = strengths
    n = len(x)
    for strength, op in (
        (brightness, adjust_brightness),
        (contrast, adjust_contrast),
        (saturation, adjust_saturation),
    ):
        if strength > 0:
            low = max(0.0, 1.0 - strength)
            x = op(x, low + (1.0 + strength - low) * _rand((n,), generator, x.device))
    if hue > 0:
        x = adjust_hue(x, hue * (2 * _rand((n,), generator, x.device) - 1))
    return x


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (x * factor + other * (1 - factor)).clamp_(0, 1)


def _fallback_crop(h: int, w: int, ratio: tuple[float, float]) -> tuple[float, float]:
    """torchvision's fallback box (width, height fractions): the whole image, trimmed to the
    nearest allowed aspect ratio."""
    in_ratio = w / h
    if in_ratio < ratio[0]:
        return 1.0, in_ratio / ratio[0]
    if in_ratio > ratio[1]:
        return ratio[1] / in_ratio, 1.0
    return 1.0, 1.0


def _per_sample(values: torch.Tensor) -> torch.Tensor:
    return values.view(-1, 1, 1, 1)


def _rand(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str
) -> torch.Tensor:
    """Uniform [0,1) draws from ``generator`` (on its own device), moved to ``device``."""
    source = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=source).to(device)


def _to_unit(images_u8: torch.Tensor) -> torch.Tensor:
    if images_u8.dtype != torch.uint8 or images_u8.ndim != 4 or images_u8.shape[1] != 3:
        raise DataError(
            f"augmentation expects a uint8 [B,3,H,W] batch, got {images_u8.dtype} "
            f"{tuple(images_u8.shape)}"
        )
    return images_u8.float().div_(255)


def _pair(key: str, value: Sequence[float]) -> tuple[float, float]:
    pair = tuple(value)
    if len(pair) != 2 or not all(math.isfinite(v) for v in pair):
        raise ConfigError(f"{key} must be two finite numbers, got {value!r}")
    return float(pair[0]), float(pair[1])
