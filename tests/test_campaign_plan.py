"""The reproduction campaign's plan (``scripts/campaign.py``): every (profile, method) of it is a
valid configuration and every claim names two methods its profile tunes, so a campaign of many
hours cannot stop at its 40th tune on a typo, and no claim waits for a method never run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from feddomain.config import load_config
from feddomain.evaluation.claims import ClaimSpec
from feddomain.evaluation.report import METRICS, OPTIONAL_METRICS

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


def test_every_claim_names_two_methods_of_its_profile_and_a_reported_metric():
    """Catches a claim that can never be tested (a label its profile does not tune, a metric
    no report reads) and a profile whose claims were forgotten."""
    assert set(CAMPAIGN.CLAIMS) == set(CAMPAIGN.PROFILES)
    for profile, claims in CAMPAIGN.CLAIMS.items():
        for claim in claims:
            spec = ClaimSpec.parse(claim)
            assert {spec.first, spec.second} <= set(CAMPAIGN.METHODS[profile]), (profile, claim)
            assert spec.first != spec.second
            assert spec.metric in {*METRICS, *OPTIONAL_METRICS}, (profile, claim)
