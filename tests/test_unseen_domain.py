"""Unseen-domain evaluation: the target's pilot set, the pilot task, and a method's model for the
unseen domain (``ServerAlgorithm.eval_arrays(None)``), in the simulator and on Flower.

Expected numbers are computed here: pilot and evaluated images are matched to the dataset by
content, and accuracies / NLL come from this file's own forward pass and argmax.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import Arrays, ClientContext, Hparams, MethodSpec
from feddomain.algorithms.local import LocalClient, LocalServer
from feddomain.data.export import SiteExport
from feddomain.errors import ConfigError
from feddomain.federation.data import UNLABELED, ClientData
from feddomain.federation.messages import Message
from feddomain.federation.privacy import PrivacyViolation, Uploads
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import PILOT_CID
from feddomain.models import build_model
from tests.engine_helpers import run_sim, tiny_config, tiny_dataset, tiny_federation
from tests.test_flower import (  # noqa: F401 - fixtures, used by name
    assert_same_run,
    demo_config,
    deploy_loopback,
    records,
    simulate,
    site_nodes,
    sites,
    sites_config,
    task_identity,
)

PILOT_TASKS: list[dict[str, Any]] = []  # what each pilot task's client part was given


# ------------------------------------------------------------------ a method with a pilot
def unseen_model(initial: Arrays, pixel_mean: torch.Tensor) -> Arrays:
    """The test method's unseen-domain model: the initial model with a classifier-bias ramp
    scaled by the pilot images' mean brightness."""
    bias = initial["classifier.bias"]
    ramp = torch.arange(bias.numel(), dtype=bias.dtype) * (4.0 * float(pixel_mean.mean()) / 255)
    return {**initial, "classifier.bias": bias + ramp}


