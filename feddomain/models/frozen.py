"""Frozen-backbone mode: featurize a whole dataset once, cache it, then train only a head.

With a pretrained backbone frozen, every round of federated training would recompute the same
features; computing them once turns a CPU-hours experiment into minutes. The cache file is keyed
by everything that changes the features (module class and weights, data, resolution,
normalisation, a deterministic pixel variant such as a fixed style) and is written atomically,
so concurrent runs never read a partial file; it is read memory-mapped. The same machinery
caches a frozen prefix's feature maps (``models/prefix.py``: ``flatten=False``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddomain.errors import ConfigError, DataError
from feddomain.models.base import FeatureClassifier

_FORMAT = 1


@dataclass(frozen=True)
class PixelVariant:
    """A deterministic change of the images before the frozen module (a fixed style): ``key``
    names it in the cache key (e.g. a digest of the style and its settings), ``apply`` maps
    images in [0, 1] [B, 3, H, W] to images in [0, 1]."""

    key: str
    apply: Callable[[Tensor], Tensor]


def _digest_tensors(named: Sequence[tuple[str, Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in named:
        flat = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{flat.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def weights_hash(module: nn.Module) -> str:
    """SHA-256 of a module's state dict (parameters and buffers, names, dtypes, shapes)."""
    return _digest_tensors(list(module.state_dict().items()))


def _featurizer(backbone: nn.Module) -> nn.Module:
    return getattr(backbone, "featurizer", backbone)


def _check_inputs(
    images_u8: Tensor, batch_size: int, mean: Sequence[float], std: Sequence[float]
) -> None:
    if images_u8.dtype != torch.uint8 or images_u8.ndim != 4 or images_u8.shape[1] != 3:
        raise DataError(
            f"frozen features: images must be uint8 [N, 3, H, W], got {images_u8.dtype} "
            f"{tuple(images_u8.shape)}"
        )
    if batch_size < 1:
        raise ConfigError(f"frozen features: batch_size={batch_size} must be >= 1")
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ConfigError(
            f"frozen features: mean={list(mean)} and std={list(std)} need 3 values each, std > 0"
        )


class FrozenFeatures:
    """Computes (or loads from cache) ``featurizer(normalise(resize(images)))`` for a dataset."""

    @staticmethod
    def cache_fields(
        backbone: nn.Module,
        images_u8: Tensor,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        resolution: int | None = None,
        key: str | None = None,
        variant: PixelVariant | None = None,
    ) -> dict[str, object]:
        """Everything the features depend on; the cache file name is a hash of these fields.

        ``key`` should name the image set (e.g. the decode cache's key); without one the image
        bytes themselves are hashed, which costs about a second per 500 MB.
        """
        featurizer = _featurizer(backbone)
        n, _, height, width = images_u8.shape
        return {
            "format": _FORMAT,
            "model": f"{type(featurizer).__module__}.{type(featurizer).__qualname__}",
            "weights": weights_hash(featurizer),
            "data": key if key is not None else _digest_tensors([("images", images_u8)]),
            "n_images": int(n),
            "image_size": [int(height), int(width)],
            "resolution": int(resolution) if resolution is not None else int(height),
            "mean": [float(m) for m in mean],
            "std": [float(s) for s in std],
            "variant": variant.key if variant is not None else None,
        }

    @staticmethod
    def compute(
        backbone: nn.Module,
        images_u8: Tensor,
        *,
        batch_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        resolution: int | None = None,
        cache_dir: str | Path | None = None,
        key: str | None = None,
        variant: PixelVariant | None = None,
        flatten: bool = True,
    ) -> Tensor:
        """Features [N, F] float32 on CPU of ``backbone.featurizer`` (or ``backbone`` itself);
        with ``flatten=False`` the module's output shape per image is kept (a prefix's maps).

        Runs in eval mode without gradients and restores each submodule's train/eval flag after.
        ``variant`` changes the images first; ``resolution`` resizes square inputs on the fly
        (bilinear, antialiased) when it differs from the stored images. With ``cache_dir`` the
        result is read (memory-mapped) from, or written to, one file per :meth:`cache_fields`.
        """
        _check_inputs(images_u8, batch_size, mean, std)
        module = _featurizer(backbone)
        run = (images_u8, batch_size, mean, std, resolution, variant)
        if cache_dir is None:
            return _shaped(_forward_all(module, *run), flatten)
        fields = FrozenFeatures.cache_fields(
            backbone, images_u8, mean=mean, std=std, resolution=resolution, key=key,
            variant=variant,
        )
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
        path = Path(cache_dir) / f"features-{digest}.pt"
        if path.exists():
            return _shaped(_load(path, fields), flatten)
        features = _forward_all(module, *run)
        _save_atomic(path, {"fields": fields, "features": features})
        return _shaped(features, flatten)


