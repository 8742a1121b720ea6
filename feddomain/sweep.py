"""``feddomain sweep``: a grid of settings x every target split, run in worker processes.

Each run is one (grid point, target split) with its own directory ``OUT/<point>/<split>``,
holding exactly what ``feddomain run`` writes, so any run can also be inspected, resumed
(``feddomain run --resume``) or reported on its own. Running the same command again skips the
finished runs (``summary.json``) and resumes the others from their last checkpoint, through the
same code as ``run --resume``. Workers die with the sweep's parent process (a watchdog thread),
so a sweep killed outright leaves no orphan still writing into a run directory that the rerun
takes over. Progress (runs completed of the total, time per run, ETA: ``feddomain.progress``) is
the live table's title on a terminal and one plain line per ended run otherwise; a rerun first
lists the runs it skips (finished), resumes (checkpoint) and restarts (no checkpoint yet).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from feddomain.config import ExperimentConfig, config_differences, load_config, validate_config
from feddomain.errors import DIVERGED_RECORD, ConfigError, FeddomainError
from feddomain.lifetime import die_with_parent
from feddomain.progress import CampaignProgress, duration

ERROR_LOG = "error.log"  # the traceback of a failed run, in its directory
STYLES = {"queued": "dim", "running": "cyan", "done": "green", "skipped": "green", "failed": "red"}


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``feddomain sweep`` on the CLI's sub-command parser."""
    sw = sub.add_parser(
        "sweep",
        help="a grid of settings x every target split, in parallel worker processes",
        description=(
            "Run CONFIG for every combination of the --grid values and every target split, "
            "each run in OUT/<settings>/<split>. Rerunning the same command skips finished "
            "runs and resumes interrupted ones; a report of OUT is written at the end."
        ),
    )
    sw.add_argument("config", type=Path, help="YAML config")
    sw.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    sw.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=[V1,V2]",
        help="a dotted key and the YAML list of its values, e.g. 'seed=[0,1,2]' (repeatable)",
    )
    workers = sw.add_mutually_exclusive_group()
    workers.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    workers.add_argument(
        "--jobs-per-gpu",
        type=int,
        default=None,
        metavar="K",
        help="K worker processes on every visible GPU, each pinned to its GPU "
        "(CUDA_VISIBLE_DEVICES); the runs' device must be auto or cuda",
    )
    sw.add_argument("--out", type=Path, required=True, help="sweep directory (new or to resume)")
    sw.add_argument("--quiet", action="store_true", help="no live table")
    sw.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Exit status 1 when a run failed (the others still ran), 130 when interrupted."""
    from feddomain.api import sweep

    grid = dict(parse_grid(text) for text in args.grid)
    if len(grid) != len(args.grid):
        raise ConfigError(f"--grid names a key twice: {[parse_grid(t)[0] for t in args.grid]}")
    console = Console(stderr=True)
    try:
        result = sweep(
            args.config,
            *args.overrides,
            grid=grid,
            out=args.out,
            jobs=args.jobs,
            jobs_per_gpu=args.jobs_per_gpu,
            live=not args.quiet,
        )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: rerun the same command to resume the sweep")
        return 130
    for s in result.failed:
        console.print(f"[red]failed[/] {escape(s.run.name)}: {escape(s.error or '')}")
    if not args.quiet:
        console.print(_table(result.states))
    if result.report is None:
        console.print("no run finished, so no report")
    else:
        print(result.report.to_markdown())
        console.print(f"report (CSV and plots) written to {args.out / 'report'}")
    return 1 if result.failed else 0


def gpu_slots(per_gpu: int, runs: list[SweepRun]) -> list[str]:
    """``per_gpu`` worker slots on every visible GPU: the ``CUDA_VISIBLE_DEVICES`` value each
    worker is pinned to. Refused without CUDA, and for runs whose device names another place
    (``cpu``, or ``cuda:N``, which a worker that sees one GPU does not have)."""
    import torch

    if per_gpu < 1:
        raise ConfigError(f"--jobs-per-gpu must be at least 1, got {per_gpu}")
    for run in runs:
        device = run.config.get("device", "auto")
        if device not in ("auto", "cuda"):
            raise ConfigError(
                f"--jobs-per-gpu pins every run to a GPU, but run {run.name} has device "
                f"{device!r}; set device to auto or cuda (or use --jobs)"
            )
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(
            "--jobs-per-gpu needs a CUDA device and none is visible here; use --jobs N on CPU"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [i.strip() for i in visible.split(",")][:count] if visible else list(map(str, range(count)))
    )
    return [gpu for gpu in ids for _ in range(per_gpu)]


# ----------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class SweepRun:
    """One (grid point, target split): its directory and its full resolved config."""

    name: str  # the directory relative to the sweep's, e.g. "algorithm=fedprox,seed=0/lodo-grey"
    out: Path
    config: dict[str, Any]  # ExperimentConfig.to_dict(), what the worker validates and runs


def parse_grid(text: str) -> tuple[str, list[Any]]:
    """``'seed=[0,1,2]'`` -> ``("seed", [0, 1, 2])``; the values are a YAML list."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--grid {text!r} must look like KEY=[V1,V2] (e.g. seed=[0,1,2])")
    try:
        parsed = yaml.safe_load(values)
    except yaml.YAMLError as err:
        raise ConfigError(f"--grid {text!r}: the values are not a YAML list ({err})") from None
    if not isinstance(parsed, list) or not parsed:
        raise ConfigError(
            f"--grid {text!r}: the values must be a non-empty list like {key}=[a,b], got {parsed!r}"
        )
    return key, parsed


