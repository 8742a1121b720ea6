"""Claims in the report (issue 25, item 3): paired differences over (seed, target), their 95%
intervals computed by hand here, the verdicts, the tuning beside each row; and runs of one
setting grouped as one row however their hyper-parameters were written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from feddomain.cli import main
from feddomain.config import load_config
from feddomain.errors import DataError
from feddomain.evaluation.claims import (
    Claim,
    ClaimSpec,
    bootstrap_interval,
    read_claims,
    t_interval,
)
from feddomain.evaluation.report import build_report
from tests.test_report import write_run, write_runs

T_975_3 = 3.182446305284263  # Student's t quantile 0.975 with 3 degrees of freedom (tables)
T_975_4 = 2.7764451051977987  # ... with 4


def _hand_t(values: list[float], t_quantile: float) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def test_t_interval_matches_the_hand_computed_one():
    """Catches a z quantile instead of t, the population std (ddof 0), a missing √n, or a
    99% interval: on five differences each would move the ends."""
    diffs = [0.02, 0.05, -0.01, 0.04, 0.03]
    _, low, high = _hand_t(diffs, T_975_4)
    assert t_interval(np.array(diffs)) == pytest.approx((low, high), abs=1e-12)
    # mean 0.026, s = sqrt(2.12e-3 / 4) = 0.0230, half width 2.776 * 0.0230 / sqrt(5) = 0.0286
    assert (low, high) == pytest.approx((-0.00259, 0.05459), abs=1e-5)


def test_verdicts_follow_the_interval_on_the_claimed_side():
    """Catches a verdict read from the mean alone, an interval touching 0 counted, and a
    "lower is the claim" (A < B on ood_ece) judged as if higher were."""

    def claim(low: float, high: float, direction: str = ">") -> Claim:
        spec = ClaimSpec("a", "b", direction, "ood_acc" if direction == ">" else "ood_ece")
        return Claim(spec, 4, (low + high) / 2, low, high, "t")

    assert claim(0.01, 0.05).verdict == "holds"
    assert claim(-0.05, -0.01).verdict == "refuted"
    assert claim(-0.01, 0.05).verdict == "unresolved"
    assert claim(0.0, 0.05).verdict == "unresolved"
    assert claim(math.nan, math.nan).verdict == "unresolved"
    assert claim(-0.05, -0.01, "<").verdict == "holds"
    assert claim(0.01, 0.05, "<").verdict == "refuted"
    assert claim(-0.01, 0.0, "<").verdict == "unresolved"


def test_report_claims_pair_seed_and_target_cells(tmp_path: Path, capsys):
    """Catches unpaired differences (means subtracted), a run without a partner counted as a
    pair, and the CLI's --against not testing every row against the baseline. hfedf - fedavg
    at the source_val round: photo 0.06, 0.06; sketch 0.10, 0.06 (test_report's table); an
    extra hfedf seed has no fedavg partner."""
    root = write_runs(tmp_path / "runs")
    write_run(root, "hfedf", "photo", 2, (0.99, 0.99, 0.01))
    report = build_report([root], against_method="fedavg")
    (claim,) = report.claims
    mean, low, high = _hand_t([0.06, 0.06, 0.10, 0.06], T_975_3)  # 0.07 ± 3.18 · 0.01
    assert (claim.spec, claim.pairs) == (ClaimSpec("hfedf", "fedavg"), 4)
    assert (claim.mean, claim.low, claim.high) == pytest.approx((mean, low, high), abs=1e-12)
    assert claim.verdict == "holds"

    claims = tmp_path / "claims.txt"
    claims.write_text("# the other way round\nfedavg > hfedf\n")
    (reverse,) = build_report([root], claims_file=claims).claims
    assert (reverse.low, reverse.high) == pytest.approx((-high, -low), abs=1e-12)
    assert reverse.verdict == "refuted"

    assert main(["report", str(root), "--against", "fedavg"]) == 0
    assert "| hfedf > fedavg | 4 | +7.00 | [+3.82, +10.18] | holds |" in capsys.readouterr().out


def test_a_lower_is_better_claim_on_a_named_metric_pairs_that_metric(tmp_path: Path, capsys):
    """Catches a claim on ECE scored on ood accuracy, its sign flipped, and a metric the runs
    do not record accepted silently. ECE a - b over (photo, sketch) x seeds 0, 1: -0.05,
    -0.06, -0.07, -0.04, while a's ood accuracy is the lower one (a > b on it is refuted)."""
    root = tmp_path / "runs"
    eces = {"a": (0.05, 0.06, 0.04, 0.05), "b": (0.10, 0.12, 0.11, 0.09)}
    for method, ood in (("a", 0.5), ("b", 0.7)):
        for i, (target, seed) in enumerate([(t, s) for t in ("photo", "sketch") for s in (0, 1)]):
            write_run(root, method, target, seed, (ood + 0.01 * i, 0.9, eces[method][i]))
    claims = tmp_path / "claims.txt"
    claims.write_text("a < b on ood_ece\nb < a on ood_ece\na > b\n")
    lower, higher, accuracy = build_report([root], claims_file=claims).claims
    mean, low, high = _hand_t([-0.05, -0.06, -0.07, -0.04], T_975_3)
    assert (lower.mean, lower.low, lower.high) == pytest.approx((mean, low, high), abs=1e-12)
    assert (lower.spec.metric, lower.verdict, higher.verdict) == ("ood_ece", "holds", "refuted")
    assert (accuracy.mean, accuracy.verdict) == (pytest.approx(-0.2), "refuted")
    assert main(["report", str(root), "--claims", str(claims)]) == 0
    assert "| a < b on ood_ece | 4 | -5.50 |" in capsys.readouterr().out
    claims.write_text("a < b on ood_spread_typo\n")
    with pytest.raises(DataError, match=r"records no numeric 'ood_spread_typo'"):
        build_report([root], claims_file=claims)


def test_a_trailing_metric_is_the_mean_of_the_last_50_rounds_whatever_the_selection(
    tmp_path: Path,
):
    """Catches fedvr.md B2's L_var read at the selected round (round 10 here) instead of
    averaged over the last 50 rounds, a window off by one, and a run too short for the window
    given a value. Per-round client_loss_var: a = round / 1000 over rounds 1-60 (mean of
    rounds 11-60: 35.5 / 1000), b = 0.1 every round, so a - b = -0.0645 in every cell. Also
    catches every report reading every run's rounds.jsonl when no trailing metric is asked for
    (a damaged one then blocks an unrelated report), and the value a run's summary keeps
    (``trailing``) not read when the per-round log is absent (the campaign commits none)."""
    root = tmp_path / "runs"
    for method in ("a", "b"):
        for target, seed in [(t, s) for t in ("photo", "sketch") for s in (0, 1)]:
            run = write_run(root, method, target, seed, (0.6, 0.9, 0.1))
            per_round = [r / 1000 if method == "a" else 0.1 for r in range(1, 61)]
            (run / "rounds.jsonl").write_text(
                json.dumps({"round": 0, "task": "collect"})
                + "".join(
                    "\n" + json.dumps({"round": r, "client_loss_var": v})
                    for r, v in enumerate(per_round, start=1)
                )
            )
    claims = tmp_path / "claims.txt"
    claims.write_text("a < b on client_loss_var_last50\n")
    (claim,) = build_report([root], claims_file=claims).claims
    assert claim.mean == pytest.approx(35.5 / 1000 - 0.1, abs=1e-12)
    assert (claim.low, claim.high, claim.verdict) == (claim.mean, claim.mean, "holds")
    for method in ("a", "b"):
        short = write_run(tmp_path / "short", method, "photo", 0, (0.6, 0.9, 0.1))
        lines = (json.dumps({"round": r, "client_loss_var": 0.1}) for r in range(1, 50))
        (short / "rounds.jsonl").write_text("\n".join(lines))
    with pytest.raises(DataError, match=r"records no numeric 'client_loss_var_last50'"):
        build_report([tmp_path / "short"], claims_file=claims)
    with pytest.raises(DataError, match=r"over the last 50 rounds; neither its summary"):
        build_report([tmp_path / "short"], extra_metrics=("client_loss_var_last50",))
    (short / "rounds.jsonl").write_text("{not json\n")  # read only when a metric needs it
    assert len(build_report([tmp_path / "short"]).runs) == 2
    for run in root.rglob("rounds.jsonl"):  # a run's summary keeps it: no per-round log needed
        summary = json.loads((run.parent / "summary.json").read_text())
        kept = 0.5 if run.parent.name.startswith("a_") else 0.25
        summary["trailing"] = {"client_loss_var_last50": kept}
        (run.parent / "summary.json").write_text(json.dumps(summary))
        run.unlink()
    (claim,) = build_report([root], claims_file=claims).claims
    assert (claim.mean, claim.verdict) == (0.25, "refuted")


def test_bootstrap_interval_is_seeded_and_inside_the_differences(tmp_path: Path):
    """Catches an unseeded bootstrap (a report that changes between two calls) and one that
    resamples something other than the pairs: a percentile interval of means of resampled
    differences lies within [min, max] of them."""
    root = write_runs(tmp_path / "runs")
    first = build_report([root], against_method="fedavg", bootstrap=True).claims[0]
    again = build_report([root], against_method="fedavg", bootstrap=True).claims[0]
    assert (first.low, first.high) == (again.low, again.high)
    assert 0.06 <= first.low < first.high <= 0.10
    assert first.verdict == "holds" and first.interval == "bootstrap"
    assert bootstrap_interval(np.array([0.03, 0.03])) == (0.03, 0.03)
    spread = np.array([0.013, 0.021, -0.004, 0.037, 0.029, 0.008, 0.016])
    assert bootstrap_interval(spread) == bootstrap_interval(spread)
    assert bootstrap_interval(spread, seed=1) != bootstrap_interval(spread)


def test_a_claim_on_gains_pairs_the_two_gains_cell_by_cell(tmp_path: Path, capsys):
    """Catches HFedATM's "larger gains with FedSR clients than with FedAvg" computed from the
    rows' means (unpaired), a cell one of the four rows lacks counted, or the gains subtracted
    the wrong way round. Per (target, seed) cell, ood at the source_val round:
    (hfedatm_fedsr - hfedavg_fedsr) - (hfedatm - hfedavg) = (3, 5, 2, 4) points; the cell
    (sketch, 2) that hfedavg lacks would add -40 points."""
    root = tmp_path / "runs"
    cells = [("photo", 0), ("photo", 1), ("sketch", 0), ("sketch", 1)]
    rows = {  # ood accuracy per cell, in cells' order
        "hfedavg": (0.60, 0.62, 0.40, 0.44),
        "hfedatm": (0.61, 0.62, 0.42, 0.44),  # gains 1, 0, 2, 0 points
        "hfedavg_fedsr": (0.50, 0.55, 0.30, 0.35),
        "hfedatm_fedsr": (0.54, 0.60, 0.34, 0.39),  # gains 4, 5, 4, 4 points
    }
    for row, values in rows.items():
        for (target, seed), ood in zip(cells, values, strict=True):
            write_run(root, row, target, seed, (ood, 0.9, 0.1))
    for row, ood in (("hfedatm", 0.9), ("hfedavg_fedsr", 0.1), ("hfedatm_fedsr", 0.5)):
        write_run(root, row, "sketch", 2, (ood, 0.9, 0.1))  # no hfedavg partner
    claims = tmp_path / "claims.txt"
    claims.write_text(
        "hfedatm_fedsr - hfedavg_fedsr > hfedatm - hfedavg\n"
        "hfedatm - hfedavg > hfedatm_fedsr - hfedavg_fedsr\n"
    )
    larger, reverse = build_report([root], claims_file=claims).claims
    mean, low, high = _hand_t([0.03, 0.05, 0.02, 0.04], T_975_3)  # 0.035 ± 3.18 · 0.00645
    assert larger.pairs == 4
    assert (larger.mean, larger.low, larger.high) == pytest.approx((mean, low, high), abs=1e-12)
    assert (larger.verdict, reverse.verdict) == ("holds", "refuted")
    assert main(["report", str(root), "--claims", str(claims)]) == 0
    out = capsys.readouterr().out
    assert "| hfedatm_fedsr - hfedavg_fedsr > hfedatm - hfedavg | 4 | +3.50 |" in out


def test_claims_parse_back_to_their_text():
    """Catches a gain claim misread (its baselines dropped, or a row's label split at a
    hyphen that is part of it) and a gain compared with a plain row, which has no meaning."""
    gains = ClaimSpec.parse("a_x - b-1 < c - d on ood_ece")
    assert gains == ClaimSpec("a_x", "c", "<", "ood_ece", "b-1", "d")
    assert gains.rows == ("a_x", "b-1", "c", "d")
    assert ClaimSpec.parse(gains.text) == gains
    assert ClaimSpec.parse("fedfd-a > fedfd").rows == ("fedfd-a", "fedfd")
    for text in ("a - b > c", "a > c - d", "a - b - c > d - e", "a -  > c - d"):
        with pytest.raises(ValueError):
            ClaimSpec.parse(text)


def test_claims_files_and_bad_claims(tmp_path: Path):
    """Catches a YAML list not read as claims, a malformed line accepted, and a claim about
    a row the report lacks passing silently (the message lists the rows)."""
    listed = tmp_path / "claims.yaml"
    listed.write_text('- "hfedf > fedavg"\n- fedprox > fedavg\n')
    assert read_claims(listed) == [ClaimSpec("hfedf", "fedavg"), ClaimSpec("fedprox", "fedavg")]
    bad = tmp_path / "bad.txt"
    for line in ("hfedf >> fedavg", "hfedf > fedavg < fedprox", "hfedf < fedavg on two words"):
        bad.write_text(f"{line}\n")
        with pytest.raises(DataError, match=rf"entry 1: '{line}' is not 'A > B'"):
            read_claims(bad)
    root = write_runs(tmp_path / "runs")
    with pytest.raises(DataError, match=r"claim names 'fedprox'.*rows: \['fedavg', 'hfedf'\]"):
        build_report([root], claims_file=listed)


def test_the_tune_behind_a_row_is_shown_with_its_selection(tmp_path: Path):
    """Catches confirmation runs of a tune reported without the hyper-parameters chosen and
    the number of trials behind them, or an oracle tune shown as a source-validation one."""
    root = write_runs(tmp_path / "plain")
    tune_dir = tmp_path / "tune-hfedf"
    confirm = tune_dir / "confirm"
    for target in ("photo", "sketch"):
        write_run(confirm, "hfedf", target, 7, (0.6, 0.9, 0.1))
    selected = {"oracle": True, "trials": 6, "selected": {"overrides": ["train.lr=0.002"]}}
    (tune_dir / "selected.yaml").write_text(yaml.safe_dump(selected))
    text = build_report([root, confirm]).to_markdown()
    assert f"| hfedf | train.lr=0.002 | 6 | ORACLE (target accuracy) | {tune_dir} |" in text
    assert "| fedavg |" not in text.split("## Tuning")[1]


# --------------------------------------------------------------------------- grouping
def test_saved_hyper_parameters_are_typed(tmp_path: Path):
    """Catches `algorithm.mu=1e-2` (or `mu: 1e-2` in a YAML file, which PyYAML reads as a
    string) saved as the string "1e-2", which then compares unequal to 0.01."""
    cfg = load_config(None, ["algorithm=fedprox", "algorithm.mu=1e-2"])
    assert cfg.to_dict()["algorithm"] == {"name": "fedprox", "label": None, "mu": 0.01}
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: {name: fedprox, mu: 1e-2}\n")
    saved = yaml.safe_load(yaml.safe_dump(load_config(path).to_dict()))
    assert saved["algorithm"]["mu"] == 0.01 and isinstance(saved["algorithm"]["mu"], float)


def _fedprox_run(root: Path, seed: int, algorithm: str, ood: float) -> None:
    for target in ("photo", "sketch"):
        run = write_run(root, f"fedprox_{seed}", target, seed, (ood, 0.9, 0.1))
        (run / "config.yaml").write_text(f"algorithm: {algorithm}\nseed: {seed}\n")
        summary = (run / "summary.json").read_text().replace(f'"fedprox_{seed}"', '"fedprox"')
        (run / "summary.json").write_text(summary)


def test_a_stated_default_a_string_and_an_implicit_default_are_one_row(tmp_path: Path):
    """Catches the report splitting one setting into rows of one seed each: `mu: "1e-2"` (an
    untyped saved value), `mu: 0.01` and `algorithm: fedprox` (mu left at its default 0.01)
    are one FedProx row with three seeds; mu = 0.1 is another row."""
    root = tmp_path / "runs"
    _fedprox_run(root, 0, '{name: fedprox, mu: "1e-2"}', 0.50)
    _fedprox_run(root, 1, "{name: fedprox, mu: 0.01}", 0.60)
    _fedprox_run(root, 2, "fedprox", 0.70)
    report = build_report([root])
    assert {(g.algorithm, g.target, len(g.runs)) for g in report.groups} == {
        ("fedprox", "photo", 3), ("fedprox", "sketch", 3)
    }  # fmt: skip
    assert report.groups[0].stats["ood_acc"].mean == pytest.approx(0.60)
    assert not [w for w in report.warnings if "differ" in w]
    _fedprox_run(root, 3, "{name: fedprox, mu: 0.1}", 0.40)
    rows = {(g.algorithm, len(g.runs)) for g in build_report([root]).groups}
    assert rows == {("fedprox (mu=0.01)", 3), ("fedprox (mu=0.1)", 1)}
