"""Configuration: overrides, and errors that name the key and suggest the closest valid one."""

from __future__ import annotations

from pathlib import Path

import pytest

from feddomain.cli import main
from feddomain.config import load_config
from feddomain.errors import ConfigError


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 7\ntrain:\n  lr: 0.01\nalgorithm: fedprox\n")
    return path


def test_dotted_overrides_are_typed_and_nested(config_file):
    cfg = load_config(
        config_file,
        [
            "rounds=50",
            "algorithm.mu=0.5",
            "train.augment.hflip=true",
            "dataset.name=pacs",
            "split.targets=[photo, sketch]",
        ],
    )
    assert cfg.rounds == 50 and cfg.train.lr == 0.01
    assert cfg.algorithm.name == "fedprox" and cfg.algorithm.hparams == {"mu": 0.5}
    assert cfg.train.augment.hflip is True
    assert cfg.split.targets == ["photo", "sketch"]


def test_unknown_key_names_it_and_suggests_closest(config_file):
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lrr'; did you mean 'train\.lr'\?"):
        load_config(config_file, ["train.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"unknown key 'rouns'; did you mean 'rounds'\?"):
        load_config(config_file, ["rouns=3"])


def test_wrong_type_names_key_and_value(config_file):
    with pytest.raises(ConfigError, match=r"'rounds': .*got 'many'"):
        load_config(config_file, ["rounds=many"])
    with pytest.raises(ConfigError, match=r"'partition\.n_clients'"):
        load_config(config_file, ["partition.n_clients=0"])


def test_unknown_algorithm_and_hyperparameter(config_file):
    with pytest.raises(ConfigError, match=r"unknown algorithm 'fedavgg'; did you mean 'fedavg'\?"):
        load_config(config_file, ["algorithm=fedavgg"])
    with pytest.raises(
        ConfigError, match=r"unknown key 'algorithm\.muu'; did you mean 'algorithm\.mu'\?"
    ):
        load_config(config_file, ["algorithm.muu=0.1"])
    with pytest.raises(ConfigError, match=r"'algorithm\.mu'"):
        load_config(config_file, ["algorithm.mu=-1"])


def test_malformed_override_and_missing_file(tmp_path, config_file):
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(config_file, ["rounds"])
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(bad)


def test_bad_data_root_fails_before_training_with_a_clear_message(tmp_path, config_file, capsys):
    code = main(
        [
            "run",
            str(config_file),
            "dataset.name=pacs",
            f"dataset.root={tmp_path / 'missing'}",
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "missing" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_every_shipped_config_validates_and_names_its_experiment_uniquely():
    """A renamed key or a removed option breaks a shipped config only at a user's first run;
    catch it here. Distinct names keep their runs apart in reports."""
    paths = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))
    names = [load_config(path).name for path in paths]  # raises ConfigError on a bad key
    assert len(paths) >= 10
    assert len(set(names)) == len(names), names


def test_a_bad_override_is_blamed_on_the_command_line_and_a_bad_file_key_on_the_file(tmp_path):
    """Catches an error a command-line override caused read as one of the YAML file's (the
    user searches the file for `rounds: abc`): each line names the override at fault, the
    section override for a method's hyper-parameter, and a line the file caused names none."""
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 7\ntrain:\n  lrr: 0.01\nalgorithm: fedavg\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["rounds=abc", "seed=2"])
    header, *lines = str(err.value).splitlines()
    assert header == f"invalid configuration ({path} and the command line):"
    (rounds,) = [line for line in lines if "'rounds'" in line]
    (lrr,) = [line for line in lines if "train.lrr" in line]
    assert rounds.endswith("[from the command line: rounds=abc]")
    assert "command line" not in lrr
    path.write_text("rounds: 7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["algorithm=fedprox", "algorithm.muu=3"])
    assert str(err.value).splitlines()[1].endswith("[from the command line: algorithm.muu=3]")


def test_config_differences_name_each_dotted_key_with_both_values():
    """Catches a refused resume or sweep that cannot say what differs: nested keys dotted,
    values as YAML spells them, a key one side lacks shown as '-', equal keys left out."""
    from feddomain.config import config_differences

    saved = {"rounds": 12, "train": {"lr": 0.1, "augment": {"invert_p": 0.5}}, "seed": 0}
    given = {"rounds": 20, "train": {"lr": 1e-5, "augment": {}}, "seed": 0, "name": None}
    assert config_differences(saved, given) == [
        "name: - vs null",
        "rounds: 12 vs 20",
        "train.augment: - vs {}",
        "train.augment.invert_p: 0.5 vs -",
        "train.lr: 0.1 vs 1.0e-05",
    ]
    assert config_differences(saved, saved) == []
