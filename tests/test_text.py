"""Text domains: the Blitzer review layout and the generic .txt tree, the built-in tokenizers,
the token cache, text_cnn, the refusal of image-only methods, and a short run of every
text-capable method on made-up sentiment domains."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from feddomain.algorithms import METHODS
from feddomain.cli import run_experiment
from feddomain.config import validate_config
from feddomain.data import text as text_data
from feddomain.data.text import ByteTokenizer, WordTokenizer, load_text_dataset, read_reviews
from feddomain.errors import ConfigError, DataError
from feddomain.models import build_model
from tests.text_helpers import DOMAINS, write_reviews, write_text_folder

PROJECT = Path(__file__).resolve().parents[1]
WORDS = WordTokenizer(vocab_size=512)


def _config(root: Path, cache: Path, **extra) -> dict:
    raw = {
        "rounds": 1,
        "dataset": {"name": "AmazonReviews", "root": str(root), "max_length": 24},
        "partition": {"n_clients": 3},
        "model": {"name": "text_cnn", "options": {"vocab_size": 512, "dim": 8, "width": 8}},
        "train": {"batch_size": 8},
        "eval": {"every": 1},
        "checkpoint": {"every": 0},
        "threads": 1,
    }
    raw["dataset"]["cache_dir"] = str(cache)
    for key, value in extra.items():
        node = raw
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return raw


# ------------------------------------------------------------------------------ reading


def test_reviews_layout_gives_each_review_its_domain_and_class(tmp_path):
    """Catches reviews lost or merged by the pseudo-XML parser, the kitchen folder alias
    (kitchen_&_housewares) not found, or labels taken from the wrong file."""
    write_reviews(tmp_path, n_per_class=5)
    ds = load_text_dataset("AmazonReviews", tmp_path, WORDS, 16, tmp_path / "cache")
    assert ds.domains == DOMAINS and ds.classes == ("negative", "positive")
    assert ds.counts().tolist() == [[5, 5]] * 4
    assert ds.is_text and ds.images.dtype == torch.int32 and ds.images.shape == (40, 16)
    first_positive = ds.paths.index("kitchen/positive#0")
    assert ds.labels[first_positive] == 1 and ds.domain_ids[first_positive] == 3


def test_review_text_is_the_review_text_element_with_entities_decoded(tmp_path):
    """Catches the rating or id fields read as text, or HTML entities kept as written."""
    path = tmp_path / "positive.review"
    path.write_text(
        "<review>\n<rating>\n5.0\n</rating>\n<review_text>\nGood &amp; cheap\n</review_text>\n"
        "</review>\n<review>\n<review_text>\nsecond\none\n</review_text>\n</review>\n"
    )
    assert read_reviews(path) == ["Good & cheap", "second\none"]


def test_processed_acl_feature_files_are_refused_with_the_fix(tmp_path):
    """Catches the processed_acl word:count files (no text) silently read as zero reviews."""
    path = tmp_path / "negative.review"
    path.write_text("great:2 bad_movie:1 #label#:negative\n")
    with pytest.raises(DataError, match=r"negative\.review.*processed_acl.*sorted_data_acl"):
        read_reviews(path)


def test_text_folder_reads_each_file_as_one_sample(tmp_path):
    """Catches the generic layout's labels or domains in another order than the folders."""
    write_text_folder(tmp_path, n_per_class=3)
    ds = load_text_dataset("text_folder", tmp_path, ByteTokenizer(), 8, tmp_path / "c")
    assert ds.domains == ("books", "dvd", "electronics") and ds.classes == ("neg", "pos")
    assert ds.counts().tolist() == [[3, 3]] * 3
    text = (tmp_path / ds.paths[4]).read_text()
    assert ds.images[4].tolist() == [1, *(b + 2 for b in text.encode()[:7])]


def test_a_text_file_that_is_not_utf8_is_named(tmp_path):
    """Catches a Latin-1 file decoded into mojibake (or a bare UnicodeDecodeError)."""
    write_text_folder(tmp_path, n_per_class=2)
    bad = tmp_path / "dvd" / "pos" / "1.txt"
    bad.write_bytes("caf\xe9 great".encode("latin-1"))
    with pytest.raises(DataError, match=rf"{bad}.*not UTF-8.*byte 3"):
        load_text_dataset("text_folder", tmp_path, WORDS, 8, tmp_path / "c")


def test_an_empty_class_folder_is_named(tmp_path):
    """Catches a class folder without .txt files accepted as a class with no samples."""
    write_text_folder(tmp_path, n_per_class=2)
    empty = tmp_path / "books" / "neg"
    for f in empty.iterdir():
        f.unlink()
    (empty / "notes.md").write_text("not a sample")
    with pytest.raises(DataError, match=rf"empty class folder {empty}: no text \(\.txt\) files"):
        load_text_dataset("text_folder", tmp_path, WORDS, 8, tmp_path / "c")


