"""The reproduction campaign's plan (``scripts/campaign.py``): every (profile, method) of it is a
valid configuration and every claim names two methods its profile tunes, so a campaign of many
hours cannot stop at its 40th tune on a typo, and no claim waits for a method never run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from feddomain.config import load_config
from feddomain.evaluation.claims import ClaimSpec
from feddomain.evaluation.report import METRICS, OPTIONAL_METRICS, RunResult

ROOT = Path(__file__).resolve().parents[1]


def _campaign():
    spec = importlib.util.spec_from_file_location("campaign", ROOT / "scripts" / "campaign.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CAMPAIGN = _campaign()
PLAN = CAMPAIGN.plan(list(CAMPAIGN.PROFILES), None)


@pytest.mark.parametrize(
    ("profile", "label", "overrides"), PLAN, ids=[f"{p}/{m}" for p, m, _ in PLAN]
)
def test_every_tune_of_the_plan_is_a_valid_configuration(profile, label, overrides):
    """Catches a plan entry whose overrides the config refuses (a renamed key, a method name
    that is not registered, a client method the server does not take) and an ablation whose
    report row would not carry its label."""
    cfg = load_config(ROOT / CAMPAIGN.PROFILES[profile][0], ["dataset.root=/data", *overrides])
    assert (cfg.algorithm.label or cfg.algorithm.name) == label


CAMPAIGN_OUT = ROOT / "results" / "campaign"
COMMITTED_TUNES = sorted(CAMPAIGN_OUT.glob("*/*/study.db"))
# the --data the committed campaign ran with: a tune's and a run's saved settings name it
DATA_ROOT = next(
    (load_config(c).dataset.root for c in CAMPAIGN_OUT.glob("*/*/confirm/*/*/config.yaml")), None
)


@pytest.mark.parametrize(
    "study", COMMITTED_TUNES, ids=[str(s.parent.relative_to(CAMPAIGN_OUT)) for s in COMMITTED_TUNES]
)
def test_every_committed_tune_resumes_under_the_plan_as_it_is_now(study):
    """Catches a change to a profile's config or to the overrides the plan gives it that the
    committed tunes did not run with (an evaluation batch size set in the profile's config for
    its later runs): the next session's resume would refuse the tune, and every later one of
    the campaign with it."""
    from feddomain.tune import check_resumable

    profile, label = study.parent.parent.name, study.parent.name
    config = ROOT / CAMPAIGN.PROFILES[profile][0]
    check_resumable(
        study.parent, config, [f"dataset.root={DATA_ROOT}", *TUNE_OVERRIDES[profile, label]]
    )


COMMITTED_VARIANTS = [
    (profile, label)
    for profile, variants in CAMPAIGN.VARIANTS.items()
    for label in variants
    if (CAMPAIGN_OUT / profile / label / "confirm").is_dir()
]


@pytest.mark.parametrize(
    ("profile", "label"), COMMITTED_VARIANTS, ids=[f"{p}/{m}" for p, m in COMMITTED_VARIANTS]
)
def test_every_committed_variant_resumes_under_the_plan_as_it_is_now(profile, label):
    """Catches the same change for a variant's runs (its base's selection and its own change):
    the variant's sweep would refuse their directories on the next resume."""
    from feddomain.sweep import plan

    plan(
        ROOT / CAMPAIGN.PROFILES[profile][0],
        [f"dataset.root={DATA_ROOT}", *CAMPAIGN.variant_overrides(CAMPAIGN_OUT, profile, label)],
        [("seed", list(CAMPAIGN.SEEDS))],
        CAMPAIGN_OUT / profile / label / "confirm",
    )


