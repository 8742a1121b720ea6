"""Command line: ``feddomain demo | list | run | sweep | report | data describe | partition |
export | flower``.

Every user-facing failure is a ``FeddomainError`` whose message names the file, key or value at
fault; ``main`` prints it on one line and exits with status 2 instead of a traceback. ``data
describe`` exits with status 1 when it lists problems in the folder (0 when it is clean).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

import feddomain
from feddomain import api
from feddomain.api import run_experiment
from feddomain.config import ExperimentConfig, load_config
from feddomain.errors import FeddomainError, Interrupted
from feddomain.federation.flower.commands import add_commands as add_flower_commands
from feddomain.reproduce import add_command as add_reproduce_command
from feddomain.sweep import add_command as add_sweep_command
from feddomain.tune import add_command as add_tune_command

if TYPE_CHECKING:
    from feddomain.evaluation.report import Report

console = Console(stderr=True)
PROJECT_ROOT = Path(feddomain.__file__).resolve().parents[1]


def _methods_epilog() -> str:
    """Every registered method with its one-line description and citation (algorithm.name)."""
    from feddomain.algorithms import METHODS
    from feddomain.plugins import load_entry_points

    load_entry_points()
    width = max(len(name) for name in METHODS)
    lines = [f"  {name:<{width}}  {spec.description}" for name, spec in sorted(METHODS.items())]
    return "methods (algorithm.name):\n" + "\n".join(lines)


class _HelpWithMethods(argparse.Action):
    """``run --help``: the help text with every registered method appended, listed only when
    asked for, because listing them imports every method (POT, SciPy, torchvision: seconds),
    which ``--version`` and the other commands' help need not wait for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.epilog = _methods_epilog()
        parser.print_help()
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "list":  # the others need them: loaded while Ctrl-C exits at once
        import numpy  # noqa: F401
        import torch  # noqa: F401
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # from here: KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # on a terminal, rich's layout; otherwise (a batch job, CI, a redirect) plain lines
    handler = (
        RichHandler(console=console, show_path=False)
        if console.is_terminal
        else logging.StreamHandler()
    )
    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(message)s",
        handlers=[handler],
    )
    try:
        status = args.func(args)
    except FeddomainError as err:
        # escaped: a message quoting a list ("seed=[0,1]") must not be read as rich markup
        console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        return 2
    except Interrupted as err:
        console.print(f"[yellow]interrupted:[/] {err}", highlight=False, soft_wrap=True)
        return 130
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    return int(status or 0)


