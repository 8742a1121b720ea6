"""Clients trained together (``federation/batched.py``, ``train.batched_clients``) against the
sequential path: the same batches, the same optimiser math, the same replies.

Bounds. In float64 both paths differ only by the summation order of the batched kernels (about
1e-16 relative per operation), so after a few dozen steps of a LeNet-5 the weights agree to
1e-10 absolute, where a wrong batch, a missed or extra step, a wrong anchor or a wrong
optimiser state moves them by about lr·|g| ≥ 1e-4. The float32 engine test uses SGD, where the
rounding difference propagates linearly (observed ≤ 2e-8 after two rounds): 1e-5 leaves three
orders of margin on either side. (Adam in float32 amplifies rounding of near-zero gradient
entries into steps of size up to lr, so Adam is compared in float64, on the engine too.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from feddomain.algorithms.base import ClientContext, fit_together
from feddomain.algorithms.fedprox import FedProxClient, FedProxHparams
from feddomain.errors import ConfigError
from feddomain.federation.batched import OptimizerSettings, fit_clients
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from feddomain.federation.training import get_arrays, set_arrays, train_epochs
from feddomain.models.lenet import lenet5
from tests.engine_helpers import tiny_config, tiny_federation

SIZES = (23, 13, 6)  # unequal: 3, 2 and 1 batches of 8 per epoch, each with a partial batch
BATCH = 8
F64 = 1e-10


def noisy(x: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
    """Augmentation drawn from the client's generator, as the real pipeline's is: a batch seen
    with another generator state gets other noise."""
    noise = torch.rand(x.shape, generator=g, dtype=torch.float64)
    return x.double() / 255 + 0.1 * noise


def client_sets(sizes=SIZES, seed: int = 0) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    return [
        ClientData(
            torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8),
            torch.randint(0, 3, (n,), generator=g),
            noisy,
        )
        for n in sizes
    ]


def float64_lenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return lenet5(3).double()


def starts_for(model: torch.nn.Module, n: int) -> list[dict[str, torch.Tensor]]:
    """Different initial weights per client (Local-only's situation)."""
    base = get_arrays(model)
    return [{k: v + 0.01 * i for k, v in base.items()} for i in range(n)]


def sequential(
    model, start, data, seed, settings, *, lr, epochs, reg=None, clip=None, drop_last=False
):
    """The engine's sequential client step: torch.optim over the shared model."""
    set_arrays(model, start)
    opt = settings(list(model.parameters()), lr)
    stats = train_epochs(
        model,
        data,
        opt,
        epochs=epochs,
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(seed),
        regularizer=reg,
        grad_clip=clip,
        drop_last=drop_last,
    )
    return get_arrays(model), stats


def assert_close(a: dict, b: dict, bound: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert worst <= bound, worst


SETTINGS = {
    "sgd_momentum": OptimizerSettings("sgd", momentum=0.9, weight_decay=5e-4),
    "adam": OptimizerSettings("adam", weight_decay=5e-4),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_clients_of_unequal_sizes_train_together_as_they_train_alone(name):
    """Each client's final weights, step and example counts and per-batch losses equal the
    sequential torch.optim run on the same generator, in float64, over two epochs with partial
    batches. Catches: batches drawn in another order (an epoch's permutation drawn before the
    previous epoch ends), a finished client that keeps stepping on padding, padding counted in
    the mean loss, SGD momentum or Adam moments/bias corrections that differ from torch's."""
    settings, model, datas = SETTINGS[name], float64_lenet(), client_sets()
    starts = starts_for(model, len(datas))
    lr = 0.05 if name.startswith("sgd") else 0.01
    together = fit_clients(
        model,
        starts,
        datas,
        [torch.Generator().manual_seed(10 + i) for i in range(3)],
        settings=settings,
        lr=lr,
        epochs=2,
        batch_size=BATCH,
    )
    for i, (arrays, stats) in enumerate(together):
        ref_arrays, ref = sequential(model, starts[i], datas[i], 10 + i, settings, lr=lr, epochs=2)
        assert_close(arrays, ref_arrays, F64)
        assert (
            (stats.steps, stats.examples)
            == (ref.steps, ref.examples)
            == (
                2 * -(-SIZES[i] // BATCH),
                2 * SIZES[i],
            )
        )
        assert torch.allclose(stats.batch_losses, ref.batch_losses.double(), atol=1e-12)
        assert stats.mean_loss == pytest.approx(ref.mean_loss, abs=1e-12)


def proximal(pairs, mu: float = 0.5):
    """FedProx's sequential regulariser over (parameter, anchor) pairs."""
    return lambda: 0.5 * mu * sum((p - a).pow(2).sum() for p, a in pairs)


def test_proximal_term_and_gradient_clipping_match_the_sequential_step():
    """FedProx's (μ/2)‖w − w_g‖² with each client's own anchor, and per-client gradient
    clipping, as the sequential regulariser closure and clip_grad_norm_ do. Catches: the
    anchor of another client (or none), the clipping norm taken over all clients together."""
    mu, clip = 0.5, 0.05
    model, datas = float64_lenet(), client_sets()
    starts = starts_for(model, 3)
    anchors = [{k: v - 0.02 for k, v in s.items()} for s in starts]
    settings = SETTINGS["sgd_momentum"]

    together = fit_clients(
        model,
        starts,
        datas,
        [torch.Generator().manual_seed(i) for i in range(3)],
        settings=settings,
        lr=0.05,
        epochs=1,
        batch_size=BATCH,
        grad_clip=clip,
        regularizer=FedProxClient(FedProxHparams(mu=mu)).functional_regularizer(),
        anchors=anchors,
    )
    for i, (arrays, _) in enumerate(together):
        set_arrays(model, starts[i])
        pairs = [(p, anchors[i][k]) for k, p in model.named_parameters()]
        ref, _ = sequential(
            model,
            starts[i],
            datas[i],
            i,
            settings,
            lr=0.05,
            epochs=1,
            reg=proximal(pairs, mu),
            clip=clip,
        )
        assert_close(arrays, ref, F64)


def test_a_client_without_a_step_keeps_its_arrays_exactly():
    """With drop_last a client smaller than a batch takes no step: its arrays come back bit for
    bit as it sent them, while the others train. Catches: a finished (or never active) client
    updated by the masked computation (a zero-gradient Adam or momentum step still moves it)."""
    model, datas = float64_lenet(), client_sets((20, 5, 12))
    starts = starts_for(model, 3)
    out = fit_clients(
        model,
        starts,
        datas,
        [torch.Generator().manual_seed(i) for i in range(3)],
        settings=SETTINGS["adam"],
        lr=0.01,
        epochs=1,
        batch_size=BATCH,
        drop_last=True,
    )
    assert [s.steps for _, s in out] == [2, 0, 1]
    assert all(torch.equal(out[1][0][k], starts[1][k]) for k in starts[1])
    assert not torch.equal(out[0][0]["classifier.weight"], starts[0]["classifier.weight"])


def test_models_with_state_in_their_training_step_are_refused():
    """BatchNorm (running statistics) and dropout (global-RNG masks) cannot be batched exactly;
    the refusal names the layer. Catches: a silent batched run whose results differ."""
    datas = client_sets((8,))
    for model, needle in ((lenet5(3, norm="batch"), "BatchNorm layer 'featurizer.bn1'"),):
        with pytest.raises(ValueError, match=needle):
            fit_clients(
                model,
                [get_arrays(model)],
                datas,
                [torch.Generator()],
                settings=SETTINGS["adam"],
                lr=0.01,
                epochs=1,
                batch_size=BATCH,
            )


def test_fit_together_refuses_clients_that_disagree_on_the_round_settings():
    """Clients trained together share one learning rate and local step; two contexts with
    different lr are refused by name. Catches: a batch silently trained at the first client's
    rate."""
    model, datas = float64_lenet(), client_sets((8, 8))

    def ctx(i: int, lr: float) -> ClientContext:
        return ClientContext(
            i,
            1,
            model,
            datas[i],
            datas[i],
            Message("state"),
            torch.Generator(),
            1,
            BATCH,
            SETTINGS["adam"],
            lr=lr,
        )

    with pytest.raises(ValueError, match="share lr"):
        fit_together([ctx(0, 0.01), ctx(1, 0.02)], starts_for(model, 2))


# ----------------------------------------------------------------------------- the engine


def unequal_federation(cfg):
    """The tiny federation with clients of 36, 21 and 9 training images."""
    fed = tiny_federation(cfg)
    fed.train = [
        ClientData(c.inputs[:n], c.labels[:n], c.transform)
        for c, n in zip(fed.train, (36, 21, 9), strict=True)
    ]
    return fed


def in_float64(fed):
    """Every split's batches as float64 (the model is float64 under the default dtype)."""

    def wrap(c: ClientData) -> ClientData:
        return ClientData(c.inputs, c.labels, lambda x, g, t=c.transform: t(x, g).double())

    fed.train = [wrap(c) for c in fed.train]
    fed.val = [wrap(c) for c in fed.val]
    fed.targets = {d: wrap(c) for d, c in fed.targets.items()}
    return fed


@pytest.fixture
def float64_default():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def run(tmp_path: Path, mode: str, method: str, *, float64: bool = False, **overrides):
    cfg = tiny_config(
        algorithm={"name": method, **({"mu": 0.1} if method == "fedprox" else {})},
        rounds=2,
        train__batched_clients=mode,
        train__local_epochs=2,
        **overrides,
    )
    fed = unequal_federation(cfg)
    out = tmp_path / mode
    out.mkdir()
    sim = Simulation(cfg, in_float64(fed) if float64 else fed, out)
    assert sim.batched == (mode == "on")
    summary = sim.run()
    return sim, summary


def models_of(sim: Simulation, method: str) -> list[dict[str, torch.Tensor]]:
    """What each client would evaluate with: the global model, or Local-only's own models."""
    if method == "local":
        return [dict(s.arrays) for s in sim.states]
    return [sim.server.global_arrays]


# float32 bound on the models after two rounds: 1e-5 on the CPU; on CUDA both paths run cuDNN
# convolutions in TF32 (torch's default: 10-bit mantissa inputs) with other summation orders
F32 = {"cpu": 1e-5, "cuda": 1e-3}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("method", ["fedavg", "fedprox", "local"])
def test_a_batched_round_equals_the_sequential_round_sgd_float32(method, device, tmp_path):
    """Two rounds of FedAvg / FedProx / Local-only with SGD + momentum, three clients of 36, 21
    and 9 images (the smallest finishes its 2 epochs after 2 steps, the largest after 6), on
    the real engine in float32, on the CPU and on CUDA: the same models (within ``F32``),
    losses and byte counts. Catches: the engine handing the batch other messages, generators or
    states than the sequential path (e.g. Local-only's own model, FedProx's anchor), replies in
    another order, a reply that skips the privacy check or the ledger."""
    over = {"train__momentum": 0.9, "train__weight_decay": 5e-4, "train__lr": 0.05}
    seq, s_sum = run(tmp_path, "off", method, device=device, **over)
    bat, b_sum = run(tmp_path, "on", method, device=device, **over)
    for a, b in zip(models_of(seq, method), models_of(bat, method), strict=True):
        assert_close(a, b, F32[device])
    assert s_sum["ledger"] == b_sum["ledger"]
    for r_seq, r_bat in zip(seq.round_log, bat.round_log, strict=True):
        assert r_seq["bytes_up"] == r_bat["bytes_up"] > 0 or method == "local"


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "local"])
def test_a_batched_round_equals_the_sequential_round_adam_float64(
    method, tmp_path, float64_default
):
    """The same with Adam, the whole engine in float64 (bound 1e-10). Catches: Adam's state
    or bias correction across clients that finish at different steps, on the engine path."""
    seq, _ = run(tmp_path, "off", method, float64=True, train__optimizer="adam")
    bat, _ = run(tmp_path, "on", method, float64=True, train__optimizer="adam")
    for a, b in zip(models_of(seq, method), models_of(bat, method), strict=True):
        assert next(iter(a.values())).dtype == torch.float64
        assert_close(a, b, F64)


def test_auto_trains_clients_one_after_another_on_the_cpu():
    """``auto`` batches only on CUDA (on the CPU vmap measured slower); ``off`` never. Catches:
    auto switching the CPU default to the batched path."""
    cfg = tiny_config(train__batched_clients="auto")
    sim = Simulation(cfg, tiny_federation(cfg), Path("/nonexistent-unused"))
    assert sim.batched is (sim.device.type == "cuda")


def test_a_runner_whose_clients_run_elsewhere_never_batches():
    """A runner that replaces ``execute`` (the Flower runner: each client trains on its node)
    keeps one task per client even with ``on``. Catches: the ServerApp training the nodes'
    clients itself."""

    class Remote(Simulation):
        def execute(self, cid, rnd, msg, station_round=0, purpose=0):
            raise AssertionError("not reached")

    cfg = tiny_config(train__batched_clients="on")
    assert Simulation(cfg, tiny_federation(cfg), Path("/nonexistent-unused")).batched
    assert not Remote(cfg, tiny_federation(cfg), Path("/nonexistent-unused")).batched


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"algorithm": "fedsr"}, "method 'fedsr' has a local step of its own"),
        (
            {"algorithm": {"name": "hfedatm", "client": {"name": "fedprox"}}},
            "aggregator 'hfedatm' wraps its clients' training",
        ),
        ({"model__options": {"norm": "batch"}}, "BatchNorm layer 'featurizer.bn1'"),
        ({"model__name": "hfedf_cnn"}, "dropout"),
        ({"train__persistent_optimizer": True}, "train.persistent_optimizer"),
    ],
)
def test_batched_on_refuses_what_it_cannot_batch_exactly(overrides, needle):
    """``train.batched_clients: on`` is refused when the config loads, naming the key and the
    reason: a method with its own local step (FedSR), an aggregator that wraps even a batchable
    client's training (HFedATM's Gram capture around FedProx), BatchNorm, dropout, per-client
    optimiser state. Catches: a run that silently falls back or batches a step it would
    change."""
    with pytest.raises(ConfigError, match=re.escape("'train.batched_clients' = 'on'")) as err:
        tiny_config(train__batched_clients="on", **overrides)
    assert needle in str(err.value)


