"""`feddomain tune` (issue 25, item 1): the space, seeded draws, ranking, the refusal to select on
the target, and SIGKILL + rerun giving the same trials and selection as an uninterrupted tune."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from feddomain.algorithms.space import LogUniform
from feddomain.config import load_config
from feddomain.errors import ConfigError, FeddomainError
from feddomain.evaluation.report import RUN_FILES, build_report
from feddomain.sweep import SweepRun, plan, run_sweep
from feddomain.tune import (
    Objective,
    Trial,
    TuneResult,
    _check_settings,
    draw,
    rank,
    reuse_trial_runs,
    search_space,
    trials_markdown,
    tune,
    write_selected,
)
from tests.resume_helpers import FEDDOMAIN, PROJECT, write_config
from tests.test_sweep import _alive, _descendants, _signal_all

TINY = {
    "name": "tune-test",
    "seed": 0,
    "rounds": 4,
    "dataset": {"name": "digits_embedded", "resolution": 16},
    "split": {"scheme": "lodo", "targets": ["grey", "inverted"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "small_cnn", "options": {"norm": "group", "groups": 2, "widths": [4, 8, 8]}},
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.003, "max_steps": 5},
    "eval": {"every": 1},
    "checkpoint": {"every": 1},
    "threads": 1,
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("tune-config") / "tiny.yaml", TINY)


# ------------------------------------------------------------------------------ the space
def test_space_is_the_lr_around_the_config_plus_the_method_less_fixed_keys(config: Path):
    """Catches the lr missing or not centred on the config's value, the method's own space
    missing, and a hyper-parameter fixed on the command line still being searched."""
    cfg = load_config(config, ["algorithm=fedprox"])
    space = search_space(cfg, ["algorithm=fedprox"])
    assert list(space) == ["train.lr", "algorithm.mu"]
    lr = space["train.lr"]
    assert isinstance(lr, LogUniform)
    assert (lr.low, lr.high) == pytest.approx((0.0003, 0.03), rel=1e-12)
    fixed = ["algorithm=fedprox", "algorithm.mu=0.1"]
    assert list(search_space(load_config(config, fixed), fixed)) == ["train.lr"]


def test_draws_are_seeded_and_a_longer_tune_extends_a_shorter_one():
    """Catches unseeded sampling (a rerun would draw other points), and a longer tune whose
    first trials are not the shorter tune's (`--trials 6` after `--trials 3` must keep them)."""
    space = {"train.lr": LogUniform(1e-4, 1e-2), "algorithm.mu": LogUniform(1e-3, 1.0)}
    three = draw(space, seed=0, n=3)
    assert draw(space, seed=0, n=5)[:3] == three
    assert draw(space, seed=1, n=3) != three
    assert len({p["train.lr"] for p in three}) == 3
    assert all(1e-4 <= p["train.lr"] <= 1e-2 and 1e-3 <= p["algorithm.mu"] <= 1 for p in three)


def test_ranking_is_by_value_then_trial_and_unfinished_trials_come_last():
    """Catches a ranking by trial number or ascending value, a tie going to the later trial,
    and an unfinished trial ranked among the finished ones."""
    trials = [
        Trial(0, {}, "complete", 0.5), Trial(1, {}, "running"), Trial(2, {}, "complete", 0.7),
        Trial(3, {}, "complete", 0.5),
    ]  # fmt: skip
    assert [t.number for t in rank(trials)] == [2, 0, 3, 1]


# ------------------------------------------------------------------------- the objective
def test_a_tune_that_would_select_on_the_target_needs_oracle(config: Path, tmp_path: Path):
    """Catches a tune whose runs pick rounds by target accuracy (eval.selection = oracle)
    passing as a source-validation tune: refused before anything is written."""
    out = tmp_path / "tune"
    with pytest.raises(ConfigError, match=r"eval.selection = 'oracle'.*--oracle"):
        tune(config, ["eval.selection=oracle"], trials=1, out=out)
    assert not out.exists()
    with pytest.raises(ConfigError, match="no source validation data"):
        tune(config, ["split.val_fraction=0"], trials=1, out=out)
    cfg = load_config(config, ["eval.selection=oracle"])
    assert Objective.of(cfg, oracle=True).key == "ood_acc"
    assert Objective.of(load_config(config), oracle=False).key == "id_acc"