EXAMPLES = """examples:
  feddomain demo                                    # 4 methods on the built-in digits (~2 min)
  feddomain list methods                            # also: models, datasets, configs
  feddomain run feddomain:demo algorithm=fedprox split.targets=sketch --out runs/prox
  feddomain run feddomain:demo --dry-run            # a shipped config, from any folder
  feddomain run --resume runs/prox                  # continue an interrupted run
  feddomain run --resume runs/prox rounds=16        # extend a finished run to 16 rounds
  feddomain report runs/prox --out report/ --html   # tables (md, CSV, LaTeX), plots, HTML
  feddomain reproduce hfedf --table 2 --dry-run     # a paper's table and the runs behind it

docs (in the repository): README.md; every config key and method hyper-parameter:
docs/config.md; deploying on Flower: docs/deployment.md"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="feddomain",
        description="Federated domain generalisation: simulate, deploy on Flower, report.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"feddomain {feddomain.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="FedAvg, FedProx, Local, Central on the built-in digits")
    demo.add_argument("--out", type=Path, default=None, help="run directory (default: a temp dir)")
    demo.add_argument("--quiet", action="store_true", help="no per-round progress")
    demo.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. rounds=4")
    demo.set_defaults(func=cmd_demo)

    lst = sub.add_parser("list", help="methods, models, datasets or shipped configs, one line each")
    lst.add_argument("what", choices=LISTS, help="what to list")
    lst.add_argument(
        "--spaces", action="store_true", help="methods: their search spaces (`feddomain tune`)"
    )
    lst.set_defaults(func=cmd_list)

    run = sub.add_parser(
        "run",
        help="run one experiment config (all its target splits)",
        description="Run one experiment config (all its target splits). Every config key: "
        "docs/config.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    run.add_argument(
        "-h", "--help", action=_HelpWithMethods, help="show this help message and exit"
    )
    run.add_argument("config", type=Path, nargs="?", help="YAML config (optional with --resume)")
    run.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. rounds=50 algorithm.mu=0.01"
    )
    run.add_argument("--out", type=Path, help="new output directory (must not hold files)")
    run.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue an interrupted run; with rounds=N (more rounds), extend a finished one",
    )
    run.add_argument(
        "--quiet", action="store_true", help="no per-round progress; the result is still printed"
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and the partition table; train nothing, write nothing",
    )
    run.set_defaults(func=cmd_run)

    res = sub.add_parser(
        "rescore",
        help="score a finished run again under evaluation-only settings, without training",
        description="Score a finished run again from the states it kept "
        "(checkpoint.keep_evaluated=true) under settings that act only at evaluation: a "
        "method's test-time mode or unseen-domain model (FedFD's test_mode, hFedF's ood_model, "
        "FedSR's eval_z) or eval.selection. Any other change is refused by name.",
    )
    res.add_argument("source", type=Path, help="the finished run directory")
    res.add_argument(
        "overrides", nargs="*", help="evaluation-only overrides, e.g. algorithm.test_mode=fixed"
    )
    res.add_argument("--out", type=Path, required=True, help="new output directory")
    res.set_defaults(func=cmd_rescore)

    rep = sub.add_parser("report", help="method x target table over run directories")
    rep.add_argument("dirs", type=Path, nargs="+", help="run directories (searched recursively)")
    rep.add_argument(
        "--selection",
        default="source_val",
        choices=["source_val", "last", "oracle"],
        help="which evaluated round each run reports (default: source_val)",
    )
    rep.add_argument(
        "--spread",
        default="std",
        choices=["std", "se"],
        help="spread over seeds: sample std or standard error of the mean (default: std)",
    )
    rep.add_argument(
        "--metrics",
        nargs="+",
        default=[],
        metavar="METRIC",
        help="extra tables after ood/id accuracy and ECE, at the same selected round: "
        "worst_domain_acc, ood_nll, ood_brier; fairness over clients: worst_client_acc, "
        "client_acc_std (id accuracy), client_ood_std (ood accuracy of each client's own "
        "model: personalised methods), client_loss_var (variance of the clients' training "
        "losses; client_loss_var_last50: its mean over the run's last 50 rounds, whatever the "
        "selected round); hypernetwork diagnostics: grad_cos_pairwise, embedding_l2",
    )
    rep.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for report.md/.csv/.tex and PNG/PDF plots (default: nothing written)",
    )
    rep.add_argument(
        "--html", action="store_true", help="also write report.html (one self-contained page)"
    )
    rep.add_argument(
        "--no-plots",
        action="store_true",
        help="with --out: the tables only, no PNG/PDF plots (the plots are most of the time)",
    )
    rep.add_argument(
        "--against",
        metavar="METHOD",
        help="claims 'M > METHOD' for every other row: paired ood-accuracy difference over "
        "(seed, target) with its 95%% interval and verdict holds / refuted / unresolved",
    )
    rep.add_argument(
        "--claims",
        type=Path,
        metavar="FILE",
        help="claims to test, one per line: 'A > B' (ood accuracy), 'A < B on METRIC' "
        "(e.g. ood_ece, client_acc_std) or on gains, 'A - B > C - D'",
    )
    rep.add_argument(
        "--bootstrap",
        action="store_true",
        help="claims' intervals by paired bootstrap instead of Student's t",
    )
    rep.set_defaults(func=cmd_report)

    data = sub.add_parser("data", help="inspect datasets and partitions")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    desc = dsub.add_parser(
        "describe", help="counts per domain x class, sizes, problems (exit status 1 if any)"
    )
    desc.add_argument("--dataset", required=True, help="dataset name (feddomain list datasets)")
    desc.add_argument("--root", type=Path, default=None, help="folder holding the dataset")
    desc.add_argument("--deep", action="store_true", help="decode every image (finds truncation)")
    desc.set_defaults(func=cmd_describe)
    part = dsub.add_parser("partition", help="client x domain (and station x domain) counts")
    part.add_argument("config", type=Path, help="YAML config")
    part.add_argument("overrides", nargs="*", help="dotted overrides, as for `feddomain run`")
    part.add_argument(
        "--out", type=Path, default=None, help="CSV file to write (every split's tables)"
    )
    part.set_defaults(func=cmd_partition)
    exp = dsub.add_parser(
        "export", help="write a config's clients as site folders (rehearse a sites deployment)"
    )
    exp.add_argument("config", type=Path, help="YAML config")
    exp.add_argument("overrides", nargs="*", help="dotted overrides, as for `feddomain run`")
    exp.add_argument("--out", type=Path, required=True, help="new folder for the sites")
    exp.set_defaults(func=cmd_export)
    ada = sub.add_parser(
        "adapt",
        help="a model for a new site from a FedVR run and its unlabeled images (zero-shot)",
        description="Synthesise a new site's model from a finished FedVR run: the frozen "
        "backbone's mean feature of the site's unlabeled images (the pilot set) goes through the "
        "trained domain encoder and hypernetwork; no labels, no training (fedvr.md §3.6). With "
        "--shots the model is then fine-tuned on a few labelled images (few-shot).",
    )
    ada.add_argument("run", type=Path, help="a finished FedVR run directory (lodo-<target>)")
    ada.add_argument("--pilot", type=Path, help="folder of the site's images (flat or <class>/)")
    ada.add_argument(
        "--shots", type=Path, help="few-shot: folder <class>/<image> of labelled images"
    )
    ada.add_argument(
        "--epochs", type=int, default=None, help="few-shot epochs (default: the run's)"
    )
    ada.add_argument("--resize", action="store_true", help="resize images of another size")
    ada.add_argument("--out", type=Path, required=True, help="model file to write (new)")
    ada.set_defaults(func=cmd_adapt)
    ev = sub.add_parser("evaluate", help="score a model file from `feddomain adapt` on images")
    ev.add_argument("model", type=Path, help="model file written by `feddomain adapt`")
    ev.add_argument("folder", type=Path, help="<class>/<image> (accuracy, ECE) or flat images")
    ev.add_argument("--resize", action="store_true", help="resize images of another size")
    ev.set_defaults(func=cmd_evaluate)
    add_flower_commands(sub)
    add_sweep_command(sub)
    add_tune_command(sub)
    add_reproduce_command(sub)
    return p


def cmd_adapt(args: argparse.Namespace) -> None:
    from feddomain.adapt import adapt

    print(
        adapt(
            args.run,
            args.pilot,
            args.out,
            shots_dir=args.shots,
            epochs=args.epochs,
            resize=args.resize,
        )
    )


def cmd_evaluate(args: argparse.Namespace) -> None:
    from feddomain.adapt import evaluate

    print(evaluate(args.model, args.folder, resize=args.resize))


# --------------------------------------------------------------------------- list
LISTS = ("methods", "models", "datasets", "configs")


def cmd_list(args: argparse.Namespace) -> None:
    """One line per entry: name, then its description (citation included for methods)."""
    from feddomain import catalog

    if args.spaces and args.what != "methods":
        raise FeddomainError(f"--spaces lists the methods' search spaces, not {args.what}")
    rows = catalog.spaces() if args.spaces else getattr(catalog, args.what)()
    width = max(len(name) for name, _ in rows)
    for name, text in rows:
        print(f"{name:<{width}}  {text}")


# ---------------------------------------------------------------------------- run
def cmd_run(args: argparse.Namespace) -> None:
    if args.dry_run and args.resume is None:
        if args.config is None:
            raise FeddomainError("feddomain run --dry-run needs CONFIG")
        dry_run(load_config(args.config, args.overrides))
        return
    config, overrides = args.config, args.overrides
    resume_override = config is not None and "=" in str(config) and not config.exists()
    if args.resume is not None and resume_override:  # `--resume DIR rounds=20`: not a file
        config, overrides = None, [str(config), *overrides]
    if args.resume is not None and config is None and overrides:
        config = args.resume / "config.yaml"  # the saved config with these overrides
    cfg = None if config is None else load_config(config, overrides)
    out = args.resume if args.resume is not None else args.out
    api.run(cfg, out, resume=args.resume is not None, quiet=args.quiet)


def cmd_rescore(args: argparse.Namespace) -> None:
    api.rescore(args.source, args.out, *args.overrides)


def dry_run(cfg: ExperimentConfig) -> None:
    """The resolved config (as a run would save it) and each split's partition table: what a
    run would do, checked against the data, without training or writing anything."""
    from feddomain.data.federated import federations
    from feddomain.data.partitioners.table import render_tables

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="", flush=True)
    for fed in federations(cfg):
        render_tables(fed, console=Console(width=120))
    print(
        f"dry run: {cfg.rounds} rounds x {cfg.train.local_epochs} local epoch(s); nothing trained"
    )


# --------------------------------------------------------------------------- demo
DEMO_METHODS = ("fedavg", "fedprox", "local", "central")
DEMO_STORY = (
    "feddomain demo: 4 domains of the same digits (grey, mnistm, inverted, sketch); 3 clients "
    "each hold one source domain, and each domain is held out in turn as the unseen target. "
    "Local-only never combines clients; FedAvg and FedProx federate; Central pools all source "
    "data (the non-private reference). mnistm, the one textured domain, stays the hardest target."
)


def cmd_demo(args: argparse.Namespace) -> None:
    config = Path("feddomain:demo")
    out = args.out or Path(tempfile.mkdtemp(prefix="feddomain-demo-"))
    if out.exists() and any(out.iterdir()):
        raise FeddomainError(f"output directory {out} already holds files; choose a new --out")
    start = time.perf_counter()
    print(DEMO_STORY, flush=True)
    for method in DEMO_METHODS:
        cfg = load_config(config, [f"algorithm={method}", *args.overrides])
        run_experiment(cfg, out / method, quiet=args.quiet)
    from feddomain.evaluation.report import build_report, write_html, write_outputs

    report = build_report([out], selection="source_val")
    write_outputs(report, out / "report")
    page = write_html(report, out / "report" / "report.html")
    print(report.to_markdown())
    for note in below_chance_notes(report, n_classes=10):
        print(note)
    print(
        f"demo finished in {time.perf_counter() - start:.0f}s; runs in {out}\n"
        f"report: {out / 'report' / 'report.md'}\nopen in a browser: {page}",
        flush=True,
    )


def below_chance_notes(report: Report, n_classes: int) -> list[str]:
    """A note for each target where every method's ood accuracy is below chance, asking for a
    report: the demo's domains and model keep every target above it, so a first table that
    looks like a bug says so."""
    chance = 1 / n_classes
    notes = []
    for target in sorted({g.target for g in report.groups}):
        best = max(g.stats["ood_acc"].mean for g in report.groups if g.target == target)
        if best < chance:
            notes.append(
                f"note: on target {target} every method is below chance ({100 * chance:.0f}%): "
                "not expected; please report it as an issue."
            )
    return notes


# ------------------------------------------------------------------------- report
def cmd_report(args: argparse.Namespace) -> None:
    report = api.report(
        *args.dirs,
        selection=args.selection,
        spread=args.spread,
        metrics=args.metrics,
        out=args.out,
        html=args.html,
        against=args.against,
        claims=args.claims,
        bootstrap=args.bootstrap,
        plots=not args.no_plots,
    )
    print(report.to_markdown())
    if args.out is None:  # a run directory is the run's record: nothing is added unasked
        console.print("no files written; add --out DIR for CSV, LaTeX, plots (and --html)")
        return
    if args.html:
        console.print(f"HTML report: {args.out / 'report.html'}")
    console.print(f"tables{'' if args.no_plots else ' and plots'} written to {args.out}")


# --------------------------------------------------------------------------- data
def cmd_describe(args: argparse.Namespace) -> int:
    """Exit status 1 when the folder has problems, so scripts and CI can gate on it."""
    from feddomain.data.describe import describe, render

    description = describe(args.dataset, args.root, deep=args.deep)
    render(description, console=Console(width=120))
    return 1 if description.problems else 0


def cmd_partition(args: argparse.Namespace) -> None:
    from feddomain.data.federated import federations
    from feddomain.data.partitioners.table import render_tables, write_partition_csv

    cfg = load_config(args.config, args.overrides)
    feds = federations(cfg)
    for fed in feds:
        render_tables(fed, console=Console(width=120))
    if args.out is not None:
        write_partition_csv(args.out, feds)
        print(f"wrote {args.out}")


def cmd_export(args: argparse.Namespace) -> None:
    from feddomain.data.export import export_sites

    cfg = load_config(args.config, args.overrides)
    done = export_sites(cfg, args.out)
    console = Console()
    for i, (site, n) in enumerate(zip(done.sites, done.counts, strict=True)):
        console.print(f"client {i}: {n} images in {site}")
    console.print(f"target set: {done.target}\nsites config: {done.config}")
    if done.others:  # one deployment is one split: say which, and how to get the others
        targets = [name.removeprefix("lodo-") for name in done.others]
        console.print(
            f"exported split {done.split} only; the config's other splits "
            f"({', '.join(done.others)}) need their own export, e.g. "
            f"split.targets={targets[0]} --out ANOTHER_DIR"
        )
    console.print(
        "one machine:  feddomain run " + str(done.config) + "\n"
        "SuperNode i:  flower-supernode ... --node-config "
        f'\'partition-id=i site-root="{done.sites[0].parent.resolve()}/site<i>" '
        f'target-root="{done.target.resolve()}"\''
    )


if __name__ == "__main__":
    sys.exit(main())
