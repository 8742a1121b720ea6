"""The shared style machinery (feddomain/clustering.py, feddomain/style/): FINCH from finch-clust
against fisc.md §8 check 3, a client's style (check 4), the server's interpolation style
(check 5), AdaIN and the backends (check 6), and the AdaIN-VGG weight files' checks. Expected
values are computed here in float64 from the formulas, never taken from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feddomain.clustering import cluster_means, finch_partitions
from feddomain.errors import ConfigError
from feddomain.style.backends import (
    DCTBackend,
    VGGBackend,
    build_backend,
    dct_matrix,
    vgg_decoder,
    vgg_encoder,
)
from feddomain.style.statistics import (
    EPS,
    adain,
    channel_stats,
    client_style,
    interpolation_style,
    stylize,
)


def blobs(sizes=(20, 15, 10), dim=8, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """Well-separated Gaussian blobs along different directions (cosine distance separates them)."""
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for k, n in enumerate(sizes):
        centre = np.zeros(dim)
        centre[k] = 10.0
        rows.append(centre + rng.normal(0, 0.3, (n, dim)))
        labels += [k] * n
    return np.concatenate(rows), np.array(labels)


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two label vectors describe the same grouping (labels may be renamed)."""
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


# ---------------------------------------------------------------------- check 3: FINCH
def test_finch_finds_three_separated_blobs_finest_first():
    """Catches: a FINCH wrapper that returns partitions coarsest-first or loses the blobs (fisc.md
    §8.3: three well-separated blobs are three clusters in some partition)."""
    rows, truth = blobs()
    parts = finch_partitions(rows)
    counts = [len(set(parts[:, j].tolist())) for j in range(parts.shape[1])]
    assert counts == sorted(counts, reverse=True)  # finest first, coarsest last
    assert any(same_partition(parts[:, j], truth) for j in range(parts.shape[1]))


def test_finch_last_partition_is_never_one_cluster_unless_the_first_is():
    """Catches: a wrapper that keeps FINCH's final all-in-one level (then every client would be a
    single style cluster whatever its data; §8.3)."""
    for seed in range(5):
        rows, _ = blobs((12, 9, 7, 5), dim=6, seed=seed)
        parts = finch_partitions(rows)
        if len(set(parts[:, 0].tolist())) > 1:
            assert len(set(parts[:, -1].tolist())) > 1


@pytest.mark.parametrize("n", [1, 2])
def test_finch_on_two_or_fewer_rows_is_one_cluster(n):
    """Catches: FINCH called on n <= 2 rows (it cannot split them; §3.8 says one cluster)."""
    parts = finch_partitions(np.random.default_rng(0).normal(size=(n, 4)))
    assert parts.shape == (n, 1) and set(parts[:, 0].tolist()) == {0}


def test_cluster_means_are_the_plain_means_of_each_group():
    """Catches: size-weighted or mislabelled cluster means."""
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0]], dtype=torch.float64)
    got = cluster_means(rows, np.array([7, 7, 2]))
    assert torch.equal(got, torch.tensor([[10.0, 0.0], [2.0, 3.0]], dtype=torch.float64))


# ---------------------------------------------------------------------- check 4: client style
def coloured_features(n, shift, seed=0, c=6, side=4) -> torch.Tensor:
    """Feature maps of one synthetic domain: channel levels `shift`, small per-image noise."""
    g = torch.Generator().manual_seed(seed)
    level = torch.tensor(shift, dtype=torch.float64).view(1, c, 1, 1)
    return level + 0.1 * torch.randn(n, c, side, side, generator=g, dtype=torch.float64)


RED = [4.0, 0.2, 0.2, 3.0, 0.1, 0.1]
BLUE = [0.2, 0.2, 4.0, 0.1, 0.1, 3.0]