def test_an_oracle_tune_is_labelled_in_the_table_and_selected_yaml(config: Path, tmp_path: Path):
    """Catches an oracle tune's outputs that read like a source-validation tune's."""
    best = Trial(0, {"train.lr": 0.001}, "complete", 0.5, {"grey": 0.5})
    result = TuneResult(tmp_path, Objective("ood_acc", True), {}, [best], best)
    assert "ORACLE" in trials_markdown(result).splitlines()[0]
    assert "ORACLE ood acc" in trials_markdown(result)
    write_selected(result, config, [], load_config(config), 0, ["grey"])
    selected = yaml.safe_load((tmp_path / "selected.yaml").read_text())
    assert selected["oracle"] is True and selected["objective"].startswith("ORACLE")


# --------------------------------------------------------------------- kill and resume
def _killable(out: Path) -> bool:
    """Trial 0 finished (both targets) while a run of trial 1 is checkpointed, unfinished."""
    first = [out / "trials" / "000" / t / "summary.json" for t in ("lodo-grey", "lodo-inverted")]
    second = out / "trials" / "001"
    ckpts = [c for c in second.rglob("checkpoint.pt") if not (c.parent / "summary.json").exists()]
    return all(p.is_file() for p in first) and bool(ckpts)


@pytest.mark.slow
def test_sigkill_mid_trial_then_rerun_equals_an_uninterrupted_tune(config: Path, tmp_path: Path):
    """The acceptance test of issue 25 (tune). Catches: a rerun drawing new points instead of
    the stored ones, redoing a finished trial's runs, restarting (not resuming) the interrupted
    trial's run, losing a trial whose runs finished just before the kill, and any difference in
    the trials table or selection from a tune never interrupted; then `--confirm` runs the
    selected point, and a rerun with other settings into the same directory is refused."""
    reference = tmp_path / "reference"
    ref = tune(config, ["algorithm=fedprox"], trials=3, out=reference, confirm=[1])
    assert ref.ok and [t.state for t in ref.trials] == ["complete"] * 3
    best = ref.selected
    assert best is not None and best.value == max(t.value or 0 for t in ref.trials)
    assert best.value == pytest.approx(sum(best.per_target.values()) / 2, abs=1e-12)
    for target in ("grey", "inverted"):  # the confirmation run is the selected point, seed 1
        saved = yaml.safe_load((reference / "confirm" / "seed=1" / f"lodo-{target}" /
                                "config.yaml").read_text())  # fmt: skip
        assert saved["seed"] == 1
        assert saved["train"]["lr"] == best.params["train.lr"]
        assert saved["algorithm"]["mu"] == best.params["algorithm.mu"]
    report = build_report([reference / "confirm"])  # the report names the tune behind the row
    assert report.tuning["fedprox"]["trials"] == 3
    assert " ".join(best.overrides) in report.to_markdown().replace(", ", " ")

    out = tmp_path / "killed"
    command = [*FEDDOMAIN, "tune", str(config), "algorithm=fedprox", "--trials", "3",
               "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if _killable(out):
            workers = _descendants(proc.pid)
            _signal_all({proc.pid, *workers}, signal.SIGSTOP)
            if _killable(out):
                break
            _signal_all({proc.pid, *workers}, signal.SIGCONT)
        time.sleep(0.005)
    else:
        pytest.fail("the tune ended before trial 1 was checkpointed")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _signal_all(workers, signal.SIGCONT)
    deadline = time.time() + 10
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if _alive(w)], "workers outlived the killed tune"
    finished = {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")}
    interrupted = {
        c.parent: torch.load(c, weights_only=False)["round_log"]
        for c in out.rglob("checkpoint.pt")
        if not (c.parent / "summary.json").exists()
    }
    assert finished and interrupted and not (out / "selected.yaml").exists()

    resumed = tune(config, ["algorithm=fedprox"], trials=3, out=out)
    assert resumed.ok
    for path, mtime in finished.items():  # not redone
        assert path.stat().st_mtime_ns == mtime
    for run_dir, round_log in interrupted.items():  # resumed from its checkpoint
        rounds = [yaml.safe_load(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
        assert rounds[: len(round_log)] == round_log
    assert (out / "trials.csv").read_text() == (reference / "trials.csv").read_text()
    ref_selected = yaml.safe_load((reference / "selected.yaml").read_text())
    assert yaml.safe_load((out / "selected.yaml").read_text()) == ref_selected

    other = r"holds a tune with other settings \(differing: seed\)"
    with pytest.raises(FeddomainError, match=other):
        tune(config, ["algorithm=fedprox"], trials=3, out=out, seed=5)


def test_a_tune_saved_before_an_option_existed_resumes_and_a_changed_value_is_refused(
    config: Path, tmp_path: Path
):
    """Catches a tune started by an older feddomain (its saved config lacks an option added
    since, at its default) being refused on resume - a long campaign orphaned by an upgrade -
    and the normalisation hiding a real difference (another round count)."""
    import optuna

    cfg = load_config(config)
    objective = Objective.of(cfg, oracle=False)
    study = optuna.create_study(direction="maximize")
    _check_settings(study, tmp_path, cfg, {}, 0, objective)
    older = study.user_attrs["settings"]
    del older["config"]["tracking"]  # an option this version added, at its default
    study.set_user_attr("settings", older)
    _check_settings(study, tmp_path, cfg, {}, 0, objective)
    longer = load_config(config, ["rounds=5"])
    with pytest.raises(FeddomainError, match=r"other settings \(differing: config\)"):
        _check_settings(study, tmp_path, longer, {}, 0, objective)


@pytest.mark.slow
def test_the_confirmation_at_the_tunes_seed_is_the_selected_trial_not_a_retrain(
    config: Path, tmp_path: Path
):
    """Catches the seed-0 confirmation training the selected trial a second time (a ninth of a
    campaign's cost), a copy taken from another trial or target, and a copy that differs from
    what training that configuration afresh gives."""
    out = tmp_path / "tune"
    result = tune(config, ["algorithm=fedprox"], trials=2, out=out, confirm=[0, 1])
    status = {s.run.name: s.status for s in result.confirm}
    assert status == {
        "seed=0/lodo-grey": "skipped", "seed=0/lodo-inverted": "skipped",
        "seed=1/lodo-grey": "done", "seed=1/lodo-inverted": "done",
    }  # fmt: skip
    chosen = out / "trials" / f"{result.selected.number:03d}"
    fresh = plan(config, ["algorithm=fedprox", *result.selected.overrides], [], tmp_path / "fresh")
    assert all(s.status == "done" for s in run_sweep(fresh, jobs=1))
    for target in ("grey", "inverted"):
        copied = json.loads((out / "confirm" / "seed=0" / f"lodo-{target}" /
                             "summary.json").read_text())  # fmt: skip
        trial = json.loads((chosen / f"lodo-{target}" / "summary.json").read_text())
        again = json.loads((tmp_path / "fresh" / f"lodo-{target}" / "summary.json").read_text())
        assert copied == trial
        assert copied["target_domains"] == [target]
        for key in ("selected_round", "id_acc", "ood_acc", "ood_ece", "per_client"):
            assert copied[key] == again[key]


def test_a_reused_trial_run_keeps_its_evaluated_states_but_not_its_checkpoints(tmp_path):
    """Catches the seed-0 confirmation copied without the evaluated states a rescored variant
    reads (``checkpoint.keep_evaluated``: its rescore would fail and the variant train again),
    or copied with the checkpoints nothing reads (hundreds of MB a run on hypernetworks)."""
    trial, confirm = tmp_path / "trial", tmp_path / "confirm"
    (trial / "evaluated").mkdir(parents=True)
    kept = ("summary.json", "metrics.jsonl", "config.yaml", "evaluated/round_00002.pt")
    for name in (*kept, "final_checkpoint.pt", "server_state.pt"):
        (trial / name).write_text(name)
    config = {"seed": 0}
    reuse_trial_runs([SweepRun("seed=0", confirm, config)], [SweepRun("000", trial, config)])
    copied = sorted(p.relative_to(confirm).as_posix() for p in confirm.rglob("*.*"))
    assert copied == sorted(kept)


def test_a_trial_run_missing_its_metrics_log_is_trained_again_not_copied(tmp_path):
    """Catches a seed-0 confirmation copied from a trial run whose ignored metrics log is gone
    (a fresh clone of committed results resuming the campaign): the copy has summary.json, so
    the sweep never retrains it, and every report then fails on the run without metrics.jsonl.
    The whole trial run beside it is still copied."""
    whole, partial = tmp_path / "trial" / "lodo-a", tmp_path / "trial" / "lodo-b"
    for run, names in ((whole, RUN_FILES), (partial, ("summary.json", "config.yaml"))):
        run.mkdir(parents=True)
        for name in names:
            (run / name).write_text(name)
    confirm = tmp_path / "confirm"
    configs = ({"seed": 0, "target": "a"}, {"seed": 0, "target": "b"})
    pairs = list(zip((whole, partial), configs, strict=True))
    reuse_trial_runs(
        [SweepRun(f"seed=0/{d.name}", confirm / d.name, c) for d, c in pairs],
        [SweepRun(d.name, d, c) for d, c in pairs],
    )
    assert sorted(p.name for p in (confirm / "lodo-a").iterdir()) == sorted(RUN_FILES)
    assert not (confirm / "lodo-b").exists()
