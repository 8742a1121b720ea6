"""Experiment schema: YAML files plus dotted command-line overrides, validated before any work.

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key fails at load time with
a message naming the key and the closest valid one. Method-specific hyper-parameters live under
``algorithm:`` and are validated by the schema the method registers (see ``algorithms.base``).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from feddomain.errors import ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatasetConfig(Section):
    name: str = "digits_embedded"
    root: str | None = (
        None  # directory holding <Dataset>/<domain>/<class>/...; not needed for embedded
    )
    resolution: int = Field(32, ge=8, le=512)
    cache_dir: str | None = None
    skip_corrupt: bool = False
    # Label order for site data (partition `sites`), whose folders may each lack some classes;
    # None: the dataset's preset classes, else the class folders found.
    classes: list[str] | None = None


class SplitConfig(Section):
    # "lodo": each target domain in `targets` held out in turn (all domains when targets is None);
    # "official": PACS-style official per-domain train/crossval lists for id validation;
    # otherwise a scheme "<train letters>-<val letter>-<test letter>", e.g. "ac-p-s".
    scheme: str = "lodo"
    targets: list[str] | None = None
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    official_lists: bool = False
    few_shot: int = Field(0, ge=0)
    few_shot_per_class: bool = True

    @field_validator("targets", mode="before")
    @classmethod
    def _one_target(cls, value: Any) -> Any:
        """``split.targets=photo`` (a bare name on the command line) means ``[photo]``."""
        return [value] if isinstance(value, str) else value

    # a seeded share of each target domain's images set aside, unlabeled, as its pilot set
    # (FedVR's zero-shot model is built from it; FedVR uses 0.1) and left out of evaluation for
    # every method alike; 0: no pilot set
    pilot_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # partition `sites`: folder <domain>/<class>/<image> holding the `targets` domains (on
    # Flower, a SuperNode's `target-root`)
    target_root: str | None = None


class PartitionConfig(Section):
    # "sites": no partitioning; client i's data is its own folder (`sites[i]` here, a SuperNode's
    # `site-root` on Flower), each <domain>/<class>/<image>
    name: Literal["domains_per_client", "lambda", "dirichlet", "sites"] = "domains_per_client"
    n_clients: int = Field(3, ge=1)
    d: int = Field(1, ge=1)
    lam: float = Field(0.1, ge=0.0, le=1.0)
    alpha: float = Field(1.0, gt=0.0)
    sites: list[str] | None = None

    @model_validator(mode="after")
    def _clients_from_sites(self) -> PartitionConfig:
        if self.sites is None:
            return self
        if self.name != "sites":
            raise ValueError(f"'sites' lists client folders for name 'sites', not {self.name!r}")
        if not self.sites:
            raise ValueError("'sites' is empty: list one folder per client")
        if "n_clients" not in self.model_fields_set:
            object.__setattr__(self, "n_clients", len(self.sites))  # no re-validation loop
        elif self.n_clients != len(self.sites):
            raise ValueError(
                f"n_clients={self.n_clients} but 'sites' lists {len(self.sites)} folder(s)"
            )
        return self


class TopologyConfig(Section):
    sample_fraction: float = Field(1.0, gt=0.0, le=1.0)
    stations: int = Field(0, ge=0)  # 0: flat federation (clients -> server)
    station_rounds: int = Field(1, ge=1)
    station_assignment: Literal["contiguous", "round_robin", "random_balanced"] = "contiguous"


class ModelConfig(Section):
    name: str = "lenet5"
    options: dict[str, Any] = Field(default_factory=dict)
    # Frozen-backbone mode (FedVR's protocol; a fast CPU path): the backbone's features of every
    # image are computed once and cached, and only a head on top of them is trained.
    frozen: bool = False
    head_hidden: int | None = Field(None, ge=1)  # None: linear head; else one hidden ReLU layer
    backbone_resolution: int | None = Field(None, ge=8)  # resize for the backbone (e.g. 224)


class AugmentSection(Section):
    hflip: bool = False
    random_resized_crop: tuple[float, float] | None = None  # area scale range, e.g. (0.7, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    color_jitter: tuple[float, float, float, float] | None = None
    grayscale_p: float = Field(0.0, ge=0.0, le=1.0)


class TrainConfig(Section):
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0.0)
    momentum: float = Field(0.0, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float | None = Field(None, gt=0.0)  # max gradient L2 norm per step; None: off
    drop_last: bool = False  # skip each epoch's final partial batch
    # learning rate per global round: constant, cosine to min_lr, or step (x step_gamma once
    # step_at of the rounds are done)
    schedule: Literal["constant", "cosine", "step"] = "constant"
    min_lr: float = Field(0.0, ge=0.0)
    step_at: float = Field(0.8, gt=0.0, le=1.0)
    step_gamma: float = Field(0.1, gt=0.0, le=1.0)
    # keep each client's optimiser state (momentum, Adam moments) across its rounds (FedDG-GA's
    # protocol) instead of a fresh optimiser per round
    persistent_optimizer: bool = False
    # after local training, re-estimate BatchNorm running statistics with the final weights over
    # one pass of the client's training data (PreciseBN); see docs/results.md (issue 11)
    precise_bn: bool = False
    augment: AugmentSection = Field(default_factory=AugmentSection)
    # per-channel normalisation; None keeps inputs in [0, 1] (hFedF's protocol)
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None


class EvalConfig(Section):
    every: int = Field(5, ge=1)
    batch_size: int = Field(512, ge=1)
    selection: Literal["source_val", "last", "oracle"] = "source_val"


class CheckpointConfig(Section):
    every: int = Field(5, ge=0)  # 0 disables checkpoints


class AlgorithmConfig(BaseModel):
    """``name`` picks the method; every other key is that method's hyper-parameter."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg"
    label: str | None = None  # how reports name this run (e.g. an ablation); default: name

    @property
    def hparams(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ExperimentConfig(Section):
    name: str = "experiment"
    seed: int = 0
    rounds: int = Field(30, ge=1)
    # torch intra-op threads; None: half the CPU cores this process may use, at least 1
    # (`default_threads`; README, "Threads")
    threads: int | None = Field(None, ge=1)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm_from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _site_options(self) -> ExperimentConfig:
        sites = self.partition.name == "sites"
        if not sites:
            for key, value in (
                ("dataset.classes", self.dataset.classes),
                ("split.target_root", self.split.target_root),
            ):
                if value is not None:
                    raise ValueError(f"{key} applies to partition 'sites' only")
            return self
        s = self.split
        unsupported = [
            ("split.scheme", s.scheme != "lodo", "the sites' folders fix the source domains"),
            ("split.official_lists", s.official_lists, "sites hold their own files"),
            ("split.few_shot", s.few_shot > 0, "target samples do not live on the sites"),
            ("dataset.root", self.dataset.root is not None, "use partition.sites"),
        ]
        if not s.targets:
            raise ValueError("partition 'sites' needs split.targets: the unseen domain(s)")
        for key, bad, why in unsupported:
            if bad:
                raise ValueError(f"{key} cannot be set with partition 'sites': {why}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def torch_threads(self) -> int:
        """The intra-op thread count a run uses: ``threads``, else ``default_threads()``."""
        return self.threads or default_threads()


def default_threads() -> int:
    """Half the CPU cores this process may run on, at least 1. Torch's own default (every
    core) oversubscribes a shared machine: on a loaded 2-core machine a demo round took about
    10x longer with 2 threads than with 1 (README, "Threads")."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core counts
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, cores // 2)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML file (or start from defaults), apply ``a.b=value`` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file {path} must hold a mapping of keys, got {type(raw).__name__}"
            )
    for item in overrides or []:
        apply_override(raw, item)
    return validate_config(raw, source=str(path) if path else "defaults")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key=value (e.g. rounds=50)")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if isinstance(child, str) and part == "algorithm":  # the `algorithm: fedavg` shorthand
            child = node[part] = {"name": child}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        node[parts[-1]] = text


def validate_config(raw: dict[str, Any], source: str = "config") -> ExperimentConfig:
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, source)) from None
    _check_model(cfg)
    _check_algorithm(cfg)
    from feddomain.data.federated import check_data_config  # late: data imports this module

    check_data_config(cfg)
    return cfg


def _check_model(cfg: ExperimentConfig) -> None:
    """Model name and options, by building the model's structure without weights or data."""
    from feddomain.models import model_skeleton  # late: models are not needed otherwise

    m = cfg.model
    try:
        model_skeleton(
            m.name,
            resolution=cfg.dataset.resolution,
            options=m.options,
            frozen=m.frozen,
            head_hidden=m.head_hidden,
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model {m.name!r} with options {m.options}: {err}") from None


def _check_algorithm(cfg: ExperimentConfig) -> None:
    from feddomain.algorithms import resolve_method  # late: algorithms import this module

    method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
    # each part's constraints on the rest of the config (the client part's, then the aggregator's)
    parts = [(method.client_spec, method.client_hp)]
    if method.spec is not method.client_spec:
        parts.append((method.spec, method.hp))
    for spec, hp in parts:
        if spec.check_config is not None:
            spec.check_config(cfg, hp)


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{key}'{_suggest(e['loc'])}")
        elif e["type"] == "value_error":  # a check across keys: its message names them
            where = f"'{key}': " if key else ""
            lines.append(f"  {where}{e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  '{key}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _suggest(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    return closest(str(loc[-1]), list(model.model_fields), prefix=".".join(map(str, loc[:-1])))


def closest(word: str, options: list[str], prefix: str = "") -> str:
    """'; did you mean X?' for the nearest option, or '' when nothing is close."""
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    if not match:
        return f"; valid keys: {', '.join(sorted(options))}"
    return f"; did you mean '{prefix + '.' if prefix else ''}{match[0]}'?"
