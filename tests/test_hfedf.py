"""hFedF: the acceptance checks A1 and A3-A9 of hfedf.md §8 (A2 is the partitioner's, see
test_partition_domains_per_client.py), plus the variants, diagnostics, checkpoints and configs."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from feddomain.algorithms import algorithm_hparams
from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.hfedf import (
    ConvAutoencoder,
    HFedFServer,
    HyperNetwork,
    ParameterEMA,
    client_gradients,
    default_embed_dim,
    flat,
    gradalign_weights,
    parameter_shapes,
)
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from feddomain.models import build_model
from tests.engine_helpers import run_sim, tiny_config, tiny_federation

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# ----------------------------------------------------------------------------- helpers


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))


def make_server(name: str = "hfedf", n_clients: int = 3, **hparams) -> HFedFServer:
    hp = algorithm_hparams(name, {"hidden": 8, **hparams})
    return HFedFServer(ServerContext(tiny_model, n_clients, seed=0, rounds=10), hp)


def make_server64(name: str = "hfedf", n_clients: int = 3, **hparams) -> HFedFServer:
    """``make_server`` with the hypernetwork in float64, for identities checked to ~1e-12.

    In float32 both sides of such an identity round at ~1e-7 relative, in an order that depends
    on the CPU's kernels (AVX-512 vs AVX2, MKL's code path), so a float32 tolerance near 1e-6
    passes on one machine and fails on another; in float64 the same rounding is ~1e-16. The
    server's code is dtype-agnostic (its optimiser holds the same Parameter objects, converted
    in place, with no state yet), so this checks the same code path.
    """
    server = make_server(name, n_clients, **hparams)
    server.hnet.double()
    return server


def random_deltas(
    server: HFedFServer, seed: int, dtype: torch.dtype | None = None
) -> dict[int, dict[str, torch.Tensor]]:
    """Seeded N(0, 0.1²) deltas; ``dtype`` defaults to the server's (drawn in float32 first,
    so a float64 server sees the same values as a float32 one)."""
    dtype = dtype or server.hnet.embeddings.weight.dtype
    g = torch.Generator().manual_seed(seed)
    return {
        cid: {
            k: (0.1 * torch.randn(s, generator=g)).to(dtype) for k, s in server.hnet.shapes.items()
        }
        for cid in range(server.ctx.n_clients)
    }


def step(server, deltas: dict[int, dict[str, torch.Tensor]], rnd: int = 1) -> None:
    replies = ((cid, Message("fit", d, {"num_examples": 1})) for cid, d in deltas.items())
    server.aggregate(rnd, replies)


def params_of(server) -> list[torch.Tensor]:
    return [p.detach().clone() for p in server.hnet.parameters()]


def tee_replies(sim: Simulation) -> dict[int, Message]:
    """Record the replies the server aggregates (the runner streams them)."""
    seen: dict[int, Message] = {}
    aggregate = sim.server.aggregate

    def recording(rnd, replies):
        def through():
            for cid, msg in replies:
                seen[cid] = msg.copy()
                yield cid, msg

        aggregate(rnd, through())

    sim.server.aggregate = recording
    return seen


def accuracy(model: nn.Module, arrays, data) -> float:
    model.load_state_dict(arrays)
    model.eval()
    with torch.no_grad():
        hits = sum(
            int((model(x).argmax(1) == y).sum()) for x, y in data.batches(512, shuffle=False)
        )
    return hits / len(data)


# ----------------------------------------------------------------------------- A1 architecture


def test_a1_generated_dict_matches_the_model_and_runs_like_load_state_dict():
    torch.manual_seed(0)
    model = build_model("hfedf_cnn", 7).eval()
    hnet = HyperNetwork(3, parameter_shapes(model), embed_dim=1, hidden=4)
    phi = hnet(1)
    assert [(k, v.shape) for k, v in phi.items()] == [
        (k, v.shape) for k, v in model.state_dict().items()
    ]
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    functional = functional_call(model, phi, (x,))
    assert not torch.allclose(functional, model(x))  # the generated weights are really used
    functional.sum().backward()  # autograd flows from the client's output back to θ and ν
    assert hnet.heads[0].weight.grad is not None and hnet.embeddings.weight.grad[1].abs().sum() > 0
    model.load_state_dict({k: v.detach() for k, v in phi.items()})
    assert torch.equal(functional, model(x))


def test_a1_full_size_hypernetwork_has_the_hand_counted_parameters():
    # PACS, N = 3 clients, L = floor(1 + 3/4) = 1, hidden width 50:
    #   embedding table             3 * 1                         =          3
    #   trunk  Linear(1, 50)        50 + 50                       =        100
    #          3 x Linear(50, 50)   3 * (2500 + 50)               =      7,650
    #   heads  one Linear(50, |P|) per client tensor: 51 * 928,199 = 47,338,149
    #   total                                                       47,345,902  (≈ 47.3 M)
    shapes = parameter_shapes(build_model("hfedf_cnn", 7))
    assert len(shapes) == 22 and sum(math.prod(s) for s in shapes.values()) == 928_199
    hnet = HyperNetwork(3, shapes, default_embed_dim(3))
    assert len(hnet.heads) == 22
    assert sum(p.numel() for p in hnet.parameters()) == 47_345_902
    assert [default_embed_dim(n) for n in (3, 6, 9, 12)] == [1, 2, 3, 4]


def test_model_with_buffers_is_refused_with_a_clear_error():
    with pytest.raises(ConfigError, match=r"without buffers.*running_mean"):
        parameter_shapes(build_model("small_cnn", 3))


# ----------------------------------------------------------------------------- A3 VJP and sign


def surrogate_grads(hnet: HyperNetwork, deltas) -> list[torch.Tensor]:
    """Each client's (ν, θ) gradient of Σ_P ⟨φ_i[P], stopgrad(Δ_i[P])⟩ by plain autograd."""
    inputs = [hnet.embeddings.weight, *hnet.theta()]
    out = []
    for cid, d in deltas.items():
        phi = hnet(cid)
        surrogate = sum((phi[k] * d[k].detach()).sum() for k in phi)
        out.append(flat(torch.autograd.grad(surrogate, inputs)))
    return out