class _PilotServer(LocalServer):
    """Local-only clients (each scored with its own model); asks once for the pilot's mean
    pixel and offers ``unseen_model`` of it for the unseen domain. Keeps the pilot task's
    random draws, so a differently seeded pilot task shows in its state."""

    def __init__(self, ctx: Any, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.pilot_means: dict[str, torch.Tensor] = {}
        self.pilot_draws: dict[str, list[float]] = {}

    def pilot_task(self, domain: str) -> Message | None:
        return None if domain in self.pilot_means else Message("pilot")

    def on_pilot(self, domain: str, reply: Message) -> None:
        self.pilot_means[domain] = reply.arrays["pixel_mean"]
        self.pilot_draws[domain] = list(reply.scalars["draws"])

    def eval_arrays(self, cid: int | None) -> Arrays | None:
        if cid is not None:
            return super().eval_arrays(cid)
        (mean,) = self.pilot_means.values()
        return unseen_model(self.initial, mean)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pilot_means": self.pilot_means, "draws": self.pilot_draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pilot_means, self.pilot_draws = state["pilot_means"], state["draws"]


class _PilotClient(LocalClient):
    """Local-only training; on the pilot task, records what it was given and replies with the
    mean pixel per channel and one draw from its generator and one from torch's global RNG."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task != "pilot":
            return super().run(msg, ctx)
        PILOT_TASKS.append(
            {
                "cid": ctx.cid,
                "inputs": ctx.train.inputs.clone(),
                "labels": ctx.train.labels.clone(),
                "val": len(ctx.val),
                "state": (dict(ctx.state.arrays), dict(ctx.state.scalars)),
            }
        )
        draws = [float(torch.rand(1, generator=ctx.generator)), float(torch.rand(1))]
        pixel_mean = ctx.train.inputs.float().mean(dim=(0, 2, 3))
        return Message("pilot", {"pixel_mean": pixel_mean}, {"draws": draws})

    def uploads(self, n_clients: int) -> Uploads:
        return Uploads(statistics={"pixel_mean": (3,)}, scalars=("num_examples", "loss", "draws"))


class _PerImagePilotClient(_PilotClient):
    """Sends one brightness value per pilot image: per-sample target data."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task != "pilot":
            return super().run(msg, ctx)
        return Message("pilot", {"pixel_mean": ctx.train.inputs.float().mean(dim=(1, 2, 3))})

    def uploads(self, n_clients: int) -> Uploads:
        return Uploads(statistics={"pixel_mean": (None,)}, scalars=("num_examples", "loss"))


@contextmanager
def pilot_method(name: str = "_pilot", client: type = _PilotClient) -> Iterator[None]:
    """The test method, registered while the block runs (Flower loopback nodes run here too)."""
    register(MethodSpec(name, _PilotServer, client, Hparams))
    try:
        yield
    finally:
        del METHODS[name]


# ------------------------------------------------------------------ independent scoring
def rows(images: torch.Tensor) -> list[bytes]:
    """Each image's bytes: identifies an image independently of its position."""
    return [x.numpy().tobytes() for x in images]


def acc_and_nll(
    arrays: Arrays, data: ClientData, normalise: bool = False, model: nn.Module | None = None
) -> tuple[float, float]:
    """This file's own forward pass: argmax accuracy and mean NLL of ``model`` (default:
    LeNet-5) holding ``arrays``."""
    if model is None:
        model = build_model("lenet5", arrays["classifier.bias"].numel())
    model.load_state_dict(arrays)
    model.eval()
    x = data.inputs.float() / 255.0
    if normalise:  # the demo config's mean/std 0.5
        x = (x - 0.5) / 0.5
    with torch.no_grad():
        logits = model(x).double()
    acc = float((logits.argmax(1) == data.labels).double().mean())
    return acc, float(F.cross_entropy(logits, data.labels))


PILOT_CFG = {"algorithm": "_pilot", "split__pilot_fraction": 0.25}


@pytest.fixture(scope="module")
def pilot_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Simulation, Path]:
    """One simulated run of the pilot method on the tiny federation (target d0: 40 images, 10
    of them the pilot), with the pilot tasks it ran."""
    PILOT_TASKS.clear()
    out = tmp_path_factory.mktemp("pilot")
    with pilot_method():
        cfg = tiny_config(**PILOT_CFG)
        sim = run_sim(cfg, out, tiny_federation(cfg))
    return sim, out


# --------------------------------------------------------------------------- (a) the split
def test_the_pilot_set_is_seeded_disjoint_sized_and_the_same_for_every_method() -> None:
    """Catches: pilot images also scored as target images, a pilot of the wrong size, a pilot
    drawn per method or per partition, or one that ignores the seed."""
    dataset = tiny_dataset()
    domain = dataset.indices_of("d0")
    every = rows(dataset.images[domain])
    label_of = dict(zip(every, dataset.labels[domain].tolist(), strict=True))
    fed = tiny_federation(tiny_config(split__pilot_fraction=0.25), dataset)
    pilot, evaluated = rows(fed.pilots["d0"].inputs), rows(fed.targets["d0"].inputs)
    assert (len(pilot), len(evaluated)) == (10, 30)  # round(0.25 * 40)
    assert not set(pilot) & set(evaluated)
    assert sorted(pilot + evaluated) == sorted(every)
    assert fed.targets["d0"].labels.tolist() == [label_of[r] for r in evaluated]
    others = [
        tiny_config(split__pilot_fraction=0.25, algorithm="hfedf"),
        tiny_config(split__pilot_fraction=0.25, algorithm="local", split__val_fraction=0.3),
    ]
    for cfg in others:
        other = tiny_federation(cfg, dataset)
        assert torch.equal(other.pilots["d0"].inputs, fed.pilots["d0"].inputs)
        assert torch.equal(other.targets["d0"].inputs, fed.targets["d0"].inputs)
    reseeded = tiny_federation(tiny_config(seed=1, split__pilot_fraction=0.25), dataset)
    assert set(rows(reseeded.pilots["d0"].inputs)) != set(pilot)
    off = tiny_federation(tiny_config(), dataset)
    assert off.pilots == {} and rows(off.targets["d0"].inputs) == every


