"""The reproduction campaign (docs/results.md): every method of the seed papers' claims, tuned with
the same budget on source validation and confirmed over three seeds, profile by profile.

Each (profile, method) is one ``feddomain tune``: 6 trials of random search over the method's
declared space plus the client learning rate, seed 0, every target of the profile, ranked by the
mean source-validation accuracy; then the selected configuration over seeds 0, 1 and 2
(``--confirm``). Rerun the same command to resume: finished trials and runs are kept, an
interrupted run resumes from its checkpoint. The output folder keeps, committed, what later
sessions resume from and the tables are built from (the studies, selections and every run's
summary and config); checkpoints and per-round logs stay out of git (its ``.gitignore``).

The order is the cost order (docs/performance.md, "The reproduction campaign's cost"): the
frozen-feature profile first, its cheap methods before FedSAM, FPL and FedSR; the first 13 tunes
fit about 12 hours of a 2-core machine, the whole plan takes several hundred core-hours.

    python scripts/campaign.py --data ~/data                       # everything, in order
    python scripts/campaign.py --data ~/data --profiles pacs-effnet-frozen --methods fedavg fedvr
    python scripts/campaign.py --list                              # the plan, nothing run
    python scripts/campaign.py --report    # tables and claims from the finished confirmations
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from feddomain.evaluation.claims import ClaimSpec
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
    # FISC's own federation (its paper): 100 lambda clients, 20% sampled each round
    "pacs-effnet-tail-lam0.1": (
        "configs/protocols/pacs-effnet-tail.yaml",
        (
            "partition.name=lambda",
            "partition.n_clients=100",
            "partition.lam=0.1",
            "topology.sample_fraction=0.2",
        ),
    ),
    # HFedATM's hierarchy on the frozen profile: 12 lambda clients in 3 stations, 2 station
    # rounds per global round (100 global rounds: the profile's 200 rounds of local work)
    **{
        f"pacs-effnet-frozen-stations-lam{lam}": (
            "configs/protocols/pacs-effnet-frozen.yaml",
            (
                "partition.name=lambda",
                "partition.n_clients=12",
                f"partition.lam={lam}",
                "topology.stations=3",
                "topology.station_rounds=2",
                "rounds=100",
            ),
        )
        for lam in ("1.0", "0.1")
    },
}

# profile -> {label: (method, overrides its protocol needs)}: the claims of issue 26, cheap
# comparisons first; a label other than the method's name is an ablation or variant
FISC_ON_DIGITS = ("algorithm.freeze_bn=false", "topology.sample_fraction=0.5")
ZERO_SHOT = ("algorithm.ood_model=zero_shot",)


# HFedATM's client methods (hfedatm.md §7: FedAvg, FedSR, FedIIR clients under +HFedATM / +Avg)
HFEDATM_CLIENTS = {
    "": (),
    "_fedsr": ("algorithm.client.name=fedsr", "algorithm.client.z_dim=512"),
    "_fediir": ("algorithm.client.name=fediir",),
}


def _plain(*methods: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {m: (m, ()) for m in methods}


METHODS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "pacs-effnet-frozen": {
        **_plain("fedavg", "fedprox", "local", "hfedf", "pfedhn"),
        "fedvr": ("fedvr", ZERO_SHOT),
        "fedvr_no_var": ("fedvr_no_var", ZERO_SHOT),
        **_plain("hfedf_no_gradalign", "hfedf_no_ema", "fedgma", "feddg_ga", "fediir"),
        "scaffold": ("scaffold", ("train.momentum=0",)),
        **_plain("fedsam", "fpl"),
        "fedsr": ("fedsr", ("algorithm.z_dim=512",)),  # fedvr.md §6: a 512-d z on the adapter
    },
    "pacs-hfedf-cnn": _plain(
        "fedavg",
        "fedprox",
        "local",
        "hfedf",
        "pfedhn",
        "hfedf_no_gradalign",
        "hfedf_no_ema",
        "fedsr",
        "fedgma",
    ),
    **{
        profile: {
            "fedavg": ("fedavg", ()),
            "fisc": ("fisc", FISC_ON_DIGITS),
            "fisc_v1": ("fisc", (*FISC_ON_DIGITS, "algorithm.local_clustering=mean")),
            "fisc_v2": ("fisc", (*FISC_ON_DIGITS, "algorithm.server_clustering=mean")),
            "fisc_v3": ("fisc", (*FISC_ON_DIGITS, "algorithm.styled_loss=cross_entropy")),
            **_plain(
                "ccst",
                "fedsr",
                "fedgma",
                "feddg_ga",
                "fpl",
                "fedbn",
                "silobn",
                "mixstyle",
                "fedfd",
                "fedfd_a",
            ),
        }
        for profile in ("digits3-bn-lam1.0", "digits3-bn-lam0.1")
    },
    "pacs-effnet-tail": {
        **_plain("fedavg", "fedbn", "silobn"),
        "mixstyle": ("mixstyle", ("algorithm.blocks=[6]",)),  # stages 1-5 are the frozen prefix
        **_plain("fedsam", "fedfd", "fedfd_a", "feddg_ga"),
    },
    "pacs-effnet-tail-lam0.1": _plain("fedavg", "fisc", "ccst", "feddg_ga"),
    **{
        profile: {
            f"{server}{suffix}": (server, client)
            for server in ("hfedatm", "hfedavg")
            for suffix, client in HFEDATM_CLIENTS.items()
        }
        for profile in ("pacs-effnet-frozen-stations-lam1.0", "pacs-effnet-frozen-stations-lam0.1")
    },
}


# profile -> {label: (base label, overrides)}: a tuned method's selected configuration over the
# same seeds with one setting changed, no tune of its own (it changes what is scored, not what
# is trained): the mechanism a claim names, or the most likely reason for a refuted claim
VARIANTS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "pacs-effnet-frozen": {
        # hFedF scores each client's own model on the unseen domain (hfedf.md §2.5); its
        # clients' models differ there by tens of points: score the mean of their parameters
        "hfedf_parameter_average": ("hfedf", ("algorithm.ood_model=parameter_average",)),
        # fedvr.md B4: the zero-shot model against the mean of the clients' models and the
        # model of the clients' mean embedding
        "fedvr_parameter_average": ("fedvr", ("algorithm.ood_model=parameter_average",)),
        "fedvr_mean_embedding": ("fedvr", ("algorithm.ood_model=mean_embedding",)),
    },
}


BASELINES_OVER_FEDAVG = ("fedsr", "fedgma", "feddg_ga", "fediir", "scaffold", "fedsam")
DIGITS_CLAIMS = (
    "fisc > fedavg", "fisc > ccst", "fisc > fedsr", "fisc > fedgma", "fisc > feddg_ga",
    "fisc > fpl", "fisc > fisc_v1", "fisc > fisc_v2", "fisc > fisc_v3",
    "fedfd > silobn", "fedfd > fedavg", "fedfd_a > fedfd", "fedbn > fedavg", "mixstyle > fedavg",
)  # fmt: skip
# profile -> the papers' claims it tests, as docs/results.md lists: "A > B" (ood accuracy) or
# "A < B on METRIC" (labels of METHODS; feddomain.evaluation.claims.ClaimSpec)
CLAIMS: dict[str, tuple[str, ...]] = {
    "pacs-effnet-frozen": (
        "hfedf > fedavg", "hfedf > pfedhn", "hfedf > hfedf_no_gradalign", "hfedf > hfedf_no_ema",
        "hfedf < pfedhn on client_ood_std",  # hfedf.md §2.5: near-identical client models
        *(f"fedvr > {m}" for m in ("fedavg", "fedprox", "pfedhn", "hfedf", "fedsr", "fedgma")),
        "fedvr > fedvr_no_var",
        "fedvr < fedvr_no_var on client_loss_var",  # fedvr.md B2: the regulariser's target
        "fedvr < fedavg on client_acc_std",  # FedVR's fairness: lower cross-client variance
        "fedvr < fedavg on ood_ece", "fedvr < hfedf on ood_ece",  # fedvr.md B5: calibration
        "fedvr > fedvr_parameter_average", "fedvr > fedvr_mean_embedding",  # fedvr.md B4
        "hfedf_parameter_average > hfedf",  # the experiment behind hfedf > fedavg (refuted)
        *(f"{m} > fedavg" for m in BASELINES_OVER_FEDAVG),
    ),
    "pacs-hfedf-cnn": (
        "hfedf > fedavg", "hfedf > pfedhn", "hfedf > hfedf_no_gradalign", "hfedf > hfedf_no_ema",
        "hfedf > fedprox", "hfedf > fedsr", "hfedf > fedgma",
    ),
    "digits3-bn-lam1.0": DIGITS_CLAIMS,
    "digits3-bn-lam0.1": DIGITS_CLAIMS,
    **{
        f"pacs-effnet-frozen-stations-lam{lam}": tuple(
            f"hfedatm{c} > hfedavg{c}" for c in HFEDATM_CLIENTS
        )
        for lam in ("1.0", "0.1")
    },
    "pacs-effnet-tail": (
        "fedfd > silobn", "fedfd > fedavg", "fedfd_a > fedfd", "fedbn > fedavg",
        "mixstyle > fedavg", "fedsam > fedavg", "feddg_ga > fedavg",
    ),
    "pacs-effnet-tail-lam0.1": ("fisc > fedavg", "fisc > ccst", "fisc > feddg_ga"),
}  # fmt: skip


def plan(profiles: list[str], labels: list[str] | None) -> list[tuple[str, str, list[str]]]:
    """(profile, label, overrides) in campaign order; a label other than its method's name is
    set as ``algorithm.label`` (the report's row and the claims name it)."""
    return [
        (profile, label, [*PROFILES[profile][1], f"algorithm={method}", *extra,
                          *([f"algorithm.label={label}"] if label != method else [])])
        for profile in profiles
        for label, (method, extra) in METHODS[profile].items()
        if labels is None or label in labels
    ]  # fmt: skip


def variant_plan(profiles: list[str], labels: list[str] | None) -> list[tuple[str, str, str]]:
    """(profile, label, base label) of the variants, in campaign order."""
    return [
        (profile, label, base)
        for profile in profiles
        for label, (base, _) in VARIANTS.get(profile, {}).items()
        if labels is None or label in labels
    ]


def variant_overrides(out: Path, profile: str, label: str) -> list[str] | None:
    """The overrides of variant ``label``: its base's tune overrides and selected values, then
    its own; None while the base has no selection yet."""
    from feddomain.tune import read_selected

    base, extra = VARIANTS[profile][label]
    selected = out / profile / base / "selected.yaml"
    if not selected.is_file():
        return None
    ((_, _, tuned),) = [p for p in plan([profile], [base])]
    chosen = read_selected(selected)["selected"]["overrides"]
    return [*tuned, *chosen, *extra, f"algorithm.label={label}"]


def run_variant(out: Path, profile: str, label: str, data: Path, jobs: int) -> None:
    """The variant over the confirmation seeds, into ``<profile>/<label>/confirm`` (where the
    report finds confirmed rows); rerun to resume."""
    from feddomain import api

    overrides = variant_overrides(out, profile, label)
    if overrides is None:
        logging.info("%s %s: waits for %s's tune", profile, label, VARIANTS[profile][label][0])
        return
    config = ROOT / PROFILES[profile][0]
    confirm = out / profile / label / "confirm"
    api.sweep(config, f"dataset.root={data}", *overrides, grid={"seed": list(SEEDS)},
              out=confirm, jobs=jobs)  # fmt: skip


def report(out: Path, profile: str) -> list[str]:
    """The profile's method x target tables over every finished confirmation, and each claim
    whose two methods have them, into ``out/<profile>/report`` (report.md and the rest); its
    rows of the claims table, every claim of the profile included (untested ones say so)."""
    from feddomain import api

    confirmed = {p.parent.name: p for p in sorted((out / profile).glob("*/confirm"))}
    specs = [ClaimSpec.parse(c) for c in CLAIMS[profile]]
    tested = [c for c in specs if c.first in confirmed and c.second in confirmed]
    verdicts = {}
    if confirmed:
        claims_file = out / profile / "claims.txt"
        claims_file.write_text("".join(f"{c.text}\n" for c in tested))
        result = api.report(*confirmed.values(), out=out / profile / "report",
                            claims=claims_file if tested else None)  # fmt: skip
        verdicts = {c.spec: c for c in result.claims}
    rows = []
    for spec in specs:
        c = verdicts.get(spec)
        if c is None:
            rows.append(f"| {spec.text} | {profile} | not yet confirmed | | |")
        else:
            evidence = f"{c.difference(c.mean)} {c.interval_text()}"
            rows.append(f"| {spec.text} | {profile} | {evidence} | {c.pairs} | {c.verdict} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="the folder holding PACS/ and Digits3/")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "campaign")
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--methods", nargs="+", default=None, help="labels of the plan")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes per tune")
    ap.add_argument("--list", action="store_true", help="print the plan and stop")
    ap.add_argument(
        "--report", action="store_true",
        help="write each profile's tables and claims from its finished confirmations, and stop",
    )  # fmt: skip
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.report:
        rows = [row for profile in args.profiles for row in report(args.out, profile)]
        table = [
            "| claim | profile | A - B [95% interval] (ood accuracy unless named; % in points) "
            "| pairs | verdict |",
            "|---|---|---|---:|---|",
            *rows,
        ]
        (args.out / "claims.md").write_text("\n".join(table) + "\n")
        print("\n".join(table))
        return
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
    for profile, label, base in variant_plan(args.profiles, args.methods):
        if args.list:
            changed = " ".join(VARIANTS[profile][label][1])
            print(f"{profile:20s} {label:20s} {base}'s selection, {changed}")
            continue
        if args.data is None:
            ap.error("--data is required to run")
        run_variant(args.out, profile, label, args.data, args.jobs)


if __name__ == "__main__":
    main()