def test_a3_factored_vjps_equal_the_gradients_of_the_surrogate():
    """Catches a factored VJP or Gram matrix that is not the autograd gradient of the surrogate.

    In float64: the factored form (one matmul per head) and autograd sum the same ~60k products
    per entry in different orders. In float32 that alone gives relative errors up to ~4e-6
    depending on the CPU (measured 6e-8 on AMD EPYC, 1.2e-6 to 3.9e-6 on an AVX-512 Intel with
    MKL), so no float32 bound both holds everywhere and stays tight. In float64 the error is
    ≤ n·eps64 ≈ 6e4 · 1.1e-16 ≈ 7e-12 even in the worst case (~1e-15 typically), so 1e-10
    holds on every CPU while a real fault (a wrong head, a transposed factor, a missing bias or
    trunk term) shows up as an O(1) relative error.
    """
    torch.manual_seed(0)
    hnet = HyperNetwork(3, parameter_shapes(build_model("lenet5", 3)), embed_dim=2, hidden=8)
    hnet.double()
    g = torch.Generator().manual_seed(2)
    deltas = {
        c: {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in hnet.shapes.items()}
        for c in (2, 0)
    }
    grads = client_gradients(hnet, deltas)
    expected = surrogate_grads(hnet, deltas)
    assert grads.z.dtype == expected[0].dtype == torch.float64
    n_nu = hnet.embeddings.weight.numel()
    for i, cid in enumerate(deltas):
        one_hot = torch.zeros(2, dtype=torch.float64)
        one_hot[i] = 1.0
        got = flat(grads.combine(one_hot, one_hot))
        assert (got - expected[i]).norm() / expected[i].norm() <= 1e-10
        nu_grad = got[:n_nu].view(3, 2)
        others = [r for r in range(3) if r != cid]
        assert nu_grad[cid].abs().sum() > 0 and nu_grad[others].abs().sum() == 0  # row i only
    theta = torch.stack([e[n_nu:] for e in expected])
    nu = torch.stack([e[:n_nu] for e in expected])
    assert torch.allclose(grads.theta_gram(), theta @ theta.T, rtol=1e-10, atol=0)
    assert torch.allclose(grads.nu_gram(), nu @ nu.T, rtol=1e-10, atol=0)


