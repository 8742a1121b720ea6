"""What a new user finds without reading code (issue 17, items 5 and 7): `feddomain list`,
`run --dry-run`, help texts, the generated config reference, and what `data export` says."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from feddomain import catalog
from feddomain.algorithms import METHODS
from feddomain.cli import _parser, main
from feddomain.config import ExperimentConfig
from feddomain.data.sources import DATASETS
from feddomain.models import MODELS

PROJECT = Path(__file__).resolve().parents[1]
DEMO = PROJECT / "configs" / "demo.yaml"


def _listed(capsys, what: str) -> dict[str, str]:
    assert main(["list", what]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {line.split()[0]: line.split(maxsplit=1)[1] for line in lines}


def test_list_names_every_registered_entry_with_a_description(capsys):
    """Catches a method, model, dataset or shipped config missing from `feddomain list`, or
    listed without its description (a method's includes its citation's year)."""
    methods = _listed(capsys, "methods")
    assert set(methods) == set(METHODS)
    assert "Li et al., MLSys 2020" in methods["fedprox"]
    models = _listed(capsys, "models")
    assert set(models) == set(MODELS) and "norm='none'" in models["lenet5"]
    datasets = _listed(capsys, "datasets")
    assert set(datasets) == set(DATASETS)
    assert "art_painting, cartoon, photo, sketch" in datasets["PACS"]
    assert "grey, mnistm, inverted, sketch" in datasets["digits_embedded"]
    configs = _listed(capsys, "configs")
    shipped = (p.relative_to(PROJECT / "configs") for p in (PROJECT / "configs").rglob("*.yaml"))
    assert set(configs) == {f"feddomain:{p.with_suffix('').as_posix()}" for p in shipped}
    assert configs["feddomain:demo"].startswith("feddomain demo:")


def test_dry_run_prints_the_resolved_config_and_partition_and_writes_nothing(
    tmp_path, capsys, monkeypatch
):
    """Catches a dry run that trains, writes a run directory, or prints a config other than
    the one a run would save (overrides applied, defaults filled in)."""
    monkeypatch.chdir(tmp_path)
    import feddomain.federation.simulation as simulation

    monkeypatch.setattr(simulation.Simulation, "run", lambda self: pytest.fail("it trained"))
    argv = ["run", str(DEMO), "split.targets=sketch", "rounds=3", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out.split("lodo-sketch:")[0])
    assert resolved["rounds"] == 3 and resolved["split"]["targets"] == ["sketch"]
    assert resolved["train"]["lr"] == 0.003 and resolved["topology"]["stations"] == 0
    assert "lodo-sketch: client x domain training samples" in out
    assert list(tmp_path.iterdir()) == []


def _actions(parser: argparse.ArgumentParser, path: str = "feddomain"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _actions(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
            yield path, action


def test_every_argument_has_help_and_the_top_level_help_shows_examples(capsys):
    """Catches an argument added without a help text (a user sees only its name) and a top-
    level help without examples or a pointer to the docs."""
    missing = [f"{path} {a.dest}" for path, a in _actions(_parser()) if not a.help]
    assert missing == []
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "feddomain run feddomain:demo" in text
    assert "docs/config.md" in text


def test_config_reference_is_current_and_documents_every_key():
    """Catches docs/config.md drifting from the schemas (regenerate with
    `python -m feddomain.catalog > docs/config.md`), a config key without a meaning, and a
    method whose hyper-parameters are missing from the reference."""
    text = catalog.config_reference()
    assert (PROJECT / "docs" / "config.md").read_text() == text
    undocumented = []

    def walk(model: type, prefix: str) -> None:
        for key, field in model.model_fields.items():
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                walk(field.annotation, f"{prefix}{key}.")
            else:
                if not field.description:
                    undocumented.append(f"{prefix}{key}")
                assert f"| `{prefix}{key}` |" in text

    walk(ExperimentConfig, "")
    assert undocumented == []
    for name, spec in METHODS.items():
        assert f"### `{name}`" in text
        for key in spec.hparams.model_fields:
            assert f"| `algorithm.{key}` |" in text.split(f"### `{name}`")[1].split("###")[0]


def _meanings(text: str) -> dict[str, dict[str, str]]:
    """The reference's table rows by section: {section heading: {key: meaning}}."""
    sections: dict[str, dict[str, str]] = {}
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            rows = sections.setdefault(line.lstrip("# ").strip(), {})
        elif line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0].strip("`")] = cells[3]
    return sections


def test_config_reference_gives_every_key_and_hyper_parameter_a_meaning():
    """Catches a config key or a method hyper-parameter added without a meaning (an attribute
    docstring right after the field): its row in docs/config.md would have an empty last
    column, and a user could not tell what it does."""
    sections = _meanings(catalog.config_reference())
    config_rows = {
        key: meaning
        for section, rows in sections.items()
        if section.strip("`") not in METHODS
        for key, meaning in rows.items()
    }
    empty = []

    def walk(model: type, prefix: str) -> None:
        for key, field in model.model_fields.items():
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                walk(field.annotation, f"{prefix}{key}.")
            elif not config_rows.get(f"{prefix}{key}"):
                empty.append(f"{prefix}{key}")

    walk(ExperimentConfig, "")
    for name, spec in METHODS.items():
        rows = sections[f"`{name}`"]
        empty += [
            f"{name}: algorithm.{k}"
            for k in spec.hparams.model_fields
            if not rows.get(f"algorithm.{k}")
        ]
    assert empty == []


# experiment records: free to cite sources
RECORDS = ("docs/results.md", "docs/results-smoke.md", "docs/performance.md")


OUTPUTS = {"report.md", "comparison.md"}  # files feddomain writes (report; reproduce)


def test_user_docs_and_config_comments_point_only_at_files_users_have():
    """Catches a shipped config or a user doc that sends the reader to a file outside the project
    (`../shared/...`, a method spec such as `hfedatm.md §2.6`): a user has only the repository,
    so the pointer must be a shipped file or a paper citation."""
    texts = [*(PROJECT / "configs").rglob("*.yaml"), PROJECT / "README.md"]
    texts += [
        p for p in (PROJECT / "docs").glob("*.md") if str(p.relative_to(PROJECT)) not in RECORDS
    ]
    dangling = []
    for path in texts:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(PROJECT)}:{n}"
            if "../shared" in line:
                dangling.append(f"{where}: ../shared")
            for name in re.findall(r"[\w./-]*\w\.md\b", line):
                shipped = (PROJECT / name).exists() or (PROJECT / "docs" / name).exists()
                if not shipped and Path(name).name not in OUTPUTS:
                    dangling.append(f"{where}: {name}")
    assert dangling == []


def test_data_export_says_which_split_it_wrote_and_how_to_get_the_others(tmp_path, capsys):
    """Catches `data export` of a config with several splits silently writing only the first
    (a user would deploy one target believing they had them all)."""
    out = tmp_path / "sites"
    argv = ["data", "export", str(DEMO), "split.targets=[grey, sketch]", "--out", str(out)]
    assert main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "exported split lodo-grey only" in printed
    assert "other splits (lodo-sketch) need their own export" in printed
    assert "split.targets=sketch --out ANOTHER_DIR" in printed
    assert yaml.safe_load((out / "sites.yaml").read_text())["split"]["targets"] == ["grey"]