def plan(
    config: Path, overrides: list[str], grid: list[tuple[str, list[Any]]], out: Path
) -> list[SweepRun]:
    """Every run of the sweep in order (grid points in the order given, then targets); each
    config is validated now, so a bad combination fails before any training, and a run
    directory left by a sweep with other settings is refused."""
    keys = [key for key, _ in grid]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--grid names a key twice: {keys}")
    runs = []
    for values in itertools.product(*(vals for _, vals in grid)):
        point = [f"{k}={yaml_text(v)}" for k, v in zip(keys, values, strict=True)]
        cfg = _load(config, [*overrides, *point], point)
        for target in split_targets(cfg):
            items = [*overrides, *point]
            if target is not None:
                items.append(f"split.targets=[{yaml_text(target)}]")
            parts = run_parts(point, target)
            name = "/".join(parts)
            run_cfg = _load(config, items, point).to_dict()
            runs.append(SweepRun(name or ".", out.joinpath(*parts), run_cfg))
    _check_distinct(runs)
    for run in runs:
        _check_saved(run)
    return runs


def run_parts(point: list[str], target: str | None) -> list[str]:
    """A run's directory below the sweep's: its grid point, then its target split."""
    return [p for p in (slug(",".join(point)), target and f"lodo-{slug(target)}") if p]