def test_enabling_the_pilot_removes_exactly_its_images_from_evaluation(tmp_path: Path) -> None:
    """Catches: a pilot that changes training or scores a number of target images other than
    the domain's minus the pilot's (FedAvg: 3 clients share one model, each image counted
    once)."""
    runs = {
        f: run_sim(tiny_config(rounds=1, split__pilot_fraction=f), tmp_path / str(f))
        for f in (0.0, 0.25)
    }
    for name, value in runs[0.0].server.global_arrays.items():
        assert torch.equal(runs[0.25].server.global_arrays[name], value), name
    counts = {f: sum(s.records[-1]["calibration"]["reliability"]["count"]) for f, s in runs.items()}
    assert counts == {0.0: 40, 0.25: 30}
    assert runs[0.25].records[-1]["id_acc"] == runs[0.0].records[-1]["id_acc"]


def test_a_pilot_fraction_without_a_pilot_image_is_refused() -> None:
    """Catches: a fraction too small for the target silently giving an empty pilot set."""
    with pytest.raises(ConfigError, match=r"pilot_fraction 0.01 .* 40 images gives 0 pilot"):
        tiny_federation(tiny_config(split__pilot_fraction=0.01))
    with pytest.raises(ConfigError, match=r"split\.pilot_fraction"):
        tiny_config(split__pilot_fraction=1.0)


# ------------------------------------------------------------ (b) the unseen-domain model
def test_ood_scores_the_unseen_domain_model_and_per_client_ood_the_clients_models(
    pilot_run: tuple[Simulation, Path],
) -> None:
    """Catches: the run-level ood numbers scoring the clients' models (or the pilot images)
    when the method offers an unseen-domain model, or the clients' ood diagnostic going
    missing."""
    sim, out = pilot_run
    fed = sim.data
    target = fed.targets["d0"]
    pilot_mean = fed.pilots["d0"].inputs.float().mean(dim=(0, 2, 3))
    assert torch.allclose(sim.server.pilot_means["d0"], pilot_mean)
    unseen_acc, unseen_nll = acc_and_nll(unseen_model(sim.server.initial, pilot_mean), target)
    clients = [acc_and_nll(sim.states[c].arrays, target)[0] for c in range(3)]
    record = sim.records[-1]
    assert record["ood_acc"] == pytest.approx(unseen_acc, abs=1e-12)
    assert record["per_domain"] == {"d0": pytest.approx(unseen_acc, abs=1e-12)}
    assert record["worst_domain_acc"] == pytest.approx(unseen_acc, abs=1e-12)
    assert record["ood_nll"] == pytest.approx(unseen_nll, rel=1e-5)
    assert sum(record["calibration"]["reliability"]["count"]) == 30  # one model, 30 images
    assert record["per_client"]["ood_acc"] == pytest.approx(clients, abs=1e-12)
    assert record["client_ood_acc"] == pytest.approx(np.mean(clients), abs=1e-12)
    summary = json.loads((out / "summary.json").read_text())
    chosen = next(r for r in sim.records if r["round"] == summary["selected_round"])
    assert (summary["ood_acc"], summary["client_ood_acc"]) == (
        chosen["ood_acc"],
        chosen["client_ood_acc"],
    )


def test_the_pilot_task_runs_when_asked_and_its_bytes_are_a_pilot_record(
    pilot_run: tuple[Simulation, Path],
) -> None:
    """Catches: a pilot task run when the server does not ask, or its bytes left out of the
    ledger (asked once, before round 1's evaluation: one vector of 3 floats up)."""
    sim, out = pilot_run
    lines = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    pilots = [r for r in lines if r.get("task") == "pilot"]
    assert [r["round"] for r in pilots] == [1]
    assert pilots[0]["ledger"]["up"] == {"model": 0, "statistics": 3 * 4, "scalars": 2 * 8}
    assert sim.ledger.up["statistics"] == 3 * 4


