"""transformers sequence classifiers: the featurizer / classifier split, local-files-only
checkpoints (saved by the test itself), their tokenizers, and the errors naming a missing or
mismatched file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from feddomain.cli import run_experiment
from feddomain.config import validate_config
from feddomain.data.text import load_text_dataset
from feddomain.errors import ConfigError
from feddomain.merging.fot import Solver, align
from feddomain.merging.permutation import transformer_ffn_spec
from feddomain.models import build_model, model_skeleton, model_tokenizer
from feddomain.models.transformer import sequence_classifier
from tests.text_helpers import BAD, GOOD, TOPIC, write_reviews
from tests.transformer_helpers import save_checkpoint, tiny_roberta_config, transformers

WORDS = sorted({*GOOD, *BAD, *(w for t in TOPIC.values() for w in t), "this", "more", "&", "."})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("roberta"), WORDS)


def _tiny(arch: str, num_labels: int):
    """A randomly initialised sequence classifier of ``arch`` (pad id 1 for all three)."""
    common = dict(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64, pad_token_id=1, num_labels=num_labels,
    )  # fmt: skip
    if arch == "roberta":
        return transformers.RobertaForSequenceClassification(
            tiny_roberta_config(num_labels=num_labels)
        )
    if arch == "deberta-v2":  # DeBERTa's ContextPooler, then a Linear classifier
        config = transformers.DebertaV2Config(**common, pooler_hidden_size=16)
        return transformers.DebertaV2ForSequenceClassification(config)
    return transformers.BertForSequenceClassification(transformers.BertConfig(**common))


@pytest.mark.parametrize("arch", ["roberta", "deberta-v2", "bert"])
def test_split_computes_the_sequence_classifiers_own_logits(arch):
    """Catches a featurizer that pools another token, skips the head's dense + tanh (RoBERTa)
    or pooler (DeBERTa, BERT), or ignores the attention mask: classifier(featurizer(ids)) must
    equal the library model's logits."""
    torch.manual_seed(0)
    reference = _tiny(arch, num_labels=3).eval()
    ids = torch.tensor([[0, 5, 9, 7, 2, 1, 1], [0, 4, 2, 1, 1, 1, 1]], dtype=torch.int32)
    with torch.no_grad():
        expected = reference(input_ids=ids.long(), attention_mask=(ids != 1).long()).logits
        model = sequence_classifier(reference, 3, pad_id=1).eval()  # 3 labels: head kept
        got = model.classifier(model.featurizer(ids))
    assert torch.allclose(got, expected, atol=1e-6)
    assert model.n_features == 16 and model.featurizer(ids).shape == (2, 16)


def test_padding_does_not_change_the_pooled_representation():
    """Catches padding tokens attended to (no attention mask from the pad id)."""
    torch.manual_seed(0)
    model = sequence_classifier(
        transformers.RobertaForSequenceClassification(tiny_roberta_config()), 2, pad_id=1
    ).eval()
    with torch.no_grad():
        short = model.featurizer(torch.tensor([[0, 5, 9, 2]], dtype=torch.int32))
        padded = model.featurizer(torch.tensor([[0, 5, 9, 2, 1, 1, 1]], dtype=torch.int32))
    assert torch.allclose(short, padded, atol=1e-5)


def test_checkpoint_loads_from_local_files_with_a_fresh_head(checkpoint):
    """Catches weights not loaded (random encoder), or the saved 2-class head reused for 3
    classes."""
    saved = transformers.RobertaForSequenceClassification.from_pretrained(checkpoint)
    model = build_model("roberta", 3, path=str(checkpoint))
    encoder = model.featurizer.model.roberta.state_dict()
    for name, value in saved.roberta.state_dict().items():
        assert torch.equal(encoder[name], value), name
    assert model.classifier.out_features == 3 and model.classifier.in_features == 16
    kept = build_model("roberta", 2, path=str(checkpoint))
    assert torch.equal(kept.classifier.weight, saved.classifier.out_proj.weight)