def yaml_text(value: Any) -> str:
    """``value`` as YAML flow text that reads back as the same value (``1.0e-05``, not the
    string ``1e-05``), for an override."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").strip()


def split_targets(cfg: ExperimentConfig) -> list[str | None]:
    """The target domain of each split ``feddomain run`` would run (leave-one-domain-out: one
    per target); ``[None]`` for a config with a single split (a scheme, or sites)."""
    if cfg.split.scheme != "lodo" or cfg.partition.name == "sites":
        return [None]
    if cfg.split.targets is not None:
        return list(cfg.split.targets)
    from feddomain.data.federated import load_experiment_dataset
    from feddomain.data.sources import get_spec

    domains = get_spec(cfg.dataset.name).domains
    return list(domains or load_experiment_dataset(cfg).domains)


def _load(config: Path, items: list[str], point: list[str]) -> ExperimentConfig:
    try:
        return load_config(config, items)
    except ConfigError as err:
        raise ConfigError(f"grid point {', '.join(point) or '(none)'}: {err}") from None


def slug(text: str) -> str:
    """A directory name: spaces dropped, characters other than letters, digits and
    ``._+-=,:[]{}`` replaced by ``_`` (a path separator above all)."""
    return re.sub(r"[^A-Za-z0-9._+\-=,:\[\]{}]", "_", text.replace(" ", ""))


def _check_distinct(runs: list[SweepRun]) -> None:
    seen: dict[Path, SweepRun] = {}
    for run in runs:
        if run.out in seen:
            raise ConfigError(
                f"two runs of the sweep would share the directory {run.out} "
                f"(grid values that differ only in characters a directory name cannot hold)"
            )
        seen[run.out] = run


def _check_saved(run: SweepRun) -> None:
    """Refuse a run directory whose saved config is not this run's (an earlier sweep with other
    settings in the same --out): resuming it would mix two experiments."""
    saved = run.out / "config.yaml"
    if not saved.is_file():
        return
    differences = config_differences(load_config(saved).to_dict(), run.config)
    if differences:
        raise FeddomainError(
            f"{saved} holds other settings than this sweep gives run {run.name} (saved vs "
            f"this sweep): {'; '.join(differences)}; choose a new --out, or delete {run.out} "
            "to redo it"
        )


# ------------------------------------------------------------------------------ running
@dataclass
class RunState:
    """What the parent knows of one run, for the live table and the final account."""

    run: SweepRun
    status: str = "queued"  # queued | running | done | skipped (done earlier) | failed
    found: str = "new"  # what this session found: new | finished | checkpoint | started
    started: float | None = None
    seconds: float | None = None  # wall time of this session's attempt
    result: dict[str, Any] = field(default_factory=dict)  # ood_acc, id_acc of the summary
    error: str | None = None
    pid: int | None = None  # the worker running it


def run_sweep(
    runs: list[SweepRun],
    jobs: int,
    console: Console | None = None,
    gpus: list[str] | None = None,
    on_settle: Callable[[RunState], None] | None = None,
) -> list[RunState]:
    """Run every unfinished run in ``jobs`` worker processes; a failed run is recorded with its
    error and the others go on. With a ``console``, a live table shows every run's state. With
    ``gpus`` (one ``CUDA_VISIBLE_DEVICES`` value per worker, ``gpu_slots``), worker i sees only
    GPU ``gpus[i]``. ``on_settle(state)`` is called in the parent as each run of this session
    ends (done or failed), e.g. for ``feddomain tune`` to close a trial once its runs are in."""
    states = [RunState(r, found=found(r.out)) for r in runs]
    progress = CampaignProgress(len(states), jobs=jobs)
    for s in states:
        if s.found == "finished":
            s.status, s.result = "skipped", _headline(s.run.out)
            progress.skip()
        elif s.found == "diverged":
            record = json.loads((s.run.out / DIVERGED_RECORD).read_text())
            s.status, s.error = "skipped", f"diverged earlier: {record['message']}"
            progress.skip()
    if console is not None and any(s.found != "new" for s in states):
        console.print(rerun_account(states), highlight=False)
    todo = [s for s in states if s.status == "queued"]
    if jobs > 1:
        _fill_caches([s.run.config for s in todo])
    with _live(states, progress, console) as refresh:
        while todo:  # a pool whose worker died is replaced; runs it had not started go again
            _pool_pass(todo, jobs, refresh, gpus or [], progress, on_settle)
            todo = [s for s in todo if s.status == "queued"]
    return states


def _cache_inputs(config: dict[str, Any]) -> str:
    """What a run's feature-cache entry depends on (data, model and its seeded weights, input
    normalisation), as a key: runs that differ elsewhere (lr, method, target) share it."""
    train = config.get("train", {})
    inputs = [config.get("dataset"), config.get("model"), config.get("seed"),
              train.get("mean"), train.get("std")]  # fmt: skip
    return json.dumps(inputs, sort_keys=True, default=str)


def _fill_caches(configs: list[dict[str, Any]]) -> None:
    """Fill the feature cache once per distinct input of the runs about to start, here, before
    the workers: parallel workers would each compute the same 10-30 minute pass at once."""
    import torch  # late: `feddomain sweep --help` need not load it

    from feddomain.data.federated import fill_feature_cache

    for key in dict.fromkeys(_cache_inputs(c) for c in configs):
        cfg = validate_config(next(c for c in configs if _cache_inputs(c) == key))
        torch.set_num_threads(cfg.torch_threads)
        fill_feature_cache(cfg)


def found(run_dir: Path) -> str:
    """What a run's directory holds from an earlier session: ``finished`` (summary.json),
    ``diverged`` (its model diverged before any evaluation: an outcome, not rerun),
    ``checkpoint`` (resumed from it), ``started`` (rounds but no checkpoint yet: restarted from
    round 1) or ``new``."""
    if (run_dir / "summary.json").is_file():
        return "finished"
    if (run_dir / DIVERGED_RECORD).is_file():
        return "diverged"
    if (run_dir / "checkpoint.pt").is_file():
        return "checkpoint"
    if any((run_dir / name).is_file() for name in ("rounds.jsonl", "metrics.jsonl")):
        return "started"
    return "new"


FOUND = {
    "finished": "skipped (finished)",
    "checkpoint": "resumed (from a checkpoint)",
    "started": "restarted (no checkpoint yet)",
}


def rerun_account(states: list[RunState]) -> str:
    """One line per kind of run a rerun found, naming the runs: what it skips, resumes and
    restarts, so a rerun's work is no surprise."""
    lines = [f"this --out holds an earlier session of the sweep ({len(states)} runs):"]
    for kind, what in FOUND.items():
        names = [s.run.name for s in states if s.found == kind]
        if names:
            lines.append(f"  {len(names)} {what}: {', '.join(names)}")
    new = sum(s.found == "new" for s in states)
    if new:
        lines.append(f"  {new} not started yet")
    return "\n".join(lines)


