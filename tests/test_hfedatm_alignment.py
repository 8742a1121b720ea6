"""HFedATM's filter-wise OT alignment and permutation specs: hfedatm.md §9 checks A1-A4, A11."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.hfedatm import ACTIVE, HFedATMHparams, HFedATMServer
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.training import get_arrays, set_arrays
from feddomain.merging.fot import Solver, align, sinkhorn_plan
from feddomain.merging.gram import PREFIX, gram_shapes, recording
from feddomain.merging.permutation import apply_permutations, permutation_spec
from feddomain.models import build_model
from tests.engine_helpers import tiny_config

ARCHS = {
    "lenet5": {},
    "lenet5_bn": {"norm": "batch"},
    "vgg11": {"hidden": 32},  # torchvision's VGG-11 convs; narrow hidden layers for a CPU test
    "resnet18": {},
    "hfedf_cnn": {},
    "small_cnn": {},
}
SOLVERS = [Solver("exact"), Solver("sinkhorn", 0.05, 25)]


def make_model(arch: str, seed: int) -> nn.Module:
    """A model with random weights and (for BatchNorm) random running statistics, float64, in
    eval mode so that its function is fixed."""
    torch.manual_seed(seed)
    model = build_model(arch.removesuffix("_bn"), 5, resolution=32, **ARCHS[arch])
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.normal_()
            m.bias.data.normal_()
    return model.double().eval()


def random_grams(model: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random PSD Gram (or positive diagonal) for every dense layer, by module name."""
    out = {}
    for name, shape in gram_shapes(model, 4096).items():
        x = torch.randn(64, shape[0], generator=gen, dtype=torch.float64)
        out[name.removeprefix(PREFIX)] = x.pow(2).sum(0) if len(shape) == 1 else x.T @ x
    return out


def activation_grams(model: nn.Module, arrays, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """XᵀX of every dense layer's input on ``x``, from the layers' real inputs (forward hooks):
    a Gram computed independently of any permutation code."""
    set_arrays(model, arrays)
    with torch.enable_grad(), recording(model, x.shape[0]) as inputs:
        model(x)
    shapes = gram_shapes(model, 4096)
    return {
        n: v.T @ v if len(shapes[PREFIX + n]) == 2 else v.pow(2).sum(0) for n, v in inputs.items()
    }


def random_perms(spec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {g.name: torch.randperm(g.size, generator=gen) for g in spec.groups}


def logits(model: nn.Module, arrays, x: torch.Tensor) -> torch.Tensor:
    set_arrays(model, arrays)
    with torch.no_grad():
        return model(x)


def server_for(model: nn.Module, n_stations: int, **hp) -> HFedATMServer:
    ctx = ServerContext(lambda: model, n_clients=n_stations, seed=0, rounds=1, stations=n_stations)
    return HFedATMServer(ctx, HFedATMHparams(**hp))


def merged(server: HFedATMServer, stations: list[tuple[dict, dict, int]]):
    """Run the server's aggregation on station payloads (arrays, Grams by layer, γ)."""
    replies = [
        (
            sid,
            Message(
                "fit",
                {**arrays, **{PREFIX + k: g.float() for k, g in grams.items()}},
                {"num_examples": 10, ACTIVE: gamma},
            ),
        )
        for sid, (arrays, grams, gamma) in enumerate(stations)
    ]
    server.aggregate(1, iter(replies))
    return server.global_arrays


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.kind)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a1_a_permuted_copy_is_recovered_exactly_and_merges_back_to_the_original(arch, solver):
    """A1. Catches: a tensor the spec forgets (BatchNorm buffers, the flatten->Linear columns,
    a residual member, an Inception pass-through) — the permuted copy would compute another
    function; a wrong permutation convention (perm vs its inverse); a solver that does not find
    the planted matching; Grams not following the weight columns."""
    model = make_model(arch, seed=0)
    spec = permutation_spec(model)
    gen = torch.Generator().manual_seed(1)
    a = get_arrays(model)
    planted = random_perms(spec, gen)
    b, _ = apply_permutations(spec, a, {}, planted)
    x = torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64)
    a_grams, b_grams = activation_grams(model, a, x), activation_grams(model, b, x)
    # the permuted copy is another point in weight space computing the same function
    assert any(not torch.equal(a[k], b[k]) for k in a)
    torch.testing.assert_close(logits(model, b, x), logits(model, a, x), atol=1e-5, rtol=0)
    result = align(spec, a, b, b_grams, solver)
    for group in spec.groups:
        assert torch.equal(result.perms[group.name], torch.argsort(planted[group.name]))
    for k in a:
        assert torch.equal(result.arrays[k], a[k]), k
    for k in a_grams:  # B's Grams (its own activations) come back in A's order
        torch.testing.assert_close(result.grams[k], a_grams[k], rtol=1e-9, atol=1e-9)
    other_grams = random_grams(model, gen)  # any Grams for A
    server = server_for(model, 2, fot_solver=solver.kind)
    out = merged(server, [(a, other_grams, 3), (b, b_grams, 5)])
    for k in a:
        torch.testing.assert_close(out[k], a[k], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(model, out, x), logits(model, a, x), atol=1e-5, rtol=0)


