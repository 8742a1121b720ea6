"""`transformers` sequence classifiers (RoBERTa, DeBERTa, any ``AutoModelForSequenceClassification``
checkpoint) from a local folder, split into the featurizer / classifier every method needs.

The checkpoint folder is what ``save_pretrained`` writes (``config.json``, the weights, the
tokenizer files); it is read with ``local_files_only=True``, so a run never reaches the hub.
The model is the library's own sequence classifier with its final projection taken out: the
featurizer maps token ids to the pooled representation the head reads (RoBERTa: the start
token's state through the head's dense + tanh; DeBERTa/BERT: the pooler's output), the
classifier is that last ``nn.Linear``, refitted to the run's classes. ``transformers`` is
imported only when such a model is configured (an optional extra: ``pip install
feddomain[text]``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
# a tokenizer's vocabulary file, one of which a checkpoint folder must hold
TOKENIZER_FILES = (
    "tokenizer.json", "vocab.json", "vocab.txt", "spm.model", "tokenizer.model",
    "sentencepiece.bpe.model",
)  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx")
# registry name -> the config.json model types it accepts (None: any architecture)
ARCHITECTURES: dict[str, tuple[str, ...] | None] = {
    "transformer": None,
    "roberta": ("roberta",),
    "deberta": ("deberta", "deberta-v2"),
}


@cache
def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "transformers models need the `transformers` package: pip install 'feddomain[text]'"
        ) from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def checkpoint_config(name: str, path: str | None) -> Any:
    """The checkpoint's ``config.json`` as a transformers config, checked against ``name``'s
    architecture; a ConfigError names the missing folder or file, or the wrong architecture."""
    if not path:
        raise ConfigError(
            f"model {name!r} needs options.path: a local checkpoint folder (save_pretrained)"
        )
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model {name!r}: checkpoint folder {folder} does not exist")
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(
            f"model {name!r}: {folder / CONFIG_FILE} is missing (a checkpoint folder holds "
            "config.json, the weights and the tokenizer files that save_pretrained writes)"
        )
    try:
        config = _transformers().AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model {name!r}: cannot read {folder / CONFIG_FILE}: {exc}") from None
    accepted = ARCHITECTURES[name]
    if accepted is not None and config.model_type not in accepted:
        raise ConfigError(
            f"model {name!r}: {folder / CONFIG_FILE} is a {config.model_type!r} checkpoint, not "
            f"{' / '.join(accepted)}; use model 'transformer' for any architecture"
        )
    return config


def _load(name: str, folder: Path, config: Any, pretrained: bool) -> nn.Module:
    auto = _transformers().AutoModelForSequenceClassification
    if not pretrained:
        return auto.from_config(config)
    try:
        model, info = auto.from_pretrained(
            folder, config=config, local_files_only=True, output_loading_info=True
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"model {name!r}: cannot load the weights in {folder}: {exc}") from None
    base = f"{model.base_model_prefix}."
    lost = sorted(k for k in info["missing_keys"] | info["mismatched_keys"] if k.startswith(base))
    if lost:
        weights = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        raise ConfigError(
            f"model {name!r}: the weights {weights} in {folder} do not fit its {CONFIG_FILE} "
            f"({config.model_type}): {len(lost)} encoder tensor(s) missing or of another shape, "
            f"e.g. {lost[0]!r} (a checkpoint of another architecture?)"
        )
    return model


def _final_projection(model: nn.Module, n_labels: int) -> tuple[nn.Module, str, nn.Linear]:
    """(parent module, attribute, layer) of the head's last Linear (outputs = the labels)."""
    base = model.base_model_prefix
    for qualified, module in reversed(list(model.named_modules())):
        if isinstance(module, nn.Linear) and module.out_features == n_labels:
            if qualified.split(".")[0] == base:
                break
            parent_name, _, attr = qualified.rpartition(".")
            return model.get_submodule(parent_name), attr, module
    raise ConfigError(
        f"{type(model).__name__}: no final Linear with {n_labels} outputs in its head"
    )


class PooledEncoder(nn.Module):
    """ids [B, L] -> the pooled representation [B, F]: the sequence classifier with its final
    projection replaced by the identity, attending to every non-padding token."""

    def __init__(self, model: nn.Module, pad_id: int) -> None:
        super().__init__()
        self.model = model
        self.pad_id = pad_id

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids.long()
        return self.model(input_ids=ids, attention_mask=(ids != self.pad_id).long()).logits


def sequence_classifier(model: nn.Module, num_classes: int, pad_id: int) -> FeatureClassifier:
    """Split a transformers sequence classifier at its final projection (kept when it already
    has ``num_classes`` outputs, else a fresh Linear)."""
    parent, attr, last = _final_projection(model, model.config.num_labels)
    setattr(parent, attr, nn.Identity())
    head = last if last.out_features == num_classes else nn.Linear(last.in_features, num_classes)
    return FeatureClassifier(PooledEncoder(model, pad_id), head, last.in_features)


def _builder(name: str):
    def build(
        num_classes: int, *, resolution: int = 32, path: str | None = None, pretrained: bool = True
    ) -> FeatureClassifier:
        config = checkpoint_config(name, path)
        model = _load(name, Path(path).expanduser(), config, pretrained)
        pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        return sequence_classifier(model, num_classes, pad_id)

    kind = "any architecture" if ARCHITECTURES[name] is None else f"a {name} checkpoint"
    build.__doc__ = (
        f"transformers sequence classifier ({kind}) from the local checkpoint folder `path` "
        "(config.json, weights, tokenizer; no hub access); its tokenizer tokenises the data. "
        "`pretrained: false` builds it from config.json alone (random weights).\n\n"
        "``resolution`` is unused (token length is ``dataset.max_length``)."
    )
    build.__name__ = name
    return build


transformer = _builder("transformer")
roberta = _builder("roberta")
deberta = _builder("deberta")


@dataclass(frozen=True)
class CheckpointTokenizer:
    """A checkpoint's own tokenizer, behind the loader's ``Tokenizer`` protocol."""

    tokenizer: Any
    fingerprint: str
    name: str = "hf"

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    def encode(self, texts: list[str], max_length: int) -> np.ndarray:
        out = self.tokenizer(
            list(texts),
            max_length=max_length,
            truncation=True,
            padding="max_length",
            return_tensors="np",
        )
        return out["input_ids"].astype(np.int32)


def checkpoint_tokenizer(name: str, path: str | None) -> CheckpointTokenizer:
    """The tokenizer saved in the checkpoint folder (local files only); its fingerprint hashes
    every file of the folder but the weights, so a changed vocabulary re-tokenises the data."""
    checkpoint_config(name, path)
    folder = Path(str(path)).expanduser()
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone (every word unknown)
        raise ConfigError(
            f"model {name!r}: no usable tokenizer files in {folder} (none of "
            f"{', '.join(TOKENIZER_FILES)}; save the tokenizer there with save_pretrained)"
        )
    try:
        tok = _transformers().AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"model {name!r}: no usable tokenizer files in {folder} (tokenizer.json, or "
            f"vocab/merges; save the tokenizer with save_pretrained there): {exc}"
        ) from None
    h = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        if file.suffix not in WEIGHT_SUFFIXES:
            h.update(file.name.encode() + b"\0" + file.read_bytes())
    return CheckpointTokenizer(tok, h.hexdigest()[:16], name=f"{name}{h.hexdigest()[:8]}")
