"""The engine's state categories (``federation/layout.py``, ``algorithms/layout.py``): shared
arrays averaged and broadcast, local arrays kept by each client, server-computed arrays pushed
every round; BatchNorm layers found by module type in any model."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import ClassVar

import pytest
import torch
from torch import nn
from torchvision.models import resnet18

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import Hparams, MethodSpec, StationContext
from feddomain.algorithms.fedavg import FedAvgHparams
from feddomain.algorithms.fedbn import FedBNStation
from feddomain.algorithms.layout import LayoutClient, LayoutServer, LayoutStation
from feddomain.federation.layout import (
    COMPUTED,
    LOCAL,
    SHARED,
    StateLayout,
    batchnorm_arrays,
    load_local,
    store_local,
)
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from feddomain.federation.training import get_arrays
from feddomain.models import build_model
from tests.engine_helpers import run_sim, tiny_config
from tests.test_evidence_engine import TRAIN_SIZES, _spy_aggregate, _weighted64, uneven_federation

BN_LEAVES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


# ------------------------------------------------------------------ finding BatchNorm layers
def test_batchnorm_arrays_are_found_by_module_type_not_by_name():
    """Catches a name-based search: BatchNorm layers called anything (here 'scale', 'odd', and
    torchvision's / EfficientNet's own names) must be found, and nothing else."""
    model = nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(3, 4, 3),
            scale=nn.BatchNorm2d(4),  # a BatchNorm not named like one
            norm=nn.GroupNorm(2, 4),  # named like a norm, but no BatchNorm
            bn=nn.Linear(4, 4),  # named like one, but a Linear
            odd=nn.BatchNorm1d(4, affine=False),  # statistics only
            free=nn.BatchNorm2d(4, track_running_stats=False),  # affine only
        )
    )
    assert batchnorm_arrays(model) == (
        *(f"scale.{leaf}" for leaf in BN_LEAVES),
        "odd.running_mean",
        "odd.running_var",
        "odd.num_batches_tracked",
        "free.weight",
        "free.bias",
    )
    assert batchnorm_arrays(model, affine=False) == (
        "scale.running_mean",
        "scale.running_var",
        "scale.num_batches_tracked",
        "odd.running_mean",
        "odd.running_var",
        "odd.num_batches_tracked",
    )
    assert batchnorm_arrays(model, statistics=False) == (
        "scale.weight",
        "scale.bias",
        "free.weight",
        "free.bias",
    )


def test_batchnorm_arrays_of_our_torchvisions_and_efficientnets_models():
    """Catches BatchNorm layers missed in a real network: hand-known counts — small_cnn 3 (one
    per conv block), torchvision ResNet-18 20 (fedfda.md §3.1), EfficientNet-Lite0 49 (stem,
    head, 2 in the first MBConv block, 3 in each of the other 15) — and none in LeNet-5."""
    small = build_model("small_cnn", 7)
    assert batchnorm_arrays(small) == tuple(
        f"featurizer.{i}.1.{leaf}" for i in range(3) for leaf in BN_LEAVES
    )
    for model, layers in (
        (resnet18(), 20),
        (build_model("resnet18", 7), 20),
        (build_model("efficientnet_lite0", 7, resolution=32, pretrained=False), 49),
    ):
        names = batchnorm_arrays(model)
        assert len(names) == 5 * layers
        assert sum(n.endswith(".running_var") for n in names) == layers
        assert len(batchnorm_arrays(model, affine=False)) == 3 * layers
    assert batchnorm_arrays(build_model("lenet5", 7)) == ()
    assert batchnorm_arrays(build_model("small_cnn", 7, norm="group")) == ()


# ------------------------------------------------------------------ categories
def test_a_layout_sorts_names_into_categories_by_name_or_pattern():
    """Catches a wrong category for an array, lost order, or an array both local and
    computed (which one would win is undefined: refused)."""
    layout = StateLayout(local=("a.running_mean", "b.*"), computed=("*.global_mean",))
    arrays = {k: torch.zeros(1) for k in ("w", "a.running_mean", "b.x", "a.global_mean", "b.y")}
    parts = layout.split(arrays)
    assert list(parts[SHARED]) == ["w"]
    assert list(parts[LOCAL]) == ["a.running_mean", "b.x", "b.y"]
    assert list(parts[COMPUTED]) == ["a.global_mean"]
    assert list(layout.select(arrays, SHARED, LOCAL)) == ["w", "a.running_mean", "b.x", "b.y"]
    assert StateLayout().split(arrays)[SHARED].keys() == arrays.keys()  # FedAvg's: all shared
    with pytest.raises(ValueError, match="both local and computed"):
        StateLayout(local=("x",), computed=("x",))


def test_local_arrays_live_in_the_client_state_beside_other_entries():
    """Catches local arrays that clobber (or are clobbered by) other state entries, alias the
    model's tensors, or survive a later store that no longer names them."""
    state = Message("state", {"optimizer/0.momentum_buffer": torch.ones(2)})
    value = torch.zeros(3)
    store_local(state, {"bn.running_mean": value, "bn.running_var": torch.ones(3)})
    value += 5  # the model trains on: the stored copy must not move
    assert torch.equal(load_local(state)["bn.running_mean"], torch.zeros(3))
    store_local(state, {"bn.running_mean": torch.full((3,), 2.0)})
    assert list(load_local(state)) == ["bn.running_mean"]
    assert torch.equal(state.arrays["optimizer/0.momentum_buffer"], torch.ones(2))