def test_a2_literal_mode_is_not_function_preserving():
    """A2. Catches: ``fot_mode: literal`` silently doing graph-mode alignment (or the reverse):
    merging a permuted copy literally must give a different model, graph mode the original."""
    model = make_model("lenet5", seed=0)
    spec = permutation_spec(model)
    gen = torch.Generator().manual_seed(2)
    a, grams = get_arrays(model), random_grams(model, gen)
    b, b_grams = apply_permutations(spec, a, grams, random_perms(spec, gen))
    x = torch.randn(8, 3, 32, 32, generator=gen, dtype=torch.float64)
    literal = merged(server_for(model, 2, fot_mode="literal"), [(a, grams, 1), (b, b_grams, 1)])
    graph = merged(server_for(model, 2, fot_mode="graph"), [(a, grams, 1), (b, b_grams, 1)])
    reference = logits(model, a, x)
    assert (logits(model, literal, x) - reference).abs().max() > 1e-2
    torch.testing.assert_close(logits(model, graph, x), reference, atol=1e-5, rtol=0)
    # literal mode restored conv1's rows but left conv2's columns in B's order
    torch.testing.assert_close(literal["featurizer.conv1.weight"], a["featurizer.conv1.weight"])


def test_the_server_merges_each_station_with_its_grams_permuted_along():
    """Catches a merge that aligns a station's weights but feeds RegMean its Grams in the
    unaligned order: two genuinely different LeNet-5 stations A and B (they stay different
    after alignment, so RegMean's solve depends on the Grams); handing the server B permuted
    together with its Grams must give the same merged model as B itself, and handing it the
    permuted B with B's unpermuted Grams must not."""
    model = make_model("lenet5", seed=0)
    spec = permutation_spec(model)
    gen = torch.Generator().manual_seed(7)
    a, b = get_arrays(model), get_arrays(make_model("lenet5", seed=5))
    a_grams, b_grams = random_grams(model, gen), random_grams(model, gen)
    b_perm, b_perm_grams = apply_permutations(spec, b, b_grams, random_perms(spec, gen))
    assert any(not torch.equal(b_perm[k], b[k]) for k in b)
    assert any(not torch.equal(b_perm_grams[k], b_grams[k]) for k in b_grams)
    hp = {"fot_solver": "exact", "regmean": True}
    plain = merged(server_for(model, 2, **hp), [(a, a_grams, 3), (b, b_grams, 5)])
    permuted = merged(server_for(model, 2, **hp), [(a, a_grams, 3), (b_perm, b_perm_grams, 5)])
    for k in a:
        torch.testing.assert_close(permuted[k], plain[k], atol=1e-6, rtol=0)
    # the stations do not become one model after alignment, and the Grams matter: fc1's
    # input is conv2's permuted output, so its Gram is the one that moves with B
    dense = "featurizer.fc1.weight"
    assert (plain[dense] - a[dense]).abs().max() > 1e-2
    stale = merged(server_for(model, 2, **hp), [(a, a_grams, 3), (b_perm, b_grams, 5)])
    assert (stale[dense] - plain[dense]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "hp",
    [
        {},
        {"fot_mode": "literal", "fot_solver": "exact"},
        {"alpha": 0.0, "regmean_weighting": "gamma"},
        {"alpha": 1.0, "fot_reference": "largest"},
    ],
)
def test_a3_identical_stations_merge_to_the_same_model(hp):
    """A3. Catches: a merge that is not idempotent (a wrong normalisation of γ or of the RegMean
    solve, a non-identity matching of identical filters)."""
    model = make_model("small_cnn", seed=3)
    a = get_arrays(model)
    gen = torch.Generator().manual_seed(3)
    stations = [(a, random_grams(model, gen), g) for g in (2, 7, 4)]
    out = merged(server_for(model, 3, **hp), stations)
    for k in a:
        torch.testing.assert_close(out[k], a[k], atol=1e-6, rtol=0)
    spec = permutation_spec(model)
    result = align(spec, a, a, {}, Solver())
    assert all(torch.equal(p, torch.arange(len(p))) for p in result.perms.values())
    single = merged(server_for(model, 1, **hp), [(a, random_grams(model, gen), 4)])
    for k in a:
        torch.testing.assert_close(single[k], a[k], atol=1e-6, rtol=0)