# ---------------------------------------------------------------------------- tokenizers


def test_word_tokenizer_hashes_lowercased_words_and_marks():
    """Catches case-sensitive ids, punctuation glued to words, a missing start token or
    truncation that keeps the tail."""
    ids = WordTokenizer(vocab_size=100).encode(["Great movie!", "a b c d e f"], 5)
    h = [2 + zlib.crc32(w.encode()) % 98 for w in ("great", "movie", "!")]
    assert ids.tolist()[0] == [1, *h, 0]
    assert ids.tolist()[1] == [1, *(2 + zlib.crc32(w.encode()) % 98 for w in "abcd")]
    assert ids.dtype == np.int32


def test_byte_tokenizer_encodes_utf8_bytes_after_a_start_token():
    """Catches characters instead of UTF-8 bytes (é is two bytes) or a pad id that collides."""
    assert ByteTokenizer().encode(["hé"], 6).tolist() == [[1, 106, 0xC3 + 2, 0xA9 + 2, 0, 0]]


# ------------------------------------------------------------------------------ cache


def test_tokens_load_from_the_cache_on_the_second_run(tmp_path, monkeypatch):
    """Catches re-tokenising on every load (the decode-once promise), and a stale entry reused
    after the tokenizer, the length or a file changed."""
    root = write_text_folder(tmp_path / "data", n_per_class=2)
    cache = tmp_path / "cache"
    calls = []
    original = text_data._texts

    def counting(index, start, stop):
        texts = original(index, start, stop)
        calls.append(len(texts))
        return texts

    monkeypatch.setattr(text_data, "_texts", counting)
    first = load_text_dataset("text_folder", root, WORDS, 8, cache)
    assert sum(calls) == 12
    second = load_text_dataset("text_folder", root, WORDS, 8, cache)
    assert sum(calls) == 12  # nothing read or tokenised again
    assert torch.equal(first.images, second.images)
    retrained = dataclasses.replace(ByteTokenizer(), fingerprint="bytes-v2")  # same name
    load_text_dataset("text_folder", root, ByteTokenizer(), 8, cache)
    load_text_dataset("text_folder", root, retrained, 8, cache)
    assert sum(calls) == 36  # the same name, ids that may differ: tokenised again
    load_text_dataset("text_folder", root, WORDS, 12, cache)
    assert sum(calls) == 48  # another length
    changed = root / "books" / "neg" / "0.txt"
    changed.write_text("something else entirely")
    os.utime(changed, ns=(1, 1))
    third = load_text_dataset("text_folder", root, WORDS, 8, cache)
    assert sum(calls) == 60 and not torch.equal(third.images, first.images)


# ------------------------------------------------------------------------------ text_cnn


def test_text_cnn_features_ignore_padding():
    """Catches max pooling over padding positions (a conv with a bias makes them nonzero), which
    would make a review's features depend on max_length."""
    torch.manual_seed(0)
    model = build_model("text_cnn", 2, vocab_size=50, dim=4, width=3, kernels=[3])
    with torch.no_grad():  # real positions give 5 - (positive) < 5, padding positions 5
        model.featurizer.embed.weight.abs_()
        model.featurizer.convs[0].weight.copy_(-model.featurizer.convs[0].weight.abs())
        model.featurizer.convs[0].bias.fill_(5.0)
        short = model.featurizer(torch.tensor([[1, 7, 9]], dtype=torch.int32))
        padded = model.featurizer(torch.tensor([[1, 7, 9, 0, 0, 0]], dtype=torch.int32))
    assert torch.equal(short, padded)
    assert model.n_features == 3 and model.classifier.in_features == 3


# ----------------------------------------------------------------------- config checks

IMAGE_ONLY = (
    "ccst", "fedbn", "fedfd", "fedfd_a", "fedrc", "fisc", "hfedf_ae_embed", "mixstyle", "silobn",
)  # fmt: skip


@pytest.mark.parametrize("method", IMAGE_ONLY)
def test_image_only_methods_are_refused_on_text_by_name(tmp_path, method):
    """Catches an image-only method accepted on text (it would fail mid-run, or silently do
    nothing) or refused without saying which method and why."""
    assert METHODS[method].image_only
    with pytest.raises(ConfigError, match=rf"'algorithm.name': {method} cannot run on the text"):
        validate_config(_config(tmp_path, tmp_path, algorithm=method))


def test_the_image_only_list_is_complete():
    """Catches a new image/BatchNorm method registered without declaring it."""
    assert sorted(n for n, s in METHODS.items() if s.image_only) == sorted(IMAGE_ONLY)


