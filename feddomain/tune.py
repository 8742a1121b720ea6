"""``feddomain tune``: seeded random search over a method's declared space, on source validation.

A trial is one point of the space (the method's ``MethodSpec.space`` plus the client learning
rate, ``algorithms/space.py``) run on every target split of the config at the config's seed;
its value is the mean over targets of each run's model-selection accuracy: ``id_acc`` (accuracy
on the clients' held-out source validation data) at the round the config's selection rule picks.
No target number enters the choice unless ``oracle`` is asked for, and then every output says
ORACLE. A config whose own selection rule reads the target (``eval.selection: oracle``) is
refused without it.

The search is Optuna's: the N points are drawn once by ``RandomSampler(seed)`` (so the first N
points of a longer tune are the same) and enqueued in an SQLite study in ``OUT/study.db``; each
trial's runs live in ``OUT/trials/<number>/lodo-<target>``, run by the sweep engine
(``sweep.run_sweep``: ``jobs`` worker processes, each run exactly a ``feddomain run``). Running
the same command again resumes: complete trials are kept, and an interrupted trial keeps its
finished runs and resumes the others from their checkpoints, as ``sweep`` does (SIGKILL-safe:
the study records a trial's point before any of its runs starts, and its value only once all
of them have finished). Pruning is not offered: every trial runs its full budget.

Outputs: ``trials.csv`` / ``trials.md`` (every trial ranked, with its value per target) and
``selected.yaml`` (the chosen overrides, the space, the number of trials, the sampler's seed and
the objective). ``confirm`` seeds run the selected configuration through the sweep engine into
``OUT/confirm/seed=<s>/lodo-<target>``, which ``feddomain report`` reads with the tune's
selection beside it; the confirmation at the tune's own seed is the selected trial's runs,
copied (the same resolved config and seed train to the same result), not trained again.
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
import logging
import math
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from feddomain.config import ExperimentConfig, load_config, validate_config
from feddomain.errors import DIVERGED_RECORD, ConfigError, FeddomainError
from feddomain.sweep import (
    RunState,
    SweepRun,
    found,
    plan,
    run_sweep,
    split_targets,
    yaml_text,
)

if TYPE_CHECKING:
    import optuna

    from feddomain.algorithms.space import Dimension

log = logging.getLogger("feddomain")

STUDY_FILE = "study.db"
TRIALS_DIR = "trials"
CONFIRM_DIR = "confirm"
SELECTED_FILE = "selected.yaml"
STUDY_NAME = "feddomain-tune"
SAMPLER = "optuna RandomSampler"


@dataclass(frozen=True)
class Objective:
    """What a trial is ranked by: a summary.json key, averaged over the trial's targets."""

    key: str  # "id_acc" (source validation) or, for an oracle tune, "ood_acc" (target)
    oracle: bool

    @property
    def label(self) -> str:
        if self.oracle:
            return "ORACLE: target-domain accuracy (ood_acc), mean over targets"
        return "source-validation accuracy (id_acc at each run's selected round), mean over targets"

    @classmethod
    def of(cls, cfg: ExperimentConfig, oracle: bool) -> Objective:
        """Refuse a tune that would select on the target without ``oracle``."""
        if not oracle and cfg.eval.selection == "oracle":
            raise ConfigError(
                "eval.selection = 'oracle' picks each run's round on the target domain, so a "
                "tune of this config would select on target data; set eval.selection to "
                "source_val (or last), or ask for an oracle tune (--oracle), labelled as such"
            )
        split = cfg.split
        if not oracle and split.val_fraction == 0 and not split.official_lists:
            raise ConfigError(
                "split.val_fraction = 0 leaves the clients no source validation data, which a "
                "tune selects on; set split.val_fraction (e.g. 0.1)"
            )
        return cls("ood_acc" if oracle else "id_acc", oracle)


@dataclass(frozen=True)
class Trial:
    """One trial as the study and its run directories record it."""

    number: int
    params: dict[str, Any]
    state: str  # complete | running (interrupted, failed, or still to run)
    value: float | None = None
    per_target: dict[str, float] = field(default_factory=dict)

    @property
    def overrides(self) -> list[str]:
        return overrides_of(self.params)


@dataclass
class TuneResult:
    """What ``tune`` did: the ranked trials, the choice, and the confirmation runs."""

    out: Path
    objective: Objective
    space: dict[str, Dimension]
    trials: list[Trial]  # ranked: complete ones by value (ties: lower number), then the rest
    selected: Trial | None  # None until every trial is complete
    failed: list[RunState] = field(default_factory=list)
    confirm: list[RunState] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.selected is not None and not self.failed


