"""The Python API (``import feddomain``): only public names are used here, as a notebook would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import feddomain

PROJECT = Path(__file__).resolve().parents[1]
DEMO = PROJECT / "configs" / "demo.yaml"
# the demo's federation at its cheapest: one target, LeNet-5, 2 rounds
CHEAP = ["split.targets=[grey]", "model.name=lenet5", "model.options={}", "rounds=2"]


def readme_python_example() -> str:
    """The first ```python block of README.md's "Python API" section."""
    text = (PROJECT / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:1]
    return block


def test_the_readme_python_example_runs_and_says_what_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches the README's Python example rotting (a renamed function or field, a changed
    return type): it runs from a fresh folder holding the shipped configs, and what it prints
    is the run's own summary and records."""
    (tmp_path / "configs").symlink_to(PROJECT / "configs")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_python_example(), "README.md", "exec"), namespace)
    run_dir = tmp_path / "runs" / "api-fedprox"
    summary = json.loads((run_dir / "summary.json").read_text())
    run = namespace["run"]
    assert run.run_dir == Path("runs/api-fedprox") and run.summary == summary
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["algorithm"] == {"name": "fedprox", "label": None, "mu": 0.01}
    assert saved["rounds"] == 2 and saved["model"]["name"] == "lenet5"
    out = capsys.readouterr().out
    assert f"runs/api-fedprox {summary['selected_round']} {summary['ood_acc']}" in out
    assert "| fedprox" in out  # the report's table


def test_keyword_overrides_equal_the_dotted_ones_and_merge_into_sections() -> None:
    """Catches keyword overrides that replace a whole section (dropping the YAML's other keys
    in it) or that mean something else than the same dotted override."""
    dotted = feddomain.load_config(DEMO, "train.lr=0.05", "model.options={}", "rounds=3")
    keywords = feddomain.load_config(DEMO, train={"lr": 0.05}, model={"options": {}}, rounds=3)
    assert keywords.to_dict() == dotted.to_dict()
    yaml_train = yaml.safe_load(DEMO.read_text())["train"]
    assert keywords.train.optimizer == yaml_train["optimizer"]  # kept from the YAML
    assert keywords.train.batch_size == yaml_train["batch_size"]
    mixed = feddomain.load_config(DEMO, "train.lr=0.05", rounds=3, model={"options": {}})
    assert mixed.to_dict() == dotted.to_dict()
    with_paths = feddomain.load_config(None, dataset={"cache_dir": Path("/tmp/c")})
    assert with_paths.dataset.cache_dir == "/tmp/c"


def test_a_bad_keyword_override_names_the_key() -> None:
    """Catches a misspelt keyword override passing silently or failing without its name."""
    with pytest.raises(feddomain.ConfigError, match=r"train\.lrr.*did you mean 'train\.lr'"):
        feddomain.load_config(DEMO, train={"lrr": 0.1})


def test_run_returns_the_runs_records_and_refuses_a_used_out(tmp_path: Path) -> None:
    """Catches a result object that disagrees with the run's files (records, rounds, the
    selected round's record) and ``run`` overwriting a directory that holds a run."""
    cfg = feddomain.load_config(DEMO, *CHEAP, eval={"every": 1})
    result = feddomain.run(cfg, out=tmp_path / "r", quiet=True)
    assert isinstance(result, feddomain.ExperimentResult)
    (run,) = result.runs
    assert result.run_dirs == [tmp_path / "r"] and run.run_dir == tmp_path / "r"
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert run.records == [json.loads(line) for line in lines]
    assert [r["round"] for r in run.records] == [1, 2] and len(run.rounds) == 2
    best = max(run.records, key=lambda r: r["id_acc"])  # source_val: the best id accuracy
    assert run.selected_round == best["round"] and run.selected == best
    assert run.ood_acc == best["ood_acc"] and run.id_acc == best["id_acc"]
    assert feddomain.FinishedRun.load(tmp_path / "r") == run
    with pytest.raises(feddomain.FeddomainError, match="already holds files"):
        feddomain.run(cfg, out=tmp_path / "r", quiet=True)
    resumed = feddomain.run(out=tmp_path / "r", resume=True, quiet=True)  # finished: kept
    assert resumed.runs == [run]


def test_a_resumed_run_keeps_the_provenance_of_its_start_and_lists_each_resumption(
    tmp_path: Path,
) -> None:
    """Catches a resume overwriting the provenance of the code that ran a run's first rounds
    (its commit and start time) with the resuming code's, a no-op resume of a finished run
    (one split or several) recorded as a resumption, and a run restarted from round 1 (no
    checkpoint) still credited to the code of its first start."""
    cfg = feddomain.load_config(DEMO, *CHEAP)
    feddomain.run(cfg, out=tmp_path / "r", quiet=True)
    path = tmp_path / "r" / "provenance.yaml"
    first = yaml.safe_load(path.read_text())
    first["git_commit"] = "0" * 40  # as if the first rounds ran on another commit
    path.write_text(yaml.safe_dump(first, sort_keys=False))
    feddomain.run(feddomain.load_config(DEMO, *CHEAP, rounds=3), out=tmp_path / "r",
                  resume=True, quiet=True)  # fmt: skip
    after = yaml.safe_load(path.read_text())
    assert {k: v for k, v in after.items() if k != "resumed"} == first
    (resumed,) = after["resumed"]
    assert resumed["git_commit"] != "0" * 40 and resumed["started"] >= first["started"]
    feddomain.run(out=tmp_path / "r", resume=True, quiet=True)  # finished: nothing resumed
    assert yaml.safe_load(path.read_text()) == after
    (tmp_path / "r" / "summary.json").unlink()  # as if interrupted before any checkpoint:
    (tmp_path / "r" / "final_checkpoint.pt").unlink()  # it restarts from round 1
    feddomain.run(out=tmp_path / "r", resume=True, quiet=True)
    assert "resumed" not in yaml.safe_load(path.read_text())
    two = feddomain.load_config(DEMO, *CHEAP, "split.targets=[grey, inverted]")
    feddomain.run(two, out=tmp_path / "two", quiet=True)
    saved = {p: p.read_text() for p in (tmp_path / "two").rglob("provenance.yaml")}
    feddomain.run(out=tmp_path / "two", resume=True, quiet=True)  # every split finished
    assert len(saved) == 3 and all(p.read_text() == text for p, text in saved.items())


def test_report_is_the_clis_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches ``feddomain.report`` and ``feddomain report`` drifting apart: the same table,
    and the same files with --out/--html."""
    feddomain.run(feddomain.load_config(DEMO, *CHEAP), out=tmp_path / "runs" / "a", quiet=True)
    report = feddomain.report(tmp_path / "runs", out=tmp_path / "api", html=True)
    subprocess.run(
        [sys.executable, "-m", "feddomain.cli", "report", str(tmp_path / "runs"), "--out",
         str(tmp_path / "cli"), "--html"],
        check=True, capture_output=True, text=True, cwd=PROJECT,
    )  # fmt: skip
    assert report.to_markdown() == (tmp_path / "cli" / "report.md").read_text()
    made = sorted(p.name for p in (tmp_path / "api").iterdir())
    assert made == sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert "report.html" in made
    with pytest.raises(feddomain.FeddomainError, match="--html"):
        feddomain.report(tmp_path / "runs", html=True)


def test_sweep_runs_the_grid_and_reports(tmp_path: Path) -> None:
    """Catches ``feddomain.sweep`` running other runs than the grid's, or a rerun training a
    finished run again instead of skipping it."""
    result = feddomain.sweep(
        DEMO, *CHEAP, "rounds=1", grid={"seed": [0, 1]}, out=tmp_path / "sw"
    )
    names = [s.run.name for s in result.states]
    assert names == ["seed=0/lodo-grey", "seed=1/lodo-grey"]
    assert [s.status for s in result.states] == ["done", "done"] and result.failed == []
    assert [r.summary["seed"] for r in result.finished] == [0, 1]
    assert (tmp_path / "sw" / "report" / "report.md").read_text() == (
        result.report.to_markdown()
    )
    again = feddomain.sweep(DEMO, *CHEAP, "rounds=1", grid={"seed": [0, 1]}, out=tmp_path / "sw")
    assert [s.status for s in again.states] == ["skipped", "skipped"]


def test_import_is_cheap_and_sweep_stays_the_function() -> None:
    """Catches ``import feddomain`` importing the API (torch, pydantic) eagerly, and the
    module ``feddomain/sweep.py`` replacing the function ``feddomain.sweep`` once imported."""
    code = (
        "import sys, feddomain; heavy = [m for m in ('torch', 'pydantic', 'feddomain.api') "
        "if m in sys.modules]; print(heavy); "
        "import feddomain.cli; from feddomain.sweep import plan; "
        "print(callable(feddomain.sweep), feddomain.sweep.__module__, "
        "sys.modules['feddomain.sweep'].plan is plan)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=PROJECT
    ).stdout.splitlines()
    assert out == ["[]", "True feddomain.api True"]
    assert set(feddomain.__all__) <= set(dir(feddomain))
