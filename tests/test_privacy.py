"""The privacy contract: every method declares what its clients send, the runner holds every reply
against that declaration, and the ledger counts what crossed each way by kind."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math

import pytest
import torch
import yaml

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgServer
from feddomain.algorithms.fedfd import FedFDClient
from feddomain.algorithms.local import LocalClient, LocalServer
from feddomain.evaluation.report import build_report
from feddomain.federation.messages import Message
from feddomain.federation.privacy import PrivacyViolation, UploadCheck, Uploads
from feddomain.federation.simulation import Simulation
from feddomain.federation.training import get_arrays
from feddomain.merging.gram import gram_shapes
from tests.engine_helpers import run_sim, temporary_method, tiny_config, tiny_federation

CHEAP = {"hfedf_ae_embed": {"ae_epochs": 1, "ae_images": 8}}
# methods that refuse LeNet-5 (they need BatchNorm layers) run on this model
MODEL = {"fedbn": "small_cnn", "silobn": "small_cnn", "fedfd": "small_cnn", "fedfd_a": "small_cnn"}

# Statistics a method's clients send every round, bytes per client, from the model alone:
# SCAFFOLD's Δc_i (one float32 per trained parameter, in the fit reply), FedIIR's
# classifier-gradient sum (one float32 row of the classifier's size, in a pre-round task) and
# HFedATM's Grams ([d_in, d_in] float32 per Linear, in the fit reply).
PER_ROUND_STATISTICS = {
    "scaffold": lambda sim: 4 * sum(p.numel() for p in sim.model.parameters()),
    "fediir": lambda sim: 4 * sum(p.numel() for p in sim.model.classifier.parameters()),
    # HFedATM in a flat federation: every client sends one input Gram per dense layer a round
    "hfedatm": lambda sim: sum(4 * math.prod(s) for s in gram_shapes(sim.model, 4096).values()),
    # FPL: a prototype row per class (zeros where absent) and the per-class presence flags
    "fpl": lambda sim: 4 * len(sim.data.classes) * (sim.model.n_features + 1),
    # FedRC in a flat federation: its data's Gaussian, a float64 mean and variance per channel
    "fedrc": lambda sim: 2 * 8 * sim.data.train[0].inputs.shape[1],
}
# Methods that run only with stations: their ledgers are counted in their own tests
# (tests/test_mtgc.py).
HIERARCHICAL_ONLY = {"mtgc"}


def method_config(method: str, **overrides: object):
    algorithm = {"name": method, **CHEAP.get(method, {})}
    if method in MODEL:
        overrides.setdefault("model", {"name": MODEL[method]})
    return tiny_config(rounds=2, algorithm=algorithm, **overrides)


def declared_model_bytes(sim, uploads: Uploads) -> int:
    """Bytes of the model arrays a reply may carry, from the declaration and the model alone."""
    return sum(
        t.numel() * t.element_size()
        for name, t in sim.model.state_dict().items()
        if any(fnmatch.fnmatchcase(name, p) for p in uploads.model)
        and not any(fnmatch.fnmatchcase(name, p) for p in uploads.withheld)
    )


# FedVR runs on cached features only, and its statistics vector is as wide as the features:
# its ledger is counted by hand in tests/test_fedvr.py.
@pytest.mark.parametrize(
    "method",
    sorted(m for m in METHODS if not m.startswith("fedvr") and m not in HIERARCHICAL_ONLY),
)
def test_every_method_declares_its_uploads_and_the_ledger_counts_exactly_them(method, tmp_path):
    """Catches: a method sending more (or other) than it declares, and a ledger that counts the
    wrong kind or direction (expected bytes come from the declaration and the model shapes)."""
    cfg = method_config(method)
    sim = run_sim(cfg, tmp_path / method)
    uploads = sim.client.uploads(sim.data.n_clients)
    rounds = [json.loads(line) for line in (tmp_path / method / "rounds.jsonl").open()]
    fit_rounds = [r for r in rounds if r["round"] >= 1]
    assert [r["round"] for r in fit_rounds] == [1, 2]
    model_bytes = declared_model_bytes(sim, uploads)
    n_scalars = len(uploads.scalars)
    per_round = PER_ROUND_STATISTICS.get(method, lambda sim: 0)(sim)
    for record in fit_rounds:
        up, n = record["ledger"]["up"], record["participants"]
        expected = {"model": n * model_bytes, "statistics": n * per_round}
        assert up == {**expected, "scalars": n * 8 * n_scalars}
        assert record["bytes_up"] == up["model"] + up["statistics"]
    stats = [r for r in rounds if r["round"] == 0]
    if uploads.statistics and method not in PER_ROUND_STATISTICS:  # hFedF's AE embeddings
        (collect,) = stats
        per_client = sum(4 * torch.Size(s).numel() for s in uploads.statistics.values())
        assert collect["ledger"]["up"]["statistics"] == sim.data.n_clients * per_client
        assert collect["ledger"]["up"]["model"] == 0
    else:
        assert stats == []
    summary = json.loads((tmp_path / method / "summary.json").read_text())
    assert summary["ledger"]["up"]["model"] == sum(r["ledger"]["up"]["model"] for r in rounds)


def test_local_only_sends_no_weights_and_fedavg_sends_the_whole_model_each_way(tmp_path):
    """Catches: Local-only leaking its model upward, or FedAvg's broadcast counted as anything but
    the model (hand count: 3 clients x 2 rounds x the LeNet-5 state dict, float32)."""
    local = run_sim(tiny_config(rounds=2, algorithm="local"), tmp_path / "local")
    fedavg = run_sim(tiny_config(rounds=2), tmp_path / "fedavg")
    lenet = sum(t.numel() for t in fedavg.model.state_dict().values()) * 4
    assert local.ledger.up == {"model": 0, "statistics": 0, "scalars": 6 * 16}
    assert local.ledger.down == {"model": 3 * lenet, "statistics": 0, "scalars": 0}  # round 1
    assert fedavg.ledger.up == {"model": 6 * lenet, "statistics": 0, "scalars": 6 * 16}
    assert fedavg.ledger.down == {"model": 6 * lenet, "statistics": 0, "scalars": 0}
    summary = json.loads((tmp_path / "fedavg" / "summary.json").read_text())
    assert (summary["bytes_up"], summary["bytes_down"]) == (6 * lenet, 6 * lenet)


def test_the_report_shows_the_ledger_per_method(tmp_path):
    """Catches: a report that drops the communication table or mixes up methods' columns."""
    local = run_sim(tiny_config(rounds=2, algorithm="local"), tmp_path / "runs" / "local")
    fedavg = run_sim(tiny_config(rounds=2), tmp_path / "runs" / "fedavg")
    for sim in (local, fedavg):
        (sim.out / "config.yaml").write_text(yaml.safe_dump(sim.cfg.to_dict()))
    lenet_kib = sum(t.numel() for t in fedavg.model.state_dict().values()) * 4 / 1024
    text = build_report([tmp_path / "runs"]).to_markdown()
    assert "communication per round, summed over clients (KiB" in text
    assert "summed over all the clients of that round" in text  # 3 x one client's bytes below
    section = text.split("communication per round")[1].split("\n## ")[0]  # not the time table
    rows = {line.split(" | ")[0]: line for line in section.splitlines() if line.startswith("| ")}
    # per round: 3 clients; columns down model/statistics/scalars, up model/statistics/scalars
    fed_cells = [float(c) for c in rows["| fedavg"].strip(" |").split(" | ")[1:]]
    local_cells = [float(c) for c in rows["| local"].strip(" |").split(" | ")[1:]]
    scalars_kib = 3 * 16 / 1024
    assert fed_cells == pytest.approx(
        [3 * lenet_kib, 0, 0, 3 * lenet_kib, 0, scalars_kib], rel=1e-3
    )
    assert local_cells == pytest.approx([1.5 * lenet_kib, 0, 0, 0, 0, scalars_kib], rel=1e-3)