def tune(
    config: Path,
    overrides: Sequence[str] = (),
    *,
    trials: int,
    out: Path,
    jobs: int = 1,
    seed: int = 0,
    oracle: bool = False,
    confirm: Sequence[int] = (),
) -> TuneResult:
    """Run (or resume) a ``trials``-point random search of ``config``'s method in ``out``, then
    the selected configuration for each ``confirm`` seed. Hyper-parameters set in
    ``overrides`` are held fixed (left out of the space)."""
    if trials < 1:
        raise ConfigError(f"--trials must be at least 1, got {trials}")
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    overrides = list(overrides)
    base = load_config(config, overrides)
    objective = Objective.of(base, oracle)
    space = search_space(base, overrides)
    targets = [t or "" for t in split_targets(base)]
    out.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        study = _study(out, seed)
        _check_settings(study, out, base, space, seed, objective)
        _enqueue(study, space, seed, trials)
        pending = _start(study, space)
        runs = {n: _trial_runs(config, overrides, n, p, out) for n, p in pending.items()}
        closer = _Closer(study, runs, objective, trials)
        states = run_sweep([r for rs in runs.values() for r in rs], jobs, on_settle=closer)
        closer.close_finished()
        ranked = rank(_trials(study, out, objective))
    selected = ranked[0] if all(t.state == "complete" for t in ranked) else None
    failed = [s for s in states if s.status == "failed"]
    result = TuneResult(out, objective, space, ranked, selected, failed)
    write_trials(result)
    if selected is None:
        return result
    write_selected(result, config, overrides, base, seed, targets)
    if confirm:
        runs = plan(config, [*overrides, *selected.overrides], [("seed", list(confirm))],
                    out / CONFIRM_DIR)  # fmt: skip
        trial = _trial_runs(config, overrides, selected.number, selected.params, out)
        reuse_trial_runs(runs, trial)
        result.confirm = run_sweep(runs, jobs)
    return result


def reuse_trial_runs(confirm: Sequence[SweepRun], trial: Sequence[SweepRun]) -> None:
    """Copy each finished run of the selected trial into the confirmation run with the same
    resolved config (the tune's own seed), so it is not trained a second time; the copy lands
    whole or not at all. A trial run missing a file the report reads (a fresh clone of
    committed results has a trial's summary but not its ignored metrics log) is trained again
    rather than copied into a confirmation the report cannot load."""
    from feddomain.evaluation.report import RUN_FILES  # late: `--help` need not load matplotlib

    finished = {
        json.dumps(r.config, sort_keys=True): r.out
        for r in trial
        if all((r.out / name).is_file() for name in RUN_FILES)
    }
    for run in confirm:
        source = finished.get(json.dumps(run.config, sort_keys=True))
        if source is None or run.out.exists():
            continue
        run.out.parent.mkdir(parents=True, exist_ok=True)
        staging = run.out.with_name(f".{run.out.name}.copying")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging, ignore=_checkpoints)
        staging.rename(run.out)


def _checkpoints(folder: str, names: list[str]) -> list[str]:
    """A finished run's checkpoints, which its copy leaves behind (a confirmation is neither
    resumed nor extended), but not its evaluated states: what `feddomain rescore` reads."""
    from feddomain.federation.checkpoint import EVALUATED  # late: `--help` need not load torch

    if Path(folder).name == EVALUATED:
        return []
    return [name for name in names if name.endswith(".pt")]


# ------------------------------------------------------------------------------ the space
def search_space(cfg: ExperimentConfig, overrides: Sequence[str] = ()) -> dict[str, Dimension]:
    """The dotted keys a tune of ``cfg`` searches: the client lr (around ``train.lr``) and the
    method's declared space (a composed client part's under ``algorithm.client.``), less the
    keys ``overrides`` set explicitly."""
    from feddomain.algorithms import resolve_method  # late: `--help` need not load the methods
    from feddomain.algorithms.space import LR_KEY, lr_dimension

    method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
    space: dict[str, Dimension] = {LR_KEY: lr_dimension(cfg.train.lr)}
    space.update({f"algorithm.{k}": d for k, d in method.spec.space.items()})
    if method.client_spec is not method.spec:
        space.update({f"algorithm.client.{k}": d for k, d in method.client_spec.space.items()})
    fixed = {item.partition("=")[0].strip() for item in overrides}
    return {k: d for k, d in space.items() if k not in fixed}


def overrides_of(params: dict[str, Any]) -> list[str]:
    """``{"train.lr": 0.003}`` -> ``["train.lr=0.003"]``, each value reading back as itself."""
    return [f"{k}={yaml_text(v)}" for k, v in params.items()]