# ------------------------------------------------------------------ the parts
class PlainLayoutServer(LayoutServer):
    """The layout parts with the default layout: nothing local, nothing computed."""


PLAIN = MethodSpec("_layout_plain", PlainLayoutServer, LayoutClient, FedAvgHparams)


def add_global_means(model: nn.Module, hp) -> nn.Module:
    """FedFD-style hook: every BatchNorm layer gets a ``global_mean`` buffer (server-computed)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.register_buffer("global_mean", torch.zeros_like(m.running_mean))
    return model


def pushed_layout(model: nn.Module, hp) -> StateLayout:
    """SiloBN's local statistics plus FedFD's server-computed global means."""
    return StateLayout(local=batchnorm_arrays(model, affine=False), computed=("*.global_mean",))


class PushedServer(LayoutServer):
    layout = staticmethod(pushed_layout)

    def compute(self, local_mean):
        """global_mean <- the clients' sample-weighted mean running_mean (FedFD §3.5)."""
        return {
            k.replace("running_mean", "global_mean"): v
            for k, v in local_mean.items()
            if k.endswith("running_mean")
        }


class PushedClient(LayoutClient):
    layout = staticmethod(pushed_layout)
    seen: ClassVar[list[tuple[int, int, torch.Tensor]]] = []

    def regularizer(self, msg, ctx):
        """Records the global_mean the model holds while it trains (first batch)."""
        bn = ctx.model.featurizer[0][1]

        def record() -> torch.Tensor:
            if not self.seen or self.seen[-1][:2] != (ctx.rnd, ctx.cid):
                self.seen.append((ctx.rnd, ctx.cid, bn.global_mean.clone()))
            return torch.zeros(())

        return record


PUSHED = MethodSpec(
    "_layout_pushed", PushedServer, PushedClient, FedAvgHparams, model_hook=add_global_means
)


@pytest.fixture(autouse=True, scope="module")
def layout_methods():
    for spec in (PLAIN, PUSHED):
        register(spec)
    yield
    for spec in (PLAIN, PUSHED):
        del METHODS[spec.name]


def _records(path) -> list[dict]:
    lines = (path / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in lines]


def test_the_default_layout_is_fedavg_number_for_number(tmp_path):
    """Catches a layout base that changes FedAvg's arithmetic, its broadcast or its evaluation
    when nothing is local (same run: equal server arrays bit for bit, equal metrics)."""
    fedavg = run_sim(tiny_config(rounds=2, model={"name": "small_cnn"}), tmp_path / "fedavg")
    plain = run_sim(
        tiny_config(rounds=2, model={"name": "small_cnn"}, algorithm="_layout_plain"),
        tmp_path / "plain",
    )
    a, b = fedavg.server.global_arrays, plain.server.global_arrays
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain.server.eval_arrays(None) is None
    assert _records(tmp_path / "fedavg") == _records(tmp_path / "plain")


