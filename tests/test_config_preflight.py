"""Everything a config can get wrong is found before any data is read, and a failed start leaves
no half-made run directory behind (issue 17, item 2)."""

from __future__ import annotations

import pytest
import yaml

import feddomain.data.federated
import feddomain.federation.simulation
from feddomain.cli import main
from feddomain.config import load_config
from feddomain.errors import ConfigError

SMALL = {
    "rounds": 1,
    "dataset": {"name": "digits_embedded"},
    "split": {"targets": ["sketch"]},
    "eval": {"every": 1},
    "checkpoint": {"every": 0},
    "threads": 1,
}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


@pytest.fixture
def no_data(monkeypatch):
    """Reading any dataset fails the test: the checks must not need the data."""

    def refuse(*args, **kwargs):
        raise AssertionError("data was loaded before the config was checked")

    monkeypatch.setattr(feddomain.data.federated, "load_dataset", refuse)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.name=lenet", "unknown name 'lenet' (did you mean 'lenet5'?)"),
        ("model.options.widht=2", "unknown option 'widht'"),
        ("model.options.norm=bogus", "norm='bogus' is not one of"),
        ("split.targets=[skech]", "not domains of digits_embedded; did you mean 'sketch'?"),
        ("partition.d=4", "d=4 domains per client is impossible with 3 source domains"),
        ("partition.n_clients=1", "n_clients=1 with d=1 gives 1 parts for 3 source domains"),
        ("split.scheme=xy-z-q", "letter 'x' in scheme 'xy-z-q' matches no domain"),
        ("algorithm.mu=0.1", "unknown key 'algorithm.mu'"),
    ],
)
def test_bad_configs_fail_before_data_and_leave_no_directory(
    config, tmp_path, capsys, no_data, override, message
):
    """Catches a check that waits for the data (minutes on a real dataset) and a failed start
    that leaves config.yaml behind, so the same --out is then refused as 'already holds files'."""
    out = tmp_path / "out"
    assert main(["run", str(config), override, "--out", str(out), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_an_error_after_the_data_leaves_no_directory_and_the_same_out_works(
    config, tmp_path, capsys, monkeypatch
):
    """Catches a start that fails once the run directory is written (here: building the
    simulation) and leaves it half-made, blocking the same --out after the fix."""
    real = feddomain.federation.simulation.Simulation.__init__

    def broken(self, *args, **kwargs):
        raise ConfigError("planted failure while building the run")

    monkeypatch.setattr(feddomain.federation.simulation.Simulation, "__init__", broken)
    out = tmp_path / "out"
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 2
    assert "planted failure" in capsys.readouterr().err
    assert not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["run", str(config), "--out", str(empty), "--quiet"]) == 2
    assert empty.is_dir() and not any(empty.iterdir())  # the user's own folder stays
    monkeypatch.setattr(feddomain.federation.simulation.Simulation, "__init__", real)
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0
    assert (out / "summary.json").is_file()


def test_a_bare_target_name_is_a_one_element_list(config):
    """Catches `split.targets=photo` on the command line failing as 'not a valid list'."""
    assert load_config(config, ["split.targets=grey"]).split.targets == ["grey"]
    assert load_config(config, ["split.targets=[grey, sketch]"]).split.targets == [
        "grey",
        "sketch",
    ]
