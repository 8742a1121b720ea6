"""CCST (feddomain/algorithms/ccst.py) and FPL (feddomain/algorithms/fpl.py), FISC's baselines
(fisc.md §6): CCST's style bank and loss, FPL's prototypes, clustering and loss, each against
values computed here; FPL's first round (no prototypes yet) and λ = 0 reduce to FedAvg bit for
bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.ccst import CCSTClient, CCSTHparams, CCSTServer
from feddomain.algorithms.fpl import cluster_prototypes, prototype_term
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.models.base import FeatureClassifier
from feddomain.style.backends import DCTBackend
from feddomain.style.statistics import EPS, adain
from tests.engine_helpers import run_sim, tiny_config
from tests.test_evidence_engine import uneven_federation
from tests.test_fisc import _context


def ccst_server(n: int, k: int = 1, seed: int = 0) -> CCSTServer:
    ctx = ServerContext(lambda: torch.nn.Linear(1, 1), n, seed, 1)
    return CCSTServer(ctx, CCSTHparams(styles_per_client=k))


def style_replies(n: int) -> dict[int, Message]:
    """Client c's style: mean = c everywhere, std = c + 1 (so each is recognisable)."""
    return {
        c: Message("collect", {"style_mean": torch.full((192,), float(c)),
                               "style_std": torch.full((192,), c + 1.0)})
        for c in range(n)
    }  # fmt: skip


# ---------------------------------------------------------------------- CCST
@pytest.mark.parametrize("k", [1, 3])
def test_ccst_gives_each_client_k_distinct_styles_of_other_clients(k):
    """Catches: a client receiving its own style, duplicates, or the wrong count (K = 1)."""
    server = ccst_server(5, k)
    server.on_collect(style_replies(5))
    plan = server.broadcast(list(range(5)))
    for cid, msg in plan.items():
        means = msg.arrays["style_mean"][:, 0].tolist()
        assert len(means) == k == len(set(means)) and float(cid) not in means
        # each received (mean, std) pair is one client's, not a mix
        assert msg.arrays["style_std"][:, 0].tolist() == [m + 1 for m in means]


def test_ccst_style_draw_is_seeded():
    """Catches: an unseeded style assignment (runs and resumes could not be reproduced)."""
    draws = []
    for _ in range(2):
        server = ccst_server(6, seed=11)
        server.on_collect(style_replies(6))
        draws.append(
            {c: m.arrays["style_mean"] for c, m in server.broadcast(list(range(6))).items()}
        )
    assert all(torch.equal(draws[0][c], draws[1][c]) for c in range(6))


def test_ccst_refuses_more_styles_than_other_clients():
    """Catches: K >= N silently giving a client its own style."""
    server = ccst_server(3, k=3)
    with pytest.raises(ConfigError, match=r"styles_per_client.*only 2 other"):
        server.on_collect(style_replies(3))


def test_ccst_uploads_the_pooled_overall_style():
    """Catches: CCST using FISC's FINCH-weighted style: its upload is the channel mean and
    std (σ² = E[z²] − μ² + ε) of all its images' DCT maps pooled, computed here in float64."""
    ctx = _context(Message("state"), n=7)
    reply = CCSTClient(CCSTHparams()).run(Message("collect"), ctx)
    x = torch.cat([x for x, _ in ctx.train.batches(7, shuffle=False)]).double() * 0.25 + 0.5
    z = DCTBackend().double().encode(x).transpose(0, 1).flatten(1)
    mean = z.mean(1)
    std = (z.pow(2).mean(1) - mean**2 + EPS).sqrt()
    torch.testing.assert_close(reply.arrays["style_mean"].double(), mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reply.arrays["style_std"].double(), std, atol=1e-5, rtol=1e-5)


