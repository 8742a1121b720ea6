"""The reproduction campaign (docs/results.md): every method of the seed papers' claims, tuned with
the same budget on source validation and confirmed over three seeds, profile by profile.

Each (profile, method) is one ``feddomain tune``: 6 trials of random search over the method's
declared space plus the client learning rate, seed 0, every target of the profile, ranked by the
mean source-validation accuracy; then the selected configuration over seeds 0, 1 and 2
(``--confirm``). Rerun the same command to resume: finished trials and runs are kept, an
interrupted run resumes from its checkpoint. The output folder keeps, committed, what later
sessions resume from and the tables are built from (the studies, selections and every run's
summary and config); checkpoints and per-round logs stay out of git (its ``.gitignore``).

    python scripts/campaign.py --data ~/data                       # everything, in order
    python scripts/campaign.py --data ~/data --profiles pacs-effnet-frozen --methods fedavg fedvr
    python scripts/campaign.py --list                              # the plan, nothing run
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from feddomain.tune import tune

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 6
SEEDS = (0, 1, 2)

# profile -> (config, overrides every method of it shares)
PROFILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pacs-effnet-frozen": ("configs/protocols/pacs-effnet-frozen.yaml", ()),
    "pacs-hfedf-cnn": ("configs/protocols/pacs-hfedf-cnn.yaml", ()),
    "digits3-bn-lam1.0": ("configs/protocols/digits3-bn.yaml", ("partition.lam=1.0",)),
    "digits3-bn-lam0.1": ("configs/protocols/digits3-bn.yaml", ("partition.lam=0.1",)),
    "pacs-effnet-tail": ("configs/protocols/pacs-effnet-tail.yaml", ()),
}

# profile -> {label: (method, overrides its protocol needs)}: the claims of issue 26, cheap
# comparisons first; a label other than the method's name is an ablation or variant
FISC_ON_DIGITS = ("algorithm.freeze_bn=false", "topology.sample_fraction=0.5")
ZERO_SHOT = ("algorithm.ood_model=zero_shot",)


def _plain(*methods: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {m: (m, ()) for m in methods}


METHODS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "pacs-effnet-frozen": {
        **_plain("fedavg", "fedprox", "local", "hfedf", "pfedhn"),
        "fedvr": ("fedvr", ZERO_SHOT),
        "fedvr_no_var": ("fedvr_no_var", ZERO_SHOT),
        **_plain("hfedf_no_gradalign", "hfedf_no_ema", "fedgma", "feddg_ga", "fediir"),
        "scaffold": ("scaffold", ("train.momentum=0",)),
        **_plain("fedsam", "fpl", "fedsr"),
    },
    "pacs-hfedf-cnn": _plain(
        "fedavg", "fedprox", "local", "hfedf", "pfedhn", "hfedf_no_gradalign", "hfedf_no_ema",
        "fedsr", "fedgma",
    ),
    **{
        profile: {
            "fedavg": ("fedavg", ()),
            "fisc": ("fisc", FISC_ON_DIGITS),
            "fisc_v1": ("fisc", (*FISC_ON_DIGITS, "algorithm.local_clustering=mean")),
            "fisc_v2": ("fisc", (*FISC_ON_DIGITS, "algorithm.server_clustering=mean")),
            "fisc_v3": ("fisc", (*FISC_ON_DIGITS, "algorithm.styled_loss=cross_entropy")),
            **_plain(
                "ccst", "fedsr", "fedgma", "feddg_ga", "fpl", "fedbn", "silobn", "mixstyle",
                "fedfd", "fedfd_a",
            ),
        }
        for profile in ("digits3-bn-lam1.0", "digits3-bn-lam0.1")
    },
    "pacs-effnet-tail": _plain(
        "fedavg", "fedbn", "silobn", "mixstyle", "fedsam", "fedfd", "fedfd_a", "fisc", "ccst",
        "feddg_ga",
    ),
}


def plan(profiles: list[str], labels: list[str] | None) -> list[tuple[str, str, list[str]]]:
    """(profile, label, overrides) in campaign order."""
    return [
        (profile, label, [*PROFILES[profile][1], f"algorithm={method}", *extra])
        for profile in profiles
        for label, (method, extra) in METHODS[profile].items()
        if labels is None or label in labels
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="the folder holding PACS/ and Digits3/")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "campaign")
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--methods", nargs="+", default=None, help="labels of the plan")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes per tune")
    ap.add_argument("--list", action="store_true", help="print the plan and stop")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for profile, method, overrides in plan(args.profiles, args.methods):
        config = ROOT / PROFILES[profile][0]
        if args.list:
            print(f"{profile:20s} {method:20s} {' '.join(overrides)}")
            continue
        if args.data is None:
            ap.error("--data is required to run")
        started = time.perf_counter()
        tune(
            config,
            [f"dataset.root={args.data}", *overrides],
            trials=TRIALS,
            out=args.out / profile / method,
            jobs=args.jobs,
            confirm=SEEDS,
        )
        logging.info("%s %s: %.0f s", profile, method, time.perf_counter() - started)


if __name__ == "__main__":
    main()
