"""What ``feddomain rescore SOURCE --out DIR [overrides]`` may change: a finished run scored again
under settings that act only when a model is scored, without training it again.

A run that kept the state of every evaluated round (``checkpoint.keep_evaluated: true``) can be
scored again with other values of its method's ``evaluation_only`` hyper-parameters (FedFD's and
FedFD-A's ``test_mode`` and ``test_alpha``, hFedF's ``ood_model``, FedSR's ``eval_z``), another
``eval.selection``, label or name, and other checkpoint and tracking settings. Anything else (a
learning rate, the seed, the evaluation's batch size or schedule) would have trained or scored
differently, so it is refused by name. The rescored run is the run a full training with the
changed config writes, number for number, save its timings; its summary names the source
(``rescored_from``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from feddomain.config import ExperimentConfig, differing_keys, load_config
from feddomain.errors import DIVERGED_RECORD, FeddomainError

log = logging.getLogger("feddomain")
FREE = ("name", "algorithm.label", "eval.selection")  # nothing a model computes reads these
FREE_SECTIONS = ("checkpoint.", "tracking.")


def rescored_config(source: Path, overrides: Sequence[str]) -> ExperimentConfig:
    """``source``'s saved config with ``overrides``, refused (naming each key) where they change
    anything but what a rescore may change."""
    from feddomain.algorithms import resolve_method  # late: `--help` need not load the methods

    saved_path = source / "config.yaml"
    if not saved_path.is_file():
        raise FeddomainError(f"rescore {source}: no config.yaml there, so no run to rescore")
    saved, wanted = load_config(saved_path), load_config(saved_path, list(overrides))
    method = resolve_method(saved.algorithm.name, saved.algorithm.hparams)
    free = {*FREE, *(f"algorithm.{key}" for key in method.spec.evaluation_only)}
    refused = [
        key
        for key in differing_keys(saved.to_dict(), wanted.to_dict())
        if key not in free and not key.startswith(FREE_SECTIONS)
    ]
    if refused:
        settings = ", ".join(sorted(free)) if free else "none"
        raise FeddomainError(
            f"rescore {source}: {', '.join(refused)} would change training or what is scored, "
            f"so the run must be trained again (`feddomain run`); a rescore of "
            f"{saved.algorithm.name} may change {settings}, and checkpoint and tracking settings"
        )
    return wanted


def check_source(run_dir: Path) -> None:
    """Refuse, before anything is written, a source run that a rescore cannot stand for:
    unfinished or diverged (its training stopped early), run on Flower (its clients' states
    stayed on their nodes), itself a rescore (which keeps no states: its source does), or
    without its logs or a kept state of each evaluated round."""
    from feddomain.evaluation.report import read_metrics
    from feddomain.federation.checkpoint import EVALUATED, evaluated_path

    if (run_dir / DIVERGED_RECORD).is_file():
        raise FeddomainError(
            f"rescore {run_dir}: its model diverged before its first evaluation "
            f"({DIVERGED_RECORD}), so there is nothing to score again"
        )
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise FeddomainError(
            f"rescore {run_dir}: the run has not finished (no summary.json); finish it with "
            f"`feddomain run --resume` first"
        )
    summary = json.loads(summary_path.read_text())
    if summary.get("diverged"):
        raise FeddomainError(
            f"rescore {run_dir}: its training stopped when its model diverged "
            f"({summary['diverged']['message']}); a run under other settings would have trained "
            "on, so train it (`feddomain run`)"
        )
    if summary.get("rescored_from"):
        raise FeddomainError(
            f"rescore {run_dir}: it is a rescore of {summary['rescored_from']['run']}, which "
            "holds the states; rescore that run"
        )
    if summary.get("runner") == "flower":
        raise FeddomainError(
            f"rescore {run_dir}: it ran on Flower, whose clients kept their states on their "
            "nodes; rescore a simulated run"
        )
    logs = [name for name in ("metrics.jsonl", "rounds.jsonl") if not (run_dir / name).is_file()]
    if logs:
        raise FeddomainError(
            f"rescore {run_dir}: {' and '.join(logs)} missing (a copy of the run without its "
            "logs?); a rescore needs the run directory as the run left it"
        )
    rounds = [record["round"] for record in read_metrics(run_dir / "metrics.jsonl")]
    absent = [rnd for rnd in rounds if not evaluated_path(run_dir, rnd).is_file()]
    if not absent:
        return
    if not load_config(run_dir / "config.yaml").checkpoint.keep_evaluated:
        raise FeddomainError(
            f"rescore {run_dir}: the run kept no evaluated states; run it with "
            "checkpoint.keep_evaluated=true to rescore it"
        )
    raise FeddomainError(
        f"rescore {run_dir}: the kept states of evaluated rounds {absent} are missing from "
        f"{run_dir / EVALUATED} (a copy of the run without them?)"
    )


def check_device(run_dir: Path, cfg: ExperimentConfig) -> None:
    """Warn when the rescore scores on another device than the source trained on: its numbers
    then equal training here only up to float error."""
    import yaml

    from feddomain.federation.device import describe

    provenance = run_dir / "provenance.yaml"
    if not provenance.is_file():
        return
    trained = (yaml.safe_load(provenance.read_text()) or {}).get("device")
    here = describe(cfg.device)
    if trained is not None and _device(trained) != _device(here):
        log.warning(
            "%s trained on %s and is rescored on %s: its scores equal training with the "
            "settings only up to float error",
            run_dir,
            trained,
            here,
        )


def _device(described: str) -> str:
    """The device of a provenance's description, without how it was chosen."""
    return "cpu" if described.startswith("cpu") else described.removesuffix(" chosen by auto")