def test_every_claim_names_methods_of_its_profile_and_a_reported_metric():
    """Catches a claim that can never be tested (a label its profile neither tunes nor runs as
    a variant, a metric no report reads), a row compared with itself, and a profile whose
    claims were forgotten."""
    assert set(CAMPAIGN.CLAIMS) == set(CAMPAIGN.PROFILES)
    for profile, claims in CAMPAIGN.CLAIMS.items():
        for claim in claims:
            spec = ClaimSpec.parse(claim)
            rows = {*CAMPAIGN.METHODS[profile], *CAMPAIGN.VARIANTS.get(profile, {})}
            assert set(spec.rows) <= rows, (profile, claim)
            assert len(set(spec.rows)) == len(spec.rows), (profile, claim)
            assert spec.metric in {*METRICS, *OPTIONAL_METRICS}, (profile, claim)
            assert spec.text == claim, (profile, claim)  # the key the report looks up
            assert CAMPAIGN.STATEMENTS[claim], (profile, claim)  # the paper's words beside it
    assert {c for _, c in CAMPAIGN.WHY} <= {c for cs in CAMPAIGN.CLAIMS.values() for c in cs}
    assert all(claim in CAMPAIGN.CLAIMS[profile] for profile, claim in CAMPAIGN.WHY)


TUNE_OVERRIDES = {(profile, label): overrides for profile, label, overrides in PLAN}


def _federation(profile: str, label: str) -> dict:
    """What a row's clients see of the federation: data split, partition, participation, rounds
    and local epochs (a variant: its base's overrides, then its change)."""
    base, change = CAMPAIGN.VARIANTS.get(profile, {}).get(label, (label, ()))
    config = ROOT / CAMPAIGN.PROFILES[profile][0]
    cfg = load_config(config, ["dataset.root=/data", *TUNE_OVERRIDES[profile, base], *change])
    return {
        "split": cfg.split, "partition": cfg.partition, "topology": cfg.topology,
        "rounds": cfg.rounds, "local_epochs": cfg.train.local_epochs,
    }  # fmt: skip


def test_every_claim_compares_rows_trained_in_the_same_federation():
    """Catches a claim whose rows differ in how they are federated rather than in the method:
    the plan compared FISC at its paper's 50% client sampling with FedAvg, CCST and the other
    baselines at 100% (half the client updates a round against all of them)."""
    for profile, claims in CAMPAIGN.CLAIMS.items():
        for claim in claims:
            first, *others = ClaimSpec.parse(claim).rows
            federation = _federation(profile, first)
            for other in others:
                assert _federation(profile, other) == federation, (profile, claim, other)


VARIANTS = [(p, label) for p, variants in CAMPAIGN.VARIANTS.items() for label in variants]


@pytest.mark.parametrize(("profile", "label"), VARIANTS, ids=[f"{p}/{m}" for p, m in VARIANTS])
def test_every_variant_changes_a_tuned_method_in_a_valid_way(profile, label, tmp_path):
    """Catches a variant of a method its profile does not tune (it would wait forever) and one
    whose change the config refuses; a selection written by the base's tune is carried over,
    the variant's own change applied after it (overriding a selected value it names) and its
    row labelled; values borrowed from another method's selection taken from it, rounded."""
    base, extra = CAMPAIGN.VARIANTS[profile][label]
    assert base in CAMPAIGN.METHODS[profile]
    assert CAMPAIGN.variant_overrides(tmp_path, profile, label) is None  # no tune yet
    (tmp_path / profile / base).mkdir(parents=True)
    selected = {"selected": {"overrides": ["train.lr=0.0123"]}}
    (tmp_path / profile / base / "selected.yaml").write_text(yaml.safe_dump(selected))
    changed = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in extra)}
    if (profile, label) in CAMPAIGN.BORROWED:  # 3 significant figures of the lender's values
        lender, keys = CAMPAIGN.BORROWED[profile, label]
        assert lender in CAMPAIGN.METHODS[profile]
        assert CAMPAIGN.variant_overrides(tmp_path, profile, label) is None  # lender untuned
        params = {key: 0.0012345 * 10**i for i, key in enumerate(keys)}
        (tmp_path / profile / lender).mkdir()
        lent = {"selected": {"overrides": [], "params": params}}
        (tmp_path / profile / lender / "selected.yaml").write_text(yaml.safe_dump(lent))
        changed |= {key: [0.00123, 0.0123, 0.123, 1.23][i] for i, key in enumerate(keys)}
    overrides = CAMPAIGN.variant_overrides(tmp_path, profile, label)
    cfg = load_config(ROOT / CAMPAIGN.PROFILES[profile][0], ["dataset.root=/data", *overrides])
    assert (cfg.algorithm.label, cfg.train.lr) == (label, changed.get("train.lr", 0.0123))
    assert {k: _dotted(cfg, k) for k in changed} == changed


