"""Experiment schema: YAML files plus dotted command-line overrides, validated before any work.

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key fails at load time with
a message naming the key and the closest valid one. Method-specific hyper-parameters live under
``algorithm:`` and are validated by the schema the method registers (see ``algorithms.base``).
"""

from __future__ import annotations

import difflib
import os
import re
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
    # attribute docstrings are the fields' descriptions: docs/config.md is generated from them
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class DatasetConfig(Section):
    """Which images (or texts), at what size."""

    name: str = "digits_embedded"
    """Dataset preset (`feddomain list datasets`), `folder` for any DomainBed-style tree, or
    `text_folder` for any `<domain>/<class>/<file>.txt` tree."""
    root: str | None = None
    """Folder holding `<Dataset>/<domain>/<class>/<image>` (or the preset's own layout, e.g.
    `sorted_data_acl/`, `iwildcam_v2.0/`); not needed for `digits_embedded`."""
    resolution: int = Field(32, ge=8, le=512)
    """Square side in pixels every image is resized to."""
    max_length: int = Field(256, ge=2)
    """Text datasets: tokens per sample (truncated or padded; HFedATM uses 256)."""
    cache_dir: str | None = None
    """Decoded-image cache; null: `$FEDDOMAIN_CACHE`, else `~/.cache/feddomain`."""
    skip_corrupt: bool = False
    """Leave out images that fail to decode (listed) instead of stopping."""
    classes: list[str] | None = None
    """Label order for partition `sites`, whose folders may each lack some classes; null: the
    dataset's preset classes, else the class folders found."""