def test_skeleton_reads_only_the_config(checkpoint, tmp_path):
    """Catches the config-time check loading the weights (slow for a real checkpoint): the
    skeleton builds from config.json on the meta device even with the weights gone."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    (folder / "model.safetensors").unlink()
    skeleton = model_skeleton("roberta", options={"path": str(folder)})
    assert next(skeleton.parameters()).device.type == "meta"


def test_checkpoint_tokenizer_tokenises_the_data(checkpoint, tmp_path):
    """Catches the data tokenised with another tokenizer than the model's (pad id, vocabulary)."""
    root = write_reviews(tmp_path / "data", n_per_class=2).parent
    tokenizer = model_tokenizer("roberta", {"path": str(checkpoint)})
    ds = load_text_dataset("AmazonReviews", root, tokenizer, 12, tmp_path / "cache")
    assert ds.pad_id == 1
    vocab = transformers.AutoTokenizer.from_pretrained(checkpoint).get_vocab()
    first = (tmp_path / "data/sorted_data_acl/books/negative.review").read_text()
    words = first.split("<review_text>\n")[1].split("\n")[0].split()
    expected = [0, *(vocab[w] for w in words[:9])]  # "this", 7 words, "&"
    row = ds.images[0].tolist()
    assert row[: len(expected)] == expected


def test_a_missing_config_file_is_named(tmp_path):
    """Catches a bare transformers OSError (or a hub lookup) for a folder without config.json."""
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'config.json'} is missing"):
        build_model("roberta", 2, path=str(tmp_path))


def test_a_checkpoint_of_another_architecture_is_named(tmp_path):
    """Catches a BERT checkpoint accepted as `roberta` (its config.json names the model type),
    and BERT weights under a RoBERTa config.json silently left random."""
    bert = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    transformers.BertForSequenceClassification(bert).save_pretrained(tmp_path / "bert")
    with pytest.raises(ConfigError, match=r"config\.json is a 'bert' checkpoint, not roberta"):
        build_model("roberta", 2, path=str(tmp_path / "bert"))
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "bert", mixed)
    tiny_roberta_config().save_pretrained(mixed)  # a RoBERTa config.json over BERT weights
    with pytest.raises(ConfigError, match=r"weights \['model.safetensors'\] in .*mixed do not fit"):
        build_model("roberta", 2, path=str(mixed))


def test_a_folder_without_tokenizer_files_is_named(checkpoint, tmp_path):
    """Catches a tokenizer fetched from elsewhere (hub) when the checkpoint lacks its own."""
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    shutil.copy(checkpoint / "config.json", folder)
    with pytest.raises(ConfigError, match=rf"no usable tokenizer files in {folder}"):
        model_tokenizer("roberta", {"path": str(folder)})