@pytest.mark.parametrize(("profile", "label"), VARIANTS, ids=[f"{p}/{m}" for p, m in VARIANTS])
def test_a_rescored_variant_writes_the_config_its_sweep_would_train(profile, label, tmp_path):
    """Catches a variant rescored from runs that keep no evaluated states (every FedFD
    test-time variant is rescored, nothing else: hFedF's and FedVR's frozen-profile variants
    were trained before), and a rescored run whose config is not the one the variant's sweep
    plans (the sweep would refuse the directory, or the row would stand for other settings)."""
    assert CAMPAIGN.rescored(profile, label) == label.startswith("fedfd_test_")
    if not CAMPAIGN.rescored(profile, label):
        return
    from feddomain.rescore import rescored_config

    base, extra = CAMPAIGN.VARIANTS[profile][label]
    ((_, _, tuned),) = CAMPAIGN.plan([profile], [base])
    profile_config = ROOT / CAMPAIGN.PROFILES[profile][0]
    chosen = ["train.lr=0.0123", "algorithm.lambda_feature=2.5"]
    base_run = load_config(profile_config, ["dataset.root=/data", *tuned, *chosen, "seed=1"])
    assert base_run.checkpoint.keep_evaluated
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(base_run.to_dict()))
    (tmp_path / profile / base).mkdir(parents=True)
    (tmp_path / profile / base / "selected.yaml").write_text(
        yaml.safe_dump({"selected": {"overrides": chosen}})
    )
    planned = load_config(
        profile_config,
        ["dataset.root=/data", *CAMPAIGN.variant_overrides(tmp_path, profile, label), "seed=1"],
    )
    rescored = rescored_config(tmp_path / "run", [*extra, f"algorithm.label={label}"])
    assert rescored.to_dict() == planned.to_dict()


