"""AdaIN and the style statistics of FISC (fisc.md §3.1-3.3) and CCST.

A *style* is a pair (mean, std) of channel vectors of a backend's feature map. A client's style
groups its images' feature maps with FINCH and weights the clusters equally, so that the
dominant domain inside a client does not dominate its style; the server's interpolation style is
the element-wise (lower) median of the FINCH cluster means of the clients' styles. Moments are
accumulated in float64: E[z^2] - mu^2 cancels badly in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch

from feddomain.clustering import cluster_means, finch_partitions
from feddomain.style.backends import StyleBackend

EPS = 1e-5  # added to every variance (AdaIN's and the client style's, as in FISC's code)
Clustering = Literal["finch", "mean"]
ClientAggregation = Literal["mixture_moments", "mean_of_stats"]


def channel_stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image channel mean and std [B, C] over H x W: unbiased variance + EPS (FISC's code)."""
    flat = z.flatten(2)
    return flat.mean(2), (flat.var(2, unbiased=True) + EPS).sqrt()


def adain(z: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """AdaIN(z, μ_s, σ_s) = σ_s (z − μ(z)) / σ(z) + μ_s, per image and channel."""
    mu, sigma = channel_stats(z)
    normalised = (z - mu[..., None, None]) / sigma[..., None, None]
    return normalised * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)


@torch.no_grad()
def stylize(
    x: torch.Tensor,
    backend: StyleBackend,
    mean: torch.Tensor,
    std: torch.Tensor,
    alpha: float,
) -> torch.Tensor:
    """Images in [0, 1] re-rendered in the style (mean, std): D(α·AdaIN(E(x)) + (1 − α)·E(x)),
    clamped to [0, 1] and resized back to the input's size if the decoder changed it."""
    z = backend.encode(x)
    mixed = alpha * adain(z, mean, std) + (1 - alpha) * z
    out = backend.decode(mixed).clamp_(0, 1)
    if out.shape[-2:] != x.shape[-2:]:
        out = torch.nn.functional.interpolate(out, size=x.shape[-2:], mode="bilinear")
    return out


def client_style(
    features: torch.Tensor,
    clustering: Clustering = "finch",
    aggregation: ClientAggregation = "mixture_moments",
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A client's style from its images' feature maps [n, C, h, w] (fisc.md §3.2 A2-A4), and the
    number of clusters M. ``finch``: the coarsest FINCH partition of the flattened maps (cosine);
    ``mean``: one cluster (FISC-v1; CCST's overall style). Each cluster counts equally:
    ``mixture_moments`` (code) μ = mean_j m1_j, σ = sqrt(mean_j m2_j − μ² + ε);
    ``mean_of_stats`` (paper) the mean of the clusters' μ_j and σ_j."""
    n = features.shape[0]
    if clustering == "finch":
        # early exit off, as FISC's release calls FINCH on a client's images (fisc.md §3.2)
        labels = finch_partitions(features.flatten(1), early_exit=False)[:, -1]
    else:
        labels = torch.zeros(n, dtype=torch.long).numpy()
    z = features.double().flatten(2)  # [n, C, hw]
    per_image = torch.cat([z.mean(2), z.pow(2).mean(2)], dim=1)  # equal pixels per image
    moments = cluster_means(per_image, labels)  # [M, 2C]: m1_j, m2_j
    m1, m2 = moments.chunk(2, dim=1)
    if aggregation == "mixture_moments":
        mean = m1.mean(0)
        std = (m2.mean(0) - mean.pow(2) + EPS).clamp_min(EPS).sqrt()
    else:
        mean = m1.mean(0)
        std = (m2 - m1.pow(2) + EPS).clamp_min(EPS).sqrt().mean(0)
    return mean.float(), std.float(), int(moments.shape[0])


def lower_median(rows: torch.Tensor) -> torch.Tensor:
    """Element-wise median over rows; for an even count the lower middle value (torch.median)."""
    return rows.median(dim=0).values


def interpolation_style(
    styles: torch.Tensor, clustering: Clustering = "finch"
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The server's style from the clients' [N, 2C] (mean ‖ std) rows (fisc.md §3.3 B2-B4) and
    the number of clusters P. ``finch``: the finest FINCH partition's cluster means, then their
    element-wise lower median; ``mean``: the plain mean of the clients' styles (FISC-v2)."""
    rows = styles.double()
    if clustering == "finch":
        means = cluster_means(rows, finch_partitions(rows)[:, 0])
        merged, count = lower_median(means), int(means.shape[0])
    else:
        merged, count = rows.mean(0), 1
    mean, std = merged.float().chunk(2)
    return mean, std, count


def style_shift(styles: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """How far each client's style row [N, 2C] is from the ``target`` style [2C] it renders its
    images in, in units of the median distance between two clients' styles: about 0 for a
    client whose images barely change (FISC's premise fails for it), about 1 for one moved as
    far as clients' styles lie apart. Zero spread (identical styles) gives raw distances."""
    rows = styles.double()
    distance = torch.linalg.vector_norm(rows - target.double(), dim=1)
    pairs = torch.pdist(rows) if rows.shape[0] > 1 else rows.new_zeros(0)
    scale = float(pairs.median()) if pairs.numel() and float(pairs.median()) > 0 else 1.0
    return distance / scale


@torch.no_grad()
def encode_all(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    backend: StyleBackend,
    to_unit: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Every batch's images encoded by ``backend`` [n, C, h, w] (``to_unit``: model input ->
    [0, 1] images)."""
    return torch.cat([backend.encode(to_unit(x)) for x, _ in batches])