# ------------------------------------------------------------------- (c) what the pilot sees
def test_the_pilot_task_gets_the_pilot_images_without_labels_and_no_clients_data(
    pilot_run: tuple[Simulation, Path],
) -> None:
    """Catches: pilot labels reaching the client part, or a pilot task run on (or with the
    state of) a real client."""
    sim, _ = pilot_run
    (seen,) = PILOT_TASKS
    assert seen["cid"] == PILOT_CID
    assert torch.equal(seen["inputs"], sim.data.pilots["d0"].inputs)
    assert seen["labels"].tolist() == [UNLABELED] * 10
    assert seen["val"] == 0 and seen["state"] == ({}, {})


def test_a_pilot_reply_with_a_value_per_pilot_image_stops_the_run(tmp_path: Path) -> None:
    """Catches: pilot replies skipping the privacy check (per-image target data sent up)."""
    with (
        pilot_method("_per_image", _PerImagePilotClient),
        pytest.raises(PrivacyViolation, match=r"the pilot task sent array 'pixel_mean' \[10\]"),
    ):
        run_sim(tiny_config(algorithm="_per_image", split__pilot_fraction=0.25), tmp_path)


def test_a_method_asking_for_a_pilot_without_a_pilot_set_is_told_to_set_one(
    tmp_path: Path,
) -> None:
    """Catches: a pilot task silently skipped (or run on nothing) at pilot_fraction 0."""
    with pilot_method(), pytest.raises(ConfigError, match=r"set split\.pilot_fraction"):
        run_sim(tiny_config(algorithm="_pilot"), tmp_path)