def test_resume_of_a_batched_run_equals_the_uninterrupted_run(tmp_path):
    """Local-only (per-client models in the clients' state), batched, stopped after round 2's
    checkpoint and resumed: the same final client models, bit for bit, and the same metrics.
    Catches: a batched step that writes state the checkpoint does not hold (or reads state it
    should not), so that a resumed run diverges."""
    cfg = tiny_config(algorithm="local", rounds=3, train__batched_clients="on", checkpoint__every=1)
    full = Simulation(cfg, unequal_federation(cfg), tmp_path / "full")
    (tmp_path / "full").mkdir()
    reference = full.run()

    class Stop(Exception):
        pass

    def stop_at_3(rnd, _record):
        if rnd == 3:
            raise Stop

    out = tmp_path / "cut"
    out.mkdir()
    with pytest.raises(Stop):
        Simulation(cfg, unequal_federation(cfg), out, progress=stop_at_3).run()
    resumed_sim = Simulation(cfg, unequal_federation(cfg), out)
    resumed = resumed_sim.run()
    for a, b in zip(full.states, resumed_sim.states, strict=True):
        assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    assert resumed["per_client"] == reference["per_client"]


def test_station_rounds_train_each_stations_clients_together(tmp_path):
    """FedAvg in two stations (clients [0, 1, 2] and [3, 4] of unequal sizes) with two station
    rounds: each station round's clients trained together give the sequential run's model.
    Catches: a batch mixing stations, or the station round's generators (seeded by station
    round) mixed up."""
    over = {
        "partition__n_clients": 5,
        "partition__name": "lambda",
        "partition__lam": 0.5,
        "topology__stations": 2,
        "topology__station_rounds": 2,
        "train__momentum": 0.9,
        "train__lr": 0.05,
    }
    runs = []
    for mode in ("off", "on"):
        cfg = tiny_config(rounds=2, train__batched_clients=mode, **over)
        (tmp_path / mode).mkdir()
        sim = Simulation(cfg, tiny_federation(cfg), tmp_path / mode)
        sim.run()
        runs.append(sim)
    assert len({len(t) for t in runs[0].data.train}) > 1
    assert_close(runs[0].server.global_arrays, runs[1].server.global_arrays, 1e-5)
