"""Automatic report labels: runs of one method that differ in a setting are told apart by it."""

from __future__ import annotations

from pathlib import Path

import yaml

from feddomain.evaluation.report import build_report
from tests.test_report import table, write_run


def _fedprox(root: Path, seed: int, mu: float, ood: float, **extra) -> Path:
    run = write_run(root, f"fedprox_mu{mu}", "photo", seed, (ood, 0.9, 0.1))
    config = {"algorithm": {"name": "fedprox", "mu": mu}, "seed": seed, **extra}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    summary = (run / "summary.json").read_text().replace(f'"fedprox_mu{mu}"', '"fedprox"')
    (run / "summary.json").write_text(summary)
    return run


def _ood_rows(root: Path) -> dict[str, list[str]]:
    rows = table(build_report([root]).to_markdown(), "## pacs — ood accuracy (%)")
    return {k: v for k, v in rows.items() if k not in ("method", "---")}


def test_same_seed_runs_differing_in_mu_get_one_row_each(tmp_path: Path):
    """Catches the report refusing two FedProx runs with the same seed but different ``mu`` as
    duplicates (the state before automatic labels)."""
    _fedprox(tmp_path, 0, 0.01, 0.60)
    _fedprox(tmp_path, 0, 0.1, 0.70)
    rows = _ood_rows(tmp_path)
    assert rows["fedprox (mu=0.01)"][0] == "60.0"  # one seed: its value alone
    assert rows["fedprox (mu=0.1)"][0] == "70.0"


def test_runs_differing_in_mu_and_seed_are_not_averaged_together(tmp_path: Path):
    """Catches two settings silently pooled as two seeds of one method (mean 65 ± 7.1)."""
    _fedprox(tmp_path, 0, 0.01, 0.60)
    _fedprox(tmp_path, 1, 0.1, 0.70)
    rows = _ood_rows(tmp_path)
    assert set(rows) == {"fedprox (mu=0.01)", "fedprox (mu=0.1)"}


def test_seeds_of_one_setting_stay_one_group(tmp_path: Path):
    """Catches the seed (or where the run ran: threads, data root) being taken for a setting,
    which would split the seeds of one experiment into rows of one seed each."""
    _fedprox(tmp_path, 0, 0.01, 0.60, threads=1)
    _fedprox(tmp_path, 1, 0.01, 0.70, threads=2, dataset={"root": "/elsewhere"})
    rows = _ood_rows(tmp_path)
    assert list(rows) == ["fedprox"]
    assert rows["fedprox"][:3] == ["65.0 ± 7.1", "65.0", "2"]  # mean ± std, mean, seeds


def test_only_the_settings_that_differ_are_named(tmp_path: Path):
    """Catches labels naming every setting of the run instead of the differing ones; a
    setting a config leaves out is shown with the schema's default."""
    _fedprox(tmp_path / "a", 0, 0.01, 0.60, rounds=10, train={"lr": 0.1})
    _fedprox(tmp_path / "b", 0, 0.01, 0.70, rounds=10)
    labels = {r.algorithm for r in build_report([tmp_path]).runs}
    assert labels == {"fedprox (train.lr=0.1)", "fedprox (train.lr=0.001)"}


def test_a_run_written_before_a_setting_existed_matches_one_at_its_default(tmp_path: Path):
    """Catches a new config key (here ``precision``, and ``device``, which says only where a
    run ran) splitting the seeds of one experiment into old and new runs."""
    _fedprox(tmp_path / "old", 0, 0.01, 0.60)
    _fedprox(tmp_path / "new", 1, 0.01, 0.70, precision="fp32", device="cuda:1")
    _fedprox(tmp_path / "bf16", 2, 0.01, 0.50, precision="bf16")
    labels = [r.algorithm for r in sorted(build_report([tmp_path]).runs, key=lambda r: r.seed)]
    assert labels == ["fedprox (precision=fp32)"] * 2 + ["fedprox (precision=bf16)"]
