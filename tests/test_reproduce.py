"""`feddomain reproduce`: the papers' registry, the runs it makes and the numbers it prints
beside the paper's.

The aggregation is checked against values computed here from the run files themselves (the
last record of each ``metrics.jsonl``), never against the module's own output."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from feddomain.cli import main
from feddomain.config import load_config
from feddomain.data.sources import get_spec
from feddomain.errors import ConfigError
from feddomain.reproduce import (
    Ours,
    collect,
    comparison_markdown,
    load_paper,
    papers,
    run_table,
)
from tests.test_paper_configs import _weights_file

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reproduce.md"
TINY = {
    "name": "reproduce-test",
    "seed": 0,
    "rounds": 3,
    "dataset": {"name": "digits_embedded", "resolution": 32},
    "split": {"scheme": "lodo", "targets": ["grey", "inverted"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5"},
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002, "max_steps": 2},
    "eval": {"every": 1, "selection": "source_val"},
    "checkpoint": {"every": 0},
    "threads": 1,
}


def toy_paper(folder: Path, config: Path, **table: object) -> Path:
    """A registry folder with paper ``toy``: FedAvg per target and over both targets, FedProx
    over both, and FedAvg's mean of two columns."""
    cells = [
        {"row": "FedAvg", "column": "grey", "config": str(config), "target": "grey",
         "paper": [50.0, 40.0]},
        {"row": "FedAvg", "column": "both", "config": str(config), "paper": [55.0, 45.0]},
        {"row": "FedProx", "column": "both", "config": str(config),
         "overrides": ["algorithm=fedprox"], "paper": [None, 30.0]},
        {"row": "FedAvg", "column": "AVG", "mean_of": ["grey", "both"], "paper": [52.5, 42.5]},
    ]  # fmt: skip
    raw = {
        "paper": "toy",
        "title": "Toy",
        "source": "a test",
        "tables": [
            {"name": "1", "caption": "toy", "metrics": ["id_acc", "ood_acc"], "seeds": [0, 1],
             "cells": cells, **table}
        ],
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "toy.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The toy table run once: 2 settings x 2 seeds x 2 targets; (registry folder, out)."""
    root = tmp_path_factory.mktemp("reproduce")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    folder = toy_paper(root / "papers", config)
    (table,) = load_paper("toy", folder).tables
    assert run_table(table, root / "out", []) == []
    return folder, root / "out"


def last_records(out: Path) -> dict[tuple[str, int, str], dict]:
    """(algorithm, seed, target) -> the last evaluated record, read from the run files."""
    found = {}
    for summary in out.rglob("summary.json"):
        config = yaml.safe_load((summary.parent / "config.yaml").read_text())
        lines = (summary.parent / "metrics.jsonl").read_text().splitlines()
        last = max((json.loads(line) for line in lines), key=lambda r: r["round"])
        algorithm = config["algorithm"]["name"]
        found[(algorithm, config["seed"], config["split"]["targets"][0])] = last
    return found


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


@pytest.mark.slow
def test_cells_average_the_last_round_over_targets_then_over_seeds(finished):
    """Catches reading the source-validation round instead of the last (every paper reports
    its final round), a std pooled over (seed, target) runs instead of over the seeds' means,
    a target cell that mixes in the other target, and a mean_of cell that is not the seed-wise
    mean of its columns."""
    folder, out = finished
    (table,) = load_paper("toy", folder).tables
    records = last_records(out)
    assert len(records) == 8 and {r["round"] for r in records.values()} == {3}
    values = collect(table, out, [])

    for metric_index, metric in enumerate(("id_acc", "ood_acc")):
        grey = [records[("fedavg", s, "grey")][metric] for s in (0, 1)]
        both = [
            (records[(a, s, "grey")][metric] + records[(a, s, "inverted")][metric]) / 2
            for a in ("fedavg",)
            for s in (0, 1)
        ]
        prox = [
            (records[("fedprox", s, "grey")][metric] + records[("fedprox", s, "inverted")][metric])
            / 2
            for s in (0, 1)
        ]
        avg = [(g + b) / 2 for g, b in zip(grey, both, strict=True)]
        for column, row, expected in [
            ("grey", "FedAvg", grey), ("both", "FedAvg", both), ("both", "FedProx", prox),
            ("AVG", "FedAvg", avg),
        ]:  # fmt: skip
            got = values[(row, column)].stat(metric_index)
            assert got == pytest.approx(mean_std(expected), abs=1e-12), (row, column, metric)
    assert values[("FedAvg", "both")].finished == values[("FedAvg", "both")].planned == 4


@pytest.mark.slow
def test_the_last_round_counts_even_where_source_validation_would_pick_another(
    finished, tmp_path: Path
):
    """Catches the report's default rule (best id accuracy) in place of the papers' final
    round: one run's last record is rewritten to the worst id accuracy and an ood accuracy of
    12.5%, which only the last-round rule reads."""
    folder, out = finished
    (table,) = load_paper("toy", folder).tables
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    records = last_records(copy)
    (grey_seed0,) = [
        p.parent for p in copy.rglob("summary.json")
        if "fedprox" not in str(p) and "seed=0" in str(p) and "grey" in str(p)
    ]  # fmt: skip
    metrics = grey_seed0 / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    lines[-1].update(id_acc=0.0, ood_acc=0.125)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))

    grey = collect(table, copy, [])[("FedAvg", "grey")]
    assert grey.seeds[0] == (0.0, 0.125)
    assert grey.seeds[1] == (records[("fedavg", 1, "grey")]["id_acc"],
                             records[("fedavg", 1, "grey")]["ood_acc"])  # fmt: skip