def test_a_roberta_run_completes_from_the_saved_checkpoint(checkpoint, tmp_path):
    """Catches the transformers path failing inside a federated run (token ids, the pooled
    head, evaluation): FedAvg, 3 clients, one round, one held-out domain."""
    root = write_reviews(tmp_path / "data", n_per_class=4).parent
    cfg = validate_config(
        {
            "rounds": 1,
            "dataset": {
                "name": "AmazonReviews", "root": str(root), "max_length": 12,
                "cache_dir": str(tmp_path / "cache"),
            },
            "split": {"targets": ["dvd"]},
            "partition": {"n_clients": 3},
            "model": {"name": "roberta", "options": {"path": str(checkpoint)}},
            "train": {"batch_size": 4, "optimizer": "adam", "lr": 1e-3},
            "checkpoint": {"every": 0},
            "threads": 1,
        }
    )  # fmt: skip
    (run,) = run_experiment(cfg, tmp_path / "run", quiet=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["target_domains"] == ["dvd"] and 0 <= summary["ood_acc"] <= 1


@pytest.mark.parametrize("ffn", [False, True])
def test_hfedatm_merges_a_transformer_by_regmean(checkpoint, tmp_path, ffn):
    """Catches FOT trying to align a transformer's filters (it has none: a no-op, as the HFedATM
    paper defines it) unless fot_transformer_ffn asks for its feed-forward neurons, or RegMean
    skipping the encoder's dense layers: a Gram for every nn.Linear, attention included."""
    from feddomain.merging.gram import dense_layers
    from feddomain.merging.permutation import permutation_spec

    model = build_model("roberta", 2, path=str(checkpoint))
    assert permutation_spec(model).groups == ()
    linears = dense_layers(model)
    assert "featurizer.model.roberta.encoder.layer.0.attention.self.query" in linears
    assert "featurizer.model.roberta.encoder.layer.0.intermediate.dense" in linears
    root = write_reviews(tmp_path / "data", n_per_class=4).parent
    cfg = validate_config(
        {
            "rounds": 1,
            "dataset": {
                "name": "AmazonReviews", "root": str(root), "max_length": 12,
                "cache_dir": str(tmp_path / "cache"),
            },
            "split": {"targets": ["books"]},
            "partition": {"n_clients": 3},
            "topology": {"stations": 3},
            "model": {"name": "roberta", "options": {"path": str(checkpoint)}},
            "train": {"batch_size": 4},
            "algorithm": {"name": "hfedatm", "fot_transformer_ffn": ffn},
            "eval": {"every": 1},
            "checkpoint": {"every": 0},
            "threads": 1,
        }
    )  # fmt: skip
    (run,) = run_experiment(cfg, tmp_path / "run", quiet=True)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    (merge,) = record["diagnostics"]["merge"]
    assert set(merge["regmean_ratio"]) == set(linears)  # every dense layer merged by RegMean
    assert ("identity_fraction" in merge) == ffn  # FOT solved something only with ffn


def test_ffn_alignment_recovers_a_permuted_copy_and_keeps_its_function():
    """Catches feed-forward alignment that forgets the output layer's columns or its Gram (the
    aligned model would compute another function), or permutes the wrong axis: a copy whose
    hidden neurons are shuffled computes the same logits and aligns back exactly."""
    torch.manual_seed(0)
    model = sequence_classifier(_tiny("roberta", 2), 2, pad_id=1).eval()
    spec = transformer_ffn_spec(model)
    block = "featurizer.model.roberta.encoder.layer.0"
    assert [g.name for g in spec.groups] == [f"{block}.ffn"]
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    shuffled = dict(ref)
    for name in ("intermediate.dense.weight", "intermediate.dense.bias"):
        shuffled[f"{block}.{name}"] = ref[f"{block}.{name}"][perm]
    shuffled[f"{block}.output.dense.weight"] = ref[f"{block}.output.dense.weight"][:, perm]
    ids = torch.tensor([[0, 5, 9, 7, 2, 1]], dtype=torch.int32)
    with torch.no_grad():
        expected = model(ids)
        model.load_state_dict(shuffled)
        assert torch.allclose(model(ids), expected, atol=1e-6)
    x = torch.randn(20, 32, dtype=torch.float64)
    gram = x.T @ x  # the output layer's input Gram; the shuffled copy sees x[:, perm]
    grams = {f"{block}.output.dense": gram[perm][:, perm]}
    result = align(spec, ref, shuffled, grams, Solver("exact"))
    for name, value in ref.items():
        assert torch.equal(result.arrays[name], value), name
    assert torch.equal(result.grams[f"{block}.output.dense"], gram)


def test_ffn_alignment_is_refused_for_a_model_without_transformer_blocks(tmp_path):
    """Catches fot_transformer_ffn silently doing nothing on a model it cannot apply to."""
    raw = {
        "dataset": {"name": "AmazonReviews", "root": str(tmp_path)},
        "model": {"name": "text_cnn"},
        "topology": {"stations": 3},
        "algorithm": {"name": "hfedatm", "fot_transformer_ffn": True},
    }
    with pytest.raises(ConfigError, match=r"fot_transformer_ffn needs transformer blocks"):
        validate_config(raw)