# ------------------------------------------------------------------ misbehaving clients


class _SendsFeatures(FedAvgClient):
    """A FedAvg client that also ships the penultimate features of every training image."""

    def run(self, msg, ctx):
        reply = super().run(msg, ctx)
        with torch.no_grad():
            reply.arrays["features"] = ctx.model.featurizer(ctx.train.inputs.float() / 255)
        return reply


class _DeclaresFeaturesLoosely(_SendsFeatures):
    """Declares 'features' with a free leading dimension: still per-sample, still refused."""

    def uploads(self, n_clients):
        return Uploads(("*",), {"features": (None, 84)}, ("num_examples", "loss"))


class _LocalThatLeaksItsModel(LocalClient):
    def run(self, msg, ctx):
        reply = super().run(msg, ctx)
        return Message("fit", get_arrays(ctx.model), reply.scalars)


class _SendsAnUndeclaredScalar(FedAvgClient):
    def run(self, msg, ctx):
        reply = super().run(msg, ctx)
        reply.scalars["first_label"] = int(ctx.train.labels[0])
        return reply


class _SendsNaNLoss(FedAvgClient):
    """Client 2 reports a NaN loss with finite weights."""

    def run(self, msg, ctx):
        reply = super().run(msg, ctx)
        if ctx.cid == 2:
            reply.scalars["loss"] = float("nan")
        return reply


