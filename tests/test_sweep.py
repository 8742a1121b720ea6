"""`feddomain sweep`: planning, failure isolation, and SIGKILL of the sweep's parent + rerun,
every run equal to a one-process `feddomain run` of the same settings."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
import torch
import yaml

from feddomain.cli import main
from feddomain.config import load_config
from feddomain.errors import ConfigError, FeddomainError
from feddomain.sweep import (
    RunState,
    SweepRun,
    _settle,
    gpu_slots,
    parse_grid,
    plan,
    run_sweep,
    yaml_text,
)
from tests.resume_helpers import FEDDOMAIN, PROJECT, metrics_of, summary_of

SMALL = {
    "name": "sweep-test",
    "seed": 0,
    "rounds": 4,
    "dataset": {"name": "digits_embedded", "resolution": 32},
    "split": {"scheme": "lodo", "targets": ["grey", "inverted"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5"},
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
    "eval": {"every": 2},
    "checkpoint": {"every": 1},
    "threads": 1,
}
GRID = ["--grid", "algorithm=[fedavg,fedprox]"]
RUNS = {  # run directory -> the overrides of the equal one-process run
    f"algorithm={a}/lodo-{t}": [f"algorithm={a}", f"split.targets=[{t}]"]
    for a in ("fedavg", "fedprox")
    for t in ("grey", "inverted")
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sweep-config") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


# ------------------------------------------------------------------------------ planning
def test_grid_values_are_a_yaml_list_and_a_scalar_is_refused():
    """Catches a grid value parsed as text ('[0,1]') or a scalar taken as a one-point grid."""
    assert parse_grid("algorithm.mu=[0.01, 1.0e-3]") == ("algorithm.mu", [0.01, 0.001])
    with pytest.raises(ConfigError, match=r"--grid 'seed=3': the values must be a non-empty list"):
        parse_grid("seed=3")
    with pytest.raises(ConfigError, match="must look like KEY="):
        parse_grid("[0,1]")


def test_a_grid_value_reads_back_as_itself():
    """Catches a value that changes on its way into an override: PyYAML reads the text
    ``1e-05`` as a string, so the float must be written ``1.0e-05``."""
    for value in (1e-05, 0.01, "fedprox", [0.5, 0.5], {"norm": "batch"}, None, True):
        assert yaml.safe_load(yaml_text(value)) == value


def test_plan_is_the_grid_times_every_target_each_its_own_config(config: Path, tmp_path: Path):
    """Catches a missing grid point or target, two runs sharing a directory, and a run whose
    config is not the one `feddomain run` would use for the same settings."""
    runs = plan(
        config,
        ["rounds=2", "split.targets=null"],
        [("algorithm", ["fedavg", "fedprox"]), ("seed", [0, 1])],
        tmp_path,
    )
    domains = ["grey", "mnistm", "inverted", "sketch"]  # the embedded digits, targets unset
    assert [r.name for r in runs] == [
        f"algorithm={a},seed={s}/lodo-{t}"
        for a in ("fedavg", "fedprox")
        for s in (0, 1)
        for t in domains
    ]
    assert len({r.out for r in runs}) == len(runs)
    chosen = runs[len(domains) + 2]  # fedavg, seed 1, inverted
    assert chosen.out == tmp_path / "algorithm=fedavg,seed=1" / "lodo-inverted"
    direct = load_config(
        config, ["rounds=2", "algorithm=fedavg", "seed=1", "split.targets=[inverted]"]
    )
    assert chosen.config == direct.to_dict()


def test_values_that_would_share_a_directory_are_refused(config: Path, tmp_path: Path):
    """Catches two grid points written into one directory (the second resuming, or skipped
    as finished by, the first) when their values differ only in a character a directory name
    cannot hold."""
    with pytest.raises(ConfigError, match="would share the directory"):
        plan(config, ["split.targets=[grey]"], [("name", ["a/b", "a_b"])], tmp_path)


def test_a_bad_grid_point_is_refused_before_any_run(config: Path, tmp_path: Path):
    """Catches an invalid combination found only when its worker starts, after hours of
    other runs; the message names the point."""
    with pytest.raises(ConfigError, match=r"(?s)grid point rounds=0: .*'rounds'"):
        plan(config, [], [("rounds", [2, 0])], tmp_path)


def test_a_run_directory_with_other_settings_is_refused(config: Path, tmp_path: Path):
    """Catches a rerun with changed settings into the same --out resuming (or counting as
    finished) runs made with the old ones."""
    (run,) = plan(config, ["split.targets=[grey]"], [], tmp_path)
    run.out.mkdir(parents=True)
    (run.out / "config.yaml").write_text(yaml.safe_dump({**run.config, "rounds": 9}))
    with pytest.raises(FeddomainError, match="holds other settings than this sweep gives"):
        plan(config, ["split.targets=[grey]"], [], tmp_path)


# ------------------------------------------------------------------------------- running
def test_a_failed_run_is_reported_and_the_others_finish(config: Path, tmp_path: Path, capsys):
    """Catches one run's error stopping the sweep (or being swallowed): the bad run is listed
    with its error and traceback, the good one finishes and is reported, the status is 1. The
    bad run fails only when it loads its data (a folder dataset at a missing root: its domains
    cannot be checked with the config), so the sweep's config-time checks let it through."""
    out = tmp_path / "sweep"
    missing = tmp_path / "no-such-root"
    argv = ["sweep", str(config), "rounds=1", "split.targets=[grey]", f"dataset.root={missing}"]
    grid = ["--grid", "dataset.name=[digits_embedded, folder]"]
    status = main([*argv, *grid, "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert status == 1
    bad = out / "dataset.name=folder" / "lodo-grey"
    assert f"data root {missing} does not exist" in " ".join(captured.err.split())
    assert "DataError" in (bad / "error.log").read_text()
    assert (out / "dataset.name=digits_embedded" / "lodo-grey" / "summary.json").is_file()
    assert "| fedavg | " in captured.out  # the report of the finished run
    assert (out / "report" / "report.csv").is_file()


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _a_finished_and_a_checkpointed_run(out: Path) -> bool:
    done = list(out.rglob("summary.json"))
    ckpts = [c for c in out.rglob("checkpoint.pt") if not (c.parent / "summary.json").exists()]
    return bool(done and ckpts and len(done) < len(RUNS))


def _wait_for_a_finished_and_a_checkpointed_run(out: Path, proc: subprocess.Popen) -> set[int]:
    """Stop the sweep (parent and workers, SIGSTOP) once one run has finished while another
    has a checkpoint, and return the stopped workers. Stopping first and checking again makes
    the state the test then reads the state at the kill: on a fast machine a 4-round run can
    finish between a check and the kill."""
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if _a_finished_and_a_checkpointed_run(out):
            workers = _descendants(proc.pid)
            _signal_all({proc.pid, *workers}, signal.SIGSTOP)
            if _a_finished_and_a_checkpointed_run(out):
                return workers
            _signal_all({proc.pid, *workers}, signal.SIGCONT)
        time.sleep(0.005)
    pytest.fail("the sweep ended before a run was finished while another was checkpointed")


@pytest.mark.slow
def test_sigkill_of_the_sweep_then_rerun_equals_one_process_runs(config: Path, tmp_path: Path):
    """The acceptance test of issue 16. Catches: a rerun redoing finished runs, restarting an
    interrupted run instead of resuming its checkpoint, orphaned workers that outlive the
    killed parent (and would write into runs the rerun takes over), and any difference between
    a run made by a sweep worker and a one-process `feddomain run` of the same settings."""
    out = tmp_path / "sweep"
    command = [*FEDDOMAIN, "sweep", str(config), *GRID, "--jobs", "2", "--out", str(out), "--quiet"]
    proc = subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers = _wait_for_a_finished_and_a_checkpointed_run(out, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _signal_all(workers, signal.SIGCONT)  # stopped workers must run to notice the parent died
    assert proc.returncode == -signal.SIGKILL
    deadline = time.time() + 10
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    survivors = [w for w in workers if _alive(w)]
    for w in survivors:  # ours: do not leave them running after the test
        os.kill(w, signal.SIGKILL)
    assert not survivors, "workers outlived the killed sweep"

    finished = {p.parent: p.stat().st_mtime_ns for p in out.rglob("summary.json")}
    interrupted = {
        c.parent: torch.load(c, weights_only=False)["round_log"]
        for c in out.rglob("checkpoint.pt")
        if c.parent not in finished
    }
    assert finished and interrupted

    rerun = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    for run_dir, mtime in finished.items():  # not redone
        assert (run_dir / "summary.json").stat().st_mtime_ns == mtime
    for run_dir, round_log in interrupted.items():  # resumed: the saved rounds kept, timings too
        rounds = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
        assert rounds[: len(round_log)] == round_log

    for name, overrides in RUNS.items():
        reference = tmp_path / "reference" / name
        assert main(["run", str(config), *overrides, "--out", str(reference), "--quiet"]) == 0
        assert summary_of(out / name) == summary_of(reference), name
        assert metrics_of(out / name) == metrics_of(reference), name


def test_a_dead_worker_fails_its_run_and_the_runs_it_had_not_started_go_again(tmp_path: Path):
    """Catches a worker's death (killed, out of memory) failing every queued run of the pool,
    or being retried forever: only the run it was running fails; queued ones stay queued for
    the fresh pool ``run_sweep`` starts."""
    running, queued = (
        RunState(SweepRun(n, tmp_path / n, {}), status=s)
        for n, s in (("a", "running"), ("b", "queued"))
    )
    for state in (running, queued):
        fut: Future = Future()
        fut.set_exception(BrokenProcessPool("a child process terminated abruptly"))
        _settle(fut, state)
    assert running.status == "failed" and "worker process died" in (running.error or "")
    assert queued.status == "queued" and queued.error is None


# ------------------------------------------------------------------------------- GPUs
def test_jobs_per_gpu_gives_k_slots_on_every_visible_gpu(config: Path, tmp_path: Path, monkeypatch):
    """Catches slots on GPUs the process cannot see (ids 0..n-1 while CUDA_VISIBLE_DEVICES
    names others), or K ignored: 2 per GPU on GPUs 3 and 5 are workers 3, 3, 5, 5."""
    runs = plan(config, ["rounds=1"], [], tmp_path / "sweep")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu_slots(2, runs) == ["3", "3", "5", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_slots(1, runs) == ["0", "1"]


def test_jobs_per_gpu_is_refused_without_cuda_or_for_a_run_placed_elsewhere(
    config: Path, tmp_path: Path, monkeypatch
):
    """Catches a GPU sweep silently running on the CPU, and a run pinned to `cuda:1` (which a
    worker that sees one GPU does not have) or to the CPU accepted."""
    runs = plan(config, ["rounds=1"], [], tmp_path / "sweep")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="needs a CUDA device and none is visible"):
        gpu_slots(1, runs)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cpu = plan(config, ["rounds=1", "device=cpu"], [], tmp_path / "sweep-cpu")
    with pytest.raises(ConfigError, match=r"run lodo-grey has device 'cpu'; set device to auto"):
        gpu_slots(1, cpu)
    with pytest.raises(SystemExit):  # argparse: --jobs and --jobs-per-gpu exclude each other
        main(["sweep", str(config), "--jobs", "2", "--jobs-per-gpu", "1", "--out", "x"])


def test_each_worker_sees_only_its_gpu(config: Path, tmp_path: Path):
    """Catches workers not pinned (every run on GPU 0, or the parent's whole device list): each
    run's provenance records the CUDA_VISIBLE_DEVICES its worker had, one of the two slots (on
    a machine without CUDA the runs fall back to the CPU, which the pinning does not change)."""
    runs = plan(config, ["rounds=1"], [], tmp_path / "sweep")
    states = run_sweep(runs, 2, gpus=["7", "9"])
    assert [s.status for s in states] == ["done", "done"]
    for run in runs:
        provenance = yaml.safe_load((run.out / "provenance.yaml").read_text())
        assert provenance["cuda_visible_devices"] in ("7", "9")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") not in ("7", "9")  # the parent's untouched


def test_parallel_runs_of_a_frozen_backbone_read_one_cache_filled_before_they_start(
    tmp_path: Path,
):
    """Catches workers that each compute the frozen features at once (a 10-30 minute pass on
    PACS, done twice and written twice): with --jobs 2 the cache entry is written once, before
    any run starts, and every run of the sweep reads it."""
    frozen = {**SMALL, "model": {"name": "lenet5", "frozen": True},
              "dataset": {**SMALL["dataset"], "cache_dir": str(tmp_path / "cache")}}  # fmt: skip
    path = tmp_path / "frozen.yaml"
    path.write_text(yaml.safe_dump(frozen))
    runs = plan(path, [], [("algorithm", ["fedavg", "fedprox"])], tmp_path / "sweep")
    states = run_sweep(runs, jobs=2)
    assert [s.status for s in states] == ["done"] * 4
    (entry,) = (tmp_path / "cache" / "features").glob("features-*.pt")
    written = entry.stat().st_mtime_ns
    assert all(written < (r.out / "config.yaml").stat().st_mtime_ns for r in runs)
