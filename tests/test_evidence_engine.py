"""Evidence for the engine's numbers: every expected value here is derived independently of the
code under test (by hand, by a float64 reference formula written below, or by an exact reduction),
never read back from the implementation.

Shared tolerances (the code works in float32, the references in float64):
- accuracies are compared exactly (as fractions): the reference model runs the very same float32
  forward pass on the same one batch, so argmaxes agree bit for bit;
- ECE / NLL / Brier: the code's softmax is float32, so each probability is within a few float32
  ulps (~1e-7 relative) of the float64 reference; means of their logs / squares therefore agree to
  ~1e-6, and ``PROB_TOL`` = 1e-5 leaves a margin while still being far below any planted fault.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from fractions import Fraction
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddomain.algorithms.base import ClientAlgorithm, ClientContext
from feddomain.algorithms.fedavg import FedAvgServer
from feddomain.algorithms.fedprox import FedProxClient, FedProxHparams
from feddomain.data.federated import FederatedData, build_federated_data
from feddomain.data.splits import DomainSplit
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import INIT, derive_seed
from feddomain.federation.training import train_epochs
from feddomain.models import build_model
from tests.engine_helpers import (
    run_sim,
    temporary_method,
    tiny_config,
    tiny_dataset,
    tiny_federation,
)

PROB_TOL = 1e-5  # float32 softmax vs float64 reference, see the module docstring
TRAIN_SIZES = (36, 18, 9)
VAL_SIZES = (4, 2, 1)
D1_SIZE = 25  # target d1 is cut to 25 of its 40 samples, so the two target domains differ in size


# --------------------------------------------------------------------------- helpers
def _cut(data: ClientData, n: int) -> ClientData:
    assert len(data) >= n
    return ClientData(data.inputs[:n].clone(), data.labels[:n].clone(), data.transform)


def uneven_federation(cfg) -> FederatedData:
    """Three clients of unequal sizes (train 36/18/9, val 4/2/1) over sources d2, d3; an ood
    validation domain d4; two target domains d0 (40 samples) and d1 (25 samples)."""
    fed = build_federated_data(
        cfg, tiny_dataset(n_domains=5), DomainSplit(("d2", "d3"), ("d4",), ("d0", "d1"))
    )
    fed = dataclasses.replace(
        fed,
        train=[_cut(t, n) for t, n in zip(fed.train, TRAIN_SIZES, strict=True)],
        val=[_cut(v, n) for v, n in zip(fed.val, VAL_SIZES, strict=True)],
        targets={"d0": fed.targets["d0"], "d1": _cut(fed.targets["d1"], D1_SIZE)},
    )
    assert [len(t) for t in fed.train] == list(TRAIN_SIZES)  # really unequal
    assert [len(v) for v in fed.val] == list(VAL_SIZES)
    assert {d: len(t) for d, t in fed.targets.items()} == {"d0": 40, "d1": D1_SIZE}
    return fed


def _model(cfg, arrays) -> nn.Module:
    """A fresh model of the run's architecture holding ``arrays``, in eval mode."""
    model = build_model(cfg.model.name, 3, **cfg.model.options)
    model.load_state_dict(arrays)
    return model.eval()


def _plain(data: ClientData) -> torch.Tensor:
    """The un-augmented model input of tiny runs (no mean/std configured): x / 255."""
    return data.inputs.float() / 255


def _logits(model: nn.Module, data: ClientData) -> torch.Tensor:
    with torch.no_grad():
        return model(_plain(data))


