"""Metrics against values worked out by hand in the comments."""

from __future__ import annotations

import json
import math

import pytest
import torch

from feddomain.errors import DataError
from feddomain.evaluation.metrics import (
    NLL_EPS,
    accuracy,
    brier,
    confidence_histogram,
    ece,
    evaluate_probs,
    nll,
    reliability_bins,
    spread,
    worst_domain,
)

# Five samples, three classes. Confidence = max prob; "ok" = argmax equals the label.
#   A [0.9, 0.05, 0.05] y=0  conf 0.9  ok
#   B [0.5, 0.3,  0.2 ] y=0  conf 0.5  ok     (0.5 sits exactly on a 4-bin edge)
#   C [0.5, 0.25, 0.25] y=0  conf 0.5  ok     (also on the edge)
#   D [0.1, 0.7,  0.2 ] y=1  conf 0.7  ok
#   E [0.3, 0.3,  0.4 ] y=0  conf 0.4  wrong (predicts 2)
PROBS = torch.tensor(
    [
        [0.9, 0.05, 0.05],
        [0.5, 0.3, 0.2],
        [0.5, 0.25, 0.25],
        [0.1, 0.7, 0.2],
        [0.3, 0.3, 0.4],
    ]
)
LABELS = torch.tensor([0, 0, 0, 1, 0])


def test_accuracy_on_probs_and_on_logits():
    # 4 of 5 correct; logits = 3 log p + 5 keep every argmax.
    assert accuracy(PROBS, LABELS) == pytest.approx(0.8)
    assert accuracy(3 * PROBS.log() + 5, LABELS) == pytest.approx(0.8)


def test_accuracy_tie_predicts_lowest_class():
    uniform = torch.full((2, 4), 0.25)
    assert accuracy(uniform, torch.tensor([0, 3])) == 0.5


def test_reliability_bins_put_edge_values_in_the_bin_they_close():
    # 4 bins: [0, .25], (.25, .5], (.5, .75], (.75, 1]
    # bin 1 = {B, C, E}: conf (0.5 + 0.5 + 0.4) / 3 = 1.4/3, acc 2/3
    # bin 2 = {D}: conf 0.7, acc 1;  bin 3 = {A}: conf 0.9, acc 1
    rel = reliability_bins(PROBS, LABELS, n_bins=4)
    assert rel.count == [0, 3, 1, 1]
    assert rel.conf == pytest.approx([0.0, 1.4 / 3, 0.7, 0.9])
    assert rel.acc == pytest.approx([0.0, 2 / 3, 1.0, 1.0])


def test_ece_by_hand_with_edge_samples():
    # ECE = sum_b |B_b|/N |acc_b - conf_b|
    #     = 3/5 * |2/3 - 1.4/3| + 1/5 * |1 - 0.7| + 1/5 * |1 - 0.9|
    #     = 3/5 * 0.6/3 + 0.06 + 0.02 = 0.12 + 0.06 + 0.02 = 0.20
    # With [lo, hi) bins B and C would move to bin 2 and ECE would be 0.08 + 0.26 + 0.02 = 0.36.
    assert ece(PROBS, LABELS, n_bins=4) == pytest.approx(0.20)


def test_ece_single_bin_is_gap_between_mean_confidence_and_accuracy():
    # One bin: |mean conf - acc| = |(0.9 + 0.5 + 0.5 + 0.7 + 0.4)/5 - 0.8| = |0.6 - 0.8| = 0.2
    assert ece(PROBS, LABELS, n_bins=1) == pytest.approx(0.2)


def test_ece_of_perfectly_confident_correct_predictor_is_zero():
    probs = torch.eye(3)
    assert ece(probs, torch.tensor([0, 1, 2])) == 0.0


def test_nll_by_hand_perfect_and_uniform():
    # -(ln .9 + ln .5 + ln .5 + ln .7 + ln .3) / 5
    expected = -(math.log(0.9) + 2 * math.log(0.5) + math.log(0.7) + math.log(0.3)) / 5
    assert nll(PROBS, LABELS) == pytest.approx(expected, rel=1e-6)
    assert nll(torch.eye(3), torch.tensor([0, 1, 2])) == 0.0
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    assert nll(uniform, torch.tensor([0, 1, 2, 3])) == pytest.approx(math.log(4))


