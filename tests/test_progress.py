"""Long campaigns: `CampaignProgress` (completed/total, time per run, ETA) and what a sweep
prints of it, and of what its rerun skips, resumes and restarts (issue 29, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rich.console import Console

from feddomain.progress import CampaignProgress, duration
from feddomain.sweep import RunState, SweepRun, _ended_line, found, plan, rerun_account


class Clock:
    """A hand-moved clock, so the ETA is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_eta_is_waves_of_the_mean_run_time_less_what_running_runs_have_spent():
    """Catches an ETA that ignores the workers (runs in parallel), counts skipped runs as free
    time per run, or forgets the running runs' progress. 10 runs on 2 workers, 2 skipped;
    runs of 30 s and 50 s end: 40 s per run. 6 remain (2 running, for 30 s and 10 s): 3 waves
    of 40 s = 120 s, less (30 + 10) / 2 = 100 s."""
    clock = Clock()
    progress = CampaignProgress(10, jobs=2, clock=clock)
    progress.skip(2)
    assert progress.headline() == "sweep 2/10 (2 skipped), ETA after the first run"
    progress.start("a")
    progress.start("b")
    clock.now = 30.0
    assert progress.finish("a") == 30.0
    progress.start("c")
    clock.now = 50.0
    progress.finish("b", failed=True)
    progress.start("d")
    clock.now = 60.0  # c has run 30 s, d 10 s
    assert progress.completed == 4 and progress.seconds_per_run == 40.0
    assert progress.eta_seconds == pytest.approx(3 * 40.0 - (30.0 + 10.0) / 2)
    assert progress.headline() == "sweep 4/10 (2 skipped, 1 failed), 40 s per run, ETA 1 min 40 s"


def test_durations_read_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (4.4, 59.6, 247, 7500)] == ["4 s", "1 min 0 s", "4 min 7 s",
                                                             "2 h 05 min"]  # fmt: skip


def _state(tmp_path: Path, name: str, files: tuple[str, ...]) -> RunState:
    run = SweepRun(name, tmp_path / name, {})
    run.out.mkdir(parents=True)
    for file in files:
        (run.out / file).write_text("{}")
    return RunState(run, found=found(run.out))


def test_a_rerun_names_the_runs_it_skips_resumes_and_restarts(tmp_path):
    """Catches a rerun that does not say what it will do with the runs it finds: finished
    (summary.json) ones skipped, checkpointed ones resumed, started ones without a
    checkpoint restarted from round 1, the others new."""
    states = [
        _state(tmp_path, "seed=0", ("summary.json", "final_checkpoint.pt", "rounds.jsonl")),
        _state(tmp_path, "seed=1", ("checkpoint.pt", "rounds.jsonl")),
        _state(tmp_path, "seed=2", ("rounds.jsonl",)),
        _state(tmp_path, "seed=3", ()),
        _state(tmp_path, "seed=4", ("summary.json",)),
    ]
    assert [s.found for s in states] == ["finished", "checkpoint", "started", "new", "finished"]
    assert rerun_account(states).splitlines() == [
        "this --out holds an earlier session of the sweep (5 runs):",
        "  2 skipped (finished): seed=0, seed=4",
        "  1 resumed (from a checkpoint): seed=1",
        "  1 restarted (no checkpoint yet): seed=2",
        "  1 not started yet",
    ]


def test_a_sweep_without_a_terminal_logs_one_plain_line_per_ended_run(tmp_path, capsys):
    """Catches a batch job's sweep (no terminal: no live table) that says nothing until the
    end, and a line whose unit differs from the tables' (%)."""
    from feddomain.cli import main

    config = tmp_path / "c.yaml"
    small = {
        "rounds": 1,
        "dataset": {"name": "digits_embedded"},
        "model": {"name": "lenet5"},
        "split": {"targets": ["grey", "sketch"]},
        "threads": 1,
    }
    config.write_text(yaml.safe_dump(small))
    out = tmp_path / "sweep"
    assert main(["sweep", str(config), "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("sweep ")]
    assert [line.split(":")[0].split(",")[0] for line in lines] == ["sweep 1/2", "sweep 2/2"]
    assert " per run, ETA " in lines[0] and "ETA" not in lines[1]
    assert "lodo-grey done in" in lines[0] and "%, id " in lines[0] and lines[0].endswith("%)")
    assert main(["sweep", str(config), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "2 skipped (finished): lodo-grey, lodo-sketch" in err


def test_ended_line_of_a_failed_run_names_its_error(tmp_path):
    state = RunState(SweepRun("seed=1", tmp_path, {}), status="failed", seconds=3.2, error="Boom")
    progress = CampaignProgress(3, clock=Clock())
    assert _ended_line(state, progress) == "sweep 0/3, ETA after the first run: seed=1 failed " \
        "after 3 s: Boom"  # fmt: skip


def test_a_rerun_with_other_settings_names_what_differs(tmp_path):
    """Catches a sweep refusing a run directory with changed settings without saying which
    keys changed and how (saved vs this sweep)."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"rounds": 4, "split": {"targets": ["grey"]}}))
    (run,) = plan(config, [], [], tmp_path / "sweep")
    run.out.mkdir(parents=True)
    (run.out / "config.yaml").write_text(yaml.safe_dump({**run.config, "rounds": 9}))
    with pytest.raises(Exception, match=r"\(saved vs this sweep\): rounds: 9 vs 4;"):
        plan(config, [], [], tmp_path / "sweep")


def test_the_live_table_title_carries_the_progress(tmp_path):
    from feddomain.sweep import _table

    state = RunState(SweepRun("a", tmp_path, {}), status="done", seconds=12.0)
    progress = CampaignProgress(2, clock=Clock())
    progress.start("a")
    progress.finish("a")
    console = Console(width=200, record=True)
    console.print(_table([state], progress))
    assert "1 done; sweep 1/2, 0 s per run, ETA 0 s" in console.export_text()