def pooled_style(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = z.double().transpose(0, 1).reshape(z.shape[1], -1)
    mean = flat.mean(1)
    return mean, ((flat**2).mean(1) - mean**2 + EPS).sqrt()


def test_client_style_shapes_and_positive_std():
    """Catches: a style of the wrong length (2 x C floats per client) or a non-positive std."""
    z = torch.randn(10, 512, 3, 3)
    mean, std, _ = client_style(z)
    assert mean.shape == std.shape == (512,) and bool((std > 0).all())


def test_two_colour_domains_give_at_least_two_clusters():
    """Catches: clustering that merges two very different domains inside a client (§8.4)."""
    z = torch.cat([coloured_features(15, RED), coloured_features(15, BLUE, seed=1)])
    _, _, clusters = client_style(z.float())
    assert clusters >= 2


def test_cluster_equal_weighting_resists_the_dominant_domain():
    """Catches: a size-weighted (pooled) client style: with a 90/10 domain mix, the
    cluster-equal style must be closer to the 50/50 style than the pooled style is (§8.4)."""
    mix = torch.cat([coloured_features(45, RED), coloured_features(5, BLUE, seed=1)])
    even = torch.cat([coloured_features(25, RED, seed=2), coloured_features(25, BLUE, seed=3)])
    target = torch.cat(pooled_style(even))
    mean, std, _ = client_style(mix.float())
    ours = torch.cat([mean, std]).double()
    pooled = torch.cat(pooled_style(mix))
    assert (ours - target).norm() < 0.5 * (pooled - target).norm()


def test_client_style_moments_by_hand():
    """Catches: a wrong mixture formula: two clusters of known moments, equal weight, in both
    aggregations (code: σ² = mean m2 − μ² + ε; paper: mean of σ_j), computed here by hand."""
    a = torch.full((3, 1, 2, 2), 1.0, dtype=torch.float64)  # cluster 1: constant 1
    a[:, :, 0, 0] = 3.0  # pixels 3,1,1,1: m1 = 1.5, m2 = 3
    b = torch.full((5, 1, 2, 2), -2.0, dtype=torch.float64)  # cluster 2: constant -2 (m2 = 4)
    b[:, :, 1, 1] = 2.0  # pixels -2,-2,-2,2: m1 = -1, m2 = 4
    z = torch.cat([a, b]).expand(8, 2, 2, 2).clone()
    z[:, 1] *= 10  # a second channel, 10x (cosine clustering is unchanged)
    mean, std, m = client_style(z.float(), "finch", "mixture_moments")
    assert m == 2
    mu = (1.5 - 1.0) / 2
    sigma = np.sqrt((3 + 4) / 2 - mu**2 + EPS)
    assert torch.allclose(
        mean.double(), torch.tensor([mu, 10 * mu], dtype=torch.float64), atol=1e-6
    )
    assert abs(float(std[0]) - sigma) < 1e-5
    mean2, std2, _ = client_style(z.float(), "finch", "mean_of_stats")
    s = (np.sqrt(3 - 1.5**2 + EPS) + np.sqrt(4 - 1 + EPS)) / 2
    assert torch.equal(mean2, mean) and abs(float(std2[0]) - s) < 1e-5


# ---------------------------------------------------------------------- check 5: server style
def server_rows(seed=0) -> torch.Tensor:
    """Style rows of 12 clients from three 'domains' of unequal sizes (6, 4, 2): the clients of
    a domain share its style exactly, so FINCH's finest partition is the three domains."""
    centres = np.abs(np.random.default_rng(seed).normal(size=(3, 10)))
    centres[np.arange(3), np.arange(3)] += 10.0  # three directions
    return torch.tensor(np.repeat(centres, [6, 4, 2], axis=0), dtype=torch.float32)


def test_interpolation_style_is_the_lower_median_of_cluster_means():
    """Catches: a median over clients instead of over FINCH clusters, or the upper middle value
    for an even count (torch semantics, fisc.md S5): computed here with numpy on the known
    blobs."""
    rows = server_rows()
    truth = np.array([0] * 6 + [1] * 4 + [2] * 2)
    parts = finch_partitions(rows)[:, 0]
    assert same_partition(parts, truth)  # so the cluster means are the blobs' means
    means = np.stack([rows.double().numpy()[truth == k].mean(0) for k in range(3)])
    expected = np.median(means, axis=0)  # 3 clusters: the middle value
    mean, std, count = interpolation_style(rows)
    assert count == 3
    np.testing.assert_allclose(torch.cat([mean, std]).numpy(), expected, rtol=1e-6)
    even = np.sort(means[:2], axis=0)[0]  # two clusters: the lower one
    mean2, std2, _ = interpolation_style(rows[:10])
    np.testing.assert_allclose(torch.cat([mean2, std2]).numpy(), even, rtol=1e-6)


def test_interpolation_style_takes_the_finest_of_several_finch_levels():
    """Catches a median over the coarsest (or any other than the finest) FINCH partition: 12
    clients in four noisy style families (3 each), where FINCH returns two levels (the four
    families, then two groups) and the two medians differ (fisc.md §3.3 B2: c[:, 0])."""
    rng = np.random.default_rng(1)
    centres = np.abs(rng.normal(size=(4, 10)))
    centres[np.arange(4), np.arange(4)] += 4.0
    noisy = np.repeat(centres, 3, axis=0) + 0.3 * np.abs(rng.normal(size=(12, 10)))
    rows = torch.tensor(noisy, dtype=torch.float32)
    families = np.repeat(np.arange(4), 3)
    levels = finch_partitions(rows)
    assert levels.shape[1] == 2 and same_partition(levels[:, 0], families)
    values = rows.double().numpy()
    means = np.stack([values[families == k].mean(0) for k in range(4)])
    expected = np.sort(means, axis=0)[1]  # four clusters: the lower of the two middle values
    coarse = levels[:, 1]
    coarse_means = np.stack([values[coarse == k].mean(0) for k in np.unique(coarse)])
    assert not np.allclose(np.sort(coarse_means, axis=0)[0], expected)
    mean, std, count = interpolation_style(rows)
    assert count == 4
    np.testing.assert_allclose(torch.cat([mean, std]).numpy(), expected, rtol=1e-6)


def test_client_style_runs_finch_without_early_exit(monkeypatch):
    """Catches a client style clustered with FINCH's early exit on: FISC's release calls FINCH
    with ``ensure_early_exit=False`` on a client's images (as FPL's does). (With finch-clust
    0.2.3 and SciPy 1.17 the flag changes no partition — the links it cuts stay as explicit
    zeros, which SciPy's connected components still follow — so the call itself is checked.)"""
    import feddomain.style.statistics as statistics

    calls = []

    def spy(rows, *, early_exit=True):
        calls.append(early_exit)
        return finch_partitions(rows, early_exit=early_exit)

    monkeypatch.setattr(statistics, "finch_partitions", spy)
    client_style(torch.cat([coloured_features(6, RED), coloured_features(6, BLUE, seed=1)]))
    assert calls == [False]


def test_interpolation_style_is_invariant_to_client_order():
    """Catches: a result that depends on which client replied first (§8.5)."""
    rows = torch.tensor(np.abs(blobs((6, 4, 2), dim=10, seed=3)[0]), dtype=torch.float32)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
    a, b = interpolation_style(rows), interpolation_style(rows[perm])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_ten_extreme_duplicate_clients_move_the_median_less_than_the_mean():
    """Catches: a server style that a crowd of identical outlier clients can drag (§8.5)."""
    rows = server_rows()
    extreme = torch.full((10, rows.shape[1]), 50.0)
    before = torch.cat(interpolation_style(rows)[:2])
    after = torch.cat(interpolation_style(torch.cat([rows, extreme]))[:2])
    mean_shift = (torch.cat([rows, extreme]).mean(0) - rows.mean(0)).norm()
    assert (after - before).norm() < 0.5 * mean_shift


def test_server_mean_ablation_is_the_plain_mean():
    """Catches: FISC-v2 (`server_clustering: mean`) still clustering."""
    rows = server_rows()
    mean, std, count = interpolation_style(rows, "mean")
    assert count == 1
    torch.testing.assert_close(torch.cat([mean, std]), rows.double().mean(0).float())


# ---------------------------------------------------------------------- check 6: AdaIN, backends
class SpyBackend(torch.nn.Module):
    """Identity encoder and decoder that record what the decoder receives."""

    channels = 3

    def encode(self, x):
        return x.clone()

    def decode(self, z):
        self.decoded = z.clone()
        return z


def test_adain_alpha_one_gives_exactly_the_target_statistics():
    """Catches: AdaIN with the wrong statistics (biased variance, missing ε) — per image and
    channel, the mean is μ_s and the std σ_s (up to ε) when α = 1 (§8.6)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 5, 6, 6, generator=g, dtype=torch.float64) * 3 + 1
    mu_s = torch.linspace(-1, 1, 5, dtype=torch.float64)
    sigma_s = torch.linspace(0.5, 2, 5, dtype=torch.float64)
    out = adain(z, mu_s, sigma_s)
    flat = out.flatten(2)
    torch.testing.assert_close(flat.mean(2), mu_s.expand(4, 5))
    var_z = z.flatten(2).var(2, unbiased=True)
    # std of the output: σ_s · std(z)/sqrt(var(z) + ε)
    expected_std = sigma_s * (var_z / (var_z + EPS)).sqrt()
    torch.testing.assert_close(flat.std(2, unbiased=True), expected_std)


def test_alpha_zero_decodes_the_content_features_unchanged():
    """Catches: a style leak at α = 0: the decoder input must equal E(x) (§8.6)."""
    spy = SpyBackend()
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    stylize(x, spy, torch.zeros(3), torch.ones(3), alpha=0.0)
    assert torch.equal(spy.decoded, x)


def test_dct_matrix_is_orthonormal_and_dct_backend_is_exactly_invertible():
    """Catches: a non-orthonormal DCT (then decoding would not give back the encoded
    statistics): D Dᵀ = I in float64, and decode(encode(x)) = x to float32 rounding."""
    d = dct_matrix(dtype=torch.float64)
    torch.testing.assert_close(d @ d.T, torch.eye(8, dtype=torch.float64), atol=1e-12, rtol=0)
    backend = DCTBackend()
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    z = backend.encode(x)
    assert z.shape == (3, 192, 4, 4)
    assert (backend.decode(z) - x).abs().max() < 1e-5
    # the DC coefficient of a block is 8 x its mean (orthonormal 2-D DCT)
    torch.testing.assert_close(z[:, 0, 0, 0], 8 * x[:, 0, :8, :8].mean((1, 2)), atol=1e-5, rtol=0)


def test_dct_statistics_of_the_decoded_image_match_the_target_before_clamping():
    """Catches: a backend whose decoding loses the transferred style: re-encoding the unclamped
    decoded image gives per-channel statistics equal to AdaIN's target (§8.6, weight-free)."""
    backend = DCTBackend()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    z = backend.encode(x)
    mu_s, sigma_s = torch.rand(192) * 0.1, torch.rand(192) * 0.2 + 0.05
    recoded = backend.encode(backend.decode(adain(z, mu_s, sigma_s)))
    mean, std = channel_stats(recoded)
    torch.testing.assert_close(mean, mu_s.expand(2, -1), atol=1e-5, rtol=0)
    assert (std - sigma_s).abs().max() < 1e-3  # σ_s · sqrt(var/(var+ε)), var >> ε here


def write_vgg_files(folder, encoder_keys=None, decoder_shape_fault=False):
    """Fake AdaIN weight files with the release's tensor names (random values)."""
    enc = {**vgg_encoder().state_dict(), "31.weight": torch.zeros(1)}  # full VGG has more
    if encoder_keys is not None:
        enc = {k: v for k, v in enc.items() if k in encoder_keys}
    dec = vgg_decoder().state_dict()
    if decoder_shape_fault:
        dec["1.weight"] = torch.zeros(256, 512, 1, 1)
    torch.save(enc, folder / "vgg_normalised.pth")
    torch.save(dec, folder / "decoder.pth")
    return str(folder / "vgg_normalised.pth"), str(folder / "decoder.pth")


def test_vgg_backend_loads_the_release_layout_and_maps_back_to_image_size(tmp_path):
    """Catches: an encoder/decoder layout other than AdaIN's (keys and shapes of
    vgg_normalised.pth / decoder.pth), or a transfer that changes the image size."""
    enc, dec = write_vgg_files(tmp_path)
    backend = VGGBackend(enc, dec)
    x = torch.rand(2, 3, 32, 32)
    assert backend.encode(x).shape == (2, 512, 4, 4)
    out = stylize(x, backend, torch.zeros(512), torch.ones(512), 0.5)
    assert out.shape == x.shape and float(out.min()) >= 0 and float(out.max()) <= 1
    assert all(not p.requires_grad for p in backend.parameters())


def test_vgg_backend_refuses_a_missing_file_by_name(tmp_path):
    """Catches: a missing weights file surfacing as a bare FileNotFoundError."""
    _, dec = write_vgg_files(tmp_path)
    with pytest.raises(ConfigError, match=r"encoder weights: file not found: .*nope\.pth"):
        build_backend("adain_vgg", str(tmp_path / "nope.pth"), dec)


def test_vgg_backend_refuses_wrong_tensors_naming_them(tmp_path):
    """Catches: a weights file of another network loaded silently (or failing with torch's
    generic message): missing tensors and wrong shapes are named."""
    enc, dec = write_vgg_files(tmp_path, encoder_keys={"0.weight", "0.bias"})
    with pytest.raises(ConfigError, match=r"lacks tensors \['2.weight'"):
        build_backend("adain_vgg", enc, dec)
    enc, dec = write_vgg_files(tmp_path, decoder_shape_fault=True)
    with pytest.raises(ConfigError, match=r"decoder weights: .*'1.weight' has shape"):
        build_backend("adain_vgg", enc, dec)