# ------------------------------------------------------------------------- (d) on Flower
@pytest.mark.usefixtures("task_identity")
def test_the_pilot_method_on_flower_equals_the_simulator(tmp_path: Path) -> None:
    """Catches: the pilot task or the unseen-domain model handled differently on Flower
    (server state, every metrics record and the summary, exactly)."""
    with pilot_method():
        cfg = demo_config("algorithm.name=_pilot", "split.pilot_fraction=0.1")
        sim = simulate(cfg, tmp_path / "sim")
        grid = deploy_loopback(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")
    assert [k for _, k, g in grid.received if g == "2"].count("train") == 3 + 1  # fit + pilot
    record = records(tmp_path / "flower")[-1]
    pilot = sim.data.pilots["grey"]
    expected, _ = acc_and_nll(
        unseen_model(sim.server.initial, pilot.inputs.float().mean(dim=(0, 2, 3))),
        sim.data.targets["grey"],
        normalise=True,
    )
    assert record["ood_acc"] == pytest.approx(expected, abs=1e-12)
    assert record["client_ood_acc"] != record["ood_acc"]


@pytest.mark.usefixtures("task_identity")
def test_on_sites_the_pilot_and_the_unseen_model_go_where_the_target_set_is(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Catches: the pilot task or the unseen-domain model sent to a node without the target
    set (client 0 here): the deployed ood equals the simulator's all the same."""
    export: SiteExport = request.getfixturevalue("sites")
    overrides = ("algorithm.name=_pilot", "split.pilot_fraction=0.1")
    with pilot_method():
        simulate(sites_config(export, *overrides), tmp_path / "sim")
        cfg = sites_config(export, *overrides, server=True)
        nodes = site_nodes(export, without_target=(0,))
        grid = deploy_loopback(cfg, tmp_path / "flower", nodes=nodes)
    deployed, simulated = records(tmp_path / "flower")[-1], records(tmp_path / "sim")[-1]
    for key in ("ood_acc", "ood_ece", "ood_nll", "ood_brier", "per_domain"):
        assert deployed[key] == simulated[key], key
    assert deployed["per_client"]["ood_acc"][0] is None  # client 0's own model: no target set
    assert deployed["per_client"]["id_acc"] == simulated["per_client"]["id_acc"]
    in_round_2 = [(node, kind) for node, kind, g in grid.received if g == "2"]
    assert in_round_2.count((101, "train")) == 2  # its fit and the pilot task
    assert in_round_2.count((100, "train")) == 1  # its fit only
    assert in_round_2.count((101, "evaluate")) == 2  # its client's model and the unseen model


# -------------------------------------------------------- (e) no unseen-domain model
# Methods that offer a model for the unseen domain (tested in their own files): FedBN and SiloBN
# score the shared arrays with the clients' mean BatchNorm parts, FedFD and FedFD-A the shared
# arrays with the global statistics (and the clients' mean running statistics).
WITH_UNSEEN_MODEL = {"fedbn", "silobn", "fedfd", "fedfd_a"}


@pytest.mark.parametrize(
    "method",
    sorted(
        m
        for m in METHODS
        # FedVR needs cached features; its models (zero-shot and own) are in test_fedvr.py
        if not m.startswith(("_", "fedvr")) and m not in WITH_UNSEEN_MODEL
    ),
)
def test_a_method_without_an_unseen_domain_model_is_scored_by_its_clients_models(
    method: str, tmp_path: Path
) -> None:
    """Catches: the ood numbers of a method without an unseen-domain model changing, e.g.
    hFedF scored with its mean-embedding model instead of each client's generated model
    (hfedf.md §2.5), or a pilot set changing what the clients' models are scored on."""
    cheap = {"ae_epochs": 2} if method == "hfedf_ae_embed" else {}
    hierarchical = {"topology__stations": 1} if method == "mtgc" else {}  # needs stations
    cfg = tiny_config(
        rounds=1,
        algorithm={"name": method, **cheap},
        split__pilot_fraction=0.25,
        **hierarchical,
    )
    sim = run_sim(cfg, tmp_path)
    target = sim.data.targets["d0"]
    models = [sim.load_eval_model(c, sim.server.eval_arrays(c)) for c in range(sim.data.n_clients)]
    factory = sim.server.ctx.model_factory  # the method's model (FedSR's head, say), fresh
    scored = [acc_and_nll(arrays, target, model=factory()) for arrays in models]
    accs, nlls = zip(*scored, strict=True)
    record = sim.records[-1]
    assert record["per_client"]["ood_acc"] == pytest.approx(list(accs), abs=1e-12)
    assert record["ood_acc"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert record["ood_nll"] == pytest.approx(np.mean(nlls), rel=1e-5)
    assert "client_ood_acc" not in record
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    assert all(json.loads(line).get("task") != "pilot" for line in lines)
    assert sim.server.eval_arrays(None) is None


@pytest.mark.parametrize("method", ["fedavg", "local"])
def test_summary_reliability_counts_each_target_image_once(tmp_path: Path, method: str) -> None:
    """Catches pooled ood counts that add a model's results once per client: FedAvg's one
    shared model and Local's three distinct models alike count the 40 target images once (a
    third each for Local), in the reliability bins and the ood confidence histogram."""
    sim = run_sim(tiny_config(rounds=1, algorithm={"name": method}), tmp_path / method)
    summary = json.loads((tmp_path / method / "summary.json").read_text())
    assert len(sim.data.targets["d0"]) == 40
    assert sum(summary["reliability"]["ood"]["count"]) == pytest.approx(40, abs=1e-9)
    hist = summary["confidence_hist"]["ood"]
    assert sum(hist["correct"]) + sum(hist["incorrect"]) == pytest.approx(40, abs=1e-9)
    assert sum(summary["confidence_hist"]["id"]["correct"]) + sum(
        summary["confidence_hist"]["id"]["incorrect"]
    ) == sum(len(v) for v in sim.data.val)