class SplitConfig(Section):
    """Which domains are sources, validation and unseen targets."""

    scheme: str = "lodo"
    """`lodo`: each domain of `targets` held out in turn (all domains when `targets` is null);
    `<train letters>-<val letter>-<test letter>`, e.g. `ac-p-s`; or `wilds`: a WILDS dataset's
    official splits (train locations to clients, their `id_val` as client validation, `val` and
    `test` scored as two pooled sets)."""
    targets: list[str] | None = None
    """Unseen domains under `lodo` (one run each); a bare name is a one-element list."""

    @field_validator("targets", mode="before")
    @classmethod
    def _one_target(cls, value: Any) -> Any:
        """``split.targets=photo`` (a bare name on the command line) means ``[photo]``."""
        return [value] if isinstance(value, str) else value

    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of each client's data held out as its (in-domain) validation split."""
    official_lists: bool = False
    """Use the dataset's official train/validation lists (PACS) instead of `val_fraction`."""
    few_shot: int = Field(0, ge=0)
    """Labelled target-domain samples given to training (0: none, pure generalisation)."""
    few_shot_per_class: bool = True
    """`few_shot` counts per class (true) or in all (false)."""
    pilot_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Seeded share of each target domain set aside, unlabeled, as its pilot set (FedVR builds
    its zero-shot model from it; FedVR uses 0.1), left out of evaluation for every method."""
    target_root: str | None = None
    """Partition `sites`: folder `<domain>/<class>/<image>` holding the `targets` domains (on
    Flower, a SuperNode's `target-root`)."""


class PartitionConfig(Section):
    """How the source data is divided among clients."""

    name: Literal["domains_per_client", "lambda", "dirichlet", "sites"] = "domains_per_client"
    """`domains_per_client` (hFedF's d domains each), `lambda` (Bai et al.'s heterogeneity),
    `dirichlet` over domains, or `sites` (client i's data is its own folder)."""
    n_clients: int = Field(3, ge=1)
    """Number of clients (with `sites`: the number of folders)."""
    d: int = Field(1, ge=1)
    """`domains_per_client`: distinct source domains per client."""
    lam: float = Field(0.1, ge=0.0, le=1.0)
    """`lambda`: share of each client's data drawn from all domains (0: one domain each)."""
    alpha: float = Field(1.0, gt=0.0)
    """`dirichlet`: concentration (small: few domains per client)."""
    sites: list[str] | None = None
    """`sites`: one folder per client, each `<domain>/<class>/<image>` (on Flower, a
    SuperNode's `site-root`)."""

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
    """Who takes part in a round, and optional stations between clients and server."""

    sample_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Share of clients (or stations) sampled each round, seeded."""
    stations: int = Field(0, ge=0)
    """Stations of a hierarchical federation; 0: flat (clients talk to the server)."""
    station_rounds: int = Field(1, ge=1)
    """Rounds a station runs with its clients per global round."""
    station_assignment: Literal["contiguous", "round_robin", "random_balanced"] = "contiguous"
    """How clients are assigned to stations."""


class ModelConfig(Section):
    """The network every client trains."""

    name: str = "lenet5"
    """Backbone (`feddomain list models`)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The model's keyword options, e.g. `{norm: batch}` (`feddomain list models`)."""
    frozen: bool = False
    """Frozen-backbone mode (FedVR's protocol; a fast CPU path): the backbone's features of
    every image are computed once and cached; only a head on top of them trains."""
    head_hidden: int | None = Field(None, ge=1)
    """Frozen mode: null for a linear head, else the width of one hidden ReLU layer."""
    head_adapter: int | None = Field(None, ge=1)
    """Frozen mode: rank of a residual bottleneck adapter on the feature before the linear head
    (FedVR's client model, r = 64; starts as the identity); null: none. Exclusive with
    `head_hidden`."""
    backbone_resolution: int | None = Field(None, ge=8)
    """Frozen mode: image side the backbone sees (e.g. 224); null: `dataset.resolution`."""
    frozen_prefix: int | None = Field(None, ge=1)
    """Freeze a pretrained backbone up to and including its stage k (1-based, as MixStyle's
    `blocks`: efficientnet_lite0's 7 block groups, ResNet's layer1-4, small_cnn's conv blocks),
    compute that part's output once per image and cache it, and train the rest (its BatchNorm
    layers included) and the head; null: train the whole model. Exclusive with `frozen`."""
    prefix_cache: bool = True
    """Frozen prefix: read its output from the cache (true) or recompute it on every batch
    (false: the same run up to float error; for checks and timing)."""
    memory_format: Literal["auto", "channels_last", "contiguous"] = "auto"
    """Layout of the trained model's convolution weights, which its activations follow:
    `channels_last` trains small CNNs about 1.5x faster on the CPU (docs/performance.md);
    `auto`: channels_last on the CPU for a model with a 2-D convolution, else contiguous. The
    same run up to float error either way."""

    @model_validator(mode="after")
    def _one_frozen_mode(self) -> ModelConfig:
        if self.frozen and self.frozen_prefix is not None:
            raise ValueError(
                "'frozen: true' trains a head on cached features and 'frozen_prefix' trains the "
                "stages after the prefix: set one of them"
            )
        return self


class AugmentSection(Section):
    """Training-time augmentation (each client, on its own batches)."""

    hflip: bool = False
    """Random horizontal flips."""
    random_resized_crop: tuple[float, float] | None = None
    """Area scale range of random resized crops, e.g. `[0.7, 1.0]`; null: off."""
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    """Aspect ratio range of those crops."""
    color_jitter: tuple[float, float, float, float] | None = None
    """Brightness, contrast, saturation, hue jitter; null: off."""
    grayscale_p: float = Field(0.0, ge=0.0, le=1.0)
    """Probability of converting an image to greyscale."""
    invert_p: float = Field(0.0, ge=0.0, le=1.0)
    """Probability of inverting an image's colours (1 - x, torchvision's `RandomInvert`): makes a
    model blind to light-on-dark vs dark-on-light."""


class TrainConfig(Section):
    """Each client's local training."""

    local_epochs: int = Field(1, ge=1)
    """Passes over the client's data per round."""
    max_steps: int | None = Field(None, ge=1)
    """At most this many local steps per round (a compute budget, e.g. a large backbone on a
    CPU): the round's batches are drawn as for `local_epochs` and training stops after this many;
    null: every batch. Applies to the shared training loop every `ctx.fit` method uses."""
    batch_size: int = Field(32, ge=1)
    """Mini-batch size."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Client optimiser."""
    lr: float = Field(1e-3, gt=0.0)
    """Client learning rate (of round 1 under a schedule)."""
    momentum: float = Field(0.0, ge=0.0)
    """SGD momentum."""
    weight_decay: float = Field(0.0, ge=0.0)
    """L2 weight decay of the optimiser."""
    grad_clip: float | None = Field(None, gt=0.0)
    """Maximum gradient L2 norm per step; null: off."""
    drop_last: bool = False
    """Skip each epoch's final partial batch."""
    schedule: Literal["constant", "cosine", "step"] = "constant"
    """Learning rate per global round: constant, cosine to `min_lr`, or step (x `step_gamma`
    once `step_at` of the rounds are done)."""
    min_lr: float = Field(0.0, ge=0.0)
    """`cosine`: the final learning rate."""
    step_at: float = Field(0.8, gt=0.0, le=1.0)
    """`step`: share of the rounds after which the rate drops."""
    step_gamma: float = Field(0.1, gt=0.0, le=1.0)
    """`step`: the factor it drops by."""
    persistent_optimizer: bool = False
    """Keep each client's optimiser state (momentum, Adam moments) across its rounds
    (FedDG-GA's protocol) instead of a fresh optimiser per round."""
    precise_bn: bool = False
    """After local training, re-estimate BatchNorm statistics with the final weights over one
    pass of the client's data (PreciseBN)."""
    batched_clients: Literal["auto", "off", "on"] = "auto"
    """Train a round's clients as one batched computation (torch.func vmap over stacked
    parameters; FedAvg, FedProx, Local-only on models without BatchNorm or dropout): on,
    off, or auto (on CUDA when nothing stands in the way; the CPU keeps the sequential path).
    On an H100, 100 LeNet-5 clients train a round 5.4x faster batched (docs/performance.md)."""
    augment: AugmentSection = Field(default_factory=AugmentSection)
    mean: tuple[float, float, float] | None = None
    """Per-channel input mean; null (with `std`) keeps inputs in [0, 1] (hFedF's protocol)."""
    std: tuple[float, float, float] | None = None
    """Per-channel input standard deviation."""


class EvalConfig(Section):
    """When and how runs are scored."""

    every: int = Field(5, ge=1)
    """Evaluate every this many rounds (and after the last)."""
    batch_size: int = Field(512, ge=1)
    """Batch size of evaluation and of a frozen backbone's or prefix's feature pass; outputs do
    not depend on it beyond float rounding. On a CPU, 16-64 run fastest (docs/performance.md)."""
    selection: Literal["source_val", "last", "oracle"] = "source_val"
    """Which evaluated round a run reports: best source validation, the last, or `oracle`
    (peeks at the target domain; always labelled so)."""


class CheckpointConfig(Section):
    """Checkpoints for `--resume`."""

    every: int = Field(5, ge=0)
    """Checkpoint every this many rounds; 0: never (an interrupted run restarts)."""
    keep_final: bool = True
    """Keep a finished run's last state (`final_checkpoint.pt`), so `feddomain run --resume DIR
    rounds=N` can extend it to N rounds; false deletes it (disk-bound sweeps)."""
    keep_evaluated: bool = False
    """Keep the state of every evaluated round (`evaluated/round_NNNNN.pt`), so `feddomain
    rescore` can score the finished run again under settings that act only at evaluation
    (FedFD's test_mode, hFedF's ood_model, FedSR's eval_z) without training it again."""


class MlflowConfig(Section):
    """Where MLflow records the runs."""

    tracking_uri: str | None = None
    """MLflow tracking URI (`http://host:5000`, `sqlite:///mlflow.db`); null: MLflow's own
    default (`$MLFLOW_TRACKING_URI`, else a local store in the current folder)."""
    experiment: str | None = None
    """MLflow experiment the runs are recorded under; null: the config's `name`."""


class TrackingConfig(Section):
    """Experiment tracking: every round's metrics, the resolved config as hyper-parameters and
    the summary, also sent to TensorBoard and/or MLflow (the run directory's files are written
    as always; a tracking failure warns once and the run goes on)."""

    tensorboard: str | None = None
    """Folder of TensorBoard event files, one sub-folder per run (`tensorboard --logdir`);
    null: off. Needs `pip install 'feddomain[tensorboard]'`."""
    mlflow: MlflowConfig | None = None
    """MLflow tracking, `{tracking_uri: URI, experiment: NAME}` (both optional: the URI
    defaults to `$MLFLOW_TRACKING_URI`, else MLflow's local store in the current folder; the
    experiment to the config's `name`); null: off. Needs `pip install 'feddomain[mlflow]'`."""

    @model_validator(mode="after")
    def _installed(self) -> TrackingConfig:
        from feddomain.tracking import missing_package  # late: a cheap check, no import

        for key, on in (("tensorboard", self.tensorboard is not None), ("mlflow", self.mlflow)):
            problem = missing_package(key) if on else None
            if problem:
                raise ValueError(f"'tracking.{key}': {problem}")
        return self


class AlgorithmConfig(BaseModel):
    """``name`` picks the method; every other key is that method's hyper-parameter."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)
    name: str = "fedavg"
    """The method (`feddomain list methods`); its hyper-parameters are listed below."""
    label: str | None = None
    """How reports name this run (e.g. an ablation); null: `name`."""

    @property
    def hparams(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ExperimentConfig(Section):
    """One experiment: YAML plus dotted command-line overrides."""

    name: str = "experiment"
    """The experiment's name (reports group runs by it)."""
    seed: int = 0
    """Seeds every random draw (data split, partition, initialisation, training)."""
    rounds: int = Field(30, ge=1)
    """Global federated rounds."""
    threads: int | None = Field(None, ge=1)
    """Torch intra-op threads; null: half the CPU cores this process may use, at least 1
    (README, "Threads")."""
    device: str = "auto"
    """Where clients train and models are evaluated: auto (CUDA when available), cpu, cuda,
    cuda:N."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: mixed precision (CUDA only)."""
    deterministic: bool = False
    """Deterministic CUDA kernels (cuDNN, cuBLAS); docs/performance.md."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    plugins: list[str] = Field(default_factory=list)
    """Modules imported before the config is validated, each registering methods, datasets or
    models of its own (`my_package.my_method`; docs/plugins.md)."""

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm_from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _device_available(self) -> ExperimentConfig:
        from feddomain.federation.device import check_device  # late: it imports torch

        check_device(self.device, self.precision)
        return self

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


SHIPPED = "feddomain:"  # names a config shipped with the package, e.g. feddomain:demo
SHIPPED_DIR = Path(__file__).resolve().parent / "configs"  # the repository's configs/


def shipped_config(name: str) -> Path:
    """The file of shipped config ``name`` (``feddomain:pacs/lenet32``, ``.yaml`` optional),
    inside the installed package, so it works from any folder and without a clone."""
    rel = name.removeprefix(SHIPPED).removesuffix(".yaml") + ".yaml"
    path = SHIPPED_DIR / rel
    if ".." in Path(rel).parts or not path.is_file():
        names = [shipped_name(p) for p in sorted(SHIPPED_DIR.rglob("*.yaml"))]
        raise ConfigError(
            f"no shipped config {name!r}{closest(SHIPPED + rel.removesuffix('.yaml'), names)}"
            " (`feddomain list configs` lists them)"
        )
    return path


def shipped_name(path: Path) -> str:
    """How ``feddomain list configs`` names a shipped config file: ``feddomain:pacs/lenet32``."""
    return SHIPPED + path.relative_to(SHIPPED_DIR).with_suffix("").as_posix()


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    origin: str = "the command line",
) -> ExperimentConfig:
    """Read a YAML file (or start from defaults), apply ``a.b=value`` overrides, validate.
    ``feddomain:NAME`` reads a shipped config (``shipped_config``). ``origin``: where the
    overrides came from, as messages name it (the Python API's are its arguments)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = shipped_config(str(path)) if str(path).startswith(SHIPPED) else Path(path)
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
    source = str(path) if path else "defaults"
    if overrides:
        source += f" and {origin}"
    try:
        return validate_config(raw, source=source)
    except ConfigError as err:  # the same kind (a PluginError stays one), blamed where due
        raise type(err)(_blame_overrides(str(err), overrides or [], origin)) from None


def _blame_overrides(message: str, overrides: list[str], origin: str) -> str:
    """``message`` with each line that quotes a key set by an override marked with that
    override, so a bad ``rounds=abc`` is not looked for in the YAML file the header names."""
    keys = {item.partition("=")[0].strip(): item for item in overrides}
    lines = message.split("\n")
    for i, line in enumerate(lines):
        first = re.search(r"'([A-Za-z_][\w.]*)'", line)  # the key at fault; later: hints
        blamed = _overrides_of(first.group(1), keys) if first else []
        if blamed:
            lines[i] = f"{line} [from {origin}: {', '.join(blamed)}]"
    return "\n".join(lines)


def config_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each dotted key whose value differs between two resolved configs (``to_dict()``), as
    ``'rounds: 12 vs 20'`` (``before``'s value first; ``-`` where a key is absent), in key
    order: what a refused resume names instead of only saying that the settings differ."""
    flat_before, flat_after = _flatten(before), _flatten(after)
    missing = object()
    return [
        f"{key}: {_shown(flat_before.get(key, missing), missing)} vs "
        f"{_shown(flat_after.get(key, missing), missing)}"
        for key in differing_keys(before, after)
    ]


def differing_keys(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The dotted keys whose values differ between two resolved configs, in key order (a key
    present in one only differs)."""
    flat_before, flat_after = _flatten(before), _flatten(after)
    missing = object()
    return [
        key
        for key in sorted(flat_before.keys() | flat_after.keys())
        if flat_before.get(key, missing) != flat_after.get(key, missing)
    ]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(value: Any, missing: object) -> str:
    """A value as a config would spell it (YAML flow style); ``-`` for an absent key."""
    if value is missing:
        return "-"
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()


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


def _overrides_of(key: str, overrides: dict[str, str]) -> list[str]:
    """The overrides that set ``key``: the one naming it, else the closest section holding it
    (``algorithm=fedprox`` for ``algorithm.mu``), else those setting keys inside it."""
    if key in overrides:
        return [overrides[key]]
    sections = [k for k in overrides if key.startswith(k + ".")]
    if sections:
        return [overrides[max(sections, key=len)]]
    return [item for k, item in overrides.items() if k.startswith(key + ".")]


def validate_config(raw: dict[str, Any], source: str = "config") -> ExperimentConfig:
    from feddomain.plugins import load_plugins  # late: plugins import the registries

    load_plugins(raw.get("plugins"), source)
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, source)) from None
    _check_model(cfg)
    _check_modality(cfg)
    _check_algorithm(cfg)
    _type_algorithm(cfg)
    _check_batched(cfg)
    _check_weights(cfg)
    from feddomain.data.federated import check_data_config  # late: data imports this module

    check_data_config(cfg)
    return cfg


def _check_batched(cfg: ExperimentConfig) -> None:
    """``train.batched_clients: on`` with a method, model or setting it cannot batch exactly."""
    if cfg.train.batched_clients != "on":
        return
    from feddomain.algorithms import resolve_method  # late: algorithms import this module
    from feddomain.federation.batched import batching_problem
    from feddomain.models import configured_skeleton

    skeleton = configured_skeleton(cfg)
    method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
    problem = batching_problem(
        method.not_batchable, method.prepare_model(skeleton), cfg.train, cfg.precision
    )
    if problem:
        raise ConfigError(f"invalid configuration: 'train.batched_clients' = 'on': {problem}")


def _check_weights(cfg: ExperimentConfig) -> None:
    from feddomain.models import check_weights  # late: models are not needed otherwise

    check_weights(cfg.model.name, cfg.model.options)


def _check_model(cfg: ExperimentConfig) -> None:
    """Model name and options, by building the model's structure without weights or data."""
    from feddomain.models import configured_skeleton  # late: models are not needed otherwise

    try:
        configured_skeleton(cfg)
    except (TypeError, ValueError) as err:
        m = cfg.model
        raise ConfigError(f"model {m.name!r} with options {m.options}: {err}") from None


def text_dataset(cfg: ExperimentConfig) -> str | None:
    """The dataset's name if it is a text dataset, else None (also for an unknown name, which
    the loader names)."""
    from feddomain.data.sources import get_spec  # late: data imports this module
    from feddomain.errors import DataError

    try:
        spec = get_spec(cfg.dataset.name)
    except DataError:
        return None
    return spec.name if spec.is_text else None


def _check_modality(cfg: ExperimentConfig) -> None:
    """Text datasets need a text model and no image augmentation; images need an image model."""
    from feddomain.models import TEXT_MODELS, is_text_model

    text = text_dataset(cfg)
    if text is None and is_text_model(cfg.model.name):
        raise ConfigError(
            f"invalid configuration: 'model.name' = {cfg.model.name!r} reads text, and dataset "
            f"{cfg.dataset.name!r} holds images"
        )
    if text is None:
        return
    if not is_text_model(cfg.model.name):
        raise ConfigError(
            f"invalid configuration: 'model.name' = {cfg.model.name!r} reads images, and dataset "
            f"{text!r} is text; use one of {sorted(TEXT_MODELS)}"
        )
    augment = cfg.train.augment
    if augment != AugmentSection(crop_ratio=augment.crop_ratio):
        raise ConfigError(
            f"invalid configuration: 'train.augment' is image augmentation; dataset {text!r} is "
            "text: turn it off"
        )


def _check_algorithm(cfg: ExperimentConfig) -> None:
    from feddomain.algorithms import resolve_method  # late: algorithms import this module

    method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
    # each part's constraints on the rest of the config (the client part's, then the aggregator's)
    parts = [(method.client_spec, method.client_hp)]
    if method.spec is not method.client_spec:
        parts.append((method.spec, method.hp))
    text = text_dataset(cfg)
    for spec, _ in parts:
        if text and spec.image_only:
            key = "algorithm.client.name" if spec is not method.spec else "algorithm.name"
            raise ConfigError(
                f"invalid configuration: '{key}': {spec.name} cannot run on the text "
                f"dataset {text!r}: it {spec.image_only}"
            )
    for spec, hp in parts:
        if spec.check_config is not None:
            spec.check_config(cfg, hp)


def _type_algorithm(cfg: ExperimentConfig) -> None:
    """Keep each given hyper-parameter as its method types it (``algorithm.mu=1e-2`` is saved
    as 0.01, not the string "1e-2"): runs of one setting then save, compare and group alike."""
    from feddomain.algorithms import typed_section  # late: algorithms import this module

    typed = typed_section(cfg.algorithm.model_dump(), defaults=False)
    cfg.algorithm = AlgorithmConfig.model_validate(typed)


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
