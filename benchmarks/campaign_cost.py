"""What the reproduction campaign (``scripts/campaign.py``) costs on this machine, from probes.

Each (profile, method) of the plan runs a few rounds on one target with evaluation every round,
on one thread; its ``rounds.jsonl`` gives the steady cost of a round's training and of one
evaluation (the first round is left out of the mean: it pays warm-up and a method's one-time
phase, such as FISC's style collection); the run's fixed cost is the wall time outside its
rounds (data, model) plus the first round's extra over a steady one. A full run is then

    fixed + rounds x train + (rounds / eval.every) x evaluate

and a tune ``trials x targets`` runs, plus ``(seeds - 1) x targets`` confirmation runs (the
tune's own seed reuses the selected trial). Each probe also says whether the method learns at
its defaults before its tune is paid for: source validation and ood accuracy after the probe's
rounds, the client updates the server rejected (non-finite ones) and the method's own
diagnostics in the last evaluation (FedFD's CAFL/CE, FISC's style clusters, HFedATM's merge).
The plan's two Digits3 lambdas cost the same per run, so only lambda 0.1 is probed. One-time
caches (the frozen features, a frozen prefix) are filled before the probes and not counted:
``docs/performance.md`` times them. Run:

    python benchmarks/campaign_cost.py --data /data --profiles digits3-bn-lam0.1 --out cost.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from math import nan
from pathlib import Path
from typing import Any

from feddomain.config import load_config
from feddomain.sweep import split_targets

ROOT = Path(__file__).resolve().parents[1]
PROBE_ROUNDS = 3
SAME_COST = {"digits3-bn-lam1.0": "digits3-bn-lam0.1"}  # per-run cost as the other's


def campaign() -> object:
    """``scripts/campaign.py`` as a module (its PROFILES, METHODS, TRIALS, SEEDS and plan)."""
    spec = importlib.util.spec_from_file_location("campaign", ROOT / "scripts" / "campaign.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe(config: Path, overrides: list[str], target: str, out: Path) -> dict[str, Any]:
    """Run ``PROBE_ROUNDS`` rounds on ``target`` in a fresh process; the steady seconds per
    round of training and per evaluation, the fixed rest of the wall time, and what the method
    learned (``learned``)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "feddomain", "run", str(config), *overrides,
         f"rounds={PROBE_ROUNDS}", f"split.targets=[{target}]", "eval.every=1",
         "checkpoint.every=1000", "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"probe of {' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - started
    logged = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    times = [r["time"] for r in logged if "task" not in r]  # "task": a one-time phase (round 0)
    train = statistics.mean(t["train"] + t["aggregate"] for t in times[1:])
    evaluate = statistics.mean(t["evaluate"] for t in times[1:])
    in_rounds = sum(t["train"] + t["aggregate"] + t["evaluate"] for t in times)
    first_extra = max(0.0, times[0]["train"] + times[0]["aggregate"] - train)
    cost = {"train_s": train, "eval_s": evaluate, "fixed_s": wall - in_rounds + first_extra}
    return {**cost, **learned(out)}


def learned(out: Path) -> dict[str, Any]:
    """Source validation and ood accuracy at the probe's last evaluation (nan where clients
    hold no validation data), the client updates the server rejected over its rounds
    (non-finite), and the method's scalar diagnostics there."""
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((out / "summary.json").read_text())
    return {
        "id_acc": round(100 * (last["id_acc"] if last["id_acc"] is not None else nan), 1),
        "ood_acc": round(100 * last["ood_acc"], 1),
        "rejected": len(summary["rejected_updates"]),
        "diagnostics": " ".join(
            f"{k}={v:.3g}" for k, v in _scalars(last.get("diagnostics", {})).items()
        ),
    }


def _scalars(tree: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a nested dict, by dotted key; of a list of records (one per round since
    the last evaluation, HFedATM's merges), the last record's."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            value = value[-1]
        if isinstance(value, dict):
            out |= _scalars(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = value
    return out


def main() -> None:
    plan_module = campaign()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="holds PACS/ and Digits3/")
    parser.add_argument("--profiles", nargs="+", default=list(plan_module.PROFILES))
    parser.add_argument("--methods", nargs="+", default=None, help="labels of the plan")
    parser.add_argument("--out", type=Path, required=True, help="CSV of the probes and estimates")
    parser.add_argument(
        "--overrides", nargs="*", default=[],
        help="added to every probe and estimate, e.g. model.frozen_prefix=6 (a cheaper cut)",
    )  # fmt: skip
    args = parser.parse_args()
    rows, probed = [], {}
    for profile, label, overrides in plan_module.plan(args.profiles, args.methods):
        config = ROOT / plan_module.PROFILES[profile][0]
        items = [f"dataset.root={args.data}", *overrides, *args.overrides]
        cfg = load_config(config, items)
        targets = split_targets(cfg)
        key = (SAME_COST.get(profile, profile), label)
        if key not in probed:
            with tempfile.TemporaryDirectory() as tmp:
                probed[key] = probe(config, items, targets[0], Path(tmp) / "run")
        cost = probed[key]
        run_s = (cost["fixed_s"] + cfg.rounds * cost["train_s"]
                 + cfg.rounds / cfg.eval.every * cost["eval_s"])  # fmt: skip
        runs = plan_module.TRIALS * len(targets) + (len(plan_module.SEEDS) - 1) * len(targets)
        rows.append({
            "profile": profile, "method": label,
            **{k: round(v, 2) if isinstance(v, float) else v for k, v in cost.items()},
            "run_s": round(run_s), "runs": runs, "tune_h": round(runs * run_s / 3600, 2),
        })  # fmt: skip
        print(
            f"{profile:20s} {label:20s} round {cost['train_s']:6.2f}s  eval "
            f"{cost['eval_s']:5.2f}s  fixed {cost['fixed_s']:5.1f}s  run {run_s:6.0f}s  "
            f"x{runs}  {rows[-1]['tune_h']:5.2f} h  | id {cost['id_acc']:5.1f}  ood "
            f"{cost['ood_acc']:5.1f}  rejected {cost['rejected']}  {cost['diagnostics']}",
            flush=True,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    total = sum(r["tune_h"] for r in rows)
    print(f"plan: {len(rows)} tunes, {total:.1f} core-hours ({total / 2:.1f} h on 2 cores)")


if __name__ == "__main__":
    main()
