"""Shared command line of the benchmarks that train one run with a simulator subclass scoring
extra evaluations: ``CONFIG [key=value ...] --out DIR``, run through `feddomain run`'s own path
(config, provenance, metrics.jsonl in DIR)."""

from __future__ import annotations

import argparse
from pathlib import Path

from feddomain.cli import run_experiment
from feddomain.config import load_config
from feddomain.federation.simulation import Simulation


def scored_run(simulation: type[Simulation], doc: str) -> Path:
    """Parse the command line, run the one split it configures with ``simulation``; its
    directory."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    (run_dir,) = run_experiment(cfg, args.out, quiet=True, simulation=simulation)
    return run_dir
