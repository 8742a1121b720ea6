"""Style backends: a frozen encoder E (image in [0, 1] -> feature map) and decoder D (back).

* ``adain_dct`` (default; fisc.md §9): a fixed, orthonormal 8x8 block DCT per RGB channel. A
  side-S image becomes 192 channels x (S/8)^2, the same grid as VGG's relu4_1; the inverse DCT
  decodes it exactly (up to float rounding), so AdaIN's target statistics survive decoding until
  the final clamp to [0, 1]. DC channels carry colour, the others the energy of each spatial
  frequency (texture, edges). No weights.
* ``adain_vgg``: Huang & Belongie's AdaIN networks, the normalised VGG-19 up to relu4_1 and its
  mirror decoder, loaded from the user's ``vgg_normalised.pth`` and ``decoder.pth``. A missing
  file, or one without the expected tensors, is refused naming the file and the tensors.

Both are frozen: no parameter is ever trained, and every call runs without gradients.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from feddomain.errors import ConfigError
from feddomain.models.resnet import read_state_dict

DCT_BLOCK = 8
DCT_CHANNELS = 3 * DCT_BLOCK * DCT_BLOCK  # 192
VGG_CHANNELS = 512


def dct_matrix(n: int = DCT_BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix D [n, n]: coefficients = D @ block @ D.T."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype)


class DCTBackend(nn.Module):
    """Blockwise orthonormal DCT (encoder) and its inverse (decoder): exactly invertible."""

    channels = DCT_CHANNELS

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("d", dct_matrix(), persistent=False)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, 192, H/8, W/8], channel = colour * 64 + 8 * row freq + col freq."""
        b, c, h, w = x.shape
        n = DCT_BLOCK
        if h % n or w % n:
            raise ValueError(f"adain_dct needs image sides divisible by {n}; got {h}x{w}")
        blocks = x.reshape(b, c, h // n, n, w // n, n)
        d = self.d.to(x.dtype)
        coef = torch.einsum("ki,lj,bcxiyj->bcklxy", d, d, blocks)
        return coef.reshape(b, c * n * n, h // n, w // n)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """The inverse of ``encode`` (no clamping)."""
        b, ch, gh, gw = z.shape
        n = DCT_BLOCK
        coef = z.reshape(b, ch // (n * n), n, n, gh, gw)
        d = self.d.to(z.dtype)
        blocks = torch.einsum("ki,lj,bcklxy->bcxiyj", d, d, coef)
        return blocks.reshape(b, ch // (n * n), gh * n, gw * n)


def _pad() -> nn.Module:
    return nn.ReflectionPad2d((1, 1, 1, 1))


def vgg_encoder() -> nn.Sequential:
    """AdaIN's normalised VGG-19 up to relu4_1 (its first 31 modules, keys as in the file)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 3, 1)]
    widths = [(3, 64), (64, 64), "M", (64, 128), (128, 128), "M"]
    widths += [(128, 256), (256, 256), (256, 256), (256, 256), "M", (256, 512)]
    for item in widths:
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2, 0, ceil_mode=True))
        else:
            layers += [_pad(), nn.Conv2d(*item, 3), nn.ReLU()]
    return nn.Sequential(*layers)


def vgg_decoder() -> nn.Sequential:
    """AdaIN's decoder: relu4_1 (512 channels) back to RGB, nearest x2 upsampling three times."""
    layers: list[nn.Module] = []
    widths = [(512, 256), "U", (256, 256), (256, 256), (256, 256), (256, 128), "U"]
    widths += [(128, 128), (128, 64), "U", (64, 64), (64, 3)]
    for item in widths:
        if item == "U":
            layers.append(nn.Upsample(scale_factor=2, mode="nearest"))
        else:
            layers += [_pad(), nn.Conv2d(*item, 3), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU after the last convolution


def load_frozen(net: nn.Module, path: str, role: str) -> nn.Module:
    """``net`` with the tensors of the file at ``path`` (extra tensors of a longer network, e.g.
    the full VGG-19, are ignored), frozen in eval mode. ConfigError naming the file otherwise."""
    file = Path(path).expanduser()
    state = read_state_dict(file, f"style {role} weights")
    expected = net.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise ConfigError(
            f"style {role} weights: {file} lacks tensors {missing[:4]} ({len(missing)} in all) "
            f"of AdaIN's {role}; expected keys like {list(expected)[:3]}"
        )
    wrong = [k for k, v in expected.items() if tuple(state[k].shape) != tuple(v.shape)]
    if wrong:
        k = wrong[0]
        raise ConfigError(
            f"style {role} weights: {file}: tensor {k!r} has shape {tuple(state[k].shape)}, "
            f"expected {tuple(expected[k].shape)} ({len(wrong)} tensors differ)"
        )
    net.load_state_dict({k: state[k] for k in expected})
    return net.eval().requires_grad_(False)


class VGGBackend(nn.Module):
    """AdaIN's VGG-19 encoder (to relu4_1) and decoder, from local weight files."""

    channels = VGG_CHANNELS

    def __init__(self, encoder_path: str, decoder_path: str) -> None:
        super().__init__()
        self.encoder = load_frozen(vgg_encoder(), encoder_path, "encoder")
        self.decoder = load_frozen(vgg_decoder(), decoder_path, "decoder")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


StyleBackend = DCTBackend | VGGBackend


def build_backend(name: str, encoder_path: str | None, decoder_path: str | None) -> StyleBackend:
    """The named backend, frozen, on the CPU (the caller moves it to the data's device)."""
    if name == "adain_vgg":
        if not encoder_path or not decoder_path:
            raise ConfigError(
                "style backend adain_vgg needs encoder_weights (vgg_normalised.pth) and "
                "decoder_weights (decoder.pth): local files of AdaIN's release"
            )
        return VGGBackend(encoder_path, decoder_path)
    return DCTBackend().eval().requires_grad_(False)


def backend_channels(name: str) -> int:
    """Channels of the backend's feature map: the length of each half of a style vector."""
    return VGG_CHANNELS if name == "adain_vgg" else DCT_CHANNELS
