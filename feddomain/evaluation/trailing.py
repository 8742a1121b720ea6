"""Run-level means over a run's last rounds, for quantities a paper reads as a trend rather than
at one evaluated round (fedvr.md B2: L_var over the last 50 rounds). Each run writes them into
its ``summary.json`` (``trailing``), so a report reads them without the per-round log
(``rounds.jsonl``), which the campaign does not commit."""

from __future__ import annotations

from collections.abc import Iterable

# name -> (the per-round quantity of rounds.jsonl, the window of last rounds it is averaged over)
TRAILING_METRICS: dict[str, tuple[str, int]] = {
    "client_loss_var_last50": ("client_loss_var", 50),  # fedvr.md B2
}


def trailing_means(rounds: list[dict], names: Iterable[str] | None = None) -> dict[str, float]:
    """Those of ``names`` (default: every ``TRAILING_METRICS``) whose quantity ``rounds`` holds
    for at least its window of rounds: its mean over the last window of them. A run shorter
    than a window has none of that metric (a claim on it is then refused by name)."""
    ordered = sorted(rounds, key=lambda r: r.get("round", 0))
    out = {}
    for name in TRAILING_METRICS if names is None else names:
        key, window = TRAILING_METRICS[name]
        values = [r[key] for r in ordered if isinstance(r.get(key), int | float)]
        if len(values) >= window:
            out[name] = sum(values[-window:]) / window
    return out
