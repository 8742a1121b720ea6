"""`feddomain run` end to end: outputs, refusal to overwrite, and SIGKILL + resume equality."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from feddomain.cli import main

SMALL = {
    "name": "resume-test",
    "seed": 3,
    "rounds": 4,
    "dataset": {"name": "digits_embedded", "resolution": 32},
    "split": {"scheme": "lodo", "targets": ["grey"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5"},
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
    "eval": {"every": 2},
    "checkpoint": {"every": 1},
    "threads": 1,
}
REQUIRED = {
    "algorithm",
    "dataset",
    "target_domains",
    "seed",
    "rounds",
    "id_acc",
    "ood_acc",
    "ood_ece",
    "ood_nll",
    "per_domain",
    "selection",
    "wall_time_s",
}


@pytest.fixture(scope="module")
def small_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


@pytest.fixture(scope="module")
def reference(small_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run every killed-and-resumed run must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["run", str(small_config), "--out", str(out), "--quiet"]) == 0
    return out


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "feddomain.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _summary(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s"), s.pop("phase_seconds")
    return s


def test_run_writes_config_metrics_and_summary(small_config, tmp_path):
    out = tmp_path / "run"
    assert main(["run", str(small_config), "rounds=2", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= REQUIRED
    assert summary["target_domains"] == ["grey"] and summary["rounds"] == 2
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [2]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["rounds"] == 2 and saved["seed"] == 3
    assert "git_commit" in yaml.safe_load((out / "provenance.yaml").read_text())


def test_existing_output_directory_is_never_overwritten(small_config, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("earlier results")
    assert main(["run", str(small_config), "--out", str(out), "--quiet"]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "earlier results"


@pytest.mark.parametrize("kill_after_checkpoints", [0, 1, 3])
def test_sigkill_then_resume_matches_uninterrupted_run(
    small_config, reference, tmp_path, kill_after_checkpoints
):
    out = tmp_path / "killed"
    proc = _cli("run", str(small_config), "--out", str(out), "--quiet")
    deadline = time.time() + 120
    seen = 0
    last_mtime = None
    while seen < kill_after_checkpoints and proc.poll() is None and time.time() < deadline:
        ckpt = out / "checkpoint.pt"
        if ckpt.exists() and ckpt.stat().st_mtime_ns != last_mtime:
            last_mtime = ckpt.stat().st_mtime_ns
            seen += 1
        time.sleep(0.02)
    if kill_after_checkpoints == 0:  # during round 1, before any checkpoint
        while not (out / "config.yaml").exists() and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "summary.json").exists() or kill_after_checkpoints > 0

    resumed = _cli("run", "--resume", str(out), "--quiet")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert _summary(out) == _summary(reference)
    ref_lines = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    got_lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rec: {k: v for k, v in rec.items() if k != "time"}  # noqa: E731
    assert [strip(r) for r in got_lines] == [strip(r) for r in ref_lines]
    # rounds.jsonl is appended live: a resume must cut it back to the checkpoint's rounds
    ref_rounds = [json.loads(x) for x in (reference / "rounds.jsonl").read_text().splitlines()]
    got_rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [strip(r) for r in got_rounds] == [strip(r) for r in ref_rounds]
    assert not (out / "checkpoint.pt").exists()


def test_a_corrupt_checkpoint_is_named_and_nothing_is_overwritten(small_config, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text(small_config.read_text())
    (out / "checkpoint.pt").write_bytes(b"\x80\x02 half a pickle")
    assert main(["run", "--resume", str(out), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out / 'checkpoint.pt'} cannot be read" in err
    assert "delete it to restart the run from round 1" in err
    assert (out / "checkpoint.pt").read_bytes() == b"\x80\x02 half a pickle"


def test_a_run_committed_mid_way_restarts_from_round_1_without_keeping_its_old_lines(
    small_config, reference, tmp_path
):
    """Catches a restart that appends to the logs it finds: a fresh clone of a campaign
    committed mid-run holds the run's config and its first rounds' metrics.jsonl lines, but not
    its git-ignored checkpoint.pt, so `run --resume` starts again from round 1; keeping the
    old lines would list those rounds twice and let selection pick a stale record."""
    out = tmp_path / "cloned"
    out.mkdir()
    (out / "config.yaml").write_text((reference / "config.yaml").read_text())
    stale = _records(reference, "metrics.jsonl")[0] | {"ood_acc": 0.999}  # no run scores it
    (out / "metrics.jsonl").write_text(json.dumps(stale) + "\n")
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert _records(out, "metrics.jsonl") == _records(reference, "metrics.jsonl")
    assert [r["round"] for r in _records(out, "metrics.jsonl")] == [2, 4]
    assert _summary(out) == _summary(reference)


EXTEND = {
    **SMALL,
    "rounds": 3,  # round 3 is evaluated only as the last: the extension must not keep it
    "topology": {"sample_fraction": 0.67},  # 2 of 3 clients a round: the sampling stream too
    "checkpoint": {"every": 0},  # the final state is kept all the same (checkpoint.keep_final)
}


def _records(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / name).read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in lines]


def test_a_finished_run_extended_to_more_rounds_equals_a_run_of_that_length(tmp_path, capsys):
    """Catches an extension (`run --resume DIR rounds=5` on a finished 3-round run) that is not
    the 5-round run: one that keeps round 3's evaluation (taken only because it was the last,
    so source_val could select it), restarts from round 1, redraws the clients of rounds 4-5,
    or leaves the saved config at 3 rounds."""
    config = tmp_path / "extend.yaml"
    config.write_text(yaml.safe_dump(EXTEND))
    short, straight = tmp_path / "short", tmp_path / "straight"
    assert main(["run", str(config), "--out", str(short), "--quiet"]) == 0
    assert [r["round"] for r in _records(short, "metrics.jsonl")] == [2, 3]
    assert not (short / "checkpoint.pt").exists() and (short / "final_checkpoint.pt").exists()
    assert main(["run", "--resume", str(short), "rounds=5", "--quiet"]) == 0
    assert main(["run", str(config), "rounds=5", "--out", str(straight), "--quiet"]) == 0
    assert _records(short, "metrics.jsonl") == _records(straight, "metrics.jsonl")
    assert [r["round"] for r in _records(short, "metrics.jsonl")] == [2, 4, 5]
    assert _records(short, "rounds.jsonl") == _records(straight, "rounds.jsonl")
    assert _summary(short) == _summary(straight)
    assert yaml.safe_load((short / "config.yaml").read_text())["rounds"] == 5
    assert "round 5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.schedule=cosine", "train.schedule=cosine sets every round's learning rate"),
        ("checkpoint.keep_final=false", "finished without keeping its final state"),
    ],
)
def test_an_extension_that_would_not_be_the_longer_run_is_refused_by_name(
    override, named, tmp_path, capsys
):
    """Catches an extension silently unlike the longer run: a cosine schedule sets each
    round's rate from the total rounds; a run that did not keep its final state would restart.
    The refused run is left as it was (still finished, still 2 rounds)."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**EXTEND, "rounds": 2}))
    out = tmp_path / "run"
    assert main(["run", str(config), override, "--out", str(out), "--quiet"]) == 0
    before = (out / "summary.json").read_text()
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "rounds=4", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "extending 2 rounds to 4 is refused" in err and named in err
    assert (out / "summary.json").read_text() == before
    assert yaml.safe_load((out / "config.yaml").read_text())["rounds"] == 2