@pytest.mark.parametrize(
    ("server", "client", "message"),
    [
        (FedAvgServer, _SendsFeatures, r"client 0 sent array 'features' \[\d+, 84\].*not declared "
         "and has one row per training sample"),
        (FedAvgServer, _DeclaresFeaturesLoosely, r"'features'.*per-sample leading dimension"),
        (LocalServer, _LocalThatLeaksItsModel, r"'featurizer\.conv1\.weight'.*model array "
         "this method does not declare"),
        (FedAvgServer, _SendsAnUndeclaredScalar, r"undeclared scalar\(s\) \['first_label'\]"),
    ],
    ids=["features", "loose-declaration", "local-model", "scalar"],
)  # fmt: skip
def test_a_client_sending_anything_undeclared_stops_the_run_by_name(
    server, client, message, tmp_path
):
    """Catches: an undeclared array, a per-sample statistic, a model sent by a method that
    declares none, or an undeclared scalar reaching the server unnoticed."""
    with (
        temporary_method("_leaky", server, client),
        pytest.raises(PrivacyViolation, match=f"_leaky: .*{message}"),
    ):
        run_sim(tiny_config(rounds=1, algorithm="_leaky"), tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ({}, r"not declared and has one row per training sample"),
        ({"loss_per_image": (None,)}, r"per-sample leading dimension \(12 training samples\)"),
    ],
    ids=["undeclared", "free-length"],
)
def test_a_1d_statistic_with_one_value_per_training_sample_is_refused(declared, message):
    """Catches a per-sample check that looks for rows of a matrix only: a vector of one value
    per training sample (each image's loss, say) is per-sample data too, whether undeclared or
    declared with a free length; the same vector one value longer is an ordinary statistic."""
    check = UploadCheck("m", Uploads(statistics=declared), {"fc.weight": torch.Size([4, 3])})
    per_image = Message("fit", {"loss_per_image": torch.rand(12)})
    sent = r"client 3 sent array 'loss_per_image' \[12\]"
    with pytest.raises(PrivacyViolation, match=f"{sent}.*{message}"):
        check.check(3, per_image, n_samples=12)
    if declared:
        check.check(3, Message("fit", {"loss_per_image": torch.rand(13)}), n_samples=12)


