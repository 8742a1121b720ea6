"""Command line: ``feddomain demo | run | sweep | report | data ... | flower``.

Every user-facing failure is a ``FeddomainError`` whose message names the file, key or value at
fault; ``main`` prints it on one line and exits with status 2 instead of a traceback. ``data
describe`` exits with status 1 when it lists problems in the folder (0 when it is clean).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

import feddomain
from feddomain.config import ExperimentConfig, load_config
from feddomain.errors import FeddomainError
from feddomain.federation.flower.commands import add_commands as add_flower_commands
from feddomain.sweep import add_command as add_sweep_command

console = Console(stderr=True)
PROJECT_ROOT = Path(feddomain.__file__).resolve().parents[1]


def _methods_epilog() -> str:
    """Every registered method with its one-line description and citation (algorithm.name)."""
    from feddomain.algorithms import METHODS

    width = max(len(name) for name in METHODS)
    lines = [f"  {name:<{width}}  {spec.description}" for name, spec in sorted(METHODS.items())]
    return "methods (algorithm.name):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    try:
        status = args.func(args)
    except FeddomainError as err:
        # escaped: a message quoting a list ("seed=[0,1]") must not be read as rich markup
        console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the last checkpoint is kept; continue with --resume")
        return 130
    return int(status or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="feddomain", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"feddomain {feddomain.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="FedAvg, Local-only, Central, hFedF on the embedded digits")
    demo.add_argument("--out", type=Path, default=None, help="run directory (default: a temp dir)")
    demo.add_argument("--quiet", action="store_true")
    demo.add_argument("overrides", nargs="*", help="key=value config overrides")
    demo.set_defaults(func=cmd_demo)

    run = sub.add_parser(
        "run",
        help="run one experiment config (all its target splits)",
        description="Run one experiment config (all its target splits).",
        epilog=_methods_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("config", type=Path, nargs="?", help="YAML config (optional with --resume)")
    run.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. rounds=50 algorithm.mu=0.01"
    )
    run.add_argument("--out", type=Path, help="new output directory")
    run.add_argument("--resume", type=Path, metavar="DIR", help="continue an interrupted run")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.set_defaults(func=cmd_run)

    rep = sub.add_parser("report", help="method x target table over run directories")
    rep.add_argument("dirs", type=Path, nargs="+")
    rep.add_argument("--selection", default="source_val", choices=["source_val", "last", "oracle"])
    rep.add_argument("--out", type=Path, default=None, help="where to write CSV and plots")
    rep.set_defaults(func=cmd_report)

    data = sub.add_parser("data", help="inspect datasets and partitions")
    dsub = data.add_subparsers(dest="data_command", required=True)
    desc = dsub.add_parser(
        "describe", help="counts per domain x class, sizes, problems (exit status 1 if any)"
    )
    desc.add_argument("--dataset", required=True)
    desc.add_argument("--root", type=Path, default=None)
    desc.add_argument("--deep", action="store_true", help="decode every image (finds truncation)")
    desc.set_defaults(func=cmd_describe)
    part = dsub.add_parser("partition", help="client x domain (and station x domain) counts")
    part.add_argument("config", type=Path)
    part.add_argument("overrides", nargs="*")
    part.add_argument("--out", type=Path, default=None, help="CSV file to write")
    part.set_defaults(func=cmd_partition)
    exp = dsub.add_parser(
        "export", help="write a config's clients as site folders (rehearse a sites deployment)"
    )
    exp.add_argument("config", type=Path)
    exp.add_argument("overrides", nargs="*")
    exp.add_argument("--out", type=Path, required=True, help="new folder for the sites")
    exp.set_defaults(func=cmd_export)
    add_flower_commands(sub)
    add_sweep_command(sub)
    return p


# ---------------------------------------------------------------------------- run
def cmd_run(args: argparse.Namespace) -> None:
    if args.resume is not None:
        out = args.resume
        saved = out / "config.yaml"
        if not saved.is_file():
            raise FeddomainError(f"--resume {out}: no config.yaml there, so nothing to resume")
        cfg = load_config(saved)
        if args.config is not None:
            wanted = load_config(args.config, args.overrides)
            if wanted.to_dict() != cfg.to_dict():
                raise FeddomainError(
                    f"--resume {out}: {args.config} with these overrides differs from the saved "
                    f"{saved}; resume with the saved config (omit CONFIG) or start a new --out"
                )
    else:
        if args.config is None or args.out is None:
            raise FeddomainError("feddomain run needs CONFIG and --out DIR (or --resume DIR)")
        cfg = load_config(args.config, args.overrides)
        out = args.out
        if out.exists() and any(out.iterdir()):
            raise FeddomainError(
                f"output directory {out} already holds files; choose a new --out, or continue "
                f"it with --resume {out}"
            )
    run_experiment(cfg, out, quiet=args.quiet, resume=args.resume is not None)


def run_experiment(
    cfg: ExperimentConfig, out: Path, *, quiet: bool = False, resume: bool = False
) -> list[Path]:
    """Run every split of ``cfg`` into ``out`` (one sub-directory per split when there are
    several); returns the run directories. Data problems surface before any training."""
    import torch

    from feddomain.data.federated import federations
    from feddomain.federation.simulation import Simulation

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    feds = federations(cfg)
    out.mkdir(parents=True, exist_ok=True)
    _write_config(out, cfg)
    run_dirs = []
    for fed in feds:
        split = fed.split
        run_dir = out if len(feds) == 1 else out / split.name
        run_dirs.append(run_dir)
        if (run_dir / "summary.json").exists():
            if resume:
                logging.getLogger("feddomain").info("%s already finished", run_dir)
                continue
            raise FeddomainError(f"{run_dir} already holds a finished run")
        run_dir.mkdir(parents=True, exist_ok=True)
        if run_dir != out:
            _write_config(run_dir, cfg)
        with _progress(
            quiet, f"{cfg.algorithm.label or cfg.algorithm.name} {split.name}", cfg.rounds
        ) as tick:
            sim = Simulation(cfg, fed, run_dir, progress=tick)
            summary = sim.run()
        logging.getLogger("feddomain").info(
            "%s %s: id %.3f  ood %.3f  (%s, round %s)  %.1fs",
            summary["algorithm"],
            split.name,
            summary["id_acc"] or float("nan"),
            summary["ood_acc"],
            summary["selection"],
            summary["selected_round"],
            summary["wall_time_s"],
        )
    return run_dirs


def _write_config(run_dir: Path, cfg: ExperimentConfig) -> None:
    """The resolved config (re-loadable as is) and the provenance of the code that ran it."""
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
    }
    _write_atomic(run_dir / "provenance.yaml", yaml.safe_dump(provenance, sort_keys=False))
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
    """A rich progress bar over rounds (or nothing in quiet mode); yields a tick callback."""

    def __init__(self, quiet: bool, label: str, total: int) -> None:
        self.quiet, self.label, self.total = quiet, label, total

    def __enter__(self):
        if self.quiet:
            return None
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
            status = (
                f"id {record['id_acc'] or 0:.3f} ood {record['ood_acc']:.3f}" if record else None
            )
            self.bar.update(task, completed=rnd, **({"status": status} if status else {}))

        return tick

    def __exit__(self, *exc: object) -> None:
        if not self.quiet:
            self.bar.stop()


# --------------------------------------------------------------------------- demo
DEMO_METHODS = ("fedavg", "local", "central", "hfedf")


def cmd_demo(args: argparse.Namespace) -> None:
    config = PROJECT_ROOT / "configs" / "demo.yaml"
    if not config.is_file():
        raise FeddomainError(f"demo config not found at {config}; run from a clone of feddomain")
    out = args.out or Path(tempfile.mkdtemp(prefix="feddomain-demo-"))
    if out.exists() and any(out.iterdir()):
        raise FeddomainError(f"output directory {out} already holds files; choose a new --out")
    start = time.perf_counter()
    for method in DEMO_METHODS:
        cfg = load_config(config, [f"algorithm={method}", *args.overrides])
        run_experiment(cfg, out / method, quiet=args.quiet)
    from feddomain.evaluation.report import build_report, write_outputs

    report = build_report([out], selection="source_val")
    write_outputs(report, out / "report")
    print(report.to_markdown())
    console.print(f"demo finished in {time.perf_counter() - start:.0f}s; runs and plots in {out}")


# ------------------------------------------------------------------------- report
def cmd_report(args: argparse.Namespace) -> None:
    from feddomain.evaluation.report import build_report, write_outputs

    report = build_report(args.dirs, selection=args.selection)
    out = args.out or args.dirs[0] / "report"
    write_outputs(report, out)
    print(report.to_markdown())
    console.print(f"CSV and plots written to {out}")


# --------------------------------------------------------------------------- data
def cmd_describe(args: argparse.Namespace) -> int:
    """Exit status 1 when the folder has problems, so scripts and CI can gate on it."""
    from feddomain.data.describe import describe, render

    description = describe(args.dataset, args.root, deep=args.deep)
    render(description, console=Console(width=120))
    return 1 if description.problems else 0


def cmd_partition(args: argparse.Namespace) -> None:
    from feddomain.data.federated import federations
    from feddomain.data.partitioners.table import render_tables

    cfg = load_config(args.config, args.overrides)
    for fed in federations(cfg):
        render_tables(fed, console=Console(width=120), csv_path=args.out)


def cmd_export(args: argparse.Namespace) -> None:
    from feddomain.data.export import export_sites

    cfg = load_config(args.config, args.overrides)
    done = export_sites(cfg, args.out)
    console = Console()
    for i, (site, n) in enumerate(zip(done.sites, done.counts, strict=True)):
        console.print(f"client {i}: {n} images in {site}")
    console.print(f"target set: {done.target}\nsites config: {done.config}")
    console.print(
        "one machine:  feddomain run " + str(done.config) + "\n"
        "SuperNode i:  flower-supernode ... --node-config "
        f'\'partition-id=i site-root="{done.sites[0].parent.resolve()}/site<i>" '
        f'target-root="{done.target.resolve()}"\''
    )


if __name__ == "__main__":
    sys.exit(main())