def draw(space: dict[str, Dimension], seed: int, n: int) -> list[dict[str, Any]]:
    """The first ``n`` points ``RandomSampler(seed)`` draws from ``space`` (a prefix of any
    longer draw), in an in-memory study: the persistent one only stores them."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scratch = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    distributions = {k: d.distribution() for k, d in space.items()}
    return [scratch.ask(distributions).params for _ in range(n)]


# ------------------------------------------------------------------------------ the study
@contextmanager
def _lock(out: Path) -> Iterator[None]:
    """One tune at a time per directory (the lock dies with its process, SIGKILL included)."""
    with open(out / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FeddomainError(f"another feddomain tune is running in {out}") from None
        yield


def _study(out: Path, seed: int) -> optuna.Study:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        study_name=STUDY_NAME,
        storage=f"sqlite:///{out / STUDY_FILE}",
        sampler=optuna.samplers.RandomSampler(seed=seed),
        direction="maximize",
        load_if_exists=True,
    )


def _settings(
    cfg: ExperimentConfig, space: dict[str, Dimension], seed: int, objective: Objective
) -> dict[str, Any]:
    """What a tune searches, as its study records it (JSON types)."""
    return json.loads(json.dumps({
        "config": cfg.to_dict(),
        "space": {k: d.describe() for k, d in space.items()},
        "seed": seed,
        "objective": objective.key,
    }))  # fmt: skip


def check_resumable(
    out: Path, config: Path, overrides: Sequence[str] = (), *, seed: int = 0, oracle: bool = False
) -> None:
    """Refuse, as ``tune`` would on resuming, when the tune saved in ``out`` searched other
    settings than ``tune(config, overrides, seed=seed, oracle=oracle)`` would; runs nothing."""
    import optuna

    base = load_config(config, list(overrides))
    settings = _settings(base, search_space(base, overrides), seed, Objective.of(base, oracle))
    saved = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{out / STUDY_FILE}")
    recorded = saved.user_attrs.get("settings")
    if recorded is not None:  # a study from before settings were recorded: tune adopts it
        _refuse_other_settings(out, recorded, settings)


def _check_settings(
    study: optuna.Study,
    out: Path,
    cfg: ExperimentConfig,
    space: dict[str, Dimension],
    seed: int,
    objective: Objective,
) -> None:
    """Record what this tune searches; refuse to resume one that searched something else."""
    settings = _settings(cfg, space, seed, objective)
    saved = study.user_attrs.get("settings")
    if saved is None:
        study.set_user_attr("settings", settings)
        return
    _refuse_other_settings(out, saved, settings)


def _refuse_other_settings(out: Path, saved: dict[str, Any], settings: dict[str, Any]) -> None:
    saved = {**saved, "config": _as_current(saved.get("config"))}
    differ = sorted(k for k in settings if settings[k] != saved.get(k))
    if differ:
        raise FeddomainError(
            f"{out} holds a tune with other settings (differing: {', '.join(differ)}); choose a "
            f"new --out, or delete {out} to start over"
        )


def _as_current(config: Any) -> Any:
    """A saved tune's config as this version reads it: options added since then get their
    defaults, so upgrading feddomain between sessions does not orphan a long tune. A config
    this version cannot read stays as saved (and then differs)."""
    try:
        return json.loads(json.dumps(validate_config(dict(config)).to_dict()))
    except (ConfigError, TypeError, ValueError):
        return config


def _enqueue(study: optuna.Study, space: dict[str, Dimension], seed: int, n: int) -> None:
    """Store the points of trials not yet in the study (all of them the first time)."""
    have = len(study.get_trials(deepcopy=False))
    if have > n:
        raise FeddomainError(f"the tune holds {have} trials already; --trials must be >= {have}")
    for params in draw(space, seed, n)[have:]:
        study.enqueue_trial(params)


def _start(study: optuna.Study, space: dict[str, Dimension]) -> dict[int, dict[str, Any]]:
    """Every trial without a value, by number: the interrupted ones (still RUNNING in the
    study) and the queued ones, which are started now."""
    from optuna.trial import TrialState

    distributions = {k: d.distribution() for k, d in space.items()}
    for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        study.ask(distributions)
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    return {t.number: dict(t.params) for t in sorted(running, key=lambda t: t.number)}


def _trial_dir(out: Path, number: int) -> Path:
    return out / TRIALS_DIR / f"{number:03d}"


def _trial_runs(
    config: Path, overrides: list[str], number: int, params: dict[str, Any], out: Path
) -> list[SweepRun]:
    """The trial's runs, one per target, named ``trial NNN/lodo-<target>`` for the engine."""
    runs = plan(config, [*overrides, *overrides_of(params)], [], _trial_dir(out, number))
    return [replace(r, name=f"trial {number:03d}/{r.name}") for r in runs]


