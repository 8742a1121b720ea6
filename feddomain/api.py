"""The Python API: load a config, run it, sweep a grid, report; what the CLI does, as functions.

``feddomain run|sweep|report`` are thin layers over these functions, so a notebook and the
command line share one code path (the same checks, the same files in the run directories)::

    cfg = feddomain.load_config("configs/demo.yaml", "split.targets=[grey]", rounds=4)
    result = feddomain.run(cfg, out="runs/demo-fedavg")
    result.runs[0].summary["ood_acc"], result.runs[0].selected_round

Results are read back from the files a run writes (``summary.json``, ``metrics.jsonl``,
``rounds.jsonl``), so ``FinishedRun.load(run_dir)`` gives the same object for a run made earlier
or by the CLI.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

import feddomain
from feddomain import config as config_module
from feddomain.config import ExperimentConfig
from feddomain.errors import FeddomainError, Interrupted

if TYPE_CHECKING:
    from feddomain.evaluation.report import Report
    from feddomain.federation.simulation import Simulation
    from feddomain.sweep import RunState

PathLike = str | os.PathLike[str]
PROJECT_ROOT = Path(feddomain.__file__).resolve().parents[1]
log = logging.getLogger("feddomain")


# --------------------------------------------------------------------------- configs
def load_config(
    path: PathLike | None = None, *overrides: str, **values: Any
) -> ExperimentConfig:
    """A validated experiment config: the YAML file at ``path`` (None: the defaults), then the
    dotted ``overrides`` as on the command line (``"algorithm.mu=0.1"``), then keyword
    ``values`` (``rounds=4``, ``train={"lr": 0.01}``: a mapping sets the keys it names inside
    that section, as the dotted form does)."""
    items = [*overrides, *_dotted(values)]
    return config_module.load_config(
        None if path is None else Path(path), items, origin="the arguments of load_config"
    )


def _dotted(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Keyword overrides as dotted ``key=value`` items (values as YAML flow text); an empty
    mapping sets the key itself (``model={"options": {}}`` clears the options)."""
    from feddomain.sweep import yaml_text  # late: the sweep module is not needed otherwise

    items = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            items += _dotted(value, prefix=f"{name}.")
        else:
            items.append(f"{name}={yaml_text(_plain(value))}")
    return items


