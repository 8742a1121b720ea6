"""Classification metrics on predicted probabilities: accuracy, calibration, spread.

Every function takes ``probs`` (float ``[N, C]``, rows summing to 1; pass ``softmax(logits)``)
and integer ``labels`` ``[N]``, and returns plain Python numbers or lists so results go straight
into ``metrics.jsonl`` / ``summary.json``. ``accuracy`` also accepts logits (argmax is the same).

Binning convention, shared by ECE, the reliability diagram and the confidence histogram:
``n_bins`` equal-width bins over ``[0, 1]``, each bin ``(lo, hi]`` and the first one also holding
0, so a confidence exactly on an edge belongs to the bin it closes (0.5 with 4 bins is in
``(0.25, 0.5]``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from feddomain.errors import DataError

NLL_EPS = 1e-12  # floor on p_y so a confidently wrong sample costs ~27.6 nats, not infinity


def _check_labels(scores: torch.Tensor, labels: torch.Tensor) -> None:
    if scores.ndim != 2 or labels.ndim != 1 or scores.shape[0] != labels.shape[0]:
        raise DataError(
            f"expected scores [N, C] and labels [N], got {tuple(scores.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if scores.shape[0] == 0:
        raise DataError("cannot evaluate on an empty set (N = 0)")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise DataError(f"labels must be integer class indices, got dtype {labels.dtype}")
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= scores.shape[1]:
        raise DataError(f"labels must lie in [0, {scores.shape[1] - 1}], got range [{lo}, {hi}]")


def _check_probs(probs: torch.Tensor, labels: torch.Tensor) -> None:
    _check_labels(probs, labels)
    sums = probs.sum(dim=1, dtype=torch.float64)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
        raise DataError(
            f"probs rows must sum to 1 (got sums in [{float(sums.min()):.4g}, "
            f"{float(sums.max()):.4g}]); pass softmax(logits), not logits"
        )


def _bin_index(conf: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Bin of each confidence under the ``(lo, hi]`` convention.

    Edges are ``i / n_bins`` computed in the confidences' own dtype, so a value typed as an edge
    (0.6 in float32 or float64) compares equal to that edge instead of drifting across it.
    """
    if n_bins < 1:
        raise DataError(f"n_bins must be >= 1, got {n_bins}")
    inner = torch.arange(1, n_bins, dtype=conf.dtype, device=conf.device) / n_bins
    return torch.bucketize(conf, inner, right=False)


def accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of samples whose argmax over ``scores`` (probs or logits) equals the label.

    A tie between classes predicts the lowest class index (``torch.argmax``).
    """
    _check_labels(scores, labels)
    return float((scores.argmax(dim=1) == labels).double().mean())


def macro_f1(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Unweighted mean over the classes present in ``labels`` of each class's F1 score,
    2·TP / (2·TP + FP + FN) of argmax predictions (0 for a class never predicted correctly).

    Averaging over the true classes only is WILDS' macro-F1 (sklearn's ``f1_score(average=
    "macro", labels=unique(y_true))``), IWildCam's headline metric beside accuracy.
    """
    _check_labels(scores, labels)
    n_classes = scores.shape[1]
    pred = scores.argmax(dim=1)
    tp = torch.bincount(labels[pred == labels], minlength=n_classes).double()
    predicted = torch.bincount(pred, minlength=n_classes).double()
    actual = torch.bincount(labels, minlength=n_classes).double()
    present = actual > 0
    f1 = 2 * tp[present] / (predicted[present] + actual[present])
    return float(f1.mean())


@dataclass(frozen=True)
class Reliability:
    """Per-bin count, mean confidence and accuracy; empty bins report 0.0 (read with count)."""

    count: list[int]
    conf: list[float]
    acc: list[float]


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> Reliability:
    """Group samples by max-probability confidence: the data behind a reliability diagram."""
    _check_probs(probs, labels)
    conf, pred = probs.max(dim=1)
    correct = (pred == labels).double()
    bins = _bin_index(conf, n_bins)
    count = torch.bincount(bins, minlength=n_bins)
    zeros = torch.zeros(n_bins, dtype=torch.float64, device=conf.device)
    conf_sum = zeros.index_add(0, bins, conf.double())
    acc_sum = zeros.index_add(0, bins, correct)
    denom = count.clamp(min=1).double()
    return Reliability(
        count=count.tolist(),
        conf=(conf_sum / denom).tolist(),
        acc=(acc_sum / denom).tolist(),
    )


