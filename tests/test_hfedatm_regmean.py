"""Shrinkage-aware RegMean and Gram handling: hfedatm.md §9 checks A5-A9 and A12."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from feddomain.algorithms.base import StationAlgorithm, StationContext
from feddomain.algorithms.fedavg import FedAvgClient
from feddomain.algorithms.hfedatm import (
    ACTIVE,
    CAPTURE,
    GramClient,
    HFedATMHparams,
    HierarchicalStation,
)
from feddomain.federation.messages import Message
from feddomain.merging.gram import (
    PREFIX,
    accumulating,
    check_grams,
    dp_sigma,
    gram_of,
    privatise,
    project_psd,
    recording,
)
from feddomain.merging.regmean import objective, regmean, shrink

D_IN, D_OUT = 6, 4


def stations(seed: int = 0, rows=(5, 9, 14)):
    """Per station: activations X_e (unequal row counts), weight W_e, Gram X_eᵀX_e (float64)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, D_IN, generator=gen, dtype=torch.float64) for m in rows]
    ws = [torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64) for _ in rows]
    return xs, ws, [x.T @ x for x in xs]


def test_a5_the_merge_solves_the_normal_equations_and_beats_the_mean():
    """A5. Catches: a transposed solve (W = A⁻¹B instead of B A⁻¹), Grams multiplied on the
    wrong side of W_e, and a merge that does not minimise the RegMean objective."""
    _, ws, grams = stations()
    for alpha in (0.0, 0.75, 1.0):
        shrunk = [shrink(g, alpha) for g in grams]
        result = regmean(ws, shrunk, ridge=0.0)
        lhs = result.weight @ sum(shrunk)
        rhs = sum(w @ g for w, g in zip(ws, shrunk, strict=True))
        assert float((lhs - rhs).norm() / rhs.norm()) <= 1e-8
        gammas = [3.0, 1.0, 2.0]
        mean = sum(g * w for g, w in zip(gammas, ws, strict=True)) / sum(gammas)
        assert objective(result.weight, ws, shrunk) < objective(mean, ws, shrunk)
        assert not result.fallback


def test_m4_the_objective_is_the_weighted_trace_by_hand():
    """M4's J(W) = Σ_e c_e tr((W − W_e) Ĝ_e (W − W_e)ᵀ). Catches: one row's error paired with
    another's (the sum of every entry of ΔĜΔᵀ instead of its trace: 6 + 40 here), a station's
    coefficient dropped, and a diagonal-only Gram treated as anything but Σ Δ²·g. By hand:
    station 1, Δ = [[1, −1], [0, 2]] with Ĝ = [[2, 1], [1, 2]]: 2 + 8 = 10 (coefficient 1);
    station 2, Δ = [[0, −1], [0, 2]] with diagonal [3, 4]: 4 + 16 = 20 (coefficient 2)."""
    weight = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    ws = [torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]])]
    grams = [torch.tensor([[2.0, 1.0], [1.0, 2.0]]), torch.tensor([3.0, 4.0])]
    assert objective(weight, ws, grams, [1.0, 2.0]) == 10.0 + 2 * 20.0