def test_server_computed_arrays_are_the_weighted_mean_of_local_ones_and_reach_training(tmp_path):
    """Catches computed arrays (FedFD's global statistics) that are not pushed, not the
    sample-weighted mean of the clients' local arrays, sent back by clients, or overwritten by
    a client's own values; local statistics must stay each client's own."""
    PushedClient.seen.clear()
    cfg = tiny_config(rounds=2, model={"name": "small_cnn"}, algorithm="_layout_pushed")
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    seen = _spy_aggregate(sim)
    sim.run()
    name = "featurizer.0.1.global_mean"
    stat = "featurizer.0.1.running_mean"
    (_, _, first), (_, pushed, second) = seen
    for _, reply in first + second:  # clients send shared and local arrays, never computed ones
        assert not any(k.endswith("global_mean") for k in reply.arrays)
        assert stat in reply.arrays
    # round 2's broadcast: the float64 sample-weighted mean of round 1's running means
    expected = _weighted64([(n, m.arrays) for n, (_, m) in zip(TRAIN_SIZES, first, strict=True)])
    torch.testing.assert_close(pushed[name].double(), expected[stat], rtol=2**-23, atol=1e-12)
    # ... which every client's model held while it trained in round 2 (round 1: the initial 0)
    rounds = {(r, c): v for r, c, v in PushedClient.seen}
    assert all(torch.equal(rounds[(1, c)], torch.zeros(32)) for c in range(3))
    assert all(torch.equal(rounds[(2, c)], pushed[name]) for c in range(3))
    # the running statistics stay each client's: its state holds what it last trained
    for cid, reply in second:
        assert torch.equal(load_local(sim.states[cid])[stat], reply.arrays[stat])
    assert not torch.equal(second[0][1].arrays[stat], second[1][1].arrays[stat])


def _perturbed(arrays: dict, scale: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in arrays.items():
        if v.is_floating_point():
            out[k] = v + scale * torch.randn(v.shape, generator=g)
        else:
            out[k] = v + int(10 * scale)
    return out


def test_a_station_sends_its_clients_the_shared_mean_but_never_local_arrays():
    """Catches a station whose later downlinks carry its clients' (mean) BatchNorm layers, or
    whose uplink drops the local arrays the server's mean needs."""
    model = lambda: build_model("small_cnn", 3)  # noqa: E731
    torch.manual_seed(0)
    station = FedBNStation(StationContext(0, (0, 1), 2, 0, model_factory=model), Hparams())
    initial = get_arrays(model())
    station.begin(1, Message("fit", initial))
    assert station.downlink(1, 0).arrays is initial
    a, b = _perturbed(initial, 1.0, 1), _perturbed(initial, 3.0, 2)
    replies = [
        (0, Message("fit", a, {"num_examples": 3})),
        (1, Message("fit", b, {"num_examples": 1})),
    ]
    station.aggregate(1, 0, iter(replies))
    down = station.downlink(1, 1).arrays
    local = set(batchnorm_arrays(model()))
    assert local and down.keys() == initial.keys()
    for k in initial:
        if k in local:  # the server's (initial) values, not the clients'
            assert torch.equal(down[k], initial[k]), k
        elif initial[k].is_floating_point():
            mean = (3 * a[k].double() + b[k].double()) / 4
            torch.testing.assert_close(down[k].double(), mean, rtol=2**-23, atol=1e-12)
    up = station.uplink(1)
    assert up.scalars["num_examples"] == 4
    k = "featurizer.1.1.running_var"
    torch.testing.assert_close(
        up.arrays[k].double(), (3 * a[k].double() + b[k].double()) / 4, rtol=2**-23, atol=0
    )
    assert isinstance(station, LayoutStation)