def _plain(value: Any) -> Any:
    """Paths as strings and tuples as lists, so that YAML writes them as it reads them back."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class FinishedRun:
    """One finished run (one split of a config), as read from its directory."""

    run_dir: Path
    summary: dict[str, Any]  # summary.json: headline numbers at the selected round, bytes, time
    records: list[dict[str, Any]]  # metrics.jsonl: every evaluated round
    rounds: list[dict[str, Any]]  # rounds.jsonl: every round (phase times, bytes, losses)

    @classmethod
    def load(cls, run_dir: PathLike) -> FinishedRun:
        """Read a finished run directory (one holding ``summary.json``)."""
        run_dir = Path(run_dir)
        summary_file = run_dir / "summary.json"
        if not summary_file.is_file():
            raise FeddomainError(f"{run_dir} holds no finished run (no summary.json)")
        return cls(
            run_dir,
            json.loads(summary_file.read_text()),
            _read_jsonl(run_dir / "metrics.jsonl"),
            _read_jsonl(run_dir / "rounds.jsonl"),
        )

    @property
    def selected_round(self) -> int:
        """The evaluated round the run reports (``eval.selection``)."""
        return int(self.summary["selected_round"])

    @property
    def selected(self) -> dict[str, Any]:
        """The metrics record of the selected round."""
        return next(r for r in self.records if r["round"] == self.selected_round)

    @property
    def id_acc(self) -> float | None:
        """In-domain accuracy at the selected round (None without validation data)."""
        return self.summary.get("id_acc")

    @property
    def ood_acc(self) -> float | None:
        """Unseen-domain accuracy at the selected round."""
        return self.summary.get("ood_acc")


@dataclass(frozen=True)
class ExperimentResult:
    """What ``run`` made: one ``FinishedRun`` per split of the config, in order."""

    out: Path
    runs: list[FinishedRun]

    @property
    def run_dirs(self) -> list[Path]:
        return [r.run_dir for r in self.runs]

    def __iter__(self) -> Iterator[FinishedRun]:
        return iter(self.runs)

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, index: int) -> FinishedRun:
        return self.runs[index]


@dataclass(frozen=True)
class SweepResult:
    """What ``sweep`` made: every run's final state (done, skipped as done before, failed) and
    the report over the finished ones (None when none finished)."""

    out: Path
    states: list[RunState]
    report: Report | None

    @property
    def failed(self) -> list[RunState]:
        return [s for s in self.states if s.status == "failed"]

    @property
    def finished(self) -> list[FinishedRun]:
        return [FinishedRun.load(s.run.out) for s in self.states if s.status in _FINISHED]


_FINISHED = ("done", "skipped")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------- run
def run(
    cfg: ExperimentConfig | PathLike | None = None,
    out: PathLike | None = None,
    *,
    resume: bool = False,
    quiet: bool = False,
) -> ExperimentResult:
    """Run every split of ``cfg`` (a config, or a YAML path) into the new directory ``out``;
    with ``resume`` continue the run in ``out`` (``cfg`` may then be omitted: the saved config
    is used; given, it must equal the saved one). ``quiet``: no per-round progress."""
    if out is None:
        raise FeddomainError("feddomain run needs CONFIG and --out DIR (or --resume DIR)")
    out = Path(out)
    if cfg is not None and not isinstance(cfg, ExperimentConfig):
        cfg = load_config(cfg)
    if resume:
        cfg = _resumed_config(out, cfg)
    elif cfg is None:
        raise FeddomainError("feddomain run needs CONFIG and --out DIR (or --resume DIR)")
    elif out.exists() and any(out.iterdir()):
        raise FeddomainError(
            f"output directory {out} already holds files; choose a new --out, or continue "
            f"it with --resume {out}"
        )
    run_dirs = run_experiment(cfg, out, quiet=quiet, resume=resume)
    return ExperimentResult(out, [FinishedRun.load(d) for d in run_dirs])


def rescore(source: PathLike, out: PathLike, *overrides: str) -> ExperimentResult:
    """Score the finished run ``source`` (one split, or one directory per split) again into the
    new directory ``out``, from the states it kept (``checkpoint.keep_evaluated``), under
    ``overrides`` that act only at evaluation (FedFD's test_mode, hFedF's ood_model, FedSR's
    eval_z, eval.selection; ``feddomain.rescore``): the run training with them would write,
    without the training."""
    from feddomain.rescore import rescored_config

    source, out = Path(source), Path(out)
    cfg = rescored_config(source, overrides)
    if out.exists() and any(out.iterdir()):
        raise FeddomainError(f"output directory {out} already holds files; choose a new --out")
    existed = out.exists()
    try:
        run_dirs = _rescore_splits(cfg, source, out)
    except BaseException:  # a half-written rescore is worth nothing: the same --out works again
        _undo_start(out, existed)
        raise
    return ExperimentResult(out, [FinishedRun.load(d) for d in run_dirs])


def _rescore_splits(cfg: ExperimentConfig, source: Path, out: Path) -> list[Path]:
    """Each split of ``source`` rescored into ``out``'s matching directory; every source is
    checked before anything is written."""
    import torch

    from feddomain.data.federated import federations
    from feddomain.federation.simulation import Simulation
    from feddomain.rescore import check_device, check_source
    from feddomain.tracking import open_tracker

    torch.set_num_threads(cfg.torch_threads)
    feds = federations(cfg)
    one = len(feds) == 1
    runs = [
        (fed, source if one else source / fed.split.name, out if one else out / fed.split.name)
        for fed in feds
    ]
    for _, run_source, _ in runs:
        check_source(run_source)
        check_device(run_source, cfg)
    out.mkdir(parents=True, exist_ok=True)
    _write_config(out, cfg, rescored_from=source)
    for fed, run_source, run_dir in runs:
        if run_dir != out:
            run_dir.mkdir()
            _write_config(run_dir, cfg, rescored_from=run_source)
        tracker = open_tracker(cfg, _default_run_name(cfg, fed.split.name), run_dir)
        try:
            summary = Simulation(cfg, fed, run_dir, on_round=tracker.log_round).rescore(run_source)
        except BaseException:
            tracker.close("FAILED")
            raise
        tracker.log_summary(summary)
        tracker.close("FINISHED")
        label = f"{cfg.algorithm.label or cfg.algorithm.name} {fed.split.name}"
        print(
            f"{label}: {_scores(summary)}  ({summary['selection']}, round "
            f"{summary['selected_round']})  {summary['wall_time_s']:.1f}s, rescored from "
            f"{run_source}  -> {run_dir}",
            flush=True,
        )
    return [run_dir for _, _, run_dir in runs]


def _resumed_config(out: Path, wanted: ExperimentConfig | None) -> ExperimentConfig:
    """The config saved in ``out``, or ``wanted``, which may differ from it only by a larger
    ``rounds`` (extending a finished run: ``feddomain.resume``)."""
    from feddomain.resume import resumed_config

    return resumed_config(out, wanted)


def run_experiment(
    cfg: ExperimentConfig,
    out: Path,
    *,
    quiet: bool = False,
    resume: bool = False,
    simulation: type[Simulation] | None = None,
    tracking_name: str | None = None,
) -> list[Path]:
    """Run every split of ``cfg`` into ``out`` (one sub-directory per split when there are
    several); returns the run directories. Data problems surface before any training, and a
    new run that fails before its first round leaves no directory behind. ``simulation``: a
    subclass of the simulator that records more (benchmarks scoring extra evaluations).
    ``tracking_name``: the name the tracking backends give the run (a sweep's run name);
    default: the experiment, method, seed and split."""
    existed = out.exists()
    try:
        return _run_splits(
            cfg, out, quiet=quiet, resume=resume, simulation=simulation, name=tracking_name
        )
    except FeddomainError:
        if not resume and not _has_rounds(out):
            _undo_start(out, existed)
        raise


def _run_splits(
    cfg: ExperimentConfig,
    out: Path,
    *,
    quiet: bool,
    resume: bool,
    simulation: type[Simulation] | None = None,
    name: str | None = None,
) -> list[Path]:
    import torch

    from feddomain.data.federated import federations
    from feddomain.federation import checkpoint
    from feddomain.federation.simulation import Simulation
    from feddomain.tracking import open_tracker

    simulation = simulation or Simulation

    torch.set_num_threads(cfg.torch_threads)
    feds = federations(cfg)
    out.mkdir(parents=True, exist_ok=True)
    split_dirs = [out if len(feds) == 1 else out / fed.split.name for fed in feds]
    if not resume or any(not (d / "summary.json").exists() for d in split_dirs):
        begun = any((d / name).exists() for d in split_dirs
                    for name in ("summary.json", checkpoint.FILENAME))  # fmt: skip
        _write_config(out, cfg, continues=resume and begun)
    run_dirs = []
    for fed in feds:
        split = fed.split
        run_dir = out if len(feds) == 1 else out / split.name
        run_dirs.append(run_dir)
        if (run_dir / "summary.json").exists():
            if resume:
                log.info("%s already finished", run_dir)
                continue
            raise FeddomainError(f"{run_dir} already holds a finished run")
        run_dir.mkdir(parents=True, exist_ok=True)
        if run_dir != out:
            begun = (run_dir / checkpoint.FILENAME).exists()
            _write_config(run_dir, cfg, continues=resume and begun)
        label = f"{cfg.algorithm.label or cfg.algorithm.name} {split.name}"
        run_name = f"{name}/{split.name}" if name and len(feds) > 1 else name
        tracker = open_tracker(cfg, run_name or _default_run_name(cfg, split.name), run_dir)
        try:
            with _progress(quiet, label, cfg.rounds) as tick:
                sim = simulation(cfg, fed, run_dir, progress=tick, on_round=tracker.log_round)
                summary = sim.run()
        except KeyboardInterrupt:
            tracker.close("KILLED")
            raise Interrupted(_interrupted(cfg, out, run_dir)) from None
        except BaseException:
            tracker.close("FAILED")
            raise
        tracker.log_summary(summary)
        tracker.close("FINISHED")
        print(
            f"{label}: {_scores(summary)}  ({summary['selection']}, round "
            f"{summary['selected_round']})  {summary['wall_time_s']:.1f}s  -> {run_dir}",
            flush=True,
        )
    return run_dirs


def _default_run_name(cfg: ExperimentConfig, split: str) -> str:
    """How tracking names a run outside a sweep: experiment / method / seed / split."""
    return f"{cfg.name}/{cfg.algorithm.label or cfg.algorithm.name}/seed{cfg.seed}/{split}"


def _scores(record: dict) -> str:
    """'id 91.2%  ood 45.3%', in the report tables' unit (id '-' when the clients hold no
    validation data)."""
    id_acc = "-" if record.get("id_acc") is None else f"{100 * record['id_acc']:.1f}%"
    ood_acc = "-" if record.get("ood_acc") is None else f"{100 * record['ood_acc']:.1f}%"
    return f"id {id_acc}  ood {ood_acc}"


def _interrupted(cfg: ExperimentConfig, out: Path, run_dir: Path) -> str:
    """What a Ctrl-C kept of ``run_dir`` and how to go on."""
    if (run_dir / "checkpoint.pt").exists():
        return f"the last checkpoint in {run_dir} is kept; continue with --resume {out}"
    why = (
        "checkpoints are off (checkpoint.every=0)"
        if not cfg.checkpoint.every
        else f"the first is written after round {cfg.checkpoint.every} (checkpoint.every)"
    )
    return (
        f"nothing was checkpointed yet in {run_dir}: {why}; --resume {out} restarts it from round 1"
    )


def _has_rounds(out: Path) -> bool:
    """Whether any round of a run in ``out`` completed (its log or checkpoint exists)."""
    return out.is_dir() and any(
        next(out.rglob(name), None) for name in ("rounds.jsonl", "checkpoint.pt")
    )


def _undo_start(out: Path, existed: bool) -> None:
    """Remove what a failed start wrote, so the same --out works once the cause is fixed
    (``out`` was new or empty: ``run`` and the demo refuse any other)."""
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return
    for child in out.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _write_config(
    run_dir: Path,
    cfg: ExperimentConfig,
    *,
    continues: bool = False,
    rescored_from: Path | None = None,
) -> None:
    """The resolved config (re-loadable as is) and the provenance of the code that ran it.
    Code that ``continues`` a run from its checkpoint keeps the provenance of the run's start
    and adds its own under ``resumed``; a run restarted from round 1 gets the new one only. A
    rescored run names the run whose states it scored (``rescored_from``)."""
    import torch

    from feddomain.federation.device import describe as describe_device

    provenance = {
        "feddomain_version": feddomain.__version__,
        "git_commit": _git_commit(),
        "torch": str(torch.__version__),
        "python": sys.version.split()[0],
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seed": cfg.seed,
        "device": describe_device(cfg.device),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # a sweep's GPU pinning
        **({"rescored_from": str(rescored_from)} if rescored_from is not None else {}),
    }
    path = run_dir / "provenance.yaml"
    if continues and path.is_file():
        first = yaml.safe_load(path.read_text()) or {}
        provenance = {**first, "resumed": [*first.get("resumed", []), provenance]}
    _write_atomic(path, yaml.safe_dump(provenance, sort_keys=False))
    _write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _git_commit() -> str:
    try:
        res = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "describe", "--always", "--dirty", "--abbrev=40"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return res.stdout.strip() or "unknown"


class _progress:
    """Progress over rounds, yielding a tick callback: a rich bar on a terminal; otherwise (a
    batch job, CI, a redirect, a notebook) one plain line per evaluated round on stderr;
    nothing in quiet mode."""

    def __init__(self, quiet: bool, label: str, total: int) -> None:
        self.quiet, self.label, self.total = quiet, label, total
        self.bar = None
        self.start = time.perf_counter()

    def __enter__(self) -> Callable[[int, dict | None], None] | None:
        if self.quiet:
            return None
        from rich.console import Console

        console = Console(stderr=True)
        if not console.is_terminal:
            return self._line
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total, status="")

        def tick(rnd: int, record: dict | None) -> None:
            status = {"status": _scores(record)} if record else {}
            self.bar.update(task, completed=rnd, **status)

        return tick

    def _line(self, rnd: int, record: dict | None) -> None:
        """One plain line per evaluated round: round, scores, seconds since this session began."""
        if record is not None:
            elapsed = time.perf_counter() - self.start
            print(
                f"{self.label}  round {rnd}/{self.total}  {_scores(record)}  {elapsed:.1f}s",
                file=sys.stderr,
                flush=True,
            )

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


# ----------------------------------------------------------------------------- sweep
def sweep(
    config: PathLike,
    *overrides: str,
    grid: Mapping[str, Sequence[Any]] | None = None,
    out: PathLike,
    jobs: int = 1,
    jobs_per_gpu: int | None = None,
    live: bool = False,
) -> SweepResult:
    """``feddomain sweep``: ``config`` with ``overrides`` for every combination of the ``grid``
    values (``{"seed": [0, 1], "algorithm": ["fedavg", "fedprox"]}``) and every target split,
    each run in ``out/<settings>/<split>``, in ``jobs`` worker processes (or ``jobs_per_gpu``
    on every visible GPU). Rerunning skips finished runs and resumes interrupted ones; a failed
    run is recorded and the others go on. The report over the finished runs is written to
    ``out/report``. ``live``: a live table of the runs on stderr."""
    from feddomain.errors import ConfigError
    from feddomain.sweep import gpu_slots, plan, run_sweep

    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    out = Path(out)
    pairs = [(key, list(values)) for key, values in (grid or {}).items()]
    for key, values in pairs:
        if not values:
            raise ConfigError(f"grid {key!r}: the values must be a non-empty list")
    runs = plan(Path(config), list(overrides), pairs, out)
    gpus = [] if jobs_per_gpu is None else gpu_slots(jobs_per_gpu, runs)
    console = None
    if live:
        from rich.console import Console

        console = Console(stderr=True)
    states = run_sweep(runs, len(gpus) or jobs, console=console, gpus=gpus)
    finished = [s for s in states if s.status in _FINISHED]
    return SweepResult(out, states, report(out, out=out / "report") if finished else None)


# ---------------------------------------------------------------------------- report
def report(
    *dirs: PathLike,
    selection: str = "source_val",
    spread: str = "std",
    metrics: Sequence[str] = (),
    out: PathLike | None = None,
    html: bool = False,
    against: str | None = None,
    claims: PathLike | None = None,
    bootstrap: bool = False,
    plots: bool = True,
) -> Report:
    """``feddomain report``: the method x target tables over the finished runs under ``dirs``
    (``report.to_markdown()``); with ``out``, report.md/.csv/.tex and (``plots``) the plots
    written there (and report.html with ``html``). ``against`` (every other method > it) and
    ``claims`` (a file of "A > B" / "A < B on METRIC" / "A - B > C - D" lines) add paired 95%
    intervals and verdicts (t, or a paired bootstrap)."""
    from feddomain.evaluation.report import build_report, write_html, write_outputs

    if not dirs:
        raise FeddomainError("report needs at least one run directory")
    if html and out is None:
        raise FeddomainError("--html writes report.html into --out DIR; add --out")
    result = build_report(
        [Path(d) for d in dirs],
        selection=selection,
        spread=spread,
        extra_metrics=tuple(metrics),
        against_method=against,
        claims_file=None if claims is None else Path(claims),
        bootstrap=bootstrap,
    )
    if out is not None:
        write_outputs(result, Path(out), plots=plots)
        if html:
            result.files.append(write_html(result, Path(out) / "report.html"))
    return result