def test_ccst_loss_is_ce_on_originals_plus_ce_on_restyled():
    """Catches: a CCST loss without the original images' CE, or the styled CE weighted wrong
    (K = 2: CE(x) + ½ Σ_k CE(x̃_k)), against a float64 formula written here."""
    torch.manual_seed(0)
    model = FeatureClassifier(torch.nn.Flatten(), torch.nn.Linear(768, 3), 768).double()
    means, stds = torch.rand(2, 192) * 0.2, torch.rand(2, 192) * 0.1 + 0.02
    state = Message("state", {"style/style_mean": means, "style/style_std": stds})
    ctx = _context(state)
    x = torch.rand(6, 3, 16, 16, dtype=torch.float64) * 2 - 1
    y = torch.tensor([0, 1, 2, 0, 1, 1])
    got = CCSTClient(CCSTHparams(styles_per_client=2)).loss_fn(Message("fit"), ctx)(model, x, y)
    b = DCTBackend().double()
    z = b.encode(x * 0.25 + 0.5)
    expected = F.cross_entropy(model(x), y)
    for m, s in zip(means, stds, strict=True):
        styled = b.decode(0.5 * adain(z, m.double(), s.double()) + 0.5 * z).clamp(0, 1)
        expected = expected + 0.5 * F.cross_entropy(model((styled - 0.5) / 0.25), y)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------- FPL
def test_fpl_prototype_term_by_hand():
    """Catches: InfoNCE with the wrong positives, temperature or normaliser, or the MSE to a
    mean other than the class's cluster prototypes' (float64, written out here)."""
    f = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 2])  # class 2 has no prototype: contributes 0, still counts in B
    protos = torch.tensor([[1.0, 0.2], [0.8, -0.1], [0.1, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    tau = 0.5

    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    total = 0.0
    for i in range(2):
        e = [np.exp(cos(f[i], p) / tau) for p in protos]
        pos = sum(e[j] for j in range(3) if labels[j] == y[i])
        mean_proto = protos[labels == y[i]].mean(0)
        total += -np.log(pos / sum(e)) + float((f[i] - mean_proto).pow(2).mean())
    got = prototype_term(f, y, protos, labels, tau)
    assert abs(float(got) - total / 3) < 1e-9


def test_fpl_clusters_each_class_separately_with_finch():
    """Catches: prototypes clustered across classes, or a class's outlying domain averaged away:
    class 0 has two separated groups of clients (two cluster prototypes), class 1 two clients
    (one prototype, their mean)."""
    g0 = [torch.tensor([5.0, 0.1 * i, 0.0]) for i in range(3)]
    g1 = [torch.tensor([0.0, 0.1 * i, 5.0]) for i in range(3)]
    c1 = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([3.0, 1.0, 0.0])]
    protos, labels = cluster_prototypes({0: g0 + g1, 1: c1})
    assert labels.tolist() == [0, 0, 1]
    got0 = sorted(protos[:2].tolist())
    expected0 = sorted([torch.stack(g1).mean(0).tolist(), torch.stack(g0).mean(0).tolist()])
    np.testing.assert_allclose(got0, expected0, rtol=1e-6)
    np.testing.assert_allclose(protos[2].tolist(), [2.0, 1.0, 0.0])


def test_fpl_without_prototype_weight_is_fedavg_bit_for_bit(tmp_path):
    """Catches: an FPL client step that differs from FedAvg's apart from the prototype term
    (λ = 0; unequal clients; the prototype pass after training must not disturb anything),
    and prototypes that leave the client per sample (the privacy check would stop the run)."""
    runs = {}
    for name, hp in (("fpl", {"weight": 0.0}), ("fedavg", {})):
        cfg = tiny_config(rounds=3, algorithm={"name": name, **hp}, train__optimizer="adam")
        runs[name] = run_sim(cfg, tmp_path / name, uneven_federation(cfg))
    for k, v in runs["fedavg"].server.global_arrays.items():
        assert torch.equal(runs["fpl"].server.global_arrays[k], v), k
    assert runs["fpl"].server.protos.shape[0] >= 3  # prototypes of every class were made


def test_fpl_first_round_is_fedavg_and_later_rounds_use_prototypes(tmp_path):
    """Catches: a prototype term before any prototype exists (round 1 must be FedAvg), or one
    that never acts (round 2 must differ)."""
    runs = {}
    for name in ("fpl", "fedavg"):
        for rounds in (1, 2):
            cfg = tiny_config(rounds=rounds, algorithm={"name": name}, train__optimizer="adam")
            runs[name, rounds] = run_sim(cfg, tmp_path / f"{name}{rounds}", uneven_federation(cfg))
    one = [runs[m, 1].server.global_arrays for m in ("fpl", "fedavg")]
    assert all(torch.equal(one[0][k], v) for k, v in one[1].items())
    two = [runs[m, 2].server.global_arrays for m in ("fpl", "fedavg")]
    assert any(not torch.equal(two[0][k], v) for k, v in two[1].items())