def test_a6_special_cases_by_hand():
    """A6. Catches: (a) a merge that is not the plain mean under a shared Gram, (b) one that moves
    equal weights, (c) α = 1 not being classic RegMean (checked against the least-squares fit of
    the stacked activations, an independent computation), (d) α = 0 collapsing to the plain
    mean instead of the per-column diagonal-weighted mean, (e) a ridge pulling dead inputs to
    zero instead of to the plain average."""
    xs, ws, grams = stations()
    # hand-computed scalar case: (1·1 + 3·3) / (1 + 3) = 2.5
    scalar = regmean(
        [torch.tensor([[1.0]]), torch.tensor([[3.0]])], [torch.eye(1), 3 * torch.eye(1)], ridge=0.0
    )
    assert scalar.weight.item() == pytest.approx(2.5, abs=1e-12)
    shared = regmean(ws, [grams[0]] * 3)  # (a)
    torch.testing.assert_close(shared.weight, sum(ws) / 3, atol=1e-10, rtol=0)
    same = regmean([ws[0]] * 3, grams)  # (b)
    torch.testing.assert_close(same.weight, ws[0], atol=1e-10, rtol=0)
    stacked_x = torch.cat(xs)  # (c) min Σ ‖X_e Wᵀ − X_e W_eᵀ‖²
    stacked_y = torch.cat([x @ w.T for x, w in zip(xs, ws, strict=True)])
    classic = torch.linalg.lstsq(stacked_x, stacked_y).solution.T
    torch.testing.assert_close(regmean(ws, grams, ridge=0.0).weight, classic, atol=1e-9, rtol=0)
    diagonal = regmean(ws, [shrink(g, 0.0) for g in grams], ridge=0.0).weight  # (d)
    g = [torch.diagonal(gr) for gr in grams]
    by_column = sum(w * d for w, d in zip(ws, g, strict=True)) / sum(g)
    torch.testing.assert_close(diagonal, by_column, atol=1e-10, rtol=0)
    assert (diagonal - sum(ws) / 3).abs().max() > 1e-2
    dead = [gr.clone() for gr in grams]  # (e) input 2 never active anywhere
    for gr in dead:
        gr[2, :] = 0
        gr[:, 2] = 0
    merged = regmean(ws, dead).weight
    torch.testing.assert_close(merged[:, 2], (sum(ws) / 3)[:, 2], atol=1e-10, rtol=0)


def test_a7_permuting_inputs_permutes_the_merge():
    """A7. Catches: a merge that mixes input columns inconsistently with the Gram's rows."""
    _, ws, grams = stations(seed=1)
    idx = torch.tensor([3, 0, 5, 1, 4, 2])
    base = regmean(ws, [shrink(g, 0.75) for g in grams]).weight
    moved = regmean([w[:, idx] for w in ws], [shrink(g[idx][:, idx], 0.75) for g in grams]).weight
    torch.testing.assert_close(moved, base[:, idx], atol=1e-10, rtol=0)


def test_a8_shrinkage_keeps_the_diagonal_and_makes_rank_deficient_grams_definite():
    """A8. Catches: α applied to the diagonal instead of the full matrix, asymmetric results,
    and shrinkage that leaves a singular Gram singular."""
    x = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)  # rank 1, positive diagonal
    g = x.T @ x
    torch.testing.assert_close(shrink(g, 1.0), g, atol=0, rtol=0)
    torch.testing.assert_close(shrink(g, 0.0), torch.diag(torch.tensor([1.0, 4.0, 1.0])).double())
    half = shrink(g, 0.5)
    assert half[0, 1] == pytest.approx(1.0) and half[1, 1] == pytest.approx(4.0)
    assert torch.equal(half, half.T)
    assert float(torch.linalg.eigvalsh(half).min()) > 0
    assert float(torch.linalg.eigvalsh(g).min()) < 1e-12


def test_an_indefinite_system_falls_back_to_least_squares_and_says_so():
    """Catches: a Cholesky failure that crashes or goes unreported (the fallback count)."""
    g = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)  # indefinite (eigen 3, -1)
    ws = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])]
    result = regmean(ws, [g, g], ridge=0.0)
    assert result.fallback
    rhs = sum(w.double() @ g for w in ws)
    torch.testing.assert_close(result.weight @ (2 * g), rhs, atol=1e-10, rtol=0)


