"""A small text classifier trained from scratch: token embedding, 1-D convolutions, max over time.

For CPU runs and tests of text domains (a CNN over words trains in seconds where a transformer
takes minutes). Its tokenizer is built in (``data/text.py``: hashed ``words`` or UTF-8
``bytes``), so it needs no download and no vocabulary file. No BatchNorm and no dropout: every
text-capable method, batched clients included, runs it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddomain.data.text import PAD, ByteTokenizer, builtin_tokenizer
from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier


class TokenCNN(nn.Module):
    """ids [B, L] -> [B, width * len(kernels)]: embedding, one convolution per kernel width,
    ReLU, max over the non-padding positions (padding contributes 0 <= every ReLU output)."""

    def __init__(self, vocab_size: int, dim: int, width: int, kernels: Sequence[int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=PAD)
        self.convs = nn.ModuleList(nn.Conv1d(dim, width, k, padding=k // 2) for k in kernels)

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids.long()
        keep = (ids != PAD).unsqueeze(1).to(self.embed.weight.dtype)  # [B, 1, L]
        x = self.embed(ids).transpose(1, 2)  # [B, dim, L]
        pooled = [(F.relu(conv(x)) * keep).amax(dim=2) for conv in self.convs]
        return torch.cat(pooled, dim=1)


def text_cnn(
    num_classes: int,
    *,
    resolution: int = 32,
    tokenizer: str = "words",
    vocab_size: int = 2**14,
    dim: int = 64,
    width: int = 64,
    kernels: Sequence[int] = (3, 5),
) -> FeatureClassifier:
    """Text CNN from scratch (Kim 2014 style) on built-in `words` (hashed) or `bytes` tokens.

    ``vocab_size`` is the number of hashed word ids (`words`; `bytes` has 258); ``kernels`` the
    odd convolution widths. ``resolution`` is unused (token length is ``dataset.max_length``).
    """
    kernels = tuple(int(k) for k in kernels)
    if not kernels or any(k < 1 or k % 2 == 0 for k in kernels):
        raise ConfigError(f"text_cnn: kernels={list(kernels)} must be odd positive widths")
    if dim < 1 or width < 1:
        raise ConfigError(f"text_cnn: dim={dim} and width={width} must be >= 1")
    vocab = builtin_tokenizer(tokenizer, vocab_size)
    n_vocab = ByteTokenizer.vocab_size if tokenizer == "bytes" else vocab.vocab_size
    featurizer = TokenCNN(n_vocab, dim, width, kernels)
    n_features = width * len(kernels)
    return FeatureClassifier(featurizer, nn.Linear(n_features, num_classes), n_features)