def _pool_pass(
    todo: list[RunState],
    jobs: int,
    refresh: Callable[[RunState | None], None],
    gpus: list[str],
    progress: CampaignProgress,
    on_settle: Callable[[RunState], None] | None = None,
) -> None:
    """Submit ``todo`` to a fresh pool and settle each run as its future completes."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a parent holding torch's threads
    events, slots = ctx.Queue(), ctx.Queue()
    for gpu in gpus:  # each worker takes one as it starts
        slots.put(gpu)
    by_name = {s.run.name: s for s in todo}
    init = (os.getpid(), events, slots if gpus else None)
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=init) as pool:
        futures = {pool.submit(execute, s.run.config, str(s.run.out), s.run.name): s for s in todo}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                _drain(events, by_name, progress)
                for fut in done:
                    state = futures[fut]
                    if _settle(fut, state):
                        progress.finish(state.run.name, failed=state.status == "failed")
                        refresh(state)
                        if on_settle is not None:
                            on_settle(state)
                refresh(None)
        except BaseException:  # Ctrl-C, or a fault of the parent: stop now, not after every run
            pool.shutdown(wait=False, cancel_futures=True)
            for s in todo:
                if s.status == "running" and s.pid is not None:
                    os.kill(s.pid, signal.SIGKILL)  # the rerun resumes it
            raise


def _drain(events: Any, by_name: dict[str, RunState], progress: CampaignProgress) -> None:
    """Mark the runs whose workers reported a start as running."""
    while not events.empty():
        name, pid = events.get()
        state = by_name[name]
        state.status, state.pid, state.started = "running", pid, time.time()
        progress.start(name)


def _settle(fut: Future, state: RunState) -> bool:
    """Record how ``state``'s run ended; False when it did not (its pool broke before it
    started: it goes to the next pool)."""
    err = fut.exception()
    if state.started is not None:
        state.seconds = time.time() - state.started
    if err is None:
        state.status, state.result = "done", fut.result()
    elif isinstance(err, BrokenProcessPool):
        if state.status == "running":  # its worker died under it (killed, out of memory)
            state.status, state.error = "failed", "its worker process died (killed or crashed)"
    else:
        state.status, state.error = "failed", f"{type(err).__name__}: {err}"
    return state.status in ("done", "failed")


# ------------------------------------------------------------------------------- worker
_events: Any = None  # the worker's queue of start events to the parent


def _init_worker(parent: int, events: Any, slots: Any = None) -> None:
    """Per worker process: report starts on ``events``; take a GPU from ``slots`` and see only
    it (before CUDA is initialised, so ``cuda`` means that GPU for every run of the worker);
    leave Ctrl-C to the parent (which kills running workers itself); exit as soon as the parent
    is gone."""
    from feddomain.federation.device import CUBLAS_WORKSPACE

    global _events
    _events = events
    if slots is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = slots.get()
    # read once per process, at the first cuBLAS call: a worker may run a deterministic run
    # after another (apply_determinism sets it too late there); harmless for the others
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """The watch where the kernel has none (off Linux), and for a parent that died before
    ``die_with_parent``: exit within 0.1 s of being re-parented."""
    while os.getppid() == parent:
        time.sleep(0.1)
    os._exit(1)


def execute(config: dict[str, Any], out: str, name: str) -> dict[str, Any]:
    """Run (or resume) one run in this worker, exactly as ``feddomain run`` would; returns
    its headline numbers. A failure leaves its traceback in ``error.log`` beside the run."""
    _events.put((name, os.getpid()))
    from feddomain.api import run_experiment
    from feddomain.config import validate_config

    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ERROR_LOG).unlink(missing_ok=True)
    try:
        cfg = validate_config(config, source=name)
        tracked = None if name == "." else f"{cfg.name}/{name}"  # each run its own tracked run
        run_experiment(cfg, run_dir, quiet=True, resume=True, tracking_name=tracked)
    except Exception:
        (run_dir / ERROR_LOG).write_text(traceback.format_exc())
        raise
    return _headline(run_dir)


def _headline(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: summary.get(k) for k in ("ood_acc", "id_acc")}


# ------------------------------------------------------------------------------ display
@contextmanager
def _live(
    states: list[RunState], progress: CampaignProgress, console: Console | None
) -> Iterator[Callable[[RunState | None], None]]:
    """Yield a callback called with each run that ends, and with None between: on a terminal
    it redraws the live table (the campaign's progress in its title); otherwise (a batch job,
    CI, a redirect) it prints one plain line per ended run; nothing without a console."""
    if console is None:
        yield lambda ended: None
        return
    if not console.is_terminal:
        yield lambda ended: ended and console.print(_ended_line(ended, progress), highlight=False)
        return
    with Live(
        _table(states, progress), console=console, refresh_per_second=4, transient=True
    ) as live:
        yield lambda ended: live.update(_table(states, progress))


def _ended_line(state: RunState, progress: CampaignProgress) -> str:
    """``'sweep 3/8, 41 s per run, ETA 3 min 25 s: seed=1/lodo-grey done in 40 s (ood 45.1%,
    id 91.0%)'``, the plain-log counterpart of the live table."""
    if state.status == "done":
        scores = ", ".join(
            f"{key} {_pct(state.result.get(f'{key}_acc'))}%"
            for key in ("ood", "id")
            if state.result.get(f"{key}_acc") is not None
        )
        what = f"done in {duration(state.seconds or 0.0)}" + (f" ({scores})" if scores else "")
    else:
        what = f"failed after {duration(state.seconds or 0.0)}: {state.error}"
    return f"{progress.headline()}: {state.run.name} {what}"