def _dotted(cfg, key: str):
    """``cfg.train.lr`` for ``"train.lr"``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_report_rewrites_only_what_lies_between_the_markers_of_the_results_page(tmp_path):
    """Catches a report that appends a second table on every rerun, or overwrites the page's
    hand-written analysis around the generated tables."""
    docs = tmp_path / "results.md"
    page = (
        f"intro\n{CAMPAIGN.CLAIMS_BEGIN}\nold claims\n{CAMPAIGN.MARKER_END}\nanalysis\n"
        f"{CAMPAIGN.TABLES_BEGIN}\nold tables\n{CAMPAIGN.MARKER_END}\nappendix\n"
    )
    docs.write_text(page)
    for _ in range(2):
        CAMPAIGN.write_claims(tmp_path, ["| c |"], ["### `pacs-effnet-frozen`", "| t |"], docs)
    assert docs.read_text() == (
        f"intro\n{CAMPAIGN.CLAIMS_BEGIN}\n| c |\n{CAMPAIGN.MARKER_END}\nanalysis\n"
        f"{CAMPAIGN.TABLES_BEGIN}\n### `pacs-effnet-frozen`\n| t |\n{CAMPAIGN.MARKER_END}\n"
        "appendix\n"
    )
    assert (tmp_path / "claims.md").read_text() == "| c |\n"


def test_a_confirmation_counts_only_once_every_seed_and_target_has_finished(tmp_path):
    """Catches a verdict printed from a confirmation still running (two of twelve runs gave
    the first table an interval 28 points wide), and a tune under way reported as not started
    or with a trial counted before all its targets have finished."""
    confirm = tmp_path / "pacs-effnet-frozen" / "fedvr" / "confirm"
    targets = ("art_painting", "cartoon", "photo", "sketch")
    for seed in (0, 1, 2):
        for target in targets:
            (confirm / f"seed={seed}" / f"lodo-{target}").mkdir(parents=True)
    runs = sorted(confirm.glob("seed=*/lodo-*"))
    for run in runs[:-1]:
        (run / "summary.json").write_text("{}")
    done, progress = CAMPAIGN.confirmations(tmp_path, "pacs-effnet-frozen")
    assert done == {} and progress == {"fedvr": "fedvr confirming (11 of 12 runs)"}
    (runs[-1] / "summary.json").write_text("{}")
    assert CAMPAIGN.confirmations(tmp_path, "pacs-effnet-frozen")[0] == {"fedvr": confirm}
    trials = tmp_path / "pacs-effnet-frozen" / "fedsr" / "trials"
    # 001: one run still going; 002: two runs finished, the other two not yet begun
    for trial, begun, finished in (
        ("000", targets, targets), ("001", targets, targets[:3]), ("002", targets[:2], targets[:2])
    ):
        for target in begun:
            (trials / trial / f"lodo-{target}").mkdir(parents=True)
        for target in finished:
            (trials / trial / f"lodo-{target}" / "summary.json").write_text("{}")
    progress = CAMPAIGN.confirmations(tmp_path, "pacs-effnet-frozen")[1]
    assert progress == {"fedsr": "fedsr tuning (1 of 6 trials)"}


def _run(label: str, rejected: int, merges: list[dict], seconds: dict | None = None):
    """A confirmation run as the report loads it, with only what the mechanism table reads."""
    summary = {"rejected_updates": [{"round": 1}] * rejected, "phase_seconds": seconds or {}}
    records = [{"round": 5, "diagnostics": {"merge": merges}}]
    return RunResult(Path(label), label, "PACS", ("sketch",), 0, {}, records, summary)


def test_the_mechanism_table_combines_each_rows_runs_and_shows_only_columns_some_row_has():
    """Catches the table summing what it should average (HFedATM's identity fraction: runs of
    0.6 and 0.1 give 35%), averaging the worst merge share (runs of 5% and 10%: 10.0%) or the
    rejected updates (1 + 2 = 3), a round that keeps our J-ratio diagnostic in it (the second
    run's 0.4 s merge over 3 + 2 - 1 s, not 5 s: 10.0%, not 8.0%), and a column for a mechanism
    no row has (FISC's, FedFD's)."""
    merge_a = [{"identity_fraction": 0.5}, {"identity_fraction": 0.7}]
    runs = [
        _run("hfedatm", 1, merge_a, {"train": 9.0, "aggregate": 1.0, "server_merge": 0.5}),
        _run("hfedatm", 2, [{"identity_fraction": 0.1}],
             {"train": 3.0, "aggregate": 2.0, "server_objective": 1.0, "server_merge": 0.4}),
        _run("hfedavg", 0, []),
    ]  # fmt: skip
    _, _, header, _, *rows, _ = CAMPAIGN.mechanism_table(runs)
    assert header == (
        "| row | client updates rejected (non-finite) | HFedATM: filters matched to themselves"
        " | server merge / round (train + aggregate), worst run |"
    )
    assert rows == ["| hfedatm | 3 | 35% | 10.0% |", "| hfedavg | 0 | — | — |"]


def test_the_ga_column_measures_the_selected_weights_against_the_participants_sample_shares():
    """Catches FedDG-GA's mechanism column measuring against shares over every client instead
    of the round's participants (client 1 of sizes 100, 200, 300 left out: shares 0.25, 0.75),
    against uniform weights, at the last round instead of the selected one, or summing where
    it averages: weights 0.45, 0.55 sit 20 points off, 0.25, 0.75 none: 10.0 over the runs;
    the largest weights 0.55 and 0.75 average 0.65, not the last round's 0.90."""
    def ga_run(weights: list[float]) -> RunResult:
        summary = {"rejected_updates": [], "client_domain_counts": [[100, 0], [0, 200], [300, 0]]}
        ga = {"clients": [0, 2], "weights": weights, "gaps": [0.1, -0.1], "step": 0.1}
        selected = {"round": 5, "diagnostics": {"ga": ga}}
        last = {"round": 10, "diagnostics": {"ga": {**ga, "weights": [0.9, 0.1]}}}
        return RunResult(Path("ga"), "feddg_ga", "PACS", ("sketch",), 0, selected,
                         [selected, last], summary)  # fmt: skip

    runs = [ga_run([0.45, 0.55]), ga_run([0.25, 0.75]), _run("fedavg", 0, [])]
    _, _, header, _, *rows, _ = CAMPAIGN.mechanism_table(runs)
    assert header.endswith("| FedDG-GA: largest weight off the sample shares, selected round "
                           "(points) | FedDG-GA: largest weight, selected round |")  # fmt: skip
    assert rows == ["| fedavg | 0 | — | — |", "| feddg_ga | 0 | 10.0 | 0.65 |"]


def test_the_gma_columns_average_the_selected_rounds_mask_over_the_runs():
    """Catches FedGMA's mechanism columns reading the last round instead of the selected one
    (0.10 and 0.95 there), summing where they average, or swapping the two statistics: masked
    shares 0.70 and 0.80 at the selected rounds give 75%, mean masks 0.40 and 0.60 give 0.50."""
    def gma_run(masked: float, mean_mask: float) -> RunResult:
        selected = {"round": 5, "diagnostics": {"gma": {"masked_fraction": masked,
                                                        "mean_mask": mean_mask}}}
        last = {"round": 10, "diagnostics": {"gma": {"masked_fraction": 0.1, "mean_mask": 0.95}}}
        return RunResult(Path("gma"), "fedgma", "PACS", ("sketch",), 0, selected,
                         [selected, last], {"rejected_updates": []})  # fmt: skip

    runs = [gma_run(0.7, 0.4), gma_run(0.8, 0.6), _run("fedavg", 0, [])]
    _, _, header, _, *rows, _ = CAMPAIGN.mechanism_table(runs)
    assert header.endswith("| FedGMA: coordinates whose step the mask scales down (m < 1), "
                           "selected round | FedGMA: mean mask, selected round |")  # fmt: skip
    assert rows == ["| fedavg | 0 | — | — |", "| fedgma | 0 | 75% | 0.50 |"]


def test_a_rescored_variant_is_its_bases_runs_scored_again_and_its_sweep_trains_nothing(
    tmp_path, monkeypatch
):
    """Catches the campaign's rescore step writing runs its variant's sweep then refuses (a
    config other than the one it plans: the campaign would stop) or trains again (the saving
    lost), and a base run whose rescore is refused stopping the campaign instead of being left
    to the sweep."""
    import feddomain

    profile, label = "tiny", "fedfd_test_instance"
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tiny", "rounds": 2, "threads": 1,
        "dataset": {"name": "digits_embedded", "resolution": 16},
        "split": {"scheme": "lodo", "targets": ["grey"]},
        "partition": {"n_clients": 3, "d": 1},
        "model": {"name": "small_cnn", "options": {"widths": [8, 16]}},
        "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
        "eval": {"every": 1}, "checkpoint": {"every": 0},
    }))  # fmt: skip
    monkeypatch.setitem(CAMPAIGN.PROFILES, profile, (str(config), ()))
    monkeypatch.setitem(CAMPAIGN.METHODS, profile, {"fedfd": ("fedfd", CAMPAIGN.KEEP_EVALUATED)})
    monkeypatch.setitem(
        CAMPAIGN.VARIANTS, profile, {label: ("fedfd", ("algorithm.test_mode=instance",))}
    )
    out = tmp_path / "campaign"
    base = out / profile / "fedfd"
    base.mkdir(parents=True)
    selected = {"trials": 1, "oracle": False, "selected": {"overrides": [], "value": 0.5}}
    (base / "selected.yaml").write_text(yaml.safe_dump(selected))
    ((_, _, tuned),) = CAMPAIGN.plan([profile], ["fedfd"])
    feddomain.sweep(config, "dataset.root=/unused", *tuned, grid={"seed": [0, 1, 2]},
                    out=base / "confirm")  # fmt: skip
    (base / "confirm" / "seed=2" / "lodo-grey" / "evaluated" / "round_00002.pt").unlink()

    CAMPAIGN.run_variant(out, profile, label, Path("/unused"), jobs=1)
    runs = {p.parent.parent.name: p.parent for p in (out / profile / label).rglob("summary.json")}
    assert sorted(runs) == ["seed=0", "seed=1", "seed=2"]
    for seed, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["algorithm"] == label
        # seed 2 lost a kept state: its rescore was refused and the sweep trained it
        assert ("rescored_from" in summary) == (seed != "seed=2"), seed