@pytest.mark.slow
def test_a_seed_missing_one_target_is_left_out_and_the_cell_says_so(finished, tmp_path: Path):
    """Catches an average over the targets a seed happens to have finished: seed 1 without its
    `inverted` run must drop out of the both-targets cell (and of its mean_of), not count as
    its grey accuracy alone."""
    folder, out = finished
    (table,) = load_paper("toy", folder).tables
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    (inverted_seed1,) = [
        p.parent for p in copy.rglob("summary.json")
        if "fedprox" not in str(p) and "seed=1" in str(p) and "inverted" in str(p)
    ]  # fmt: skip
    (inverted_seed1 / "summary.json").unlink()
    records = last_records(copy)

    values = collect(table, copy, [])
    both = values[("FedAvg", "both")]
    assert sorted(both.seeds) == [0] and (both.finished, both.planned) == (3, 4)
    expected = (
        records[("fedavg", 0, "grey")]["ood_acc"] + records[("fedavg", 0, "inverted")]["ood_acc"]
    ) / 2
    assert both.stat(1) == pytest.approx((expected, 0.0), abs=1e-12)
    assert sorted(values[("FedAvg", "AVG")].seeds) == [0]
    assert sorted(values[("FedAvg", "grey")].seeds) == [0, 1]  # its own runs are all there
    markdown = comparison_markdown(table, values)
    assert "(1 of 2 seeds)" in markdown


@pytest.mark.slow
def test_a_setting_two_tables_list_is_run_once_and_compared_without_the_run_flags(finished):
    """Catches a setting trained again for every table that lists it (a GPU-day each for the
    hFedF and HFedATM tables), and a comparison that insists on the exact flags of the run
    (another --device, no weights file on the laptop that tabulates)."""
    folder, out = finished
    raw = yaml.safe_load((folder / "toy.yaml").read_text())
    second = {**raw["tables"][0], "name": "2", "needs": ["model.options.weights_path"]}
    second["cells"] = [c for c in second["cells"] if c["column"] == "grey"]
    raw["tables"].append(second)
    (folder / "again.yaml").write_text(yaml.safe_dump({**raw, "paper": "again"}))
    first, other = load_paper("again", folder).tables
    ours = collect(first, out, [])[("FedAvg", "grey")]
    flags = ["device=cuda", "model.options.weights_path=/nowhere.pt"]
    assert collect(other, out, flags)[("FedAvg", "grey")] == ours
    assert (ours.finished, ours.planned) == (2, 2)


def test_ours_beside_the_paper_in_percent_with_the_difference():
    """Catches a fraction printed as a percentage (or the reverse), a population std, and a
    difference taken the wrong way round: seeds at 50%, 60% and 70% are 60.0 ± 10.0 (their
    sample std; the population std would be 8.2), printed against the paper's number."""
    folder_table = load_paper("hfedf").tables[0]
    cell = folder_table.cells[0]
    values = {(c.row, c.column): Ours({}, 0, 12) for c in folder_table.cells}
    values[(cell.row, cell.column)] = Ours({0: (0.5, 0.5), 1: (0.6, 0.6), 2: (0.7, 0.7)}, 12, 12)
    line = next(
        ln for ln in comparison_markdown(folder_table, values).splitlines()
        if ln.startswith(f"| {cell.row} | {cell.column} |")
    )  # fmt: skip
    first_paper = cell.paper[0]
    assert f"| {first_paper:g} | 60.0 ± 10.0 | {60.0 - first_paper:+.1f} |" in line
    assert "not run (0/12 runs)" in comparison_markdown(folder_table, values)