def test_nll_clamps_a_zero_probability_on_the_true_class():
    # p_y = 0 -> -ln(1e-12) = 27.631..., finite
    value = nll(torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
    assert value == pytest.approx(-math.log(NLL_EPS))


def test_brier_by_hand_perfect_and_uniform():
    # A: .1^2 + .05^2 + .05^2 = .015     B: .5^2 + .3^2 + .2^2 = .38
    # C: .5^2 + .25^2 + .25^2 = .375     D: .1^2 + .3^2 + .2^2 = .14
    # E: .7^2 + .3^2 + .4^2 = .74        mean = 1.65 / 5 = .33
    assert brier(PROBS, LABELS) == pytest.approx(0.33, abs=1e-6)
    assert brier(torch.eye(3), torch.tensor([0, 1, 2])) == 0.0
    # uniform over C = 5: (1 - 1/5)^2 + 4 * (1/5)^2 = 0.64 + 0.16 = 0.8 = 1 - 1/C
    uniform = torch.full((2, 5), 0.2, dtype=torch.float64)
    assert brier(uniform, torch.tensor([0, 4])) == pytest.approx(0.8)


def test_confidence_histogram_counts_on_20_bins():
    # width .05, (lo, hi]: .9 -> 17, .5 -> 9 (twice), .7 -> 13 (all correct); .4 -> 7 (wrong)
    hist = confidence_histogram(PROBS, LABELS)
    correct, incorrect = [0] * 20, [0] * 20
    correct[17], correct[9], correct[13] = 1, 2, 1
    incorrect[7] = 1
    assert hist == {"correct": correct, "incorrect": incorrect}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_binning_holds_in_both_float_widths(dtype):
    # 0.6 is not exact in binary; with 5 bins it must still land in (0.4, 0.6] = bin 2,
    # and confidence 1.0 in the last bin.
    probs = torch.tensor([[0.6, 0.4], [1.0, 0.0]], dtype=dtype)
    hist = confidence_histogram(probs, torch.tensor([0, 1]), n_bins=5)
    assert hist == {"correct": [0, 0, 1, 0, 0], "incorrect": [0, 0, 0, 0, 1]}


def test_spread_uses_population_std():
    # mean .7; population std sqrt((.04 + 0 + .04)/3) = sqrt(.08/3); the sample std would be 0.2
    s = spread([0.5, 0.7, 0.9])
    assert s == pytest.approx({"mean": 0.7, "std": math.sqrt(0.08 / 3), "min": 0.5, "max": 0.9})
    assert spread([0.4]) == {"mean": 0.4, "std": 0.0, "min": 0.4, "max": 0.4}


def test_worst_domain_breaks_ties_alphabetically():
    assert worst_domain({"photo": 0.8, "sketch": 0.4, "art": 0.4}) == ("art", 0.4)
    assert worst_domain({"cartoon": 0.3}) == ("cartoon", 0.3)


def test_evaluate_probs_combines_metrics_and_serialises_to_summary_format():
    result = evaluate_probs(PROBS, LABELS, ece_bins=4)
    assert result.n == 5
    assert result.acc == pytest.approx(0.8)
    assert result.ece == pytest.approx(0.20)
    assert result.brier == pytest.approx(0.33, abs=1e-6)
    assert result.nll == pytest.approx(nll(PROBS, LABELS))
    assert result.reliability.count == [0, 3, 1, 1]
    assert sum(result.conf_hist["correct"]) == 4 and sum(result.conf_hist["incorrect"]) == 1
    # the report reads reliability as {"count", "conf", "acc"} from summary.json
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data["reliability"]) == {"count", "conf", "acc"}
    assert data["reliability"]["count"] == [0, 3, 1, 1]


def test_logits_passed_as_probs_are_rejected():
    with pytest.raises(DataError, match="sum to 1"):
        nll(torch.tensor([[3.0, -1.0]]), torch.tensor([0]))


@pytest.mark.parametrize(
    ("probs", "labels", "match"),
    [
        (torch.full((3, 2), 0.5), torch.tensor([0, 1]), r"\[N, C\].*\(3, 2\).*\(2,\)"),
        (torch.full((2, 2), 0.5), torch.tensor([0, 2]), r"\[0, 1\], got range \[0, 2\]"),
        (torch.full((2, 2), 0.5), torch.tensor([0.0, 1.0]), "integer class indices"),
        (torch.zeros((0, 2)), torch.zeros(0, dtype=torch.long), "empty"),
    ],
)
def test_bad_inputs_raise_data_error(probs, labels, match):
    with pytest.raises(DataError, match=match):
        ece(probs, labels)


def test_bad_spread_and_worst_domain_inputs():
    with pytest.raises(DataError, match="non-empty"):
        spread([])
    with pytest.raises(DataError, match="empty mapping"):
        worst_domain({})
    with pytest.raises(DataError, match="n_bins must be >= 1, got 0"):
        ece(PROBS, LABELS, n_bins=0)
