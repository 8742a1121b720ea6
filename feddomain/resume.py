"""What ``feddomain run --resume DIR [CONFIG] [overrides]`` continues with: the run's saved
config, unchanged, or with more rounds, which extends a finished run.

An extension replays the longer run exactly: a finished run keeps its last state
(``final_checkpoint.pt``, ``checkpoint.keep_final``), taken before the evaluation that only a
last round off the ``eval.every`` schedule gets, and the sampling stream's first rounds do not
depend on the total. What does depend on the total is refused by name: a learning-rate schedule
other than constant (cosine and step are set from ``rounds``) and a method declaring
``uses_total_rounds`` (FedDG-GA's step size decays over them).
"""

from __future__ import annotations

import json
from pathlib import Path

from feddomain.config import ExperimentConfig, config_differences, load_config
from feddomain.errors import FeddomainError
from feddomain.federation import checkpoint


def resumed_config(out: Path, wanted: ExperimentConfig | None) -> ExperimentConfig:
    """The config to resume ``out`` with: the saved one, or ``wanted`` (CONFIG and/or
    overrides), which may differ from it only by a larger ``rounds`` (then ``out``'s finished
    runs are reopened for the extra rounds). Any other difference is refused, naming each key
    as ``saved vs given``."""
    saved_path = out / "config.yaml"
    if not saved_path.is_file():
        raise FeddomainError(f"--resume {out}: no config.yaml there, so nothing to resume")
    saved = load_config(saved_path)
    if wanted is None:
        return saved
    differences = config_differences(saved.to_dict(), wanted.to_dict())
    others = [d for d in differences if not d.startswith("rounds:")]
    if others:
        raise FeddomainError(
            f"--resume {out}: the config given differs from the saved {saved_path} (saved vs "
            f"given): {'; '.join(differences)}. Only rounds may grow (it extends the run); "
            "resume with the saved config (omit CONFIG and overrides) or start a new --out"
        )
    if wanted.rounds < saved.rounds:
        raise FeddomainError(
            f"--resume {out}: rounds: {saved.rounds} vs {wanted.rounds}: a run cannot be "
            f"shortened; its evaluated rounds are all in metrics.jsonl"
        )
    if wanted.rounds > saved.rounds:
        _check_extensible(saved, wanted.rounds)
        reopen_finished(out, saved.rounds, wanted.rounds)
    return wanted


def _check_extensible(cfg: ExperimentConfig, rounds: int) -> None:
    """Refuse an extension that would not be the run of ``rounds`` rounds, naming the cause."""
    from feddomain.algorithms import resolve_method

    change = f"extending {cfg.rounds} rounds to {rounds}"
    if cfg.train.schedule != "constant":
        raise FeddomainError(
            f"{change} is refused: train.schedule={cfg.train.schedule} sets every round's "
            f"learning rate from the total rounds, so the first {cfg.rounds} rounds of a "
            f"{rounds}-round run differ from these; start a new run with rounds={rounds}"
        )
    method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
    for spec in (method.spec, method.client_spec):
        if spec.uses_total_rounds:
            raise FeddomainError(
                f"{change} is refused: method {spec.name} uses the total rounds in its updates, "
                f"so the first {cfg.rounds} rounds of a {rounds}-round run differ from these; "
                f"start a new run with rounds={rounds}"
            )


def reopen_finished(out: Path, rounds: int, new_rounds: int) -> list[Path]:
    """Turn every finished run under ``out`` (``out`` itself, or one directory per split) back
    into an unfinished one at its final state; returns them. All are checked first, so a run
    that cannot be extended changes nothing."""
    finished = [d for d in (out, *sorted(out.iterdir())) if (d / "summary.json").is_file()]
    for run_dir in finished:
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("rescored_from"):
            raise FeddomainError(
                f"extending {rounds} rounds to {new_rounds} is refused: {run_dir} is a rescore "
                f"of {summary['rescored_from']['run']}, which holds the run's states; extend "
                "that run and rescore it again"
            )
        if summary.get("runner") == "flower":
            raise FeddomainError(
                f"extending {rounds} rounds to {new_rounds} is refused: {run_dir} ran on Flower, "
                "whose clients keep their state on their nodes, not in the run's final state; "
                f"start a new run with rounds={new_rounds}"
            )
        if not (run_dir / checkpoint.FINAL).is_file():
            raise FeddomainError(
                f"extending {rounds} rounds to {new_rounds} is refused: {run_dir} finished "
                f"without keeping its final state ({checkpoint.FINAL}; checkpoint.keep_final "
                f"was false); start a new run with rounds={new_rounds}"
            )
    for run_dir in finished:
        checkpoint.reopen_final(run_dir)
        (run_dir / "summary.json").unlink()
    return finished