def test_a_table_needing_a_key_is_refused_before_any_run(tmp_path: Path):
    """Catches a run of a ResNet table started without its weights file: the refusal names the
    key and comes before any run directory is made."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    folder = toy_paper(tmp_path / "papers", config, needs=["model.options.weights_path"])
    (table,) = load_paper("toy", folder).tables
    with pytest.raises(ConfigError, match=r"model\.options\.weights_path=\.\.\."):
        run_table(table, tmp_path / "out", ["dataset.root=/data"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c[0].update(paper=[50.0]), "paper needs 2 values"),
        (
            lambda c: c[3].update(mean_of=["grey", "nowhere"]),
            r"averages missing columns \['nowhere'\]",
        ),
        (lambda c: c[0].update(colour="red"), r"unknown keys \['colour'\]"),
        (lambda c: c[3].update(config="x.yaml"), "either config or mean_of"),
        (lambda c: c.append(dict(c[0])), "share a row and column"),
    ],
)
def test_a_malformed_registry_entry_is_refused_with_where_it_is(tmp_path: Path, change, message):
    """Catches a registry typo that would print a wrong or missing comparison silently."""
    folder = toy_paper(tmp_path, tmp_path / "tiny.yaml")
    raw = yaml.safe_load((folder / "toy.yaml").read_text())
    change(raw["tables"][0]["cells"])
    (folder / "toy.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=message) as err:
        load_paper("toy", folder)
    assert "toy.yaml" in str(err.value)


# ------------------------------------------------------------------ the shipped registry
def test_every_seed_paper_has_a_registry():
    """Catches a seed paper the command cannot reproduce."""
    assert papers() == ["fedfd", "fedvr", "fisc", "hfedatm", "hfedf"]


@pytest.mark.parametrize("name", ["fedfd", "fedvr", "fisc", "hfedatm", "hfedf"])
def test_every_cell_loads_and_names_real_target_domains(name: str, tmp_path: Path):
    """Catches an override a config refuses (a key renamed since, `algorithm.name=` where the
    method needs its own defaults) and a target domain the dataset does not have: either would
    fail hours into a user's GPU run, or print an empty cell."""
    weights: dict[str, list[str]] = {}  # model -> the override of its stand-in weights file
    for table in load_paper(name).tables:
        for setting in table.settings():
            items = [*setting.overrides, "dataset.root=/data"]
            cfg = load_config(Path(setting.config), items)
            if "model.options.weights_path" in table.needs:
                if cfg.model.name not in weights:
                    weights[cfg.model.name] = _weights_file(cfg, tmp_path)
                cfg = load_config(Path(setting.config), [*items, *weights[cfg.model.name]])
            domains = get_spec(cfg.dataset.name).domains
            for cell in table.cells:
                if cell.setting == setting and cell.target is not None and domains:
                    assert cell.target in domains, (table.name, cell.row, cell.column)


SPECS = {
    "fedfd": "fedfda",
    "fedvr": "fedvr",
    "fisc": "fisc",
    "hfedatm": "hfedatm",
    "hfedf": "hfedf",
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_paper_number_is_printed_in_the_paper_or_docs_reproduce(name: str, shared_data):
    """Catches a transcription error (a digit swapped, a value in the wrong row): each number
    of the registry must appear as printed in docs/reproduce.md or in the paper's own text
    (../shared/papers: the paper, its poster, its specification) on a line that names its row
    or prints another of the row's numbers. (Two values swapped within one printed row are not
    caught.)"""
    sources = [DOCS, *sorted((shared_data.parent / "papers").glob(f"{SPECS[name]}.*"))]
    assert len(sources) > 2, f"no text of {name} under {shared_data.parent / 'papers'}"
    lines = [line for p in sources for line in p.read_text().lower().splitlines()]
    numbers = [set(re.findall(r"\d+\.\d+", line)) for line in lines]
    missing = [
        (t.name, c.row, c.column, v)
        for t in load_paper(name).tables
        for c in t.cells
        for v in c.paper
        if v is not None
        and not _printed_in_its_row(v, c.row, _row_values(t, c.row), lines, numbers)
    ]
    assert not missing


def _row_values(table, row: str) -> list[float]:
    return [v for c in table.cells if c.row == row for v in c.paper if v is not None]


def _printed_in_its_row(
    value: float, row: str, row_values: list[float], lines: list[str], numbers: list[set[str]]
) -> bool:
    """``value`` on a line that names the row, or that prints another number of the same row
    (a paper's table row holds a row's numbers; a number alone proves nothing)."""
    others = [w for w in row_values if w != value] or [value]
    return any(
        _printed(value, found) and (row.lower() in line or any(_printed(w, found) for w in others))
        for line, found in zip(lines, numbers, strict=True)
    )


def _printed(value: float, numbers: set[str]) -> bool:
    return bool({f"{value:.1f}", f"{value:.2f}"} & numbers)


def test_dry_run_prints_the_papers_numbers_and_the_sweeps(capsys):
    """Catches a dry run that runs something or omits how to run a table by hand."""
    assert main(["reproduce", "hfedf", "dataset.root=/data", "--table", "2", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "| hFedF | PACS d=1 | 71.5 | 54.6 |" in text
    assert (
        "feddomain sweep feddomain:pacs/hfedf_d1 dataset.root=/data --grid 'seed=[0,1,2]'" in text
    )