def _reference(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> dict:
    """Accuracy (exact fraction), ECE with ``n_bins`` equal-width (lo, hi] bins (the first also
    holds 0), NLL with p_y floored at 1e-12, multi-class Brier (sum over classes), in float64."""
    p = torch.softmax(logits.double(), dim=1)
    n = len(labels)
    conf, pred = p.max(dim=1)
    correct = (pred == labels).double()
    ece = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        inside = (conf <= hi) & ((conf > lo) | (b == 0))
        k = int(inside.sum())
        if k:
            ece += k / n * abs(float(correct[inside].mean()) - float(conf[inside].mean()))
    p_true = p[torch.arange(n), labels]
    onehot = torch.zeros_like(p)
    onehot[torch.arange(n), labels] = 1.0
    return {
        "acc": Fraction(int(correct.sum()), n),
        "ece": ece,
        "nll": float(-torch.log(torch.clamp(p_true, min=1e-12)).mean()),
        "brier": float(((p - onehot) ** 2).sum(dim=1).mean()),
        "conf": conf,
        "correct": correct,
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _pop_spread(values: list[Fraction]) -> dict[str, float]:
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / len(values)  # population variance, exact
    return {
        "mean": float(m),
        "std": math.sqrt(var),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def _bins(conf: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Bin index of each confidence under the (lo, hi] convention, by a plain loop."""
    out = torch.empty(len(conf), dtype=torch.long)
    for i, c in enumerate(conf.tolist()):
        out[i] = next(b for b in range(n_bins) if c <= (b + 1) / n_bins)
    return out


def _spy_aggregate(sim: Simulation) -> list[tuple[int, dict, list[tuple[int, Message]]]]:
    """Wrap the server's aggregate: records (round, global arrays before, replies seen)."""
    seen: list[tuple[int, dict, list[tuple[int, Message]]]] = []
    aggregate = sim.server.aggregate

    def spy(rnd, replies):
        before = {k: v.clone() for k, v in sim.server.global_arrays.items()}
        got: list[tuple[int, Message]] = []
        seen.append((rnd, before, got))

        def tee():
            for cid, msg in replies:
                got.append((cid, msg.copy()))
                yield cid, msg

        aggregate(rnd, tee())

    sim.server.aggregate = spy
    return seen


def _weighted64(pairs: list[tuple[float, dict]]) -> dict[str, torch.Tensor]:
    """Reference sum_i n_i w_i / sum_i n_i in float64."""
    total = sum(n for n, _ in pairs)
    keys = pairs[0][1].keys()
    return {k: sum(n * a[k].double() for n, a in pairs) / total for k in keys}


def _max_gap(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ----------------------------------------------------------- 1. run-level numbers
def test_run_level_numbers_and_selection_match_an_independent_reference(tmp_path):
    """Catches wrong run-level means/ECE/NLL/Brier/per-domain/worst/spread/selection numbers."""
    # Every evaluated round of a Local-only run (3 distinct models) against a float64 reference:
    # unweighted means over clients (and over target domains), pooled calibration, and the
    # source_val pick (highest exact id accuracy, latest on ties) in summary.json.
    cfg = tiny_config(
        rounds=4,
        seed=0,
        algorithm="local",
        train__optimizer="adam",
        train__lr=0.002,
        train__batch_size=16,
    )
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    snapshots: list[list[dict]] = []
    evaluate = sim.evaluate

    def spy():  # the per-client models (Local keeps one per client) at each evaluation
        snapshots.append([{k: v.clone() for k, v in s.arrays.items()} for s in sim.states])
        return evaluate()

    sim.evaluate = spy
    sim.run()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["round"] for r in records] == [1, 2, 3, 4] and len(snapshots) == 4

    expected = []
    weighting_would_differ = domain_weighting_would_differ = False
    for rec, models in zip(records, snapshots, strict=True):
        ids, ood, ood_val = [], [], []
        for arrays, val in zip(models, fed.val, strict=True):
            model = _model(cfg, arrays)
            ids.append(_reference(_logits(model, val), val.labels))
            ood.append({d: _reference(_logits(model, t), t.labels) for d, t in fed.targets.items()})
            ood_val.append(_reference(_logits(model, fed.ood_val["d4"]), fed.ood_val["d4"].labels))
        id_accs = [r["acc"] for r in ids]
        client_ood = [_mean(c[d]["acc"] for d in ("d0", "d1")) for c in ood]  # unweighted
        per_domain = {d: _mean(c[d]["acc"] for c in ood) for d in ("d0", "d1")}
        worst = min(sorted(per_domain), key=lambda d: per_domain[d])
        weighted_id = sum(a * n for a, n in zip(id_accs, VAL_SIZES, strict=True)) / sum(VAL_SIZES)
        weighting_would_differ |= weighted_id != _mean(id_accs)
        domain_weighting_would_differ |= any(c["d0"]["acc"] != c["d1"]["acc"] for c in ood)
        exp = {
            "id_acc": _mean(id_accs),
            "ood_acc": _mean(client_ood),
            "per_domain": per_domain,
            "worst_domain": worst,
            "per_client_id": id_accs,
            "per_client_ood": client_ood,
            "ood_val_acc": _mean(r["acc"] for r in ood_val),
        }
        for field in ("ece", "nll", "brier"):
            exp[field] = _mean(_mean(c[d][field] for d in ("d0", "d1")) for c in ood)
        # pooled reliability (15 bins) over every (client, target domain) prediction, each
        # target image once: the three clients' distinct models count a third each
        conf = torch.cat([c[d]["conf"] for c in ood for d in ("d0", "d1")])
        correct = torch.cat([c[d]["correct"] for c in ood for d in ("d0", "d1")])
        bins = _bins(conf, 15)
        exp["rel_count"] = [pytest.approx(int((bins == b).sum()) / 3) for b in range(15)]
        exp["rel_conf"] = [
            float(conf[bins == b].mean()) if (bins == b).any() else 0.0 for b in range(15)
        ]
        exp["rel_acc"] = [
            float(correct[bins == b].mean()) if (bins == b).any() else 0.0 for b in range(15)
        ]
        # pooled 20-bin confidence histograms, id and ood
        hist = {}
        for name, parts, share in (
            ("id", ids, 1),
            ("ood", [c[d] for c in ood for d in ("d0", "d1")], 3),
        ):
            cf = torch.cat([r["conf"] for r in parts])
            ok = torch.cat([r["correct"] for r in parts]).bool()
            hb = _bins(cf, 20)
            hist[name] = {
                "correct": [pytest.approx(int(((hb == b) & ok).sum()) / share) for b in range(20)],
                "incorrect": [
                    pytest.approx(int(((hb == b) & ~ok).sum()) / share) for b in range(20)
                ],
            }
        exp["hist"] = hist
        expected.append(exp)

        # the round's record against the reference
        assert rec["per_client"]["id_acc"] == pytest.approx([float(a) for a in id_accs], abs=1e-12)
        assert rec["per_client"]["ood_acc"] == pytest.approx(
            [float(a) for a in client_ood], abs=1e-12
        )
        assert rec["id_acc"] == pytest.approx(float(exp["id_acc"]), abs=1e-12)
        assert rec["ood_acc"] == pytest.approx(float(exp["ood_acc"]), abs=1e-12)
        assert rec["per_domain"] == pytest.approx(
            {d: float(v) for d, v in per_domain.items()}, abs=1e-12
        )
        assert rec["worst_domain"] == worst
        assert rec["worst_domain_acc"] == pytest.approx(float(per_domain[worst]), abs=1e-12)
        assert rec["ood_val_acc"] == pytest.approx(float(exp["ood_val_acc"]), abs=1e-12)
        assert rec["ood_ece"] == pytest.approx(exp["ece"], abs=PROB_TOL)
        assert rec["ood_nll"] == pytest.approx(exp["nll"], abs=PROB_TOL)
        assert rec["ood_brier"] == pytest.approx(exp["brier"], abs=PROB_TOL)
        assert rec["id_spread"] == pytest.approx(_pop_spread(id_accs), abs=1e-12)
        assert rec["ood_spread"] == pytest.approx(_pop_spread(client_ood), abs=1e-12)
        assert rec["distinct_models"] == 3
        rel = rec["calibration"]["reliability"]
        assert rel["count"] == exp["rel_count"]
        assert rel["conf"] == pytest.approx(exp["rel_conf"], abs=PROB_TOL)
        assert rel["acc"] == pytest.approx(exp["rel_acc"], abs=1e-12)
        assert rec["calibration"]["confidence_hist"] == hist

    # the test can tell weighted from unweighted means, and domains apart
    assert weighting_would_differ and domain_weighting_would_differ
    assert all(len(set(e["per_client_ood"])) > 1 for e in expected)  # spreads are not trivial
    assert len({float(v) for v in expected[-1]["per_domain"].values()}) == 2

    # source_val: the round with the highest (exact) id accuracy, the latest on ties. The
    # preconditions below depend on this run's trajectory; the smallest top-2 logit margin on a
    # validation sample here is ~7e-3, far above cross-CPU float32 differences (~1e-6).
    best = max(e["id_acc"] for e in expected)
    tied = [i for i, e in enumerate(expected) if e["id_acc"] == best]
    chosen = tied[-1]
    # this run has a tie at the best round (so the tie rule shows) and the pick is not the last
    # round (so "last" shows); the tied rounds have the same per-client values, so the tie is
    # exact in float arithmetic too
    assert len(tied) > 1 and chosen != len(expected) - 1
    assert all(expected[i]["per_client_id"] == expected[chosen]["per_client_id"] for i in tied)
    exp = expected[chosen]
    assert summary["selection"] == "source_val"
    assert summary["selected_round"] == chosen + 1
    assert summary["id_acc"] == pytest.approx(float(exp["id_acc"]), abs=1e-12)
    assert summary["ood_acc"] == pytest.approx(float(exp["ood_acc"]), abs=1e-12)
    assert summary["ood_ece"] == pytest.approx(exp["ece"], abs=PROB_TOL)
    assert summary["ood_nll"] == pytest.approx(exp["nll"], abs=PROB_TOL)
    assert summary["ood_brier"] == pytest.approx(exp["brier"], abs=PROB_TOL)
    assert summary["per_domain"] == pytest.approx(
        {d: float(v) for d, v in exp["per_domain"].items()}, abs=1e-12
    )
    assert summary["worst_domain_acc"] == pytest.approx(
        float(exp["per_domain"][exp["worst_domain"]]), abs=1e-12
    )
    assert summary["per_client"]["id_acc"] == pytest.approx(
        [float(a) for a in exp["per_client_id"]], abs=1e-12
    )
    assert summary["reliability"]["ood"]["count"] == exp["rel_count"]
    assert summary["confidence_hist"] == exp["hist"]
    last = expected[-1]
    assert summary["final"]["id_acc"] == pytest.approx(float(last["id_acc"]), abs=1e-12)
    assert summary["final"]["ood_acc"] == pytest.approx(float(last["ood_acc"]), abs=1e-12)
    assert summary["final"]["ood_nll"] == pytest.approx(last["nll"], abs=PROB_TOL)
    assert summary["final"]["per_domain"] == pytest.approx(
        {d: float(v) for d, v in last["per_domain"].items()}, abs=1e-12
    )
    assert summary["n_clients"] == 3 and summary["target_domains"] == ["d0", "d1"]


# ----------------------------------------------------------------- 2. sample weighting
def test_fedavg_aggregate_is_the_sample_weighted_mean_of_unequal_clients(tmp_path):
    """Catches an unweighted (or otherwise wrongly weighted) FedAvg mean over unequal clients."""
    cfg = tiny_config(rounds=2, train__lr=0.1)
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    seen = _spy_aggregate(sim)
    sim.run()
    results = [before for _, before, _ in seen[1:]] + [sim.server.global_arrays]
    gaps = []
    for (rnd, _, replies), result in zip(seen, results, strict=True):
        assert [c for c, _ in replies] == [0, 1, 2], rnd
        # num_examples are the hand-known training sizes, not something the code chose
        assert [m.scalars["num_examples"] for _, m in replies] == list(TRAIN_SIZES)
        expected = _weighted64(
            [(n, m.arrays) for n, (_, m) in zip(TRAIN_SIZES, replies, strict=True)]
        )
        for k, v in expected.items():
            # the code accumulates in float64 and rounds once to float32: within half a float32
            # ulp; every |w| < 1 here, so that is at most 2**-25, inside the 2**-24 allowed
            assert float(v.abs().max()) < 1
            torch.testing.assert_close(result[k].double(), v, rtol=0, atol=2**-24, msg=k)
        unweighted = _weighted64([(1, m.arrays) for _, m in replies])
        gaps.append(_max_gap(expected, unweighted))
    assert min(gaps) > 1e-5  # weighted and unweighted means really differ here


def test_fedavg_server_lr_moves_part_way_to_the_mean(tmp_path):
    """Catches a server_lr that is ignored or misapplied: w <- w + lr * (mean - w), lr = 0.3."""
    # 0.3, not 0.5: at 0.5 swapping lr and 1 - lr would give the same result
    server_lr = 0.3
    cfg = tiny_config(rounds=2, train__lr=0.1, algorithm={"name": "fedavg", "server_lr": server_lr})
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    seen = _spy_aggregate(sim)
    sim.run()
    init = sim.server.ctx.model_factory().state_dict()
    assert all(torch.equal(seen[0][1][k], v) for k, v in init.items())  # round 1 starts at init
    results = [seen[1][1], sim.server.global_arrays]
    for (_, before, replies), result in zip(seen, results, strict=True):
        mean = _weighted64([(n, m.arrays) for n, (_, m) in zip(TRAIN_SIZES, replies, strict=True)])
        expected = {
            k: before[k].double() + server_lr * (mean[k] - before[k].double()) for k in mean
        }
        # the code does this step in float32 on |w| < 1: a few float32 ulps (< 2.4e-7) off
        for k, v in expected.items():
            torch.testing.assert_close(result[k].double(), v, rtol=0, atol=1e-6, msg=k)
        assert _max_gap(expected, mean) > 1e-4  # lr = 1 would be told apart


def test_stations_weight_by_samples_at_both_tiers(tmp_path):
    """Catches stations weighted equally or reporting a wrong num_examples to the server."""
    # Exact reduction: with sample-count weights at both tiers the two-tier result is the flat
    # sample-weighted mean over all clients.
    cfg = tiny_config(rounds=1, train__lr=0.1, topology__stations=2)
    fed = uneven_federation(cfg)
    assert [s.tolist() for s in fed.stations] == [[0, 1], [2]]  # contiguous: 36+18 vs 9
    sim = Simulation(cfg, fed, tmp_path)
    server_seen = _spy_aggregate(sim)
    client_replies: list[tuple[int, Message]] = []

    def spy(station_aggregate):
        def aggregate(rnd, r, replies):
            def tee():
                for cid, msg in replies:
                    client_replies.append((cid, msg.copy()))
                    yield cid, msg

            return station_aggregate(rnd, r, tee())

        return aggregate

    for station in sim.stations:
        station.aggregate = spy(station.aggregate)
    sim.run()
    assert [c for c, _ in client_replies] == [0, 1, 2]
    stations = server_seen[0][2]
    assert [sid for sid, _ in stations] == [0, 1]
    assert [m.scalars["num_examples"] for _, m in stations] == [36 + 18, 9]
    flat = _weighted64(
        [(n, m.arrays) for n, (_, m) in zip(TRAIN_SIZES, client_replies, strict=True)]
    )
    # two float64 means (station, then server), each rounded to float32 once: half a float32
    # ulp each; with every |w| < 1 that is <= 2**-25 per rounding, so 2**-23 leaves a 2x margin
    for k, v in flat.items():
        assert float(v.abs().max()) < 1
        got = sim.server.global_arrays[k].double()
        torch.testing.assert_close(got, v, rtol=0, atol=2**-23, msg=k)
    station_models = [m.arrays for _, m in stations]
    equal_stations = _weighted64([(1, a) for a in station_models])
    assert _max_gap(flat, equal_stations) > 1e-5  # equal station weights would be told apart


# ---------------------------------------------------- 3. regulariser and optimiser mechanics
def test_fedprox_regularizer_value_and_gradient_on_hand_made_tensors():
    """Catches a proximal term other than mu/2 * ||w - w_global||^2 (gradient mu * (w - g))."""
    model = nn.Linear(2, 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    received = Message(
        "fit",
        {
            "weight": torch.tensor([[0.0, 1.0]], dtype=torch.float64),
            "bias": torch.tensor([-0.5], dtype=torch.float64),
        },
    )
    ctx = ClientContext(
        cid=0,
        rnd=1,
        model=model,
        train=None,
        val=None,
        state=Message("state"),
        generator=torch.Generator(),
        local_epochs=1,
        batch_size=1,
        make_optimizer=None,
    )
    proximal = FedProxClient(FedProxHparams(mu=0.3)).regularizer(received, ctx)
    value = proximal()
    # w - g = (1, -3 | 1): squared norm 1 + 9 + 1 = 11; 0.3 / 2 * 11 = 1.65
    assert float(value.detach()) == pytest.approx(1.65, abs=1e-12)
    value.backward()
    # d/dw = mu * (w - g) = 0.3 * (1, -3) and 0.3 * 1
    assert model.weight.grad[0].tolist() == pytest.approx([0.3, -0.9], abs=1e-12)
    assert model.bias.grad.tolist() == pytest.approx([0.3], abs=1e-12)


def test_fedprox_training_step_adds_mu_times_distance_to_the_gradient(tmp_path):
    """Catches a FedProx proximal term missing from, or mis-scaled in, the training step."""
    # Two full-batch SGD steps: w2 = w1 - lr * (grad CE(w1) + mu * (w1 - w_global)).
    lr, mu = 0.5, 2.0
    raw = {
        "rounds": 1,
        "partition__n_clients": 1,
        "partition__d": 3,
        "train__lr": lr,
        "train__batch_size": 10_000,
        "train__local_epochs": 2,
    }
    cfg = tiny_config(**raw, algorithm={"name": "fedprox", "mu": mu})
    fed = tiny_federation(cfg)
    sim = run_sim(cfg, tmp_path / "prox", fed)

    torch.manual_seed(derive_seed(cfg.seed, INIT))
    model = build_model("lenet5", 3)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _plain(fed.train[0]), fed.train[0].labels
    steps = []
    for _ in range(2):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            step = {n: p.grad + mu * (p - w0[n]) for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                p -= lr * step[n]
        steps.append(step)
    # full batch, so only the summation order of the batch mean differs from the code
    # (shuffled): float32 rounding ~1e-7 relative, two steps -> well inside 1e-5
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            sim.server.global_arrays[n], p.detach(), rtol=0, atol=1e-5, msg=n
        )
    # the proximal part of step 2, lr * mu * (w1 - w0), is large enough to be seen
    gap = max(float((lr * mu * (steps[0][n] * -lr)).abs().max()) for n in w0)
    assert gap > 1e-3


def _linear_problem(scale: float):
    """A float64 linear classifier at zero weights on 12 samples; its CE gradient by hand."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 4, generator=g, dtype=torch.float64) * scale
    y = torch.tensor([0, 1, 2] * 4)
    model = nn.Linear(4, 3).double()
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    # at zero weights p = 1/3 everywhere: dCE/dlogits = (p - onehot) / N
    delta = (torch.full((12, 3), 1 / 3, dtype=torch.float64) - F.one_hot(y, 3).double()) / 12
    grad = {"weight": delta.T @ x, "bias": delta.sum(0)}
    norm = math.sqrt(sum(float((v**2).sum()) for v in grad.values()))
    return model, ClientData(x, y), grad, norm


@pytest.mark.parametrize("clipped", [True, False])
def test_gradient_clipping_step_equals_the_bound_or_is_untouched(clipped):
    """Catches a skipped or wrong gradient clip: one SGD step must be -g * min(1, c/||g||)."""
    # clipped: the step norm EQUALS the bound (not just <=); unclipped: the step is untouched
    model, data, grad, norm = _linear_problem(scale=30.0)
    assert norm > 10  # a large raw gradient
    bound = norm / 7 if clipped else norm * 7
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_epochs(
        model,
        data,
        torch.optim.SGD(model.parameters(), lr=1.0),
        epochs=1,
        batch_size=12,
        generator=torch.Generator().manual_seed(1),
        grad_clip=bound,
    )
    step = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    moved = math.sqrt(sum(float((v**2).sum()) for v in step.values()))
    factor = min(1.0, bound / norm)
    # float64 throughout; torch divides by (||g|| + 1e-6), a relative 1e-6/||g|| < 1e-7 effect
    assert moved == pytest.approx(min(bound, norm), rel=1e-6)
    for n in step:
        torch.testing.assert_close(step[n], -factor * grad[n], rtol=1e-6, atol=1e-12)


# --------------------------------------------------------------------- 4. Central pooling
def _rows(data: ClientData) -> Counter:
    return Counter(
        (x.numpy().tobytes(), int(y)) for x, y in zip(data.inputs, data.labels, strict=True)
    )


def test_central_pools_exactly_the_union_of_all_clients_samples(tmp_path):
    """Catches a Central pool that loses/duplicates client samples or does not train on all."""
    lr = 0.1
    cfg = tiny_config(rounds=1, algorithm="central", train__lr=lr, train__batch_size=10_000)
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    assert sim.data.n_clients == 1
    pool_train, pool_val = sim.data.train[0], sim.data.val[0]
    assert len(pool_train) == sum(TRAIN_SIZES) and len(pool_val) == sum(VAL_SIZES)
    assert _rows(pool_train) == sum((_rows(t) for t in fed.train), Counter())
    assert _rows(pool_val) == sum((_rows(v) for v in fed.val), Counter())
    assert len(_rows(pool_train)) == sum(TRAIN_SIZES)  # no repeated images: a multiset check bites
    sim.run()

    # one full-batch SGD step on the union, computed here from the clients' own data
    torch.manual_seed(derive_seed(cfg.seed, INIT))
    model = build_model("lenet5", 3)
    x = torch.cat([_plain(t) for t in fed.train])
    y = torch.cat([t.labels for t in fed.train])
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    # the same full batch in another order: float32 summation differences only (~1e-8 here)
    for n, v in model.state_dict().items():
        torch.testing.assert_close(sim.server.global_arrays[n], v, rtol=0, atol=1e-6, msg=n)
    union = ClientData(
        torch.cat([v.inputs for v in fed.val]), torch.cat([v.labels for v in fed.val])
    )
    expected = _reference(_logits(_model(cfg, sim.server.global_arrays), union), union.labels)
    assert sim.records[-1]["per_client"]["id_acc"] == [pytest.approx(float(expected["acc"]))]
    assert sim.records[-1]["id_acc"] == pytest.approx(float(expected["acc"]), abs=1e-12)


# ------------------------------------------------------------------ 5. evaluation protocol
def test_models_are_scored_in_eval_mode(tmp_path):
    """Catches scoring in train mode: BatchNorm must use running stats, as model.eval() does."""
    cfg = tiny_config(rounds=1, model__name="small_cnn", model__options={"widths": [4, 8]})
    fed = uneven_federation(cfg)
    sim = run_sim(cfg, tmp_path, fed)
    assert any(isinstance(m, nn.BatchNorm2d) for m in sim.model.modules())
    rec = sim.records[-1]
    model = _model(cfg, sim.server.global_arrays)
    ids = [_reference(_logits(model, v), v.labels) for v in fed.val]
    ood = {d: _reference(_logits(model, t), t.labels) for d, t in fed.targets.items()}
    assert rec["per_client"]["id_acc"] == pytest.approx([float(r["acc"]) for r in ids], abs=1e-12)
    assert rec["ood_acc"] == pytest.approx(float(_mean(r["acc"] for r in ood.values())), abs=1e-12)
    eval_nll = _mean(r["nll"] for r in ood.values())
    assert rec["ood_nll"] == pytest.approx(eval_nll, abs=PROB_TOL)
    # train mode (batch statistics) gives clearly different numbers on the same model
    model.train()
    train_nll = _mean(_reference(_logits(model, t), t.labels)["nll"] for t in fed.targets.values())
    assert abs(train_nll - eval_nll) > 1e-3


AUGMENT = {
    "hflip": True,
    "random_resized_crop": [0.5, 1.0],
    "color_jitter": [0.4, 0.4, 0.4, 0.1],
    "grayscale_p": 0.5,
}


def test_validation_and_target_data_are_never_augmented(tmp_path):
    """Catches train.augment applied to validation/target data (or their metrics)."""
    cfg = tiny_config(rounds=1, train__augment=AUGMENT)
    fed = uneven_federation(cfg)
    held_out = [*fed.val, *fed.targets.values(), *fed.ood_val.values()]
    for data in held_out:
        x, _ = next(data.batches(len(data), torch.Generator().manual_seed(3), shuffle=False))
        assert torch.equal(x, _plain(data))
    for data in fed.train:  # ... while the training batches are augmented
        x, _ = next(data.batches(len(data), torch.Generator().manual_seed(3), shuffle=False))
        assert not torch.equal(x, _plain(data))

    sim = run_sim(cfg, tmp_path, fed)
    rec = sim.records[-1]
    model = _model(cfg, sim.server.global_arrays)
    ids = [_reference(_logits(model, v), v.labels) for v in fed.val]
    ood = {d: _reference(_logits(model, t), t.labels) for d, t in fed.targets.items()}
    assert rec["per_client"]["id_acc"] == pytest.approx([float(r["acc"]) for r in ids], abs=1e-12)
    assert rec["per_domain"] == pytest.approx(
        {d: float(r["acc"]) for d, r in ood.items()}, abs=1e-12
    )
    assert rec["ood_nll"] == pytest.approx(_mean(r["nll"] for r in ood.values()), abs=PROB_TOL)
    assert rec["ood_brier"] == pytest.approx(_mean(r["brier"] for r in ood.values()), abs=PROB_TOL)


# ---------------------------------------------------------------- 6. non-finite updates
class _ShiftOrPoison(ClientAlgorithm):
    """Replies with the received arrays + 1; the clients named in ``poison`` put a non-finite
    value (given per client) into one array."""

    poison: ClassVar[dict[int, tuple[str, float]]] = {}

    def run(self, msg, ctx):
        arrays = {k: v + 1 for k, v in msg.arrays.items()}
        if ctx.cid in self.poison:
            name, value = self.poison[ctx.cid]
            arrays[name].view(-1)[0] = value
        return Message("fit", arrays, {"num_examples": len(ctx.train)})

    def uploads(self, n_clients):
        return Uploads(model=("*",))


class _PlusMinusInf(_ShiftOrPoison):
    poison: ClassVar[dict[int, tuple[str, float]]] = {
        1: ("classifier.bias", math.inf),
        2: ("featurizer.conv1.weight", -math.inf),
    }


class _AllBad(_ShiftOrPoison):
    poison: ClassVar[dict[int, tuple[str, float]]] = {
        0: ("classifier.bias", math.nan),
        1: ("classifier.weight", math.inf),
        2: ("featurizer.fc1.bias", -math.inf),
    }


def test_plus_and_minus_infinity_updates_are_rejected(tmp_path):
    """Catches a finiteness check that only looks for NaN: +Inf and -Inf replies are rejected."""
    with temporary_method("_inf", FedAvgServer, _PlusMinusInf):
        cfg = tiny_config(rounds=2, algorithm="_inf")
        sim = run_sim(cfg, tmp_path, uneven_federation(cfg))
    assert sim.rejected == [
        {"round": 1, "client": 1, "arrays": ["classifier.bias"]},
        {"round": 1, "client": 2, "arrays": ["featurizer.conv1.weight"]},
        {"round": 2, "client": 1, "arrays": ["classifier.bias"]},
        {"round": 2, "client": 2, "arrays": ["featurizer.conv1.weight"]},
    ]
    # only client 0 is left each round: the mean of one reply is that reply, (init + 1) + 1
    init = sim.server.ctx.model_factory().state_dict()
    for k, v in init.items():
        assert torch.equal(sim.server.global_arrays[k], (v + 1) + 1), k


@pytest.mark.parametrize("stations", [0, 2])
def test_a_round_with_every_update_rejected_keeps_the_model_and_completes(tmp_path, stations):
    """Catches a crash or a moved global model when every client of a round is rejected."""
    with temporary_method("_allbad", FedAvgServer, _AllBad):
        cfg = tiny_config(rounds=2, algorithm="_allbad", topology__stations=stations)
        sim = run_sim(cfg, tmp_path, uneven_federation(cfg))
    init = sim.server.ctx.model_factory().state_dict()
    for k, v in init.items():
        assert torch.equal(sim.server.global_arrays[k], v), k
    assert [(r["round"], r["client"]) for r in sim.rejected] == [
        (rnd, c) for rnd in (1, 2) for c in (0, 1, 2)
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["round"] for r in sim.records] == [1, 2]
    assert len(summary["rejected_updates"]) == 6
    model_bytes = sum(v.numel() * v.element_size() for v in init.values())
    client_link = summary["links"]["client-station" if stations else "client-server"]
    assert client_link["up"]["model"] == 6 * model_bytes  # every client still sent its model
    if stations:  # ... but no station reply went up to the server
        assert summary["links"]["station-server"]["up"]["model"] == 0
