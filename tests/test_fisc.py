"""FISC (feddomain/algorithms/fisc.py) against fisc.md §8: the triplet term (check 7), the
reduction to FedAvg (check 8), frozen BatchNorm and a frozen style network (check 9), the
round-0 traffic (check 10), the loss weights by hand, and the bad inputs the issue names.
Checks 1-2 (partition, sampling, aggregation) are the engine's: tests/test_partition_lambda.py
(every sample once, lambda 0 single-domain with the greedy counts, lambda 1 within 1 of n_d/N,
seeds, the N < D branch), tests/test_engine.py::test_sampling_stream_is_seeded_and_sized and
tests/test_evidence_engine.py::test_fedavg_aggregate_is_the_sample_weighted_mean_of_unequal_clients.
Checks 3-6 (FINCH, styles, AdaIN, backends) are in tests/test_styles.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import ClientContext, MethodSpec
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgServer
from feddomain.algorithms.fisc import FISCClient, FISCHparams, fisc_model, triplet_term
from feddomain.errors import ConfigError, FeddomainError
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from feddomain.models.base import FeatureClassifier
from feddomain.style.statistics import style_shift
from tests.engine_helpers import run_sim, tiny_config, tiny_federation
from tests.test_evidence_engine import uneven_federation
from tests.test_styles import write_vgg_files

NORM = {"train__mean": [0.5, 0.5, 0.5], "train__std": [0.25, 0.25, 0.25]}


def fisc_config(rounds=2, model="lenet5", **algorithm):
    return tiny_config(
        rounds=rounds,
        algorithm={"name": "fisc", **algorithm},
        model={"name": model},
        train__optimizer="adam",
        train__lr=0.001,
        **NORM,
    )


def untimed(records):
    """Records without phase times and FISC's own diagnostics (its style-cluster count)."""
    return [{k: v for k, v in r.items() if k not in ("time", "diagnostics")} for r in records]


# ---------------------------------------------------------------------- check 7: triplet
def test_triplet_negatives_always_have_another_label():
    """Catches: a negative drawn from the anchor's own class: positives coincide with anchors and
    every other-class image is far, so the loss is 0 only if no same-class negative is drawn
    (a same-class negative would cost the full margin)."""
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    directions = torch.eye(3)[y] + 0.01 * torch.arange(8.0)[:, None] / 8  # same class: close
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        assert float(triplet_term(directions, directions, y, 0.3, gen)) == 0.0


def test_triplet_single_class_batch_is_zero_and_draws_nothing():
    """Catches: a loss (or a NaN) for a batch with no possible negative, or random draws that
    would shift the batch order of later epochs."""
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    f = torch.randn(5, 4)
    assert float(triplet_term(f, f.flip(0), torch.zeros(5, dtype=torch.long), 0.3, gen)) == 0.0
    assert torch.equal(gen.get_state(), state)


