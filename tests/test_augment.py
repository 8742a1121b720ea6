"""Batched augmentation: exact identities, torchvision semantics, per-sample randomness, seeding."""

from __future__ import annotations

import math

import pytest
import torch
import torchvision.transforms.v2.functional as TF

from feddomain.data.augment import (
    AugmentConfig,
    BatchAugment,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    resized_crop,
    sample_crop_boxes,
    to_grayscale,
)
from feddomain.errors import ConfigError, DataError

ALL_ON = AugmentConfig(
    hflip=True,
    random_resized_crop=(0.5, 1.0),
    color_jitter=(0.4, 0.4, 0.4, 0.1),
    grayscale_p=0.2,
    invert_p=0.5,
)


def images(n: int = 8, size: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_all_off_is_exactly_division_by_255_and_draws_nothing() -> None:
    x = images()
    g = gen(0)
    state = g.get_state()
    out = BatchAugment(AugmentConfig(), None, None)(x, g)
    assert out.dtype == torch.float32
    assert torch.equal(out, x.float() / 255)
    assert torch.equal(g.get_state(), state)


def test_normalisation_uses_mean_and_std_per_channel() -> None:
    x = torch.tensor([0, 255, 51], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2)
    aug = BatchAugment(AugmentConfig(), mean=(0.5, 0.5, 0.2), std=(0.25, 0.5, 0.1))
    # (0 - .5)/.25 = -2, (1 - .5)/.5 = 1, (.2 - .2)/.1 = 0
    expected = torch.tensor([-2.0, 1.0, 0.0]).view(1, 3, 1, 1).expand(2, 3, 2, 2)
    torch.testing.assert_close(aug(x, gen(0)), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(aug.normalize(x), expected, atol=1e-5, rtol=0)


def test_normalize_ignores_augmentation_settings() -> None:
    x = images()
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.3, 0.4)
    plain = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    assert torch.equal(BatchAugment(ALL_ON, mean, std).normalize(x), plain)


def test_hflip_flips_exactly_about_half_of_the_samples_independently() -> None:
    x = images(n=1).expand(2000, -1, -1, -1)
    out = BatchAugment(AugmentConfig(hflip=True), None, None)(x, gen(3))
    ref = x.float() / 255
    same = (out == ref).flatten(1).all(1)
    flipped = (out == ref.flip(-1)).flatten(1).all(1)
    assert bool((same ^ flipped).all())  # every sample is one of the two, exactly
    assert 0.45 < flipped.float().mean().item() < 0.55


def test_flipped_samples_equal_torch_flip() -> None:
    x = images(n=64)
    out = BatchAugment(AugmentConfig(hflip=True), None, None)(x, gen(1))
    flipped = (out == (x.float() / 255).flip(-1)).flatten(1).all(1)
    assert 0 < int(flipped.sum()) < 64
    assert torch.equal(out[flipped], x[flipped].flip(-1).float() / 255)


@pytest.mark.parametrize("ratio", [(1.0, 1.0), (3 / 4, 4 / 3)])
def test_full_scale_crop_is_the_identity(ratio) -> None:
    """Scale (1, 1) leaves only the whole image: directly for ratio 1, via torchvision's
    fallback when every drawn ratio != 1 makes the box overflow."""
    x = images(n=16, size=20)
    cfg = AugmentConfig(random_resized_crop=(1.0, 1.0), crop_ratio=ratio)
    out = BatchAugment(cfg, None, None)(x, gen(0))
    # float32: affine_grid/grid_sample place each sample within ~(20/2)·2·ulp(1) ≈ 2.4e-6 px of
    # the pixel centre, so a value moves by ≤ 2.4e-6 (neighbours differ by ≤ 1); measured
    # 6.9e-7 under every ATEN_CPU_CAPABILITY. A crop shifted by 0.1 px moves values by up to 0.1.
    torch.testing.assert_close(out, x.float() / 255, atol=1e-5, rtol=0)


def test_centre_half_crop_of_a_ramp_matches_hand_computation() -> None:
    # Image value = 16 * column. The centre crop of half width spans pixel edges 2..6 of 8;
    # output column j samples source position 1.75 + 0.5 j, and bilinear is exact on a ramp.
    x = (16 * torch.arange(8, dtype=torch.uint8)).expand(1, 3, 8, 8).contiguous()
    box = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    out = resized_crop(x.float() / 255, box)
    expected = (16 * (1.75 + 0.5 * torch.arange(8.0)) / 255).expand(1, 3, 8, 8)
    # float32: positions within ~(8/2)·ulp(1) ≈ 5e-7 px, times the slope 16/255 per px, plus
    # the rounding of values ≤ 0.33: ≲ 1e-7 (measured 1.5e-8); half a pixel off is 3e-2
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_crop_boxes_respect_scale_ratio_and_image_bounds() -> None:
    boxes = sample_crop_boxes(4000, (32, 32), (0.3, 0.9), (3 / 4, 4 / 3), gen(5))
    width, height, cx, cy = boxes.unbind(1)
    area, aspect = width * height, width / height
    assert area.min() >= 0.3 - 1e-6 and area.max() <= 0.9 + 1e-6
    assert aspect.min() >= 3 / 4 - 1e-6 and aspect.max() <= 4 / 3 + 1e-6
    assert (cx.abs() + width).max() <= 1 + 1e-6 and (cy.abs() + height).max() <= 1 + 1e-6
    assert len(torch.unique(boxes, dim=0)) == 4000


def test_crop_area_and_log_aspect_are_uniform_when_every_box_fits() -> None:
    # areas <= 0.7 < 3/4 fit at any allowed aspect, so the first attempt is always kept:
    # area ~ U(0.3, 0.7) (mean 0.5), log aspect ~ U(-log 4/3, log 4/3) (mean 0)
    boxes = sample_crop_boxes(4000, (32, 32), (0.3, 0.7), (3 / 4, 4 / 3), gen(6))
    width, height = boxes[:, 0], boxes[:, 1]
    assert abs((width * height).mean().item() - 0.5) < 0.01
    assert abs(torch.log(width / height).mean().item()) < 0.012
    centres = boxes[:, 2] / (1 - width)  # position within the free margin: U(-1, 1)
    assert abs(centres.mean().item()) < 0.05 and centres.abs().max() <= 1 + 1e-6


def test_wide_images_fall_back_to_the_widest_allowed_centre_crop() -> None:
    # A 1 x 4 image cannot fit any box with aspect <= 4/3 and area 1: torchvision's fallback
    # keeps the full height and a width of ratio_max * H, centred.
    boxes = sample_crop_boxes(5, (8, 32), (1.0, 1.0), (3 / 4, 4 / 3), gen(0))
    expected = torch.tensor([(4 / 3) / 4, 1.0, 0.0, 0.0]).expand(5, 4)
    torch.testing.assert_close(boxes[:, :2], expected[:, :2])
    assert boxes[:, 2].abs().max() <= 1 - (4 / 3) / 4 + 1e-6


def test_identical_images_get_different_random_parameters() -> None:
    x = images(n=1).expand(16, -1, -1, -1)
    out = BatchAugment(ALL_ON, None, None)(x, gen(0))
    assert len(torch.unique(out.flatten(1), dim=0)) == 16


def test_same_seed_same_output_and_the_generator_advances() -> None:
    x = images(n=32)
    aug = BatchAugment(ALL_ON, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    g = gen(7)
    first = aug(x, g)
    assert torch.equal(first, aug(x, gen(7)))
    assert not torch.equal(first, aug(x, g))  # same generator, next batch: fresh draws
    assert not torch.equal(first, aug(x, gen(8)))


def test_brightness_matches_torchvision_exactly() -> None:
    x = images(n=4).float() / 255
    factors = torch.tensor([0.5, 1.3, 0.0, 2.0])
    out = adjust_brightness(x, factors)
    for i, f in enumerate(factors.tolist()):
        assert torch.equal(out[i], TF.adjust_brightness(x[i], f))


@pytest.mark.parametrize(
    ("ours", "theirs", "values"),
    [
        (adjust_contrast, TF.adjust_contrast, [0.0, 0.6, 1.0, 1.4]),
        (adjust_saturation, TF.adjust_saturation, [0.0, 0.6, 1.0, 1.4]),
        (adjust_hue, TF.adjust_hue, [-0.5, -0.1, 0.0, 0.37]),
    ],
)
def test_colour_ops_match_torchvision(ours, theirs, values) -> None:
    x = images(n=4).float() / 255
    x[0, :, :4] = x[0, :1, :4]  # grey pixels (hue undefined) and channel ties
    x[1, 1] = x[1, 0]
    out = ours(x, torch.tensor(values))
    # Different formulas in float32 (ours branch-free, torchvision's via HSV): the hue in
    # sextants [0, 6) is rounded to ~ulp(6) = 4.8e-7 on each side and scaled by the pixel's
    # spread (≤ 1), so the outputs agree to ≲ 3e-6 (measured 8.9e-7 for hue, 6e-8 for the
    # others, under every ATEN_CPU_CAPABILITY). A hue shift off by 0.01 moves values by 6e-2.
    for i, v in enumerate(values):
        torch.testing.assert_close(out[i], theirs(x[i], v), atol=1e-5, rtol=0)


def test_grayscale_uses_torchvisions_weights() -> None:
    x = images(n=4).float() / 255
    assert torch.equal(to_grayscale(x), TF.rgb_to_grayscale(x, num_output_channels=1))
    pure = torch.eye(3).view(3, 3, 1, 1)  # pure red, green, blue pixels
    torch.testing.assert_close(to_grayscale(pure).flatten(), torch.tensor([0.2989, 0.587, 0.114]))


def test_grayscale_probability_one_greys_every_sample() -> None:
    x = images(n=8)
    out = BatchAugment(AugmentConfig(grayscale_p=1.0), None, None)(x, gen(0))
    expected = TF.rgb_to_grayscale(x.float() / 255, num_output_channels=3)
    assert torch.equal(out, expected)


def test_grayscale_probability_is_per_sample() -> None:
    x = images(n=1).expand(2000, -1, -1, -1)
    out = BatchAugment(AugmentConfig(grayscale_p=0.3), None, None)(x, gen(0))
    grey = (out.std(dim=1) == 0).flatten(1).all(1)
    assert 0.26 < grey.float().mean().item() < 0.34
    assert torch.equal(out[~grey], (x[~grey].float() / 255))


def test_inversion_is_torchvisions_per_sample_and_drawn_from_the_generator() -> None:
    """Catches an inversion that is not 1 - x (torchvision's ``invert`` on floats), that flips
    the whole batch or no sample instead of each with probability p, that leaves an inverted
    sample partly unchanged, or that ignores the caller's generator (unreproducible runs)."""
    x = images(n=2000, size=4)
    out = BatchAugment(AugmentConfig(invert_p=0.3), None, None)(x, gen(0))
    unit = x.float() / 255
    inverted = (out != unit).flatten(1).any(1)
    assert 0.26 < inverted.float().mean().item() < 0.34
    assert torch.equal(out[inverted], TF.invert(unit[inverted]))
    assert torch.equal(out[~inverted], unit[~inverted])
    again = BatchAugment(AugmentConfig(invert_p=0.3), None, None)(x, gen(0))
    other = BatchAugment(AugmentConfig(invert_p=0.3), None, None)(x, gen(1))
    assert torch.equal(out, again) and not torch.equal(out, other)


def test_brightness_jitter_draws_one_factor_per_sample_from_its_range() -> None:
    x = torch.full((512, 3, 4, 4), 100, dtype=torch.uint8)  # 100 * 1.5 stays below 255
    out = BatchAugment(AugmentConfig(color_jitter=(0.5, 0.0, 0.0, 0.0)), None, None)(x, gen(0))
    factors = out.flatten(1) / (100 / 255)
    assert torch.allclose(factors, factors[:, :1].expand_as(factors))  # one factor per image
    f = factors[:, 0]
    assert f.min() >= 0.5 - 1e-6 and f.max() <= 1.5 + 1e-6
    assert f.min() < 0.55 and f.max() > 1.45 and abs(f.mean().item() - 1) < 0.05


def test_hue_jitter_leaves_grey_images_unchanged() -> None:
    x = torch.randint(0, 256, (16, 1, 8, 8), generator=gen(0), dtype=torch.uint8).expand(
        -1, 3, -1, -1
    )
    out = BatchAugment(AugmentConfig(color_jitter=(0.0, 0.0, 0.0, 0.5)), None, None)(x, gen(0))
    assert torch.equal(out, x.float() / 255)


def test_all_on_output_stays_in_unit_range_and_keeps_shape() -> None:
    x = images(n=64, size=32)
    out = BatchAugment(ALL_ON, None, None)(x, gen(0))
    assert out.shape == (64, 3, 32, 32) and out.dtype == torch.float32
    assert out.min() >= 0 and out.max() <= 1


def test_config_lists_from_yaml_are_accepted() -> None:
    cfg = AugmentConfig(random_resized_crop=[0.7, 1.0], color_jitter=[0.1, 0.1, 0.1, 0.0])
    out = BatchAugment(cfg, None, None)(images(), gen(0))
    assert out.shape == (8, 3, 16, 16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"random_resized_crop": (0.0, 1.0)}, "random_resized_crop"),
        ({"random_resized_crop": (0.9, 0.5)}, "random_resized_crop"),
        ({"random_resized_crop": (0.5,)}, "random_resized_crop must be two"),
        ({"crop_ratio": (2.0, 1.0)}, "crop_ratio"),
        ({"color_jitter": (0.1, 0.1, 0.1)}, "color_jitter must be four"),
        ({"color_jitter": (-0.1, 0.0, 0.0, 0.0)}, "color_jitter must be four non-negative"),
        ({"color_jitter": (0.0, 0.0, 0.0, 0.6)}, "hue must be <= 0.5"),
        ({"color_jitter": (math.nan, 0.0, 0.0, 0.0)}, "color_jitter"),
        ({"grayscale_p": 1.5}, "grayscale_p"),
        ({"invert_p": -0.1}, "invert_p must be in"),
    ],
)
def test_bad_config_values_are_named(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        AugmentConfig(**kwargs)


@pytest.mark.parametrize(
    ("mean", "std", "match"),
    [
        ((0.5, 0.5, 0.5), None, "both mean and std"),
        ((0.5, 0.5), (0.2, 0.2), "3 values"),
        ((0.5, 0.5, 0.5), (0.2, 0.0, 0.2), "std values must be positive"),
    ],
)
def test_bad_normalisation_is_a_config_error(mean, std, match) -> None:
    with pytest.raises(ConfigError, match=match):
        BatchAugment(AugmentConfig(), mean, std)


@pytest.mark.parametrize(
    "batch",
    [
        torch.zeros(2, 3, 4, 4),
        torch.zeros(2, 1, 4, 4, dtype=torch.uint8),
        torch.zeros(3, 4, 4, dtype=torch.uint8),
    ],
)
def test_batches_must_be_uint8_rgb(batch) -> None:
    with pytest.raises(DataError, match=r"uint8 \[B,3,H,W\]"):
        BatchAugment(AugmentConfig(), None, None)(batch, None)


@pytest.mark.cuda
def test_cpu_generator_drives_a_cuda_batch_like_a_cpu_batch() -> None:
    x = images(n=16)
    aug = BatchAugment(ALL_ON, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    on_gpu = aug(x.cuda(), gen(0)).cpu()
    torch.testing.assert_close(on_gpu, aug(x, gen(0)), atol=1e-4, rtol=0)
