"""Model registry: every backbone is built by name with explicit keyword options.

Each model is a :class:`FeatureClassifier` (``featurizer`` then ``classifier``, ``n_features``).
Names and options come from configs, so unknown ones fail with a :class:`ConfigError` that names
the culprit and the closest valid spelling.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier
from feddomain.models.efficientnet import INPUT_MEAN, INPUT_STD, efficientnet_lite0
from feddomain.models.hfedf_cnn import hfedf_cnn
from feddomain.models.lenet import lenet5
from feddomain.models.resnet import check_weights_path, resnet18, resnet50
from feddomain.models.small_cnn import small_cnn
from feddomain.models.vgg import vgg11

Builder = Callable[..., FeatureClassifier]
Normalization = tuple[tuple[float, float, float], tuple[float, float, float]]

MODELS: dict[str, Builder] = {
    "hfedf_cnn": hfedf_cnn,
    "lenet5": lenet5,
    "small_cnn": small_cnn,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "efficientnet_lite0": efficientnet_lite0,
    "vgg11": vgg11,
}



def register_model(name: str, builder: Builder) -> Builder:
    """Add a model of one's own (docs/plugins.md): ``builder(num_classes, *, resolution,
    **options)`` returns a ``FeatureClassifier``; its keyword-only parameters are the model's
    ``model.options``."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"a model's name must be a non-empty string, got {name!r}")
    if name in MODELS:
        raise ConfigError(f"model {name!r} is already registered (by {MODELS[name].__module__})")
    if not callable(builder):
        raise ConfigError(f"model {name!r}: its builder must be callable, got {builder!r}")
    params = inspect.signature(builder).parameters
    if "resolution" not in params:
        raise ConfigError(
            f"model {name!r}: its builder must take (num_classes, *, resolution, **options)"
        )
    MODELS[name] = builder
    return builder


IMAGENET_NORMALIZATION: Normalization = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
_PRETRAINED_NORMALIZATION: dict[str, Normalization] = {
    "resnet18": IMAGENET_NORMALIZATION,
    "resnet50": IMAGENET_NORMALIZATION,
    "vgg11": IMAGENET_NORMALIZATION,
    "efficientnet_lite0": (INPUT_MEAN, INPUT_STD),
}


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _builder(name: str) -> Builder:
    if name not in MODELS:
        names = sorted(MODELS)
        raise ConfigError(f"model: unknown name {name!r}{_suggest(name, names)}; valid: {names}")
    return MODELS[name]


def model_options(name: str) -> dict[str, object]:
    """The keyword options ``name`` accepts (besides ``resolution``), with their defaults."""
    params = inspect.signature(_builder(name)).parameters.values()
    return {
        p.name: p.default
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "resolution"
    }


def build_model(
    name: str, num_classes: int, *, resolution: int = 32, **options
) -> FeatureClassifier:
    """Build ``name`` for ``num_classes`` classes and square ``resolution``-pixel inputs."""
    builder = _builder(name)
    valid = model_options(name)
    for option in options:
        if option not in valid:
            raise ConfigError(
                f"model {name!r}: unknown option {option!r}{_suggest(option, list(valid))}; "
                f"valid options: {sorted(valid)}"
            )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"model {name!r}: num_classes={num_classes!r} must be a positive int")
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ConfigError(f"model {name!r}: resolution={resolution!r} must be a positive int")
    model = builder(num_classes, resolution=resolution, **options)
    model.arch = name  # what per-architecture tables (HFedATM's permutation specs) look up
    return model


def input_normalization(name: str) -> Normalization | None:
    """Per-channel (mean, std) a model's pretrained weights expect; None for from-scratch models.

    Applies only when pretrained weights are used (``weights_path`` for ResNets, the default for
    EfficientNet-Lite0); models trained from scratch use the data pipeline's own normalisation.
    """
    _builder(name)
    return _PRETRAINED_NORMALIZATION.get(name)


def check_weights(name: str, options: dict[str, Any]) -> None:
    """Refuse, when the config loads, a ``weights_path`` that is missing, unreadable or does not
    fit model ``name`` (ConfigError naming the key); nothing to check without one."""
    path = options.get("weights_path")
    if path is None or "weights_path" not in model_options(name):
        return
    try:
        check_weights_path(name, str(path))
    except ConfigError as err:
        raise ConfigError(f"invalid configuration: 'model.options.weights_path': {err}") from None


# Options that load weights into a network without changing its structure.
_WEIGHT_OPTIONS = {"pretrained": False, "weights_path": None}


def model_skeleton(
    name: str,
    *,
    resolution: int = 32,
    options: dict[str, Any] | None = None,
    frozen: bool = False,
    head_hidden: int | None = None,
    head_adapter: int | None = None,
    frozen_prefix: int | None = None,
) -> nn.Module:
    """The structure of a configured model without its weights: built on the meta device (no
    memory, no weight file read), for config-time checks of what a method needs of it. With
    ``frozen`` it is the head trained on cached features, with ``frozen_prefix`` the tail trained
    after the prefix. The class count does not shape the layers a check looks at, so it is 2."""
    from feddomain.models.frozen import head_model  # late: only config-time checks need it
    from feddomain.models.prefix import split_at

    options = dict(options or {})
    valid = model_options(name)
    options.update({k: v for k, v in _WEIGHT_OPTIONS.items() if k in valid})
    with torch.device("meta"):
        model = build_model(name, 2, resolution=resolution, **options)
        if frozen:
            model = head_model(model.n_features, 2, hidden=head_hidden, adapter=head_adapter)
        if frozen_prefix is not None:
            model = split_at(model, frozen_prefix)[1]
    return model


def configured_skeleton(cfg: Any) -> nn.Module:
    """``model_skeleton`` of an experiment config's model (``cfg.model`` at the dataset's
    resolution): the one place config-time checks build it from."""
    m = cfg.model
    return model_skeleton(
        m.name,
        resolution=cfg.dataset.resolution,
        options=m.options,
        frozen=m.frozen,
        head_hidden=m.head_hidden,
        head_adapter=m.head_adapter,
        frozen_prefix=m.frozen_prefix,
    )


__all__ = [
    "IMAGENET_NORMALIZATION",
    "MODELS",
    "FeatureClassifier",
    "build_model",
    "check_weights",
    "configured_skeleton",
    "input_normalization",
    "model_options",
    "model_skeleton",
]