def ece_from_bins(rel: Reliability) -> float:
    """ECE = sum_b |B_b| / N * |acc_b - conf_b| over the bins of a reliability table."""
    n = sum(rel.count)
    return float(
        sum(c / n * abs(a - f) for c, a, f in zip(rel.count, rel.acc, rel.conf, strict=True))
    )


def ece(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> float:
    """Expected calibration error with equal-width confidence bins (15 by default)."""
    return ece_from_bins(reliability_bins(probs, labels, n_bins))


def nll(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of the true class, ``-log max(p_y, NLL_EPS)``."""
    _check_probs(probs, labels)
    p_true = probs.double().gather(1, labels.long().unsqueeze(1)).squeeze(1)
    return float(-p_true.clamp(min=NLL_EPS).log().mean())


def brier(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Brier score: sum over classes of ``(p_c - onehot_c)^2``, then mean over samples.

    This is the original multi-class convention (Brier 1950), ranging over [0, 2]; a uniform
    predictor scores ``1 - 1/C``. Some libraries divide by C as well; we do not.
    """
    _check_probs(probs, labels)
    onehot = torch.nn.functional.one_hot(labels.long(), probs.shape[1]).double()
    return float(((probs.double() - onehot) ** 2).sum(dim=1).mean())


def confidence_histogram(
    probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 20
) -> dict[str, list[int]]:
    """Counts of max-probability confidence, split into correct and incorrect predictions.

    Counts rather than densities, so histograms from several seeds or clients can be summed
    before plotting.
    """
    _check_probs(probs, labels)
    conf, pred = probs.max(dim=1)
    bins = _bin_index(conf, n_bins)
    correct = pred == labels
    return {
        "correct": torch.bincount(bins[correct], minlength=n_bins).tolist(),
        "incorrect": torch.bincount(bins[~correct], minlength=n_bins).tolist(),
    }


def spread(values: list[float] | np.ndarray) -> dict[str, float]:
    """Mean, std, min and max of per-client or per-domain values.

    The std is the population std (ddof = 0): the clients or domains of a run are the whole
    population being described, not a sample from a larger one, and ddof = 0 stays defined for a
    single client. Across seeds, where we estimate, the report uses ddof = 1 instead.
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise DataError(f"spread needs a non-empty 1-D list of values, got shape {arr.shape}")
    return {
        "mean": float(arr.mean()),
        "std": float(arr.std(ddof=0)),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


def worst_domain(per_domain: dict[str, float]) -> tuple[str, float]:
    """The domain with the lowest value; ties go to the alphabetically first name (stable)."""
    if not per_domain:
        raise DataError("worst_domain needs at least one domain, got an empty mapping")
    name = min(sorted(per_domain), key=lambda d: per_domain[d])
    return name, float(per_domain[name])


@dataclass(frozen=True)
class EvalResult:
    """One model on one evaluation set: everything ``summary.json`` stores about it."""

    n: int
    acc: float
    ece: float
    nll: float
    brier: float
    reliability: Reliability
    conf_hist: dict[str, list[int]]
    macro_f1: float

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_probs(
    probs: torch.Tensor, labels: torch.Tensor, *, ece_bins: int = 15, hist_bins: int = 20
) -> EvalResult:
    """All metrics of one prediction set, sharing one reliability table for ECE."""
    rel = reliability_bins(probs, labels, ece_bins)
    return EvalResult(
        n=int(labels.shape[0]),
        acc=accuracy(probs, labels),
        ece=ece_from_bins(rel),
        nll=nll(probs, labels),
        brier=brier(probs, labels),
        reliability=rel,
        conf_hist=confidence_histogram(probs, labels, hist_bins),
        macro_f1=macro_f1(probs, labels),
    )