def test_a_model_array_of_the_wrong_shape_is_refused():
    """Catches: a model-named array used to smuggle other data under the model's name."""
    check = UploadCheck("m", Uploads(model=("*",)), {"fc.weight": torch.Size([4, 3])})
    check.check(0, Message("fit", {"fc.weight": torch.zeros(4, 3)}), n_samples=10)
    with pytest.raises(PrivacyViolation, match=r"'fc.weight' \[10, 3\].*differs from the model"):
        check.check(0, Message("fit", {"fc.weight": torch.zeros(10, 3)}), n_samples=10)
    patterns = UploadCheck("m", Uploads(model=("fc.*",)), {"fc.w": torch.Size([2]), "bn.w": ()})
    patterns.check(0, Message("fit", {"fc.w": torch.zeros(2)}), n_samples=10)
    with pytest.raises(PrivacyViolation, match=r"'bn\.w'"):
        patterns.check(0, Message("fit", {"bn.w": torch.zeros(())}), n_samples=10)


def test_a_non_finite_loss_scalar_is_rejected_like_a_non_finite_array(tmp_path):
    """Catches: a NaN scalar in a reply being accepted (its client's update averaged in)."""
    with temporary_method("_nan_loss", FedAvgServer, _SendsNaNLoss):
        sim = run_sim(tiny_config(rounds=1, algorithm="_nan_loss"), tmp_path / "nan")
    assert sim.rejected == [{"round": 1, "client": 2, "arrays": ["loss"]}]
    # reference: clients 0 and 1 of the same round (identical seeds), averaged by hand
    cfg = tiny_config(rounds=1)
    clean = Simulation(cfg, tiny_federation(cfg), tmp_path)
    init = clean.server.global_arrays
    replies = [clean.execute(c, 1, Message("fit", init)) for c in (0, 1)]
    sizes = [float(r.scalars["num_examples"]) for r in replies]
    for name, value in sim.server.global_arrays.items():
        parts = zip(sizes, replies, strict=True)
        expected = sum(n * r.arrays[name].double() for n, r in parts) / sum(sizes)
        assert torch.allclose(value.double(), expected, atol=1e-6, rtol=0), name


def test_withheld_model_arrays_are_refused_even_where_a_pattern_allows_them():
    """Catches ``Uploads.withheld`` ignored: FedFD's clients declare every model array but the
    global statistics the server computes, so a reply carrying those is a violation."""
    shapes = {"bn.weight": torch.Size([4]), "bn.global_mean": torch.Size([4])}
    check = UploadCheck("m", Uploads(model=("*",), withheld=("*global_mean",)), shapes)
    check.check(0, Message("fit", {"bn.weight": torch.zeros(4)}), n_samples=10)
    with pytest.raises(PrivacyViolation, match=r"'bn\.global_mean'.*model array this method"):
        check.check(0, Message("fit", {"bn.global_mean": torch.zeros(4)}), n_samples=10)


class _FedFDSendingGlobalStatistics(FedFDClient):
    """A FedFD client that also sends back the global statistics it received."""

    def run(self, msg, ctx):
        reply = super().run(msg, ctx)
        reply.arrays.update({k: v for k, v in get_arrays(ctx.model).items() if "global_" in k})
        return reply


def test_fedfd_sends_parameters_and_running_statistics_only(tmp_path):
    """Catches FedFD's declaration letting the global statistics go back up (they are the
    server's), or FedFD's client sending them: the run stops naming the array."""
    spec = METHODS["fedfd"]
    register(dataclasses.replace(spec, name="_fd_leaky", client=_FedFDSendingGlobalStatistics))
    try:
        with pytest.raises(PrivacyViolation, match=r"_fd_leaky: client 0 sent array '.*\.global_"):
            cfg = tiny_config(rounds=1, algorithm="_fd_leaky", model={"name": "small_cnn"})
            run_sim(cfg, tmp_path / "run")
    finally:
        del METHODS["_fd_leaky"]