def test_a3_a_small_sgd_step_moves_the_generated_model_toward_the_trained_one(tmp_path):
    cfg = tiny_config(
        rounds=1,
        partition__n_clients=1,
        partition__d=3,
        train__optimizer="adam",
        train__lr=1e-3,
        algorithm={"name": "hfedf_no_ema", "server_optimizer": "sgd", "lr_s": 1e-4, "wd_s": 0.0},
    )
    fed = tiny_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    phi0 = {k: v.clone() for k, v in sim.server.generated(0).items()}
    replies = tee_replies(sim)
    sim._round(1)
    delta = replies[0].arrays
    trained = {k: phi0[k] - delta[k] for k in phi0}
    # the client's convention: φ~ = φ0 − Δ is the locally improved model
    model = sim.model
    loss = lambda arrays: float(  # noqa: E731
        sum(
            nn.functional.cross_entropy(
                functional_call(model.eval(), arrays, (x,)), y, reduction="sum"
            )
            for x, y in fed.train[0].batches(512, shuffle=False)
        )
    )
    assert loss(trained) < loss(phi0)
    new = sim.server.generated(0)
    inner = sum(float(((new[k] - phi0[k]) * (trained[k] - phi0[k])).sum()) for k in phi0)
    assert inner > 0


# ----------------------------------------------------------------------------- A4 GradAlign


def gram(vectors: list[torch.Tensor]) -> torch.Tensor:
    x = torch.stack(vectors).double()
    return x @ x.T


def test_a4_gradalign_weights_match_a_hand_computed_example():
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    # g_avg = (2/3, 1/3), |g_avg| = sqrt(5)/3 -> cosines 2/sqrt(5), 2/sqrt(5), 1/sqrt(5)
    c_hi, c_lo = 2 / math.sqrt(5), 1 / math.sqrt(5)
    for sign in (1, -1):
        z = 2 * math.exp(sign * c_hi) + math.exp(sign * c_lo)
        expected = [math.exp(sign * c_hi) / z] * 2 + [math.exp(sign * c_lo) / z]
        weights, cosines = gradalign_weights(gram(grads), sign)
        assert cosines.tolist() == pytest.approx([c_hi, c_hi, c_lo], abs=1e-9)
        assert weights.tolist() == pytest.approx(expected, abs=1e-9)
        assert float(weights.sum()) == pytest.approx(1.0, abs=1e-12)


def test_a4_identical_gradients_give_uniform_weights_and_one_client_gets_one():
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for n in (2, 3, 5):
        weights, _ = gradalign_weights(gram([g] * n))
        assert weights.tolist() == pytest.approx([1.0 / n] * n, rel=1e-14)  # float64 rounding
    assert gradalign_weights(gram([g]))[0].tolist() == [1.0]


