"""FedRC, Gaussian (Kou et al., IROS 2024): the data Gaussian, the station and server weightings by
hand, the reduction to +Avg as τ → ∞, what its clients may send, bad configurations, SIGKILL
resume and Flower parity."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import feddomain.algorithms.fedrc as fedrc
from feddomain.algorithms.base import ServerContext, StationContext
from feddomain.algorithms.hfedatm import ACTIVE
from feddomain.errors import ConfigError
from feddomain.federation.data import ClientData, Pixels
from feddomain.federation.messages import Message
from feddomain.federation.privacy import PrivacyViolation, UploadCheck
from feddomain.federation.training import get_arrays
from tests.engine_helpers import run_sim
from tests.resume_helpers import (
    assert_resumed_equals,
    kill_after_checkpoint,
    resume,
    run_to_end,
    station_resume_config,
    write_config,
)
from tests.test_flower import (
    assert_same_run,
    demo_config,
    deploy_loopback,
    simulate,
    task_identity,  # noqa: F401 - a fixture the Flower test uses
)
from tests.test_hfedatm import assert_same_arrays, hierarchical
from tests.test_mtgc import context


def bhattacharyya(m1: float, v1: float, m2: float, v2: float) -> float:
    """D_B of two 1-D Gaussians, written out."""
    v = (v1 + v2) / 2
    return (m1 - m2) ** 2 / (8 * v) + 0.5 * math.log(v / math.sqrt(v1 * v2))


def pooled(means, variances, counts) -> tuple[float, float]:
    n = sum(counts)
    mean = sum(c * m for c, m in zip(counts, means, strict=True)) / n
    second = sum(c * (v + m * m) for c, m, v in zip(counts, means, variances, strict=True)) / n
    return mean, second - mean * mean


def filled(like: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in like.items()}


def summary(message: Message, means: list[float], variances: list[float]) -> Message:
    arrays = {
        **message.arrays,
        fedrc.MEAN: torch.tensor([means], dtype=torch.float64),
        fedrc.VAR: torch.tensor([variances], dtype=torch.float64),
    }
    return Message(message.task, arrays, message.scalars)


def test_the_data_gaussian_by_hand():
    """Catches: statistics over the wrong axis (per image or per pixel instead of per channel),
    pixels not read as [0, 1], a sample instead of a population variance, and token ids (or any
    other input) summarised instead of refused."""
    images = torch.tensor(
        [[[[0, 255]], [[255, 255]]], [[[51, 102]], [[255, 255]]]], dtype=torch.uint8
    )  # 2 images, 2 channels, 1x2 pixels
    mean, var = fedrc.data_gaussian(ClientData(images, torch.tensor([0, 1])))
    assert torch.allclose(mean, torch.tensor([0.4, 1.0], dtype=torch.float64), atol=1e-12)
    # channel 0: {0, 1, 0.2, 0.4}: E[x²] − 0.4² = 0.3 − 0.16
    assert torch.allclose(var, torch.tensor([0.14, 0.0], dtype=torch.float64), atol=1e-12)
    features = torch.tensor([[1.0, -2.0], [3.0, 2.0]])
    mean, var = fedrc.data_gaussian(ClientData(features, torch.tensor([0, 1])))
    assert mean.tolist() == [2.0, 0.0] and var.tolist() == [1.0, 4.0]
    with pytest.raises(ValueError, match=r"images \[N, C, H, W\] or features \[N, F\]"):
        fedrc.data_gaussian(ClientData(torch.tensor([[5, 7, 9]]), torch.tensor([0])))


def test_frozen_prefix_clients_summarise_their_own_images():
    """Catches: a frozen-prefix client summarising its cached features (per feature dimension,
    a D_B summed over 1280 terms that made the weights winner-take-all at lambda 0.1) instead
    of its images, and the whole dataset's images summarised instead of the client's (index)."""
    source = torch.tensor(
        [[[[0, 255]], [[255, 255]]], [[[9, 9]], [[9, 9]]], [[[51, 102]], [[255, 255]]]],
        dtype=torch.uint8,
    )  # 3 images, 2 channels, 1x2 pixels; the client holds images 2 and 0
    features = torch.tensor([[1.0, -2.0, 7.0], [3.0, 2.0, 7.0]])
    pixels = Pixels(source, torch.tensor([2, 0]), maps=lambda images, variant=None: images)
    mean, var = fedrc.data_gaussian(ClientData(features, torch.tensor([0, 1]), pixels=pixels))
    # as in the test above: channel 0 holds {0.2, 0.4, 0, 1}, channel 1 is constant at 1
    assert torch.allclose(mean, torch.tensor([0.4, 1.0], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(var, torch.tensor([0.14, 0.0], dtype=torch.float64), atol=1e-12)


def test_frozen_backbone_clients_summarise_the_images_the_image_run_sees(tmp_path):
    """Catches: frozen-backbone clients (the pacs-effnet-frozen profiles) summarising their
    cached features, 84 dimensions here, instead of their images' 3 channels; pixels that are
    not the client's own (index), or in another order than its features (maps of the images
    must give its inputs). The Gaussians must equal those of the same clients in image mode."""
    algorithm = {"name": "fedrc", "tau": 1.0}
    images = run_sim(hierarchical(algorithm, rounds=1), tmp_path / "images")
    frozen_cfg = hierarchical(
        algorithm, rounds=1, model__frozen=True, dataset__cache_dir=str(tmp_path / "cache")
    )
    frozen = run_sim(frozen_cfg, tmp_path / "frozen")
    for cid, train in enumerate(frozen.data.train):
        assert train.inputs.shape[1] == 84  # lenet5's features, not images
        for key in (fedrc.MEAN, fedrc.VAR):
            got, want = frozen.states[cid].arrays[key], images.states[cid].arrays[key]
            assert got.shape == (3,)
            assert torch.equal(got, want), (cid, key)
        torch.testing.assert_close(
            train.pixels.maps(train.pixels.images), train.inputs, rtol=1e-4, atol=1e-5
        )


def test_station_weights_by_hand_on_unequal_clients():
    """Catches: weights without the sample counts, without the Gaussian term or with another
    distance (Euclidean, KL), a barycentre that is not the pooled data's (unweighted, or
    missing the spread of the means), τ ignored or inverted, and a station uplink without its
    sample count or Gaussian. Three clients of 10, 30 and 20 samples, τ = 0.5."""
    station = fedrc.FedRCStation(StationContext(0, (0, 1, 2), 1, 0), fedrc.FedRCHparams(tau=0.5))
    like = get_arrays(nn.Linear(2, 2))
    counts, means, variances = [10, 30, 20], [0.2, 0.5, 0.4], [0.01, 0.04, 0.02]
    station.begin(1, Message("fit", like))
    replies = [
        (cid, summary(Message("fit", filled(like, value), {"num_examples": n}), [m], [v]))
        for cid, (value, n, m, v) in enumerate(
            zip([1.0, 2.0, 4.0], counts, means, variances, strict=True)
        )
    ]
    station.aggregate(1, 0, iter(replies))
    centre = pooled(means, variances, counts)
    raw = [
        n * math.exp(-bhattacharyya(m, v, *centre) / 0.5)
        for n, m, v in zip(counts, means, variances, strict=True)
    ]
    want = sum(w * value for w, value in zip(raw, [1.0, 2.0, 4.0], strict=True)) / sum(raw)
    up = station.uplink(1)
    assert torch.allclose(up.arrays["weight"], torch.full((2, 2), want), atol=1e-6)
    assert abs(want - 30 / 60 * 2 - 10 / 60 - 20 / 60 * 4) > 1e-3  # not the sample weighting
    assert up.scalars["num_examples"] == 60
    assert up.arrays[fedrc.MEAN].item() == pytest.approx(centre[0], abs=1e-12)
    assert up.arrays[fedrc.VAR].item() == pytest.approx(centre[1], abs=1e-12)


def test_server_weights_by_hand_on_unequal_stations():
    """Catches: the server weighting stations by their clients (γ) or equally instead of by
    their samples, or ignoring their Gaussians; and the weights missing from the diagnostics.
    Two stations of 54 and 18 samples (3 and 1 clients), 2-channel Gaussians, τ = 1."""
    model = nn.Linear(2, 2)
    server = fedrc.FedRCServer(
        ServerContext(lambda: model, 4, 0, 1, stations=2), fedrc.FedRCHparams(tau=1.0)
    )
    like = server.global_arrays
    stations = [(1.0, 54, [0.3, 0.6], [0.02, 0.05], 3), (5.0, 18, [0.5, 0.2], [0.04, 0.01], 1)]
    replies = [
        (sid, summary(Message("fit", filled(like, x), {"num_examples": n, ACTIVE: a}), m, v))
        for sid, (x, n, m, v, a) in enumerate(stations)
    ]
    server.aggregate(1, iter(replies))
    raw = []
    for _, n, m, v, _ in stations:
        distance = 0.0
        for c in range(2):
            centre = pooled([s[2][c] for s in stations], [s[3][c] for s in stations], [54, 18])
            distance += bhattacharyya(m[c], v[c], *centre)
        raw.append(n * math.exp(-distance))
    weights = [w / sum(raw) for w in raw]
    want = weights[0] * 1.0 + weights[1] * 5.0
    assert torch.allclose(server.global_arrays["bias"], torch.full((2,), want), atol=1e-6)
    assert server.diagnostics()["merge"][0]["weights"] == pytest.approx(weights, abs=1e-12)


def test_infinite_temperature_is_plus_avg_bit_for_bit(tmp_path):
    """Catches: a station or server weighting other than the sample counts at τ = ∞ (the
    Gaussian term leaking in, weights normalised differently) or any other drift from +Avg, on
    clients of unequal size (36 and 18) in stations of equal size, where +Avg's γ and FedRC's
    samples weigh the stations alike; and a finite τ that changes nothing."""
    plus_avg = run_sim(hierarchical({"name": "hfedavg"}), tmp_path / "avg")
    limit = run_sim(hierarchical({"name": "fedrc", "tau": math.inf}), tmp_path / "inf")
    assert [len(plus_avg.data.train[c]) for c in range(4)] == [36, 18, 36, 18]
    assert_same_arrays(limit.server.global_arrays, plus_avg.server.global_arrays)
    finite = run_sim(hierarchical({"name": "fedrc", "tau": 0.01}), tmp_path / "finite")
    key = "classifier.weight"
    assert not torch.equal(finite.server.global_arrays[key], plus_avg.server.global_arrays[key])
    records = (tmp_path / "finite" / "metrics.jsonl").read_text().splitlines()
    (merge,) = json.loads(records[-1])["diagnostics"]["merge"]
    assert merge["weights"] != pytest.approx([0.5, 0.5])


def test_clients_send_their_model_and_one_gaussian_only():
    """Catches: the declaration missing the Gaussian (every run would stop), or allowing more
    than one row of it (per-image statistics would then leave the client)."""
    client = fedrc.FedRCClient(fedrc.FedRCHparams())
    model = nn.Linear(2, 3)
    data = ClientData(torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))
    arrays = get_arrays(model)
    reply = client.run(Message("fit", arrays), context(model, data, Message(), 1, 0, 2))
    check = UploadCheck("fedrc", client.uploads(4), {k: v.shape for k, v in arrays.items()})
    check.check(0, reply, len(data))
    assert reply.arrays[fedrc.MEAN].shape == reply.arrays[fedrc.VAR].shape == (1, 2)
    two_rows = {**reply.arrays, fedrc.MEAN: torch.zeros(2, 2)}
    with pytest.raises(PrivacyViolation, match="fedrc_mean"):
        check.check(0, Message("fit", two_rows, reply.scalars), len(data))


@pytest.mark.parametrize("tau", [0, -1.0, math.nan])
def test_a_temperature_that_is_not_positive_is_refused(tau):
    """Catches: τ ≤ 0 or NaN (weights exp(±∞) or NaN) reaching a run instead of a config error
    naming the key."""
    with pytest.raises(ConfigError, match=r"'algorithm.tau'"):
        hierarchical({"name": "fedrc", "tau": tau})


def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    """Catches: the global model or the weights of the rounds not yet logged (the server's
    pending diagnostics, evaluated every third round) lost or stale across a SIGKILL and
    --resume."""
    config = station_resume_config("fedrc", {"name": "fedrc", "tau": 0.05}, rounds=3, eval_every=3)
    path = write_config(tmp_path / "fedrc.yaml", config)
    run_to_end(path, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(path, out, min_round=1)
    assert state["round"] < 3
    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")


@pytest.mark.usefixtures("task_identity")
def test_on_flower_equals_the_simulator(tmp_path):
    """Catches: the Gaussians lost or altered in transport (client → station in the ServerApp)
    or the stations' weighting working in-process only: final server state, metrics (with the
    weights) and summary equal the simulator's."""
    cfg = demo_config(
        "algorithm.name=fedrc",
        "algorithm.tau=0.05",
        "partition.n_clients=4",
        "topology.stations=2",
        "topology.station_rounds=2",
    )
    sim = simulate(cfg, tmp_path / "sim")
    deploy_loopback(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")
    assert '"weights"' in (tmp_path / "flower" / "metrics.jsonl").read_text()