def test_feddg_ga_declares_that_it_uses_the_total_rounds():
    """Catches FedDG-GA extended as if its step size (d0 (1 - (r - 1) / rounds)) did not
    depend on the run's length, and that flag leaking onto FedAvg."""
    from feddomain.algorithms import METHODS

    assert METHODS["feddg_ga"].uses_total_rounds and not METHODS["fedavg"].uses_total_rounds


def test_resuming_with_other_settings_names_each_key_and_both_values(
    small_config, tmp_path, capsys
):
    """Catches a refused resume that only says the settings differ: it must name each key
    with the saved and the given value (`rounds: 4 vs 2`, `train.lr: 0.002 vs 0.01`); and a
    shorter run refused as such."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text(small_config.read_text())
    argv = ["run", "--resume", str(out), str(small_config), "train.lr=0.01", "seed=4"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "(saved vs given): seed: 3 vs 4; train.lr: 0.002 vs 0.01." in err
    assert main(["run", "--resume", str(out), "rounds=2"]) == 2
    assert "rounds: 4 vs 2: a run cannot be shortened" in " ".join(capsys.readouterr().err.split())


def test_extending_a_run_made_on_flower_is_refused(tmp_path, capsys):
    """Catches an extension of a Flower run in the simulator: its clients' state lived on the
    SuperNodes, not in its final state, so a stateful method would go on from empty states."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**EXTEND, "rounds": 1}))
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "runner": "flower"}))
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "rounds=2", "--quiet"]) == 2
    assert "ran on Flower, whose clients keep their state" in capsys.readouterr().err
    assert (out / "final_checkpoint.pt").is_file() and not (out / "checkpoint.pt").exists()
