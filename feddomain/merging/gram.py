"""Input Grams of dense layers (hfedatm.md §3.2): capture on a client, optional DP noise, and the
checks a station or server applies to what it receives.

A client records, for every ``nn.Linear`` l, G_l = XᵀX over the rows of one training mini-batch
of that layer's input X [m, d_in] (an un-normalised sum; Eq. 8): a forward pre-hook keeps the
input of the latest full-size training batch (grad enabled, so evaluation and BatchNorm
re-estimation passes are ignored; a ragged last batch only when no full one came), so after
local training it holds the last full batch of the last epoch (the paper's m = the mini-batch
size); or (``accumulating``) G_l summed over every training batch of the round. Above ``max_dim``
inputs only the diagonal Σ x² is kept ([d_in]), as a 25,088-wide VGG-11 Gram would be 2.5 GB.

DP (optional, §3.2): spectral-norm clipping to C, then symmetric Gaussian noise (N + Nᵀ)/2 with
N_ij ~ N(0, σ²), σ = C·sqrt(2 ln(1.25/δ))/ε (the Gaussian mechanism with sensitivity C; not a
per-sample accounting, which the paper does not give); the station projects the noisy mean onto
the PSD cone (post-processing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

PREFIX = "gram/"  # a Gram's array name in a message: gram/<Linear module name>


def dense_layers(model: nn.Module) -> dict[str, int]:
    """Input width of every ``nn.Linear`` of ``model``, by module name."""
    return {n: m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def gram_shapes(model: nn.Module, max_dim: int) -> dict[str, tuple[int, ...]]:
    """The shape each dense layer's Gram has in a message: [d, d], or [d] above ``max_dim``."""
    return {PREFIX + n: (d, d) if d <= max_dim else (d,) for n, d in dense_layers(model).items()}


@contextmanager
def _training_inputs(model: nn.Module, on_input: Callable[[str, Tensor], None]) -> Iterator[None]:
    """While open, call ``on_input(name, x)`` with each Linear's input, rows flattened to
    [m, d_in], in every grad-enabled forward (evaluation and BatchNorm re-estimation passes run
    without grad and are ignored)."""

    def hook(name: str):
        def seen(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            if torch.is_grad_enabled():
                on_input(name, args[0].detach().reshape(-1, args[0].shape[-1]))

        return seen

    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def recording(model: nn.Module, batch_size: int) -> Iterator[dict[str, Tensor]]:
    """While open, keep each Linear's input of the latest full-size (``batch_size`` rows)
    training batch, by module name (a smaller batch only until a full one comes)."""
    inputs: dict[str, Tensor] = {}
    full: dict[str, bool] = {}

    def keep(name: str, x: Tensor) -> None:
        is_full = x.shape[0] == batch_size
        if is_full or not full.get(name, False):
            inputs[name] = x
            full[name] = is_full

    with _training_inputs(model, keep):
        yield inputs


@contextmanager
def accumulating(model: nn.Module, max_dim: int) -> Iterator[dict[str, Tensor]]:
    """While open, sum each Linear's input Gram over every training batch (ragged ones too), by
    module name: float64 sums of float32 per-batch products, the diagonal above ``max_dim``.
    RegMean's own Gram over a client's data (Jin et al. 2022), where ``recording`` keeps one
    batch: rank up to the samples seen instead of the batch size."""
    sums: dict[str, Tensor] = {}

    def add(name: str, x: Tensor) -> None:
        gram = _product(x, max_dim).double()
        sums[name] = gram if name not in sums else sums[name] + gram

    with _training_inputs(model, add):
        yield sums


def gram_of(x: Tensor, max_dim: int) -> Tensor:
    """XᵀX (float64 accumulation, float32 result), or its diagonal above ``max_dim``."""
    return _product(x.double(), max_dim).float()


def _product(x: Tensor, max_dim: int) -> Tensor:
    """XᵀX in ``x``'s dtype, or its diagonal (the squared column sums) above ``max_dim``."""
    return x.pow(2).sum(0) if x.shape[1] > max_dim else x.T @ x


def dp_sigma(clip: float, epsilon: float, delta: float) -> float:
    """σ of the Gaussian mechanism with sensitivity ``clip``."""
    return clip * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def privatise(gram: Tensor, clip: float, sigma: float, generator: torch.Generator) -> Tensor:
    """Clip to spectral norm ``clip`` (absolute value for a diagonal), add symmetric noise."""
    g = gram.double()
    norm = float(g.abs().max()) if g.dim() == 1 else float(torch.linalg.matrix_norm(g, ord=2))
    if norm > clip:
        g = g * (clip / norm)
    noise = torch.randn(g.shape, generator=generator, dtype=torch.float64) * sigma
    if g.dim() == 2:
        noise = (noise + noise.T) / 2
    return (g + noise).float()


def project_psd(gram: Tensor) -> Tensor:
    """The nearest PSD matrix (negative eigenvalues clamped to 0); a diagonal clamped at 0."""
    g = gram.double()
    if g.dim() == 1:
        return g.clamp_min(0.0).to(gram.dtype)
    values, vectors = torch.linalg.eigh((g + g.T) / 2)
    return ((vectors * values.clamp_min(0.0)) @ vectors.T).to(gram.dtype)


def check_grams(grams: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]], who: str):
    """Raise ``ValueError`` naming the array when a Gram is unknown, of the wrong shape, or
    non-finite."""
    for name, gram in grams.items():
        want = shapes.get(name)
        if want is None:
            raise ValueError(f"{who}: {name!r} is not the Gram of a dense layer of the model")
        if tuple(gram.shape) != want:
            raise ValueError(f"{who}: {name} has shape {list(gram.shape)}, expected {list(want)}")
        if not bool(torch.isfinite(gram).all()):
            raise ValueError(f"{who}: {name} holds non-finite values")