def test_a4_more_aligned_gets_more_weight_and_the_sign_reverses_the_order():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(500, generator=gen)
    grads = [base + s * torch.randn(500, generator=gen) for s in (0.2, 1.0, 3.0, 0.6)]
    w_pos, cosines = gradalign_weights(gram(grads), 1)
    w_neg, _ = gradalign_weights(gram(grads), -1)
    # The reference in float64 too: a float32 cosine over 500 terms is only good to ~1e-7..1e-6
    # (CPU-dependent accumulation order), the bound of 1e-6 would be no margin at all.
    mean = torch.stack(grads).double().mean(0)
    direct = [float(torch.nn.functional.cosine_similarity(g.double(), mean, dim=0)) for g in grads]
    assert cosines.tolist() == pytest.approx(direct, abs=1e-12)
    by_cosine = torch.argsort(cosines).tolist()
    assert len(set(cosines.tolist())) == 4
    assert torch.all(torch.diff(w_pos[by_cosine]) > 0)  # strictly increasing with alignment
    assert torch.all(torch.diff(w_neg[by_cosine]) < 0)


def softmax_of_cosines_to_mean(vectors: list[torch.Tensor]) -> list[float]:
    mean = torch.stack(vectors).mean(0)
    cos = torch.stack([torch.nn.functional.cosine_similarity(v, mean, dim=0) for v in vectors])
    return torch.softmax(cos.double(), 0).tolist()


def test_a4_server_step_is_the_gradalign_weighted_sum_with_separate_theta_and_nu_weights():
    # float64 (make_server64): the step goes through the factored VJP, the reference through
    # autograd; see test_a3 for why a float32 comparison of the two is CPU-dependent.
    server = make_server64("hfedf_no_ema", server_optimizer="sgd", lr_s=1.0, wd_s=0.0)
    deltas = random_deltas(server, 7)
    deltas[2] = {k: 5 * v for k, v in deltas[0].items()}  # aligned with client 0, larger
    per_client = surrogate_grads(copy.deepcopy(server.hnet), deltas)
    n_nu = server.hnet.embeddings.weight.numel()
    g_nu = [g[:n_nu] for g in per_client]
    g_theta = [g[n_nu:] for g in per_client]
    w_nu, w_theta = softmax_of_cosines_to_mean(g_nu), softmax_of_cosines_to_mean(g_theta)
    assert w_theta != pytest.approx([1 / 3] * 3, abs=1e-3) and w_nu != pytest.approx(w_theta)
    expected_nu = sum(w * g for w, g in zip(w_nu, g_nu, strict=True))
    expected_theta = sum(w * g for w, g in zip(w_theta, g_theta, strict=True))
    before = flat([p.detach() for p in server.hnet.parameters()])
    step(server, deltas)
    after = flat([p.detach() for p in server.hnet.parameters()])
    # float64 rounding leaves ≤ ~1e-13 (measured 8e-14); a wrong weight (w_theta is > 1e-3 from
    # uniform, asserted above), θ's weights used for ν or a missing client moves entries by
    # ~1e-3·|g| or more, far above 1e-10
    expected = torch.cat([expected_nu, expected_theta])
    assert torch.allclose(before - after, expected, rtol=0, atol=1e-10)
    assert server.diagnostics()["gradalign_w_theta"] == pytest.approx(w_theta, abs=1e-12)


def test_a4_embedding_cosine_reduces_to_the_relative_norm():
    torch.manual_seed(0)
    hnet = HyperNetwork(3, {"w": torch.Size([4, 3]), "b": torch.Size([4])}, embed_dim=2)
    g = torch.Generator().manual_seed(5)
    deltas = {c: {k: torch.randn(s, generator=g) for k, s in hnet.shapes.items()} for c in range(3)}
    grads = client_gradients(hnet, deltas)
    _, cosines = gradalign_weights(grads.nu_gram())
    norms = grads.nu.double().norm(dim=1)
    assert cosines.tolist() == pytest.approx((norms / norms.pow(2).sum().sqrt()).tolist(), rel=1e-6)


# ----------------------------------------------------------------------------- A5 EMA