def _table(states: list[RunState], progress: CampaignProgress | None = None) -> Table:
    counts = {k: sum(s.status == k for s in states) for k in STYLES}
    title = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    if progress is not None:
        title = f"{title}; {progress.headline()}"
    table = Table(title=f"sweep: {title}", title_justify="left")
    for col in ("run", "status", "round", "ood acc (%)", "id acc (%)", "time", "error"):
        table.add_column(col, overflow="fold")
    for s in states:
        table.add_row(
            escape(s.run.name),
            f"[{STYLES[s.status]}]{s.status}[/]",
            _round(s),
            _pct(s.result.get("ood_acc")),
            _pct(s.result.get("id_acc")),
            _elapsed(s),
            escape(s.error or ""),
        )
    return table


def _round(state: RunState) -> str:
    """The last evaluated round of a running run (from its metrics.jsonl) out of its rounds."""
    if state.status != "running":
        return ""
    metrics = state.run.out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    try:
        last = json.loads(lines[-1])["round"] if lines else 0
    except json.JSONDecodeError:  # a line being written
        last = "?"
    return f"{last}/{state.run.config['rounds']}"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}"


def _elapsed(state: RunState) -> str:
    if state.seconds is not None:
        return f"{state.seconds:.0f}s"
    return f"{time.time() - state.started:.0f}s" if state.started is not None else ""
