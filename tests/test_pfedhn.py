"""pFedHN (hfedf.md §6): one hypernetwork step per client, in a seeded random order."""

from __future__ import annotations

import torch

from feddomain.algorithms import algorithm_hparams
from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.pfedhn import PFedHNServer
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from tests.engine_helpers import tiny_config, tiny_federation
from tests.test_hfedf import tiny_model


def test_each_client_gets_the_model_of_the_hypernetwork_its_predecessor_updated(tmp_path):
    cfg = tiny_config(rounds=2, algorithm="pfedhn", train__optimizer="adam", train__lr=1e-3)
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    initial = {c: {k: v.clone() for k, v in sim.server.generated(c).items()} for c in range(3)}
    log: list[tuple[int, int, Message, Message]] = []  # (round, cid, received, reply)
    run = sim.client.run

    def recording(msg, ctx):
        reply = run(msg, ctx)
        log.append((ctx.rnd, ctx.cid, msg.copy(), reply.copy()))
        return reply

    sim.client.run = recording
    sim._round(1)
    sim._round(2)

    assert [sorted(c for r, c, *_ in log if r == rnd) for rnd in (1, 2)] == [[0, 1, 2]] * 2
    # Replay with a fresh server of the same seed: message k must be what the hypernetwork
    # generates after exactly the k earlier steps.
    replay = PFedHNServer(sim.server.ctx, sim.server.hp)
    for rnd, cid, received, reply in log:
        for k, v in replay.generated(cid).items():
            assert torch.equal(v, received.arrays[k]), (rnd, cid, k)
        replay.aggregate(rnd, iter([(cid, reply)]))
    for a, b in zip(replay.hnet.parameters(), sim.server.hnet.parameters(), strict=True):
        assert torch.equal(a, b)
    # the second client of round 1 did not get the initial hypernetwork's model
    _, second, received, _ = log[1]
    assert not torch.equal(
        received.arrays["classifier.weight"], initial[second]["classifier.weight"]
    )
    assert sim.server.steps == 6


def test_defaults_are_sgd_with_momentum_and_table_10_pacs_values():
    hp = algorithm_hparams("pfedhn", {})
    server = PFedHNServer(ServerContext(tiny_model, 3, seed=0, rounds=1), hp)
    assert isinstance(server.optimizer, torch.optim.SGD)
    group = server.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (1e-2, 0.9, 1e-3)
    assert server.hnet.embeddings.weight.shape == (3, 1)
    assert sum(p.numel() for p in server.trainable()) == sum(
        p.numel() for p in server.hnet.parameters()
    )


def test_client_order_is_a_seeded_random_permutation():
    def orders(seed):
        hp = algorithm_hparams("pfedhn", {"hidden": 4})
        server = PFedHNServer(ServerContext(tiny_model, 5, seed=seed, rounds=1), hp)
        return [server.random_order(5) for _ in range(8)]

    a = orders(0)
    assert all(sorted(o) == list(range(5)) for o in a)
    assert len({tuple(o) for o in a}) > 1
    assert a == orders(0) and a != orders(1)


def test_server_grad_clip_bounds_the_step_to_the_global_norm_and_leaves_small_steps_alone():
    """Catches a server clip applied per tensor instead of globally, a clip that is never
    applied, or one that rescales gradients already below the bound."""
    hp = algorithm_hparams(
        "pfedhn",
        {"hidden": 4, "lr_s": 1.0, "wd_s": 0.0, "server_momentum": 0.0, "server_grad_clip": 5.0},
    )
    server = PFedHNServer(ServerContext(tiny_model, 3, seed=0, rounds=1), hp)
    params = server.trainable()
    # every entry 1: the global norm is sqrt(n); each tensor alone is below it
    n = sum(p.numel() for p in params)
    assert n > 25
    before = [p.detach().clone() for p in params]
    server.apply([torch.ones_like(p) for p in params])
    moved = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, params, strict=True)])
    # SGD, lr 1: the move is the clipped gradient, every entry 5 / sqrt(n)
    torch.testing.assert_close(moved, torch.full_like(moved, 5.0 / n**0.5), rtol=1e-5, atol=0)
    small = [torch.full_like(p, 0.5 / n**0.5) for p in params]  # global norm 0.5 < 5
    before = [p.detach().clone() for p in params]
    server.apply(small)
    for b, p, g in zip(before, params, small, strict=True):
        torch.testing.assert_close(b - p.detach(), g, rtol=1e-5, atol=1e-7)
