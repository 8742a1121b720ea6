"""A tiny randomly initialised RoBERTa and a word-level tokenizer, saved the way a real
checkpoint folder is (``save_pretrained``), so the local-files-only path is tested without a
download."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # RoBERTa's ids 0..3: pad = 1


def tiny_roberta_config(vocab_size: int = 64, num_labels: int = 2):
    return transformers.RobertaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        pad_token_id=1,
        num_labels=num_labels,
    )


def word_tokenizer(words: list[str]):
    vocab = {w: i for i, w in enumerate((*SPECIALS, *words))}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    core.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def save_checkpoint(folder: Path, words: list[str], *, seed: int = 0) -> Path:
    """A RoBERTa sequence classifier and its tokenizer in ``folder`` (config.json, weights,
    tokenizer files)."""
    import torch

    torch.manual_seed(seed)
    tokenizer = word_tokenizer(words)
    model = transformers.RobertaForSequenceClassification(tiny_roberta_config(len(tokenizer)))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