def test_a5_ema_changes_nothing_before_warmup_and_scales_the_step_after():
    # float64: in float32, p − b and 0.75·(a − b) each round at ulp(|p|) ≈ 5e-7 for |p| ≈ 4,
    # with or without a fused multiply-add depending on the CPU; in float64 at ~1e-15.
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.randn(5, generator=gen, dtype=torch.float64),
        torch.randn(2, 3, generator=gen, dtype=torch.float64),
    ]
    ema = ParameterEMA(alpha=0.75, warmup=2)
    for t in range(6):
        before = [p.clone() for p in params]
        for p in params:  # stands in for the optimiser's step
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        after_step = [p.clone() for p in params]
        ema.update(params, t)
        for p, b, a in zip(params, before, after_step, strict=True):
            if t <= 2:  # before the warm-up step, and at it (initialisation only)
                assert torch.equal(p, a)
            else:
                assert torch.allclose(p - b, 0.75 * (a - b), rtol=0, atol=1e-12)  # fault: > 0.1


def test_a5_alpha_one_is_identical_to_no_ema():
    with_ema = make_server("hfedf", ema_alpha=1.0, ema_warmup=1)
    without = make_server("hfedf_no_ema")
    for rnd in range(1, 5):
        deltas = random_deltas(with_ema, rnd)
        step(with_ema, deltas, rnd)
        step(without, deltas, rnd)
    for a, b in zip(params_of(with_ema), params_of(without), strict=True):
        assert torch.equal(a, b)


def test_a5_server_ema_is_alpha_times_the_plain_adam_step():
    # float64: the Adam step is ~1e-3, and in float32 a_ema − b and a_step − b each carry the
    # rounding of |p| ≤ 1 (ulp ≤ 1.2e-7), ~1e-4 of the step, in a CPU-dependent way (measured
    # up to 0.44 of the old 1e-7 bound); in float64 that rounding is ≤ 1.1e-16.
    server = make_server64("hfedf", ema_alpha=0.75, ema_warmup=1)
    for rnd in range(1, 4):  # steps 0..2: past the warm-up
        step(server, random_deltas(server, rnd), rnd)
    twin = make_server64("hfedf_no_ema", ema_alpha=0.75)  # same Adam state, no EMA
    twin.load_state_dict(copy.deepcopy(server.state_dict()))
    before = params_of(server)
    deltas = random_deltas(server, 99)
    step(server, deltas, 4)
    step(twin, deltas, 4)
    for b, a_ema, a_step in zip(before, params_of(server), params_of(twin), strict=True):
        # steps are ~1e-3; no EMA (factor 1) or the wrong α (0.95) is off by > 1e-4
        assert torch.allclose(a_ema - b, 0.75 * (a_step - b), rtol=0, atol=1e-13)


# ----------------------------------------------------------------------------- A6 reductions


def test_a6_without_gradalign_and_ema_one_adam_step_on_the_mean_vjp():
    # float64: the server (factored VJP, fused Adam) and the reference (autograd, for-loop Adam)
    # round differently; in float32 that was up to 0.27 of a 1e-7 bound and CPU-dependent.
    server = make_server64("hfedf_no_gradalign_no_ema", lr_s=1e-2, wd_s=1e-3)
    reference = copy.deepcopy(server.hnet)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=1e-3)
    for rnd in (1, 2):
        deltas = random_deltas(server, rnd)
        step(server, deltas, rnd)
        surrogate = sum(
            (reference(cid)[k] * d[k]).sum() for cid, d in deltas.items() for k in d
        ) / len(deltas)
        optimizer.zero_grad()
        surrogate.backward()
        optimizer.step()
        for a, b in zip(server.hnet.parameters(), reference.parameters(), strict=True):
            # Adam moves each entry by ~1e-2 per step; a wrong mean (sum), sign or
            # weight decay is off by > 1e-4; float64 rounding is ~1e-16
            assert torch.allclose(a, b, atol=1e-12, rtol=0)
        assert all(server.optimizer.state[p]["step"] == rnd for p in server.trainable())