def test_a4_matching_never_costs_more_than_identity_and_is_order_and_label_invariant():
    """A4. Catches: a solver returning a worse-than-identity matching, a merge that depends on
    the order of the non-reference stations, and a matching that does not follow a relabelling
    of the reference's filters (Lemma 2)."""
    models = [get_arrays(make_model("lenet5", seed=s)) for s in (10, 11, 12)]
    model = make_model("lenet5", seed=10)
    spec = permutation_spec(model)
    exact = Solver("exact")
    result = align(spec, models[0], models[1], {}, exact)
    for matched, identity, _ in result.costs.values():
        assert matched <= identity + 1e-12
    assert any(m < i - 1e-6 for m, i, _ in result.costs.values())  # unrelated nets: it matters
    gen = torch.Generator().manual_seed(4)
    grams = [random_grams(model, gen) for _ in models]
    stations = [(m, g, 1) for m, g in zip(models, grams, strict=True)]
    first = merged(server_for(model, 3, fot_solver="exact"), stations)
    order = [0, 2, 1]
    swapped = merged(
        server_for(model, 3, fot_solver="exact"), [(models[i], grams[i], 1) for i in order]
    )
    for k in first:
        torch.testing.assert_close(swapped[k], first[k], atol=1e-6, rtol=0)
    relabel = random_perms(spec, gen)
    ref_p, _ = apply_permutations(spec, models[0], {}, relabel)
    moved = align(spec, ref_p, models[1], {}, exact)
    expected, _ = apply_permutations(spec, result.arrays, {}, relabel)
    for k in expected:
        assert torch.equal(moved.arrays[k], expected[k]), k


def test_a11_sinkhorn_plans_are_finite_with_unit_rows_and_round_to_permutations():
    """A11. Catches: non-finite plans at ε = 0.05 on costs up to 4, marginals other than 1, a
    rounding that is not a permutation (row-wise argmax) or misses a planted matching. (In
    float64 these costs do not underflow a plain-domain Sinkhorn either: exp(−80) ≈ 2e-35, so
    the log-domain choice is not observable here.)"""
    gen = np.random.default_rng(0)
    k = 64
    filters = gen.normal(size=(k, 75))
    filters /= np.linalg.norm(filters, axis=1, keepdims=True)
    planted = gen.permutation(k)
    noisy = filters[planted] + 0.05 * gen.normal(size=(k, 75))
    noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
    cost = ((filters[:, None, :] - noisy[None, :, :]) ** 2).sum(-1)
    assert cost.max() <= 4.0
    plan = sinkhorn_plan(cost, 0.05, 25)
    assert np.isfinite(plan).all()
    np.testing.assert_allclose(plan.sum(1), 1.0, atol=1e-3)
    perm = Solver()(cost)
    assert np.array_equal(perm, np.argsort(planted))
    worst = np.full((k, k), 4.0)  # a flat cost at the top of the range
    assert sorted(Solver()(worst)) == list(range(k))
    assert np.isfinite(sinkhorn_plan(worst, 0.05, 25)).all()


def test_a_model_without_a_permutation_spec_is_refused_by_name():
    """Catches: FOT silently skipping (misaligning) an architecture it has no spec for, at
    config time and when the server is built; a GroupNorm model (channel permutations across
    its groups change the function)."""
    with pytest.raises(ConfigError, match=r"'model.name' = 'resnet50'.*no permutation spec"):
        tiny_config(algorithm={"name": "hfedatm"}, model={"name": "resnet50"})
    tiny_config(algorithm={"name": "hfedatm", "fot": False}, model={"name": "resnet50"})
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    with pytest.raises(ConfigError, match="model 'Sequential' has no permutation spec"):
        permutation_spec(plain)
    group_norm = build_model("small_cnn", 3, norm="group")
    with pytest.raises(ConfigError, match="GroupNorm"):
        permutation_spec(group_norm)
    head = nn.Sequential(nn.Linear(8, 3))  # no convolutions: nothing to align
    assert permutation_spec(head).groups == ()