def test_triplet_value_by_hand_on_normalised_features():
    """Catches: distances on unnormalised features or a missing margin: two images of two
    classes (the negative is forced), computed in float64 by hand; scaling f by 100 changes
    nothing."""
    f = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    fs = torch.tensor([[0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    a = f / f.norm(dim=1, keepdim=True)
    p = fs / fs.norm(dim=1, keepdim=True)
    n = p.flip(0)
    m = 0.3
    expected = (
        sum(max(0.0, float((a[i] - p[i]).norm() - (a[i] - n[i]).norm()) + m) for i in range(2)) / 2
    )
    gen = torch.Generator().manual_seed(0)
    got = triplet_term(f, fs, y, m, gen)
    assert abs(float(got) - expected) < 1e-6  # eps = 1e-7 inside the distances
    assert abs(float(triplet_term(100 * f, 7 * fs, y, m, gen)) - expected) < 1e-6
    assert expected > 0


# ---------------------------------------------------------------------- check 8: reduction
@contextmanager
def fedavg_on_fisc_model():
    """FedAvg's parts on the model FISC's hook builds (frozen BN), for the reduction."""
    name = "_fedavg_fisc_arch"
    register(MethodSpec(name, FedAvgServer, FedAvgClient, FISCHparams, model_hook=fisc_model))
    try:
        yield name
    finally:
        del METHODS[name]


def test_with_both_weights_zero_fisc_is_fedavg_bit_for_bit(tmp_path):
    """Catches: anything but the two loss terms differing from FedAvg — the batches, the
    augmentation draws, the optimiser, a style phase that perturbs later seeds, draws for
    negatives when λ_con = 0 (fisc.md §8.8): BatchNorm model, unequal clients (36/18/9),
    3 rounds of Adam; the global arrays are bit-identical and so is every metric."""
    hp = {"lambda_con": 0.0, "lambda_reg": 0.0}
    runs = {}
    with fedavg_on_fisc_model() as reference:
        for name in ("fisc", reference):
            cfg = tiny_config(
                rounds=3,
                algorithm={"name": name, **hp},
                model={"name": "small_cnn"},
                train__optimizer="adam",
                train__local_epochs=2,  # a stray draw would shift epoch 2's order and flips
                train__augment={"hflip": True},
                **NORM,
            )
            runs[name] = run_sim(cfg, tmp_path / name, uneven_federation(cfg))
    fisc, fedavg = runs["fisc"].server.global_arrays, runs[reference].server.global_arrays
    init = runs["fisc"].server.ctx.model_factory().state_dict()
    assert any(not torch.equal(v, init[k]) for k, v in fisc.items())  # it trained
    for k, v in fedavg.items():
        assert torch.equal(fisc[k], v), k
    assert untimed(runs["fisc"].records) == untimed(runs[reference].records)
    assert runs["fisc"].records[-1]["diagnostics"]["style_clusters"] >= 1


def test_the_loss_is_ce_plus_weighted_triplet_and_l2_by_hand():
    """Catches: wrong weights, CE on the styled images, or a feature penalty other than
    mean(f²) + mean(f̃²): the client's loss on one batch against the formula written here
    (float64, a linear featurizer, the same negatives drawn from a copy of the generator)."""
    torch.manual_seed(0)
    model = FeatureClassifier(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 3), 768).double()
    hp = FISCHparams(lambda_con=0.6, lambda_reg=0.4, margin=0.5, alpha=0.7)
    client = FISCClient(hp)
    mean, std = torch.rand(192) * 0.2, torch.rand(192) * 0.1 + 0.02
    state = Message("state", {"style/style_mean": mean, "style/style_std": std})
    ctx = _context(state)
    x = torch.rand(6, 3, 16, 16, dtype=torch.float64) * 2 - 1  # normalised inputs
    y = torch.tensor([0, 1, 2, 0, 1, 1])
    gen_copy = torch.Generator().manual_seed(5)
    ctx.generator.manual_seed(5)
    got = client.loss_fn(Message("fit"), ctx)(model, x, y)
    # by hand: restyle, features, CE + 0.6 triplet + 0.4 (mean f² + mean f̃²)
    from feddomain.style.backends import DCTBackend
    from feddomain.style.statistics import adain

    b = DCTBackend().double()
    unit = x * 0.25 + 0.5
    z = b.encode(unit)
    styled = b.decode(0.7 * adain(z, mean.double(), std.double()) + 0.3 * z).clamp(0, 1)
    xs = (styled - 0.5) / 0.25
    f, fs = x.flatten(1), xs.flatten(1)
    ce = F.cross_entropy(model.classifier(f), y)
    tri = triplet_term(f, fs, y, 0.5, gen_copy)
    expected = ce + 0.6 * tri + 0.4 * (f.pow(2).mean() + fs.pow(2).mean())
    assert float(tri) > 0
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def _context(state: Message, n: int = 6, cid: int = 4) -> ClientContext:
    seeded = torch.Generator().manual_seed(cid)
    images = torch.randint(0, 255, (n, 3, 16, 16), dtype=torch.uint8, generator=seeded)
    data = ClientData(images, torch.arange(n) % 3, lambda x, g: x.float() / 255)
    return ClientContext(
        cid=cid,
        rnd=1,
        model=None,
        train=data,
        val=data,
        state=state,
        generator=torch.Generator().manual_seed(0),
        local_epochs=1,
        batch_size=4,
        make_optimizer=None,
        normalization=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
    )


# ---------------------------------------------------------------------- check 9: frozen parts
def test_bn_statistics_and_the_style_network_stay_frozen(tmp_path):
    """Catches: BatchNorm running statistics that move during FISC's training, or a style
    encoder/decoder that trains or collects gradients (fisc.md §8.9; AdaIN-VGG backend from
    fake weight files, small_cnn with BatchNorm)."""
    enc, dec = write_vgg_files(tmp_path)
    cfg = fisc_config(
        rounds=2, model="small_cnn", backend="adain_vgg", encoder_weights=enc, decoder_weights=dec
    )
    sim = run_sim(cfg, tmp_path / "run")
    init = sim.server.ctx.model_factory().state_dict()
    trained = sim.server.global_arrays
    bn = [k for k in trained if "running" in k or "num_batches" in k]
    assert bn and all(torch.equal(trained[k], init[k]) for k in bn)
    assert any(not torch.equal(trained[k], init[k]) for k in trained if k.endswith("weight"))
    backend = sim.client._backend
    reference = torch.load(enc, weights_only=True)
    for name, p in backend.encoder.state_dict().items():
        assert torch.equal(p, reference[name]), name
    assert all(p.grad is None and not p.requires_grad for p in backend.parameters())


# ---------------------------------------------------------------------- check 10: traffic
def test_one_style_up_and_one_down_per_client_then_fedavg_traffic(tmp_path):
    """Catches: styles sent more than once, per-image statistics, or extra per-round traffic:
    round 0 carries exactly 2 x 192 float32 up and down per client (plus the sample count),
    and every later round's ledger equals FedAvg's on the same model (§8.10)."""
    runs = {}
    with fedavg_on_fisc_model() as reference:
        for name in ("fisc", reference):
            cfg = fisc_config(rounds=2)
            cfg = cfg.model_copy(
                update={"algorithm": tiny_config(algorithm={"name": name}).algorithm}
            )
            runs[name] = run_sim(cfg, tmp_path / name)
    n = runs["fisc"].data.n_clients
    zero = runs["fisc"].round_log[0]
    assert zero["round"] == 0
    assert zero["ledger"]["up"] == {"model": 0, "statistics": n * 2 * 192 * 4, "scalars": n * 8}
    assert zero["ledger"]["down"] == {"model": 0, "statistics": n * 2 * 192 * 4, "scalars": 0}
    fisc_rounds = [r["ledger"] for r in runs["fisc"].round_log[1:]]
    fedavg_rounds = [r["ledger"] for r in runs[reference].round_log]
    assert fisc_rounds == fedavg_rounds and len(fisc_rounds) == 2


def test_the_style_is_in_the_checkpointed_state_of_server_and_clients(tmp_path):
    """Catches: a broadcast style kept only in memory (a resumed run would train without it),
    or a style phase limited to the sampled clients: with 1 of 3 clients sampled per round, the
    server's state_dict and every client's persistent state hold the same style."""
    cfg = fisc_config(rounds=1)
    cfg = cfg.model_copy(
        update={"topology": cfg.topology.model_copy(update={"sample_fraction": 0.34})}
    )
    sim = run_sim(cfg, tmp_path / "run")
    assert len(sim.schedule[0]) == 1
    styles = sim.server.state_dict()["styles"]
    assert set(styles) == set(range(sim.data.n_clients))
    for cid, state in enumerate(sim.states):
        assert torch.equal(state.arrays["style/style_mean"], styles[cid]["style_mean"])
        assert torch.equal(state.arrays["style/style_std"], styles[cid]["style_std"])


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_outside_unit_interval_is_refused_by_name(alpha):
    """Catches: an α outside [0, 1] accepted (it would extrapolate the style)."""
    with pytest.raises(ConfigError, match="alpha"):
        fisc_config(alpha=alpha)


def test_missing_or_wrong_style_weights_are_refused_when_the_config_loads(tmp_path):
    """Catches: weight-file problems found only in round 0 (after data loading), or unnamed."""
    with pytest.raises(ConfigError, match=r"file not found: .*vgg\.pth"):
        fisc_config(
            backend="adain_vgg",
            encoder_weights=str(tmp_path / "vgg.pth"),
            decoder_weights=str(tmp_path / "dec.pth"),
        )
    enc, dec = write_vgg_files(tmp_path, encoder_keys={"0.weight"})
    with pytest.raises(ConfigError, match="lacks tensors"):
        fisc_config(backend="adain_vgg", encoder_weights=enc, decoder_weights=dec)
    with pytest.raises(ConfigError, match="needs both encoder_weights"):
        fisc_config(backend="adain_vgg", encoder_weights=enc)
    with pytest.raises(ConfigError, match="encoder_weights is set but backend is 'adain_dct'"):
        fisc_config(encoder_weights=enc)


def test_a_resolution_the_dct_backend_cannot_tile_is_refused():
    """Catches: a DCT backend failing mid-run on image sides not divisible by 8."""
    with pytest.raises(ConfigError, match=r"dataset.resolution.*multiple of 8"):
        tiny_config(algorithm={"name": "fisc"}, dataset__resolution=28)


def test_a_client_whose_style_phase_fails_is_named():
    """Catches: an anonymous failure in round 0 (which of 100 clients has no images?)."""
    client = FISCClient(FISCHparams())
    ctx = _context(Message("state"), n=0, cid=17)
    with pytest.raises(FeddomainError, match=r"style phase of client 17 \(0 training images\)"):
        client.run(Message("collect"), ctx)


def test_a_client_with_one_or_two_images_is_one_style_cluster(caplog):
    """Catches: a client too small for FINCH failing the run (§3.8: one cluster), or passing
    without a word (the log names it)."""
    client = FISCClient(FISCHparams())
    with caplog.at_level("WARNING"):
        reply = client.run(Message("collect"), _context(Message("state"), n=2, cid=9))
    assert "client 9 has 2 training image(s), fewer than FINCH needs" in caplog.text
    assert reply.arrays["style_mean"].shape == (192,)
    assert bool((reply.arrays["style_std"] > 0).all())


def test_training_without_the_round_zero_style_is_a_clear_error():
    """Catches: a client that silently trains without the interpolation style."""
    client = FISCClient(FISCHparams())
    with pytest.raises(FeddomainError, match="client 4 trains without the server's style"):
        client.loss_fn(Message("fit"), _context(Message("state")))


def test_style_noise_changes_the_upload_and_only_when_asked():
    """Catches: Table 10's noise applied by default, or not at all when set."""
    plain = FISCClient(FISCHparams()).run(Message("collect"), _context(Message("state")))
    again = FISCClient(FISCHparams()).run(Message("collect"), _context(Message("state")))
    noisy = FISCClient(FISCHparams(style_noise=0.5)).run(
        Message("collect"), _context(Message("state"))
    )
    assert torch.equal(plain.arrays["style_mean"], again.arrays["style_mean"])
    assert not torch.equal(plain.arrays["style_mean"], noisy.arrays["style_mean"])


# ------------------------------------------------------------- the premise: where s* sits
def test_style_shift_is_each_clients_distance_in_median_pairwise_units():
    """Catches a shift measured in raw units (not comparable across backends), against the
    mean instead of the median pairwise distance, or per coordinate. Hand-computed: rows
    (0, 0), (3, 0), (0, 8) and target (0, 0): distances 0, 3, 8; pairwise 3, 8, sqrt(73)
    (median 8, mean 6.5)."""
    rows = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 8.0]])
    shift = style_shift(rows, torch.tensor([0.0, 0.0]))
    assert shift.tolist() == [0.0, 0.375, 1.0]


def test_the_run_summary_says_which_clients_barely_change(tmp_path):
    """Catches the premise diagnostic missing from summary.json, computed against another
    style than the one the clients receive, or a share that counts the wrong clients."""
    cfg = fisc_config(rounds=1)
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    uploads = {}
    collect = sim.server.on_collect
    sim.server.on_collect = lambda replies: (uploads.update(replies), collect(replies))
    sim.run()
    summary = sim.summary(0.0)["server"]
    style = sim.server.styles[0]
    target = torch.cat([style["style_mean"], style["style_std"]])
    rows = torch.stack([torch.cat([r.arrays["style_mean"], r.arrays["style_std"]])
                        for _, r in sorted(uploads.items())])  # fmt: skip
    expected = style_shift(rows, target)
    got = [summary["style_shift"][str(c)] for c in range(cfg.partition.n_clients)]
    assert got == pytest.approx(expected.tolist(), abs=1e-4)
    share = sum(d < 0.25 for d in got) / len(got)
    assert summary["barely_restyled_share"] == share
