"""Evaluation: metrics on predictions, model-selection rules, and reports over run directories.

``report`` (tables, CSV, matplotlib plots) is imported on its own, as
``feddomain.evaluation.report``, so training code that only needs metrics does not load
matplotlib.
"""

from feddomain.evaluation.metrics import (
    EvalResult,
    Reliability,
    accuracy,
    brier,
    confidence_histogram,
    ece,
    evaluate_probs,
    nll,
    reliability_bins,
    spread,
    worst_domain,
)
from feddomain.evaluation.selection import RULES, select

__all__ = [
    "RULES",
    "EvalResult",
    "Reliability",
    "accuracy",
    "brier",
    "confidence_histogram",
    "ece",
    "evaluate_probs",
    "nll",
    "reliability_bins",
    "select",
    "spread",
    "worst_domain",
]