def train_then_evaluate(model: nn.Module) -> None:
    """Two epochs of SGD over 23 rows of 5 inputs in batches of 8 (8, 8 and a ragged 7), then
    one evaluation pass of 8 rows without grad."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(23, 5)
    for _ in range(2):
        for start in range(0, 23, 8):
            loss = model(data[start : start + 8]).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        model(torch.randn(8, 5))


def test_a9_the_recorded_gram_is_that_of_the_last_full_training_batch():
    """A9. Catches: a Gram from the wrong batch (the first, or a ragged last one), from an
    evaluation forward (no grad), of the wrong shape, or not XᵀX of the layer's input. The
    expected value comes from an independent hook that logs every input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    logged: list[tuple[torch.Tensor, bool]] = []
    model[0].register_forward_pre_hook(
        lambda m, args: logged.append((args[0].detach().clone(), torch.is_grad_enabled()))
    )
    with recording(model, 8) as inputs:
        train_then_evaluate(model)
    last_full = [x for x, grad in logged if grad and x.shape[0] == 8][-1]
    gram = gram_of(inputs["0"], 4096)
    expected = last_full.double().T @ last_full.double()
    torch.testing.assert_close(gram.double(), expected, rtol=1e-5, atol=1e-6)
    assert gram.shape == (5, 5) and torch.equal(gram, gram.T)
    torch.testing.assert_close(gram_of(inputs["0"], 4), torch.diagonal(gram), rtol=1e-5, atol=1e-6)
    assert len(model[0]._forward_pre_hooks) == 1  # only the test's own hook is left


def test_accumulated_gram_sums_every_training_batch_and_only_those():
    """gram_batches: all. Catches: a sum missing the ragged or the first batches, an evaluation
    forward counted, a Gram of the wrong layer input, the diagonal not kept above max_dim, and a
    hook left behind. The expected value is computed from an independent logging hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    logged: dict[int, list[torch.Tensor]] = {0: [], 2: []}
    for i in logged:
        model[i].register_forward_pre_hook(
            lambda m, args, i=i: (
                logged[i].append(args[0].detach().double().clone())
                if torch.is_grad_enabled()
                else None
            )
        )
    with accumulating(model, max_dim=4) as sums:
        train_then_evaluate(model)
    assert len(logged[0]) == 6  # 2 epochs of 3 batches, the ragged one included
    first = sum(x.pow(2).sum(0) for x in logged[0])  # 5 inputs > max_dim 4: the diagonal
    second = sum(x.T @ x for x in logged[2])
    assert sums["0"].shape == (5,) and sums["2"].shape == (3, 3)
    torch.testing.assert_close(sums["0"], first, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums["2"], second, rtol=1e-5, atol=1e-6)
    assert all(len(model[i]._forward_pre_hooks) == 1 for i in logged)


class ThreeBatches(FedAvgClient):
    """A client method whose training is three batches (8, 8 and a ragged 3 rows)."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__(HFedATMHparams())
        self.data = data

    def run(self, msg, ctx):
        for start in (0, 8, 16):
            ctx.model(self.data[start : start + 8]).sum().backward()
        return Message("fit", {"w": torch.ones(1)}, {"num_examples": 19})


