"""Shrinkage-aware RegMean (hfedatm.md §3.3, §3.5): the dense-layer merge.

A station's Gram is shrunk towards its diagonal, Ĝ = α·G + (1 − α)·diag(G) (α = 1: classic
RegMean; α = 0: diagonal only). The merged weight minimises Σ_e c_e‖X_e W − X_e W_e‖² with
X_eᵀX_e replaced by Ĝ_e; in PyTorch's [d_out, d_in] layout

    W* = (Σ_e c_e W_e Ĝ_e + λ W̄) (Σ_e c_e Ĝ_e + λ I)⁻¹,   W̄ = Σ_e c_e W_e / Σ_e c_e,

with a ridge λ = ridge · tr(Σ c_e Ĝ_e) / d_in pulling towards the plain average W̄, so that an
input feature no station ever activated (a zero Gram row and column) keeps W̄'s column instead of
collapsing to zero. Everything is float64; the solve is a Cholesky factorisation, with a
least-squares fallback (counted) when the system is not positive definite. A diagonal-only Gram
([d_in], above the capture cap, §3.2) gives the per-column weighted average
W*[:, j] = (Σ c_e g_e[j] W_e[:, j] + λ W̄[:, j]) / (Σ c_e g_e[j] + λ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def shrink(gram: Tensor, alpha: float) -> Tensor:
    """α·G + (1 − α)·diag(G); a diagonal-only Gram ([d]) is unchanged."""
    if gram.dim() == 1:
        return gram
    return alpha * gram + (1.0 - alpha) * torch.diag_embed(torch.diagonal(gram))


@dataclass(frozen=True)
class Merged:
    """A merged weight (float64) and whether the Cholesky solve fell back to least squares."""

    weight: Tensor
    fallback: bool


def regmean(
    weights: Sequence[Tensor],
    grams: Sequence[Tensor],
    coefs: Sequence[float] | None = None,
    ridge: float = 1e-6,
) -> Merged:
    """The RegMean merge of ``weights`` ([d_out, d_in] each) with their stations' shrunk
    ``grams`` ([d_in, d_in], or [d_in] diagonals), weighted by ``coefs`` (default 1 each)."""
    coefs = [1.0] * len(weights) if coefs is None else list(coefs)
    ws = [w.double() for w in weights]
    gs = [g.double() for g in grams]
    mean = sum(c * w for c, w in zip(coefs, ws, strict=True)) / sum(coefs)
    if gs[0].dim() == 1:
        a_diag = sum(c * g for c, g in zip(coefs, gs, strict=True))
        lam = ridge * float(a_diag.sum()) / a_diag.numel()
        if float(a_diag.sum()) == 0.0:  # no activation at all: nothing to weigh by
            return Merged(mean, False)
        b = sum(c * w * g for c, w, g in zip(coefs, ws, gs, strict=True))
        return Merged((b + lam * mean) / (a_diag + lam), False)
    a = sum(c * g for c, g in zip(coefs, gs, strict=True))
    trace = float(torch.trace(a))
    if trace == 0.0:
        return Merged(mean, False)
    lam = ridge * trace / a.shape[0]
    a = a + lam * torch.eye(a.shape[0], dtype=a.dtype)
    b = sum(c * w @ g for c, w, g in zip(coefs, ws, gs, strict=True)) + lam * mean
    # W a = b with a symmetric  <=>  a Wᵀ = bᵀ
    factor, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return Merged(torch.cholesky_solve(b.T, factor).T, False)
    return Merged(torch.linalg.lstsq(a, b.T).solution.T, True)


def objective(
    weight: Tensor,
    weights: Sequence[Tensor],
    grams: Sequence[Tensor],
    coefs: Sequence[float] | None = None,
) -> float:
    """J(W) = Σ_e c_e tr((W − W_e) Ĝ_e (W − W_e)ᵀ), the quantity RegMean minimises (M4)."""
    coefs = [1.0] * len(weights) if coefs is None else list(coefs)
    total = 0.0
    for c, w, g in zip(coefs, weights, grams, strict=True):
        delta = weight.double() - w.double()
        g = g.double()
        # tr(Δ G Δᵀ) as Σ (ΔG) ⊙ Δ: one d_out·d_in² product instead of two
        quad = (delta.pow(2) * g).sum() if g.dim() == 1 else ((delta @ g) * delta).sum()
        total += c * float(quad)
    return total