def trial_value(run_dirs: Sequence[Path], objective: Objective) -> dict[str, float]:
    """Each finished run's objective value, by target domain(s); a run whose model diverged
    before any evaluation scores 0 (below every trained run)."""
    values = {}
    for run_dir in run_dirs:
        if not (run_dir / "summary.json").is_file():
            diverged = json.loads((run_dir / DIVERGED_RECORD).read_text())
            log.info("%s diverged (%s): it scores 0", run_dir, diverged["message"])
            values[run_dir.name.removeprefix("lodo-")] = 0.0
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        value = summary.get(objective.key)
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise FeddomainError(
                f"{run_dir / 'summary.json'} has no {objective.key} to rank the trial by "
                f"(got {value!r})"
            )
        values["+".join(summary["target_domains"])] = float(value)
    return values


class _Closer:
    """Gives a trial its value in the study once every run of it has finished, with one log
    line; a trial with a failed run stays open (the rerun retries it)."""

    def __init__(
        self,
        study: optuna.Study,
        runs: dict[int, list[SweepRun]],
        objective: Objective,
        total: int,
    ) -> None:
        self.study, self.runs, self.objective, self.total = study, runs, objective, total
        self.closed: set[int] = set()

    def __call__(self, state: RunState) -> None:
        number = int(state.run.name.split("/")[0].removeprefix("trial "))
        if state.status == "failed":
            log.info("trial %d: run %s failed (%s)", number, state.run.name, state.error)
        self._close(number)

    def close_finished(self) -> None:
        """Close trials whose runs had all finished before this session (a kill between a
        trial's last run and its value)."""
        for number in self.runs:
            self._close(number)

    def _close(self, number: int) -> None:
        dirs = [r.out for r in self.runs[number]]
        if number in self.closed or not all(found(d) in ("finished", "diverged") for d in dirs):
            return
        values = trial_value(dirs, self.objective)
        mean = sum(values.values()) / len(values)
        self.study.tell(number, mean)
        self.closed.add(number)
        shown = ", ".join(f"{t} {100 * v:.1f}" for t, v in values.items())
        what = "ORACLE ood acc" if self.objective.oracle else "source-val acc"
        log.info("trial %d (of %d) done: %s %.2f (%s)", number, self.total, what, 100 * mean, shown)


def _trials(study: optuna.Study, out: Path, objective: Objective) -> list[Trial]:
    """Every trial of the study; a complete one with its value per target, read back from its
    runs' summaries."""
    from optuna.trial import TrialState

    trials = []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.COMPLETE:
            runs = sorted(p.parent for p in _trial_dir(out, t.number).rglob("summary.json"))
            values = trial_value(runs, objective)
            trials.append(Trial(t.number, dict(t.params), "complete", t.value, values))
        else:
            trials.append(Trial(t.number, dict(t.params), "running"))
    return trials


def rank(trials: list[Trial]) -> list[Trial]:
    """Complete trials by value, highest first (ties: the earlier trial), then the others."""
    return sorted(
        trials,
        key=lambda t: (t.state != "complete", -(t.value or 0.0), t.number),
    )