def _shaped(features: Tensor, flatten: bool) -> Tensor:
    return features.flatten(1) if flatten and features.ndim > 2 else features


def _forward_all(
    featurizer: nn.Module,
    images_u8: Tensor,
    batch_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    resolution: int | None,
    variant: PixelVariant | None,
) -> Tensor:
    param = next(featurizer.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    modes = {m: m.training for m in featurizer.modules()}
    featurizer.eval()
    chunks = []
    try:
        # no_grad, not inference_mode: the features later feed a head trained with autograd.
        with torch.no_grad():
            for start in range(0, images_u8.shape[0], batch_size):
                x = images_u8[start : start + batch_size].to(device).float().div_(255.0)
                if variant is not None:
                    x = variant.apply(x)
                if resolution is not None and tuple(x.shape[-2:]) != (resolution, resolution):
                    x = F.interpolate(
                        x,
                        size=(resolution, resolution),
                        mode="bilinear",
                        antialias=True,
                        align_corners=False,
                    )
                chunks.append(featurizer((x - mean_t) / std_t).float().cpu())
    finally:
        for module, training in modes.items():
            module.training = training
    if not chunks:
        return torch.empty(0, 0)
    return torch.cat(chunks)


def _load(path: Path, fields: dict[str, object]) -> Tensor:
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise DataError(
            f"feature cache {path} is unreadable ({exc}); delete it to recompute"
        ) from exc
    if not isinstance(stored, dict) or stored.get("fields") != fields:
        raise DataError(
            f"feature cache {path} was written for other inputs; delete it to recompute"
        )
    return stored["features"]


def _save_atomic(path: Path, payload: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResidualAdapter(nn.Module):
    """``a(z) = z + up(ReLU(down(z)))``: a residual bottleneck of rank r on the pooled feature
    (fedvr.md §3.1). ``up`` starts at zero, so the adapter starts as the identity and a head on
    top of it starts as a linear probe; methods that generate parameters zero their ``up``
    outputs too (:func:`identity_outputs`)."""

    def __init__(self, n_features: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(n_features, rank)
        self.up = nn.Linear(rank, n_features)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, z: Tensor) -> Tensor:
        return z + self.up(F.relu(self.down(z)))


def identity_outputs(model: nn.Module) -> set[str]:
    """Names of the parameters that must be zero for every residual adapter of ``model`` to be
    the identity (each adapter's ``up`` weight and bias)."""
    return {
        f"{prefix}.up.{p}" if prefix else f"up.{p}"
        for prefix, module in model.named_modules()
        if isinstance(module, ResidualAdapter)
        for p in ("weight", "bias")
    }


def head_model(
    n_features: int, num_classes: int, *, hidden: int | None = None, adapter: int | None = None
) -> FeatureClassifier:
    """The trainable part on cached features: a linear head, one hidden ReLU layer, or a
    residual bottleneck adapter of rank ``adapter`` then a linear head (FedVR's client model).

    It is a :class:`FeatureClassifier` like every backbone, so feature-level methods (FedSR,
    FedIIR) see ``featurizer`` = identity (linear head), the hidden layer (MLP head) or the
    adapter.
    """
    if n_features < 1 or num_classes < 1:
        raise ConfigError(
            f"head: n_features={n_features} and num_classes={num_classes} must be >= 1"
        )
    if hidden is not None and adapter is not None:
        raise ConfigError(
            f"head: model.head_hidden={hidden} and model.head_adapter={adapter} are exclusive; "
            "set one of them"
        )
    if adapter is not None:
        if adapter < 1:
            raise ConfigError(f"head: adapter={adapter} must be >= 1 (or None for no adapter)")
        featurizer: nn.Module = ResidualAdapter(n_features, adapter)
        return FeatureClassifier(featurizer, nn.Linear(n_features, num_classes), n_features)
    if hidden is None:
        return FeatureClassifier(nn.Identity(), nn.Linear(n_features, num_classes), n_features)
    if hidden < 1:
        raise ConfigError(f"head: hidden={hidden} must be >= 1 (or None for a linear head)")
    featurizer = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU())
    return FeatureClassifier(featurizer, nn.Linear(hidden, num_classes), hidden)