def test_a6_one_client_hfedf_without_ema_equals_pfedhn_with_an_adam_step(tmp_path):
    common = dict(rounds=2, partition__n_clients=1, partition__d=3, train__optimizer="adam")
    hfedf = run_sim(tiny_config(**common, algorithm="hfedf_no_ema"), tmp_path / "h")
    pfedhn = run_sim(
        tiny_config(
            **common,
            algorithm={"name": "pfedhn", "server_optimizer": "adam", "lr_s": 1e-3, "wd_s": 1e-5},
        ),
        tmp_path / "p",
    )
    for a, b in zip(params_of(hfedf.server), params_of(pfedhn.server), strict=True):
        assert torch.equal(a, b)
    diag = hfedf.server.diagnostics()
    assert diag["gradalign_w_theta"] == [1.0] and diag["gradalign_w_nu"] == [1.0]


# ----------------------------------------------------------------------------- A7 communication


def test_a7_bytes_are_twice_the_model_per_client_and_messages_hold_only_model_tensors(tmp_path):
    cfg = tiny_config(rounds=1, algorithm="hfedf")
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    messages: list[Message] = []
    run = sim.client.run

    def recording(msg, ctx):
        reply = run(msg, ctx)
        messages.extend([msg.copy(), reply.copy()])
        return reply

    sim.client.run = recording
    sim.run()
    shapes = {k: v.shape for k, v in sim.model.state_dict().items()}
    phi_bytes = 4 * sum(math.prod(s) for s in shapes.values())
    # 2·|φ|·4 bytes of model per client; nothing else but two scalars (8 bytes each) up
    assert sim.ledger.up == {"model": 3 * phi_bytes, "statistics": 0, "scalars": 3 * 16}
    assert sim.ledger.down == {"model": 3 * phi_bytes, "statistics": 0, "scalars": 0}
    assert len(messages) == 6
    for msg in messages:
        assert {k: v.shape for k, v in msg.arrays.items()} == shapes
        assert all(v.dtype == torch.float32 for v in msg.arrays.values())
        assert all(not isinstance(v, list) for v in msg.scalars.values())


# ----------------------------------------------------------------------------- A8 evaluation


def test_a8_each_client_is_scored_with_its_own_generated_model_on_its_own_val_split(tmp_path):
    cfg = tiny_config(rounds=1, algorithm="hfedf")
    fed = tiny_federation(cfg)
    sim = run_sim(cfg, tmp_path / "h", fed)
    summary = json.loads((tmp_path / "h" / "summary.json").read_text())
    (target,) = fed.targets.values()
    model = build_model("lenet5", 3)
    for cid in range(3):
        arrays = sim.server.eval_arrays(cid)
        fresh = sim.server.hnet(cid)  # the post-update hypernetwork's model, not a stale copy
        assert all(torch.equal(arrays[k], fresh[k].detach()) for k in arrays)
        assert summary["per_client"]["id_acc"][cid] == pytest.approx(
            accuracy(model, arrays, fed.val[cid])
        )
        assert summary["per_client"]["ood_acc"][cid] == pytest.approx(
            accuracy(model, arrays, target)
        )
    a, b = sim.server.eval_arrays(0), sim.server.eval_arrays(1)
    assert not torch.equal(a["classifier.weight"], b["classifier.weight"])
    assert sim.records[-1]["distinct_models"] == 3
    # by default (ood_model: own, §2.5) hFedF offers no unseen-domain model: its ood is the
    # mean over the clients' own models; the other choices are tested in test_ood_model.py
    assert sim.server.eval_arrays(None) is None
    assert summary["ood_acc"] == pytest.approx(np.mean(summary["per_client"]["ood_acc"]))


def test_a8_fedavg_ood_accuracy_is_identical_across_clients(tmp_path):
    run_sim(tiny_config(rounds=1), tmp_path / "f")
    summary = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert len(summary["per_client"]["ood_acc"]) == 3
    assert float(np.std(summary["per_client"]["ood_acc"])) == 0.0


