"""Claims "A > B" as paired differences with 95% intervals (``feddomain report --against`` /
``--claims``), and the tuning behind each method (``feddomain tune``'s ``selected.yaml``).

A claim compares two report rows (method labels) on one metric (ood accuracy by default) over
the (dataset, target, seed) cells both have: the difference d = A - B per cell, its mean and a
95% interval, from Student's t over the pairs (``scipy.stats.t``) or, on request, a paired
percentile bootstrap (``scipy.stats.bootstrap``, seeded). The verdict is the protocol's
(``shared/protocols.md``): the claim **holds** when the whole interval is above 0, is
**refuted** when it is below 0, and is **unresolved** otherwise (fewer than 2 pairs included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from scipy import stats

from feddomain.errors import DataError

if TYPE_CHECKING:
    from feddomain.evaluation.report import Report, RunResult

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 9999


@dataclass(frozen=True)
class Claim:
    """"better > worse" on ``metric``: the mean paired difference and its interval."""

    better: str
    worse: str
    metric: str
    pairs: int
    mean: float
    low: float
    high: float
    interval: str  # "t" or "bootstrap"

    @property
    def verdict(self) -> str:
        if self.low > 0:
            return "holds"
        if self.high < 0:
            return "refuted"
        return "unresolved"


def t_interval(diffs: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """mean ± t_{(1+c)/2, n-1} · s / √n over the paired differences (NaN for fewer than 2)."""
    n = diffs.size
    mean = float(diffs.mean()) if n else math.nan
    if n < 2:
        return math.nan, math.nan
    sem = float(diffs.std(ddof=1)) / math.sqrt(n)
    if sem == 0.0:  # every pair differs by the same amount: no spread, no width
        return mean, mean
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=sem)
    return float(low), float(high)


def bootstrap_interval(
    diffs: np.ndarray, confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the mean difference over pairs resampled with replacement
    (pairs are kept whole: a paired bootstrap); NaN for fewer than 2 pairs."""
    if diffs.size < 2:
        return math.nan, math.nan
    if np.all(diffs == diffs[0]):
        return float(diffs[0]), float(diffs[0])
    res = stats.bootstrap(
        (diffs,),
        np.mean,
        confidence_level=confidence,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired_differences(runs: list[RunResult], better: str, worse: str, metric: str) -> np.ndarray:
    """A - B over the (dataset, target, seed) cells both methods have, in a fixed order."""
    cells: dict[str, dict[tuple[str, str, int], float]] = {better: {}, worse: {}}
    for run in runs:
        if run.algorithm in cells:
            cells[run.algorithm][(run.dataset, run.target, run.seed)] = float(run.selected[metric])
    shared = sorted(set(cells[better]) & set(cells[worse]))
    return np.array([cells[better][k] - cells[worse][k] for k in shared], dtype=np.float64)


def evaluate(
    report: Report, pairs: list[tuple[str, str]], metric: str = "ood_acc", bootstrap: bool = False
) -> list[Claim]:
    """Each claim of ``pairs`` over the report's runs; a label the report lacks is an error
    naming the labels it has."""
    labels = sorted({r.algorithm for r in report.runs})
    for name in {n for pair in pairs for n in pair}:
        if name not in labels:
            raise DataError(f"claim names {name!r}, which no report row has (rows: {labels})")
    claims = []
    for better, worse in pairs:
        diffs = paired_differences(report.runs, better, worse, metric)
        low, high = bootstrap_interval(diffs) if bootstrap else t_interval(diffs)
        mean = float(diffs.mean()) if diffs.size else math.nan
        kind = "bootstrap" if bootstrap else "t"
        claims.append(Claim(better, worse, metric, int(diffs.size), mean, low, high, kind))
    return claims


def against(report: Report, baseline: str) -> list[tuple[str, str]]:
    """"M > baseline" for every other row of the report."""
    labels = sorted({r.algorithm for r in report.runs})
    if baseline not in labels:
        raise DataError(f"--against {baseline!r}: no report row has that name (rows: {labels})")
    return [(label, baseline) for label in labels if label != baseline]


def read_claims(path: Path) -> list[tuple[str, str]]:
    """A claims file: a YAML list of "A > B" strings, or plain text with one per line
    (``#`` starts a comment)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise DataError(f"claims file {path}: cannot read ({err})") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    lines = data if isinstance(data, list) else text.splitlines()
    pairs = []
    for number, line in enumerate(lines, start=1):
        entry = str(line).split("#", 1)[0].strip()
        if not entry:
            continue
        better, sep, worse = (part.strip() for part in entry.partition(">"))
        if not sep or not better or not worse or ">" in worse:
            raise DataError(f"claims file {path}, entry {number}: {entry!r} is not 'A > B'")
        pairs.append((better, worse))
    if not pairs:
        raise DataError(f"claims file {path} lists no claim ('A > B', one per line)")
    return pairs


def claims_markdown(claims: list[Claim]) -> list[str]:
    if not claims:
        return []
    kind = "Student t over the pairs" if claims[0].interval == "t" else "paired bootstrap"
    lines = [
        "",
        f"## Claims — paired difference A − B in {claims[0].metric} (points), 95% interval",
        "",
        f"Pairs: the (dataset, target, seed) cells both rows have; interval: {kind}. holds: the "
        "whole interval above 0; refuted: below 0; unresolved: otherwise.",
        "",
        "| claim | pairs | mean A − B | 95% interval | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in claims:
        interval = "—" if math.isnan(c.low) else f"[{100 * c.low:+.2f}, {100 * c.high:+.2f}]"
        mean = "—" if math.isnan(c.mean) else f"{100 * c.mean:+.2f}"
        lines.append(f"| {c.better} > {c.worse} | {c.pairs} | {mean} | {interval} | {c.verdict} |")
    return lines


# ---------------------------------------------------------------------------------- tuning
def tune_of(run_dir: Path) -> Path | None:
    """The tune a run belongs to: ``<tune>/confirm/.../<run>`` with ``<tune>/selected.yaml``."""
    for parent in run_dir.parents:
        if parent.name == "confirm" and (parent.parent / "selected.yaml").is_file():
            return parent.parent
    return None


def tuning(runs: list[RunResult]) -> dict[str, dict[str, Any]]:
    """Per report row, the selection of the tune(s) its runs confirm (``selected.yaml``)."""
    from feddomain.tune import read_selected

    found: dict[str, dict[str, Any]] = {}
    for run in runs:
        tune_dir = tune_of(run.path)
        if tune_dir is not None and run.algorithm not in found:
            found[run.algorithm] = {"dir": tune_dir, **read_selected(tune_dir / "selected.yaml")}
    return found


def tuning_markdown(found: dict[str, dict[str, Any]]) -> list[str]:
    if not found:
        return []
    lines = [
        "",
        "## Tuning — the selected hyper-parameters behind each row (feddomain tune)",
        "",
        "| method | selected | trials | objective | tune |",
        "|---|---|---|---|---|",
    ]
    for label, sel in sorted(found.items()):
        chosen = ", ".join(sel["selected"]["overrides"]) or "(defaults)"
        objective = "ORACLE (target accuracy)" if sel.get("oracle") else "source validation"
        lines.append(f"| {label} | {chosen} | {sel['trials']} | {objective} | {sel['dir']} |")
    return lines