# ------------------------------------------------------------------------------ outputs
def write_trials(result: TuneResult) -> None:
    """``trials.csv`` (fractions) and ``trials.md`` (percentages), ranked."""
    keys = list(result.space)
    names = _targets(result.trials)
    value = "oracle_ood_acc" if result.objective.oracle else "source_val_acc"
    with (result.out / "trials.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["rank", "trial", "state", value, *names, *keys])
        for i, t in enumerate(result.trials, start=1):
            writer.writerow([
                i if t.state == "complete" else "", t.number, t.state,
                "" if t.value is None else repr(t.value),
                *(repr(t.per_target[n]) if n in t.per_target else "" for n in names),
                *(repr(t.params.get(k)) for k in keys),
            ])  # fmt: skip
    (result.out / "trials.md").write_text(trials_markdown(result))


def _targets(trials: list[Trial]) -> list[str]:
    return sorted({n for t in trials for n in t.per_target})


def trials_markdown(result: TuneResult) -> str:
    """The ranked trials: value, value per target, the point."""
    keys = list(result.space)
    names = _targets(result.trials)
    head = "ORACLE ood acc" if result.objective.oracle else "source-val acc"
    lines = [
        f"# tune: {len(result.trials)} trials ({SAMPLER}); objective: {result.objective.label}",
        "",
        "| rank | trial | " + " | ".join([head, *names, *keys]) + " |",
        "|---" * (3 + len(names) + len(keys)) + "|",
    ]
    for i, t in enumerate(result.trials, start=1):
        rank_ = str(i) if t.state == "complete" else t.state
        value = "—" if t.value is None else f"{100 * t.value:.2f}"
        per = [f"{100 * t.per_target[n]:.2f}" if n in t.per_target else "—" for n in names]
        params = [f"{t.params[k]:.4g}" if isinstance(t.params.get(k), float)
                  else str(t.params.get(k)) for k in keys]  # fmt: skip
        lines.append(f"| {rank_} | {t.number} | " + " | ".join([value, *per, *params]) + " |")
    return "\n".join(lines) + "\n"


def write_selected(
    result: TuneResult,
    config: Path,
    overrides: list[str],
    cfg: ExperimentConfig,
    seed: int,
    targets: list[str],
) -> None:
    """``selected.yaml``: what was chosen, out of what, and how to run it again."""
    best = result.selected
    assert best is not None
    selected = {
        "oracle": result.objective.oracle,
        "objective": result.objective.label,
        "method": cfg.algorithm.name,
        "label": cfg.algorithm.label or cfg.algorithm.name,
        "config": str(config),
        "overrides": overrides,
        "selected": {
            "trial": best.number,
            "value": best.value,
            "per_target": best.per_target,
            "params": best.params,
            "overrides": best.overrides,
        },
        "space": {k: d.describe() for k, d in result.space.items()},
        "trials": len(result.trials),
        "sampler": SAMPLER,
        "seed": seed,
        "run_seed": cfg.seed,
        "targets": [t for t in targets if t] or None,
    }
    (result.out / SELECTED_FILE).write_text(yaml.safe_dump(selected, sort_keys=False))


def read_selected(path: Path) -> dict[str, Any]:
    """A tune's ``selected.yaml`` (for the report)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise FeddomainError(f"{path}: cannot read the tune's selection ({err})") from err
    if not isinstance(data, dict) or "selected" not in data:
        raise FeddomainError(f"{path}: not a feddomain tune selection (no 'selected')")
    return data


# ------------------------------------------------------------------------------ command
def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``feddomain tune`` on the CLI's sub-command parser."""
    tp = sub.add_parser(
        "tune",
        help="random search over the method's space, selected on source validation",
        description=(
            "Seeded random search (Optuna RandomSampler) over the method's declared search "
            "space plus the client lr (`feddomain list methods --spaces`); each trial runs "
            "every target split at the config's seed and is ranked by the mean over targets of "
            "source-validation accuracy. Rerunning the same command resumes. Hyper-parameters "
            "given as overrides are held fixed."
        ),
    )
    tp.add_argument("config", type=Path, help="YAML config")
    tp.add_argument("overrides", nargs="*", help="dotted overrides applied to every trial")
    tp.add_argument("--trials", type=int, required=True, help="number of trials")
    tp.add_argument("--out", type=Path, required=True, help="tune directory (new or to resume)")
    tp.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    tp.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    tp.add_argument(
        "--oracle",
        action="store_true",
        help="rank trials by TARGET accuracy (an oracle, labelled so in every output)",
    )
    tp.add_argument(
        "--confirm",
        type=_seeds,
        default=(),
        metavar="S1,S2,...",
        help="then run the selected configuration with these seeds into OUT/confirm",
    )
    tp.set_defaults(func=cmd_tune)


def _seeds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2, got {text!r}") from None


def cmd_tune(args: argparse.Namespace) -> int:
    """Exit status 1 when a run failed (rerun the command to retry it)."""
    result = tune(
        args.config,
        args.overrides,
        trials=args.trials,
        out=args.out,
        jobs=args.jobs,
        seed=args.seed,
        oracle=args.oracle,
        confirm=args.confirm,
    )
    print(trials_markdown(result), end="")
    if result.selected is None:
        print(f"not every trial finished; rerun the same command to resume ({args.out})")
        return 1
    print(f"selected: trial {result.selected.number}: {' '.join(result.selected.overrides)}")
    print(f"written: {args.out / SELECTED_FILE}, {args.out / 'trials.csv'}")
    failed = [s for s in result.confirm if s.status == "failed"]
    if result.confirm:
        print(f"confirmation runs in {args.out / CONFIRM_DIR}: feddomain report "
              f"{args.out / CONFIRM_DIR}")  # fmt: skip
    return 1 if failed or result.failed else 0