@pytest.mark.parametrize("batches", ["last", "all"])
def test_a_gram_client_sends_the_gram_of_the_batches_it_is_configured_for(batches):
    """gram_batches on the client. Catches: the option ignored (one batch's Gram sent for
    `all`, or a sum for the paper's `last`), the ragged batch taken as the last, and the inner
    method's arrays lost from the reply."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 2))
    data = torch.randn(19, 4, dtype=torch.float64)
    client = GramClient(ThreeBatches(data.float()), HFedATMHparams(gram_batches=batches), model)
    ctx = SimpleNamespace(model=model, batch_size=8, generator=torch.Generator())
    reply = client.run(Message("fit", {}, {CAPTURE: True}), ctx)
    rows = data[8:16] if batches == "last" else data
    torch.testing.assert_close(
        reply.arrays[PREFIX + "0"].double(), rows.T @ rows, rtol=1e-5, atol=1e-5
    )
    assert torch.equal(reply.arrays["w"], torch.ones(1))


class Recorder(StationAlgorithm):
    """The inner station: records what reaches it."""

    def aggregate(self, rnd, r, replies):
        self.seen = [sorted(msg.arrays) for _, msg in replies]
        super().aggregate(rnd, r, iter([]))
        self.current = Message("fit", {"w": torch.ones(2)}, {"num_examples": 5})


def test_a9_the_station_sends_the_shrunk_mean_gram_and_its_active_clients_only():
    """A9/A13. Catches: a station Gram that is a sum or a sample-weighted mean instead of the
    plain mean over active clients, shrinkage skipped or applied per client, Grams leaking into
    the client method's aggregation, a Gram request in a station round other than the last, and
    a payload carrying anything besides weights, Grams and counts."""
    model = nn.Sequential(nn.Linear(2, 1))
    ctx = StationContext(0, (0, 1), station_rounds=2, seed=0, model_factory=lambda: model)
    hp = HFedATMHparams(alpha=0.25)
    station = HierarchicalStation(Recorder(ctx, hp), ctx, hp)
    station.begin(1, Message("fit", {"w": torch.zeros(2)}))
    assert CAPTURE not in station.downlink(1, 0).scalars
    assert station.downlink(1, 1).scalars[CAPTURE] is True
    station.aggregate(1, 0, iter([(0, Message("fit", {"w": torch.zeros(2)}, {"num_examples": 1}))]))
    g1 = torch.tensor([[2.0, 4.0], [4.0, 10.0]])
    g2 = torch.tensor([[4.0, 0.0], [0.0, 6.0]])
    replies = [
        (0, Message("fit", {"w": torch.zeros(2), PREFIX + "0": g1}, {"num_examples": 1})),
        (1, Message("fit", {"w": torch.zeros(2), PREFIX + "0": g2}, {"num_examples": 9})),
    ]
    station.aggregate(1, 1, iter(replies))
    assert station.inner.seen == [["w"], ["w"]]
    up = station.uplink(1)
    # mean [[3, 2], [2, 8]], off-diagonal scaled by α = 0.25
    assert torch.equal(up.arrays[PREFIX + "0"], torch.tensor([[3.0, 0.5], [0.5, 8.0]]))
    assert sorted(up.arrays) == [PREFIX + "0", "w"]
    assert up.scalars == {"num_examples": 5, ACTIVE: 2}


def test_bad_grams_are_refused_naming_the_array():
    """Catches: a Gram of the wrong shape, a non-finite one, or one for no dense layer reaching
    the RegMean solve."""
    shapes = {PREFIX + "fc": (3, 3)}
    with pytest.raises(ValueError, match=r"gram/fc has shape \[2, 2\], expected \[3, 3\]"):
        check_grams({PREFIX + "fc": torch.eye(2)}, shapes, "station 1")
    bad = torch.eye(3)
    bad[0, 1] = math.nan
    with pytest.raises(ValueError, match="station 1: gram/fc holds non-finite"):
        check_grams({PREFIX + "fc": bad}, shapes, "station 1")
    with pytest.raises(ValueError, match="'gram/conv' is not the Gram of a dense layer"):
        check_grams({PREFIX + "conv": torch.eye(3)}, shapes, "station 1")


def test_a12_dp_noise_has_the_gaussian_mechanism_scale_and_stays_symmetric():
    """A12. Catches: a wrong σ formula, asymmetric noise, no clipping to the spectral bound, and
    a PSD projection leaving negative eigenvalues. σ by hand: C·sqrt(2 ln(1.25/δ))/ε."""
    clip, eps, delta = 2.0, 1.0, 1e-5
    sigma = dp_sigma(clip, eps, delta)
    assert sigma == pytest.approx(2.0 * math.sqrt(2 * math.log(125000.0)))
    gen = torch.Generator().manual_seed(0)
    zero = torch.zeros(3, 3)
    draws = torch.stack([privatise(zero, clip, sigma, gen).double() for _ in range(10_000)])
    assert torch.equal(draws, draws.transpose(1, 2))
    std = draws.std(0)
    assert abs(float(std.diagonal().mean()) / sigma - 1) < 0.05
    assert abs(float(std[0, 1]) / (sigma / math.sqrt(2)) - 1) < 0.05
    big = 10 * torch.eye(3)  # spectral norm 10 -> clipped to 2, no noise
    torch.testing.assert_close(privatise(big, clip, 0.0, gen), 2 * torch.eye(3))
    noisy = privatise(torch.eye(4), clip, 5.0, gen)
    assert float(torch.linalg.eigvalsh(project_psd(noisy).double()).min()) >= -1e-9