def test_hfedf_autoencoder_embeddings_are_refused_on_text(tmp_path):
    """Catches hFedF's image autoencoder reached through its hyper-parameter on text."""
    raw = _config(tmp_path, tmp_path, algorithm={"name": "hfedf", "embedding": "autoencoder"})
    with pytest.raises(ConfigError, match=r"'algorithm.embedding' = 'autoencoder' trains a conv"):
        validate_config(raw)


def test_image_only_client_part_under_an_aggregator_is_refused(tmp_path):
    """Catches only the aggregator's part being checked when a client method is composed."""
    raw = _config(
        tmp_path,
        tmp_path,
        algorithm={"name": "hfedatm", "client": "fisc"},
        topology={"stations": 1},
    )
    with pytest.raises(ConfigError, match=r"'algorithm.client.name': fisc cannot run"):
        validate_config(raw)


def test_text_needs_a_text_model_and_no_augmentation(tmp_path):
    """Catches an image model fed token ids, a text model fed images, or image augmentation
    applied to token ids."""
    with pytest.raises(ConfigError, match=r"'model.name' = 'lenet5' reads images.*text"):
        validate_config(_config(tmp_path, tmp_path, model={"name": "lenet5"}))
    with pytest.raises(ConfigError, match=r"'train.augment' is image augmentation"):
        validate_config(_config(tmp_path, tmp_path, train__augment={"hflip": True}))
    with pytest.raises(ConfigError, match=r"'text_cnn' reads text.*holds images"):
        validate_config({"model": {"name": "text_cnn"}})


# --------------------------------------------------------------------- acceptance runs

TEXT_METHODS = sorted(n for n, s in METHODS.items() if not s.image_only)
FROZEN = {"model__frozen": True, "model__head_adapter": 4, "split__pilot_fraction": 0.2}
OVERRIDES = {
    "scaffold": {"train__optimizer": "sgd"},
    **{n: FROZEN for n in TEXT_METHODS if n.startswith("fedvr")},  # FedVR: on frozen features
    "hfedatm": {"topology__stations": 3},
    "hfedavg": {"topology__stations": 3},
    "mtgc": {"topology__stations": 3, "train__optimizer": "sgd", "train__momentum": 0.0},
}


@pytest.fixture(scope="module")
def reviews(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reviews")
    write_reviews(root, n_per_class=8)
    return root


@pytest.mark.parametrize("method", TEXT_METHODS)
def test_every_text_capable_method_runs_lodo_on_the_sentiment_domains(reviews, tmp_path, method):
    """Catches a method that breaks on token-id inputs, a text model or pooled text features:
    one round per leave-one-domain-out split of the four domains, 3 clients, each summary
    naming its target and scoring every held-out review."""
    raw = _config(reviews, tmp_path / "cache", algorithm=method, **OVERRIDES.get(method, {}))
    runs = run_experiment(validate_config(raw), tmp_path / "run", quiet=True)
    assert [r.name for r in runs] == [f"lodo-{d}" for d in DOMAINS]
    for run, target in zip(runs, DOMAINS, strict=True):
        summary = json.loads((run / "summary.json").read_text())
        assert summary["target_domains"] == [target] and list(summary["per_domain"]) == [target]
        assert 0.0 <= summary["ood_acc"] <= 1.0 and 0.0 <= summary["ood_macro_f1"] <= 1.0
        counts = np.array(summary["client_domain_counts"])
        assert counts[:, DOMAINS.index(target)].sum() == 0  # the target never trains
        # 16 reviews per source domain, one domain per client, 2 held out for validation
        expected = [[14, 14, 14]] if method == "central" else [[14]] * 3
        assert [sorted(row[row > 0].tolist()) for row in counts] == expected


def test_transformers_is_not_imported_by_the_cli_or_the_model_registry():
    """Catches an eager `import transformers` (seconds of CLI start-up for every command): the
    CLI, the model registry (which lists the transformers models) and the data pipeline load
    without it."""
    code = (
        "import sys, feddomain.cli, feddomain.models, feddomain.data.federated; "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT, check=True
    )
    assert out.stdout.strip() == "False"


def test_image_only_commands_refuse_text_with_a_message(reviews, tmp_path):
    """Catches `data describe` or `data export` running a text dataset through the image
    path (Pillow errors on every review file, or site folders of nothing)."""
    from feddomain.data.describe import describe
    from feddomain.data.export import export_sites

    with pytest.raises(DataError, match=r"reads image folders; AmazonReviews is a text dataset"):
        describe("AmazonReviews", reviews)
    cfg = validate_config(_config(reviews, tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"site folders hold images.*'AmazonReviews' is text"):
        export_sites(cfg, tmp_path / "sites")