# ----------------------------------------------------------------------------- A9 determinism


def _first_round(seed: int, out: Path):
    cfg = tiny_config(rounds=1, seed=seed, algorithm="hfedf")
    fed = tiny_federation(cfg)
    sim = Simulation(cfg, fed, out)
    replies = tee_replies(sim)
    sim._round(1)
    return fed, replies


def test_a9_same_seed_same_splits_and_first_round_deltas_other_seed_differs(tmp_path):
    fed_a, da = _first_round(0, tmp_path)
    fed_b, db = _first_round(0, tmp_path)
    fed_c, dc = _first_round(1, tmp_path)
    for a, b in zip(fed_a.train + fed_a.val, fed_b.train + fed_b.val, strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    for cid in range(3):
        for k, v in da[cid].arrays.items():
            assert torch.equal(v, db[cid].arrays[k]), (cid, k)
    assert any(
        not torch.equal(a.inputs, c.inputs) for a, c in zip(fed_a.val, fed_c.val, strict=True)
    )
    assert not torch.equal(da[0].arrays["classifier.weight"], dc[0].arrays["classifier.weight"])


# ----------------------------------------------------------------------------- variants


def test_random_embeddings_are_redrawn_after_the_step_and_theta_is_unaffected():
    learned = make_server("hfedf")
    rand = make_server("hfedf_rand_embed")
    deltas = random_deltas(learned, 1)
    step(learned, deltas)
    step(rand, deltas)
    for a, b in zip(learned.hnet.theta(), rand.hnet.theta(), strict=True):
        assert torch.equal(a, b)  # the first step saw the same ν
    assert not torch.allclose(learned.hnet.embeddings.weight, rand.hnet.embeddings.weight)
    again = make_server("hfedf_rand_embed")
    step(again, deltas)
    assert torch.equal(again.hnet.embeddings.weight, rand.hnet.embeddings.weight)  # seeded


def test_autoencoder_has_table_6_shapes():
    ae = ConvAutoencoder(latent_dim=4)
    x = torch.rand(5, 3, 32, 32)
    assert ae.encoder(x).shape == (5, 4)
    recon = ae(x).detach()
    assert recon.shape == (5, 3, 32, 32) and 0 <= float(recon.min()) <= float(recon.max()) <= 1
    assert ae.encoder[7].in_features == 32 * 8 * 8
    with pytest.raises(ConfigError, match="resolution=30"):
        ConvAutoencoder(4, resolution=30)


def test_autoencoder_embeddings_are_the_clients_mean_latents_and_stay_fixed(tmp_path):
    cfg = tiny_config(rounds=2, algorithm={"name": "hfedf_ae_embed", "ae_epochs": 2})
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    collected: dict[int, torch.Tensor] = {}
    on_collect = sim.server.on_collect

    def recording(replies):
        collected.update({c: m.arrays["embedding"].clone() for c, m in replies.items()})
        on_collect(replies)

    sim.server.on_collect = recording
    sim.run()
    nu = sim.server.hnet.embeddings.weight
    assert not nu.requires_grad
    assert torch.equal(nu, torch.stack([collected[c] for c in range(3)]))
    assert len({tuple(v.tolist()) for v in collected.values()}) == 3  # one per client
    assert sim.ledger.up["statistics"] == 3 * 4  # one float of L = 1 per client, once


def test_variant_names_pin_their_switches():
    with pytest.raises(ConfigError, match=r"algorithm\.ema"):
        algorithm_hparams("hfedf_no_ema", {"ema": True})
    with pytest.raises(ConfigError, match=r"did you mean 'algorithm\.ema_alpha'"):
        algorithm_hparams("hfedf", {"ema_alfa": 0.9})
    hp = algorithm_hparams("hfedf_no_gradalign_no_ema", {})
    assert (hp.gradalign, hp.ema, hp.lr_s, hp.server_optimizer) == (False, False, 1e-3, "adam")


# ----------------------------------------------------------------------------- diagnostics, state


def test_diagnostics_weight_divergence_matches_pairwise_norms():
    server = make_server("hfedf", n_clients=2)
    deltas = random_deltas(server, 1)
    phi0 = {c: {k: v.clone() for k, v in server.generated(c).items()} for c in (0, 1)}
    step(server, deltas)
    diag = server.diagnostics()
    name = "0.weight"
    gen = [server.generated(c)[name] for c in (0, 1)]
    wd = float((gen[0] - gen[1]).norm())
    assert diag[f"wd_generated/{name}"] == pytest.approx(wd, rel=1e-5)
    assert diag[f"wd_generated_norm/{name}"] == pytest.approx(
        wd / float((gen[0].norm() + gen[1].norm()) / 2), rel=1e-5
    )
    trained = [phi0[c][name] - deltas[c][name] for c in (0, 1)]
    # pdist and norm sum the 24 squares in their own orders: float32 relative error ≤ 24·eps32
    # ≈ 1.4e-6 worst case, so rel 1e-5 (as above), not pytest's default 1e-6
    assert diag[f"wd_trained/{name}"] == pytest.approx(
        float((trained[0] - trained[1]).norm()), rel=1e-5
    )
    assert len(diag["gradalign_w_theta"]) == 2 and diag["server_steps"] == 1


def test_state_dict_round_trip_continues_identically():
    server = make_server("hfedf_rand_embed", ema_warmup=0)
    for rnd in (1, 2):
        step(server, random_deltas(server, rnd), rnd)
    twin = make_server("hfedf_rand_embed", ema_warmup=0)
    twin.load_state_dict(copy.deepcopy(server.state_dict()))
    deltas = random_deltas(server, 3)
    step(server, deltas, 3)
    step(twin, deltas, 3)
    for a, b in zip(params_of(server), params_of(twin), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- configs

_TABLE_10 = {  # dataset: (wd_s, ema_alpha)
    "pacs": (1e-5, 0.95),
    "officehome": (1e-5, 0.75),
    "vlcs": (1e-3, 0.75),
}


@pytest.mark.parametrize("dataset", sorted(_TABLE_10))
@pytest.mark.parametrize("d", [1, 2])
def test_full_budget_configs_follow_table_2_and_table_10(dataset, d):
    cfg = load_config(CONFIGS / dataset / f"hfedf_d{d}.yaml")
    assert (cfg.rounds, cfg.train.local_epochs, cfg.train.batch_size) == (200, 2, 64)
    assert (cfg.partition.n_clients, cfg.partition.d) == (3, d)
    assert cfg.model.name == "hfedf_cnn" and cfg.dataset.resolution == 32
    assert cfg.train.mean is None and cfg.train.std is None
    assert not cfg.train.augment.hflip and cfg.train.augment.random_resized_crop is None
    assert (cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay) == ("adam", 1e-3, 1e-3)
    assert (cfg.eval.every, cfg.eval.selection) == (5, "last")
    hp = algorithm_hparams(cfg.algorithm.name, cfg.algorithm.hparams)
    assert cfg.algorithm.name == "hfedf" and (hp.wd_s, hp.ema_alpha) == _TABLE_10[dataset]
    assert (hp.lr_s, hp.ema_warmup, hp.gradalign_sign) == (1e-3, 10, 1)


def test_cpu_profile_is_pacs_lenet32_with_hfedf():
    cfg = load_config(CONFIGS / "pacs" / "hfedf_cpu.yaml")
    base = load_config(CONFIGS / "pacs" / "lenet32.yaml")
    assert cfg.algorithm.name == "hfedf"
    for section in ("dataset", "split", "partition", "model", "train", "eval"):
        assert getattr(cfg, section) == getattr(base, section), section
    assert cfg.rounds == base.rounds == 100
