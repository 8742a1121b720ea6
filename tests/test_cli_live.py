"""`feddomain run` as a batch job sees it (issue 17, item 3): plain per-round lines without a
terminal, the final result even with --quiet, logs on disk while the run goes, a Ctrl-C message
that says what was checkpointed, and a thread count chosen for the machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import feddomain.api
import feddomain.config
from feddomain.cli import main
from feddomain.config import default_threads
from tests.resume_helpers import default_sigint

PROJECT = Path(__file__).resolve().parents[1]
SMALL = {
    "name": "live-test",
    "seed": 1,
    "rounds": 4,
    "dataset": {"name": "digits_embedded", "resolution": 32},
    "split": {"scheme": "lodo", "targets": ["sketch"]},
    "partition": {"n_clients": 3, "d": 1},
    "train": {"batch_size": 64},
    "eval": {"every": 2},
    "checkpoint": {"every": 0},
    "threads": 1,
}


def _config(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**SMALL, **changes}))
    return path


def _start(config: Path, out: Path, tmp_path: Path, *flags: str) -> subprocess.Popen:
    """`feddomain run` as a process whose stdout and stderr are files, as in a cluster job."""
    with open(tmp_path / "stdout.log", "w") as so, open(tmp_path / "stderr.log", "w") as se:
        return subprocess.Popen(
            [sys.executable, "-m", "feddomain.cli", "run", str(config), "--out", str(out), *flags],
            cwd=PROJECT,
            stdout=so,  # the child keeps its own copies of both files
            stderr=se,
            preexec_fn=default_sigint,
        )


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_without_a_terminal_each_evaluated_round_is_one_plain_line(tmp_path):
    """Catches a rich progress bar (or colour codes) written into a log file, where it shows
    nothing until the end or garbage; and a final result that goes missing from the log."""
    out = tmp_path / "run"
    proc = _start(_config(tmp_path), out, tmp_path)
    assert proc.wait(timeout=300) == 0, (tmp_path / "stderr.log").read_text()
    err = (tmp_path / "stderr.log").read_text()
    assert "\x1b" not in err and "\r" not in err
    rounds = [line for line in err.splitlines() if " round " in line]
    assert [line.split(" round ")[1].split()[0] for line in rounds] == ["2/4", "4/4"]
    summary = json.loads((out / "summary.json").read_text())
    last = json.loads(_lines(out / "metrics.jsonl")[-1])
    assert f"ood {100 * last['ood_acc']:.1f}%" in rounds[-1]  # the report tables' unit
    (result,) = _lines(tmp_path / "stdout.log")
    assert f"ood {100 * summary['ood_acc']:.1f}%" in result and str(out) in result


def test_quiet_prints_the_final_result_and_nothing_per_round(tmp_path, capsys):
    """Catches --quiet silencing the result itself (it was a log line at INFO level)."""
    out = tmp_path / "run"
    assert main(["run", str(_config(tmp_path)), "--out", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert " round 2/4" not in captured.err
    (result,) = captured.out.splitlines()
    assert f"ood {100 * summary['ood_acc']:.1f}%" in result
    assert f"round {summary['selected_round']})" in result


@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_logs_grow_while_the_run_goes_and_ctrl_c_says_what_was_kept(tmp_path, checkpoint_every):
    """Catches rounds.jsonl written only at the end of a run (a job killed at its time limit
    kept nothing to look at), and a Ctrl-C message that promises a checkpoint there is none of
    (or hides the one there is)."""
    every = {"every": checkpoint_every}
    config = _config(tmp_path, rounds=200, eval={"every": 1}, checkpoint=every)
    out = tmp_path / "run"
    proc = _start(config, out, tmp_path)
    deadline = time.time() + 300
    while len(_lines(out / "rounds.jsonl")) < 2 and proc.poll() is None:
        assert time.time() < deadline, "no two rounds logged in time"
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it was interrupted"
    assert len(_lines(out / "metrics.jsonl")) >= 1
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    err = " ".join((tmp_path / "stderr.log").read_text().split())
    assert "Traceback" not in err
    if checkpoint_every:
        assert f"the last checkpoint in {out} is kept; continue with --resume {out}" in err
    else:
        assert "nothing was checkpointed yet" in err and "checkpoint.every=0" in err
        assert f"--resume {out} restarts it from round 1" in err
    logged = [json.loads(line) for line in _lines(out / "rounds.jsonl")]
    assert [r["round"] for r in logged] == list(range(1, len(logged) + 1))
    assert all(r["time"]["evaluate"] > 0 for r in logged)  # written after the evaluation


def test_unset_threads_use_the_machines_default(tmp_path, monkeypatch):
    """Catches `threads: null` leaving torch's own default (every core): on a loaded 2-core
    machine that made a round about 14x slower than one thread (README, "Threads")."""
    monkeypatch.setattr(feddomain.config, "default_threads", lambda: 1)
    torch.set_num_threads(2)
    try:
        config = _config(tmp_path, threads=None, rounds=1, eval={"every": 1})
        assert main(["run", str(config), "--out", str(tmp_path / "run"), "--quiet"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 1), (8, 4), (16, 8)])
def test_default_threads_are_half_the_usable_cores(monkeypatch, cores, threads):
    """Catches a default of every core (oversubscribes a shared machine) or of zero threads."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert default_threads() == threads


class _StopAtRound:
    """A progress display whose tick raises Ctrl-C after a given round was logged (and before
    that round's checkpoint), as a user's Ctrl-C can."""

    def __init__(self, stop: int) -> None:
        self.stop = stop

    def __call__(self, quiet: bool, label: str, total: int) -> _StopAtRound:
        return self

    def __enter__(self):
        def tick(rnd: int, record: dict | None) -> None:
            if rnd == self.stop:
                raise KeyboardInterrupt

        return tick

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_resume_drops_the_rounds_logged_after_its_checkpoint(tmp_path, monkeypatch, capsys):
    """Catches a resume that keeps rounds.jsonl's lines from after the checkpoint and appends
    the recomputed rounds again (round 3 twice), now that the log grows during the run."""
    config = _config(tmp_path, checkpoint={"every": 2})
    reference = tmp_path / "reference"
    assert main(["run", str(config), "--out", str(reference), "--quiet"]) == 0
    out = tmp_path / "run"
    monkeypatch.setattr(feddomain.api, "_progress", _StopAtRound(3))
    assert main(["run", str(config), "--out", str(out)]) == 130
    assert f"the last checkpoint in {out} is kept" in " ".join(capsys.readouterr().err.split())
    assert [json.loads(x)["round"] for x in _lines(out / "rounds.jsonl")] == [1, 2, 3]
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--quiet"]) == 0

    def logged(run: Path, name: str) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in _lines(run / name)]

    for name in ("rounds.jsonl", "metrics.jsonl"):
        assert logged(out, name) == logged(reference, name)
