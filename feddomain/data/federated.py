"""From a config to a federation's data: dataset -> domain split -> client partition -> local
train/validation splits (+ few-shot target samples, + unlabeled target pilot sets) -> stations.

Each client's images are copied once into a contiguous tensor, so the training loop only slices
memory. Every step is seeded from the experiment seed with its own stream.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from feddomain.config import ExperimentConfig
from feddomain.data.augment import AugmentConfig, BatchAugment
from feddomain.data.cache import default_cache_dir
from feddomain.data.dataset import DomainDataset
from feddomain.data.embedded import DOMAINS as EMBEDDED_DOMAINS
from feddomain.data.partitioners import partition
from feddomain.data.partitioners.domains_per_client import check_domain_counts
from feddomain.data.partitioners.stations import assign_stations
from feddomain.data.sources import (
    get_spec,
    load_dataset,
    load_site,
    official_split_indices,
    site_classes,
)
from feddomain.data.splits import (
    DomainSplit,
    few_shot,
    holdout,
    leave_one_domain_out,
    parse_scheme,
    pilot_split,
    share_like,
)
from feddomain.data.text import load_text_dataset
from feddomain.errors import ConfigError, DataError
from feddomain.federation.data import UNLABELED, ClientData, Pixels, Transform
from feddomain.federation.topology import FEW_SHOT, INIT, PILOT_SPLIT, VAL_SPLIT, derive_seed
from feddomain.models import build_model, input_normalization, model_tokenizer
from feddomain.models.frozen import FrozenFeatures, PixelVariant
from feddomain.models.prefix import split_at

WILDS = "wilds"  # split.scheme of a WILDS dataset's official splits


@dataclass
class FederatedData:
    """Everything the runner needs about data for one (split, seed)."""

    dataset: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    split: DomainSplit
    train: list[ClientData]
    val: list[ClientData]
    client_domain_counts: np.ndarray  # [n_clients, n_domains] training samples per domain
    targets: dict[str, ClientData]  # ood test sets, one per test domain
    ood_val: dict[str, ClientData]  # held-out validation domains (schemes like "ac-p-s")
    stations: list[np.ndarray] | None = None  # client ids per station
    # unlabeled pilot set of each test domain (split.pilot_fraction > 0), labels all UNLABELED;
    # its images are not in ``targets``
    pilots: dict[str, ClientData] = field(default_factory=dict)

    @property
    def n_clients(self) -> int:
        return len(self.train)

    def to(self, device: torch.device) -> FederatedData:
        """Every split's tensors on ``device``, moved once (itself on the CPU it is on)."""
        if device.type == "cpu":
            return self

        def on(sets: dict[str, ClientData]) -> dict[str, ClientData]:
            return {d: s.to(device) for d, s in sets.items()}

        return replace(
            self,
            train=[c.to(device) for c in self.train],
            val=[c.to(device) for c in self.val],
            targets=on(self.targets),
            ood_val=on(self.ood_val),
            pilots=on(self.pilots),
        )

    def pooled(self) -> FederatedData:
        """One client holding every client's training and validation data (Central)."""
        return replace(
            self,
            train=[ClientData.concat(self.train)],
            val=[ClientData.concat(self.val)],
            client_domain_counts=self.client_domain_counts.sum(0, keepdims=True),
            stations=None,
        )


def federations(cfg: ExperimentConfig) -> list[FederatedData]:
    """The federation of every split a config asks for (one per target under
    leave-one-domain-out; one for a sites federation, whose folders are given in the config)."""
    if cfg.partition.name == "sites":
        if not cfg.partition.sites or not cfg.split.target_root:
            raise ConfigError(
                "partition 'sites' run on one machine needs partition.sites (one folder per "
                "client) and split.target_root (the target set); on Flower each SuperNode names "
                "its own with site-root / target-root"
            )
        return [build_site_data(cfg, list(cfg.partition.sites), cfg.split.target_root)]
    dataset = load_experiment_dataset(cfg)
    return [build_federated_data(cfg, dataset, s) for s in experiment_splits(cfg, dataset)]


def fill_feature_cache(cfg: ExperimentConfig) -> None:
    """Compute (or find) what a run of ``cfg`` reads from the feature cache (the frozen
    backbone's features, or the frozen prefix's maps), so that parallel runs of one sweep read
    one file instead of each computing it at once."""
    cached_prefix = cfg.model.frozen_prefix is not None and cfg.model.prefix_cache
    if cfg.partition.name == "sites" or not (cfg.model.frozen or cached_prefix):
        return
    _model_inputs(cfg, load_experiment_dataset(cfg))  # reads or writes the cache entry


def check_data_config(cfg: ExperimentConfig) -> None:
    """The config's dataset name, targets, split scheme and partition counts, checked against
    the dataset's declared domains without reading any data (a folder dataset's domains are
    known only once scanned: its checks wait for the data)."""
    try:
        spec = get_spec(cfg.dataset.name)
    except DataError:  # named by load_dataset, before it reads anything; code may build its own
        return
    _check_kind(cfg, spec.name, spec.kind)
    # the embedded digits' domains are known; a plug-in's generated source declares its own
    domains = EMBEDDED_DOMAINS if spec.name == "digits_embedded" else spec.domains
    if domains is None or cfg.partition.name == "sites":
        return
    scheme = cfg.split.scheme
    if scheme != "lodo":
        split = parse_scheme(scheme, domains)
    elif cfg.split.targets:
        unknown = [t for t in cfg.split.targets if t not in domains]
        if unknown:
            near = difflib.get_close_matches(unknown[0], domains, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"split.targets {unknown} are not domains of {spec.name}{hint} "
                f"(domains: {', '.join(domains)})"
            )
        split = leave_one_domain_out(domains)[domains.index(cfg.split.targets[0])]
    else:
        split = leave_one_domain_out(domains)[0]
    if cfg.partition.name == "domains_per_client":
        check_domain_counts(cfg.partition.n_clients, cfg.partition.d, len(split.train))


def _check_kind(cfg: ExperimentConfig, name: str, kind: str) -> None:
    """The WILDS scheme goes with WILDS datasets only (and they with it); text datasets are not
    (yet) loaded from per-site folders."""
    if (cfg.split.scheme == WILDS) != (kind == "wilds"):
        raise ConfigError(
            f"invalid configuration: 'split.scheme' = {cfg.split.scheme!r} with dataset {name!r}: "
            "WILDS datasets (IWildCam) use their official splits, `split.scheme: wilds`, and "
            "only they have them"
        )
    if kind == "text" and cfg.partition.name == "sites":
        raise ConfigError(
            f"invalid configuration: 'partition.name' = 'sites' with the text dataset {name!r}: "
            "site folders hold images only"
        )


def load_experiment_dataset(cfg: ExperimentConfig) -> DomainDataset:
    d = cfg.dataset
    root = Path(d.root).expanduser() if d.root else None
    cache = Path(d.cache_dir).expanduser() if d.cache_dir else None
    if get_spec(d.name).is_text:
        tokenizer = model_tokenizer(cfg.model.name, cfg.model.options)
        return load_text_dataset(d.name, root, tokenizer, d.max_length, cache)
    return load_dataset(d.name, root, d.resolution, cache, skip_corrupt=d.skip_corrupt)


def experiment_splits(cfg: ExperimentConfig, dataset: DomainDataset) -> list[DomainSplit]:
    """The domain splits a config asks for: one per target under leave-one-domain-out."""
    scheme = cfg.split.scheme
    if scheme == WILDS:
        return [wilds_split(dataset)]
    if scheme == "lodo":
        splits = leave_one_domain_out(dataset.domains)
        if cfg.split.targets is None:
            return splits
        unknown = sorted(set(cfg.split.targets) - set(dataset.domains))
        if unknown:
            raise ConfigError(
                f"split.targets {unknown} are not domains of {dataset.name}: "
                f"{list(dataset.domains)}"
            )
        return [s for s in splits if s.test[0] in cfg.split.targets]
    return [parse_scheme(scheme, dataset.domains)]


def build_federated_data(
    cfg: ExperimentConfig, dataset: DomainDataset, split: DomainSplit
) -> FederatedData:
    inputs, train_tf, eval_tf = _model_inputs(cfg, dataset)
    train_parts, val_parts = client_indices(cfg, dataset, split)
    target_sets, ood_val_sets = _held_out(cfg, dataset, split)
    if cfg.split.few_shot:
        train_parts = _add_few_shot(cfg, dataset, train_parts, target_sets)
    target_sets, pilot_sets = _set_pilots_aside(cfg, target_sets)

    def subset(idx: np.ndarray, transform: Transform | None) -> ClientData:
        return _subset(inputs, dataset.labels, idx, transform)

    def client_train(idx: np.ndarray) -> ClientData:
        return replace(subset(idx, train_tf), pixels=_source_pixels(cfg, dataset, idx))

    n_domains = len(dataset.domains)
    counts = np.stack(
        [np.bincount(dataset.domain_ids.numpy()[p], minlength=n_domains) for p in train_parts]
    )
    return FederatedData(
        dataset=dataset.name,
        domains=dataset.domains,
        classes=dataset.classes,
        split=split,
        train=[client_train(p) for p in train_parts],
        val=[subset(p, eval_tf) for p in val_parts],
        client_domain_counts=counts,
        targets={d: subset(i, eval_tf) for d, i in target_sets.items()},
        ood_val={d: subset(i, eval_tf) for d, i in ood_val_sets.items()},
        stations=_stations(cfg, len(train_parts)),
        pilots={d: _unlabeled(inputs, i, eval_tf) for d, i in pilot_sets.items()},
    )


def federation_classes(cfg: ExperimentConfig, roots: list[str]) -> tuple[str, ...]:
    """The label order of a sites federation: ``dataset.classes``, else the dataset's preset
    classes (PACS, ...), else the class folders found in ``roots``."""
    if cfg.dataset.classes:
        return tuple(cfg.dataset.classes)
    preset = get_spec(cfg.dataset.name).classes
    return preset if preset is not None else site_classes(roots)


def build_site_data(
    cfg: ExperimentConfig, sites: list[str | None], target_root: str | None
) -> FederatedData:
    """A federation whose clients are sites with their own folders (partition ``sites``).

    ``sites[cid]`` is client ``cid``'s folder, or None where that client's data is elsewhere (on a
    SuperNode, only its own client's folder is here); such a client gets no samples. Each site
    holds out ``split.val_fraction`` of its images with the seed the partitioned path uses, so a
    site's data is the same wherever it is built.
    """
    if len(sites) != cfg.partition.n_clients:
        raise ConfigError(
            f"partition 'sites' has n_clients={cfg.partition.n_clients} but {len(sites)} site "
            "folder(s) are given"
        )
    present = [s for s in sites if s is not None]
    classes = federation_classes(cfg, [*present, *([target_root] if target_root else [])])
    loaded = [None if s is None else _load_site(cfg, s, classes) for s in sites]
    test = tuple(cfg.split.targets or ())
    train_domains = sorted({d for ds in loaded if ds is not None for d in ds.domains})
    seen = sorted(set(test) & set(train_domains))
    if seen:
        raise ConfigError(
            f"split.targets {seen} must be unseen, but site folders hold them: remove them from "
            "the sites or choose other targets"
        )
    domains = tuple(sorted({*train_domains, *test}))
    parts: dict[int, tuple[ClientData, ClientData]] = {}
    counts = np.zeros((len(sites), len(domains)), dtype=np.int64)
    for cid, site in enumerate(loaded):
        if site is None:
            continue
        inputs, train_tf, eval_tf = _model_inputs(cfg, site)
        tr, va = holdout(
            np.arange(len(site)), cfg.split.val_fraction, seed=derive_seed(cfg.seed, VAL_SPLIT, cid)
        )
        parts[cid] = (
            _subset(inputs, site.labels, tr, train_tf),
            _subset(inputs, site.labels, va, eval_tf),
        )
        for d, name in enumerate(site.domains):
            counts[cid, domains.index(name)] = int((site.domain_ids[tr] == d).sum())
    if not parts:
        raise ConfigError("partition 'sites' needs at least one site folder (partition.sites)")
    like = next(iter(parts.values()))[0].inputs
    empty = ClientData(like.new_empty((0, *like.shape[1:])), torch.empty(0, dtype=torch.int64))
    train = [parts[cid][0] if cid in parts else empty for cid in range(len(sites))]
    val = [parts[cid][1] if cid in parts else empty for cid in range(len(sites))]
    targets, pilots = _site_targets(cfg, target_root, classes) if target_root else ({}, {})
    return FederatedData(
        dataset=cfg.dataset.name,
        domains=domains,
        classes=classes,
        split=DomainSplit(tuple(train_domains), (), test),
        train=train,
        val=val,
        client_domain_counts=counts,
        targets=targets,
        ood_val={},
        stations=_stations(cfg, len(sites)),
        pilots=pilots,
    )


def _site_targets(
    cfg: ExperimentConfig, root: str, classes: tuple[str, ...]
) -> tuple[dict[str, ClientData], dict[str, ClientData]]:
    """The ``split.targets`` domains of a target-set folder: one evaluation set each, and their
    unlabeled pilot sets (none unless ``split.pilot_fraction``)."""
    target = _load_site(cfg, root, classes)
    test = list(cfg.split.targets or ())
    missing = sorted(set(test) - set(target.domains))
    if missing:
        raise DataError(
            f"the target set {root} has no domain folder(s) {missing} (split.targets); it "
            f"holds {list(target.domains)}"
        )
    inputs, _, eval_tf = _model_inputs(cfg, target)
    evaluated, pilots = _set_pilots_aside(cfg, {d: target.indices_of(d) for d in test})
    return (
        {d: _subset(inputs, target.labels, i, eval_tf) for d, i in evaluated.items()},
        {d: _unlabeled(inputs, i, eval_tf) for d, i in pilots.items()},
    )


def _load_site(cfg: ExperimentConfig, root: str, classes: tuple[str, ...]) -> DomainDataset:
    d = cfg.dataset
    cache = Path(d.cache_dir).expanduser() if d.cache_dir else None
    return load_site(
        Path(root).expanduser(), classes, d.resolution, cache, skip_corrupt=d.skip_corrupt
    )


def _source_pixels(cfg: ExperimentConfig, dataset: DomainDataset, idx: np.ndarray) -> Pixels | None:
    """Where a client's cached inputs came from: its images and the prefix's maps (cached
    frozen-prefix mode) or backbone's features (frozen-backbone mode) of changed ones; None
    where the inputs are the images themselves, or token ids."""
    n_classes = len(dataset.classes)
    if cfg.model.frozen and not dataset.is_text:
        maps = partial(backbone_features, cfg, n_classes=n_classes, cached=True)
    elif cfg.model.frozen_prefix is not None and cfg.model.prefix_cache:
        maps = partial(prefix_features, cfg, n_classes=n_classes)
    else:
        return None
    return Pixels(dataset.images, torch.from_numpy(np.asarray(idx, dtype=np.int64)), maps)


def _subset(
    inputs: torch.Tensor, labels: torch.Tensor, idx: np.ndarray, transform: Transform | None
) -> ClientData:
    index = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    return ClientData(inputs[index].contiguous(), labels[index].clone(), transform)


def _set_pilots_aside(
    cfg: ExperimentConfig, target_sets: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(evaluated, pilot) indices of every target domain; no pilot sets at pilot_fraction 0.
    One seed for the run, keyed by domain name inside, so all methods and nodes draw alike."""
    fraction = cfg.split.pilot_fraction
    if not fraction:
        return target_sets, {}
    seed = derive_seed(cfg.seed, PILOT_SPLIT)
    pairs = {d: pilot_split(i, fraction, d, seed=seed) for d, i in target_sets.items()}
    return {d: ev for d, (ev, _) in pairs.items()}, {d: p for d, (_, p) in pairs.items()}


def _unlabeled(inputs: torch.Tensor, idx: np.ndarray, transform: Transform | None) -> ClientData:
    """Images of a pilot set without their labels: these are never copied, so no task can read
    them (every label is UNLABELED)."""
    index = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    labels = torch.full((len(index),), UNLABELED, dtype=torch.int64)
    return ClientData(inputs[index].contiguous(), labels, transform)


def _stations(cfg: ExperimentConfig, n_clients: int) -> list[np.ndarray] | None:
    if not cfg.topology.stations:
        return None
    if cfg.topology.stations > n_clients:
        raise ConfigError(
            f"topology.stations={cfg.topology.stations} exceeds partition.n_clients={n_clients}"
        )
    return assign_stations(
        n_clients, cfg.topology.stations, cfg.topology.station_assignment, seed=cfg.seed
    )


def _model_inputs(
    cfg: ExperimentConfig, dataset: DomainDataset
) -> tuple[torch.Tensor, Transform | None, Transform | None]:
    """What clients feed the model: uint8 images with train/eval transforms, or, in frozen-backbone
    mode, the backbone's cached float features of every image (no transform)."""
    augment = AugmentConfig(**cfg.train.augment.model_dump())
    if dataset.is_text and not cfg.model.frozen:
        return dataset.images, None, None  # token ids go to the model as they are
    if not cfg.model.frozen and cfg.model.frozen_prefix is None:
        return (
            dataset.images,
            BatchAugment(augment, cfg.train.mean, cfg.train.std),
            BatchAugment(AugmentConfig(), cfg.train.mean, cfg.train.std),
        )
    if augment != AugmentConfig(crop_ratio=augment.crop_ratio):
        mode = (
            "frozen-backbone mode (model.frozen: true)"
            if cfg.model.frozen
            else "frozen-prefix mode (model.frozen_prefix)"
        )
        raise ConfigError(
            f"train.augment cannot apply in {mode}: its output is computed once from the "
            "un-augmented images; turn augmentation off"
        )
    if cfg.model.frozen:
        return frozen_features(cfg, dataset), None, None
    if cfg.model.prefix_cache:
        return prefix_features(cfg, dataset.images, len(dataset.classes)), None, None
    prefix = frozen_prefix(cfg, len(dataset.classes))
    recompute = PrefixTransform(prefix, *backbone_normalization(cfg))
    return dataset.images, recompute, recompute


def frozen_features(cfg: ExperimentConfig, dataset: DomainDataset) -> torch.Tensor:
    """Backbone features [N, F] of every image, computed once and cached on disk."""
    return backbone_features(cfg, dataset.images, len(dataset.classes), cached=True)


def backbone_normalization(
    cfg: ExperimentConfig,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The input normalisation a frozen backbone (or prefix) sees: its pretrained weights', else
    the config's ``train.mean``/``train.std``, else none."""
    return input_normalization(cfg.model.name) or (
        tuple(cfg.train.mean or (0.0,) * 3),
        tuple(cfg.train.std or (1.0,) * 3),
    )


def _feature_cache(cfg: ExperimentConfig) -> Path:
    cache = Path(cfg.dataset.cache_dir) if cfg.dataset.cache_dir else default_cache_dir()
    return cache.expanduser() / "features"


def _initialised_model(cfg: ExperimentConfig, n_classes: int) -> torch.nn.Module:
    """The configured model with the run's seeded initialisation (what the runner builds)."""
    m = cfg.model
    torch.manual_seed(derive_seed(cfg.seed, INIT))
    return build_model(m.name, n_classes, resolution=cfg.dataset.resolution, **m.options)


def backbone_features(
    cfg: ExperimentConfig,
    images: torch.Tensor,
    n_classes: int,
    *,
    cached: bool,
    variant: PixelVariant | None = None,
) -> torch.Tensor:
    """The configured frozen backbone's features of uint8 ``images`` (optionally changed by a
    deterministic ``variant`` first; ``cached``: read from, or written to, the feature cache);
    the same backbone, weights and normalisation for a run's data and for images seen later
    (`feddomain adapt`)."""
    mean, std = backbone_normalization(cfg)
    return FrozenFeatures.compute(
        _initialised_model(cfg, n_classes),
        images,
        batch_size=cfg.eval.batch_size,
        mean=mean,
        std=std,
        resolution=cfg.model.backbone_resolution,
        cache_dir=_feature_cache(cfg) if cached else None,
        variant=variant,
    )


def frozen_prefix(cfg: ExperimentConfig, n_classes: int) -> torch.nn.Module:
    """The frozen prefix of the configured model (``model.frozen_prefix``), in eval mode."""
    return split_at(_initialised_model(cfg, n_classes), cfg.model.frozen_prefix)[0]


def prefix_features(
    cfg: ExperimentConfig,
    images: torch.Tensor,
    n_classes: int,
    variant: PixelVariant | None = None,
) -> torch.Tensor:
    """The frozen prefix's output maps [N, C, h, w] of uint8 ``images`` (optionally changed by a
    deterministic ``variant`` first), computed once and cached (memory-mapped) per variant."""
    mean, std = backbone_normalization(cfg)
    return FrozenFeatures.compute(
        frozen_prefix(cfg, n_classes),
        images,
        batch_size=cfg.eval.batch_size,
        mean=mean,
        std=std,
        cache_dir=_feature_cache(cfg),
        variant=variant,
        flatten=False,
    )


class PrefixTransform:
    """``model.prefix_cache: false``: a batch of uint8 images through the frozen prefix, on every
    batch (normalised as for the cache; eval mode, no gradient)."""

    def __init__(
        self, prefix: torch.nn.Module, mean: tuple[float, ...], std: tuple[float, ...]
    ) -> None:
        self.prefix = prefix
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def __call__(self, images_u8: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        del generator  # nothing random: that is what makes the prefix cacheable
        device = images_u8.device
        self.prefix.to(device)
        x = images_u8.float().div_(255.0)
        with torch.no_grad():
            return self.prefix((x - self.mean.to(device)) / self.std.to(device))


def client_indices(
    cfg: ExperimentConfig, dataset: DomainDataset, split: DomainSplit
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Partition the source domains over clients, then hold out each client's validation part."""
    p, seed = cfg.partition, cfg.seed
    params = {
        "domains_per_client": {"d": p.d},
        "lambda": {"lam": p.lam},
        "dirichlet": {"alpha": p.alpha},
    }
    if cfg.split.scheme == WILDS:
        return _wilds_indices(cfg, dataset, split, params[p.name])
    if cfg.split.official_lists:
        # Official lists fix train vs validation per domain; both are partitioned with the same
        # seeded plan, so each client's validation share comes from its own domain parts.
        root = Path(cfg.dataset.root).expanduser() if cfg.dataset.root else None
        tr = [official_split_indices(dataset, root, d, "train") for d in split.train]
        va = [official_split_indices(dataset, root, d, "crossval") for d in split.train]
        train = partition(p.name, tr, p.n_clients, seed=seed, **params[p.name])
        val = partition(p.name, va, p.n_clients, seed=seed, **params[p.name])
        return train, val
    groups = [dataset.indices_of(d) for d in split.train]
    parts = partition(p.name, groups, p.n_clients, seed=seed, **params[p.name])
    pairs = [
        holdout(part, cfg.split.val_fraction, seed=derive_seed(seed, VAL_SPLIT, cid))
        for cid, part in enumerate(parts)
    ]
    return [tr for tr, _ in pairs], [va for _, va in pairs]


def wilds_split(dataset: DomainDataset) -> DomainSplit:
    """WILDS' official roles: the locations with ``train`` images are the sources; the pooled
    ``val`` and ``test`` sets are held out (as WILDS scores them: over all their images)."""
    if not dataset.official_splits:
        raise ConfigError(
            f"split.scheme 'wilds' needs a WILDS dataset with official splits; {dataset.name} "
            "has none"
        )
    splits = np.asarray(dataset.official_splits)
    used = np.unique(dataset.domain_ids.numpy()[splits == "train"])
    return DomainSplit(
        train=tuple(dataset.domains[d] for d in used), val=("val",), test=("test",), label=WILDS
    )


def _held_out(
    cfg: ExperimentConfig, dataset: DomainDataset, split: DomainSplit
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Indices of the (test, validation) sets held out from training: one per target and
    validation domain, or WILDS' pooled official ``test`` and ``val`` sets."""
    if cfg.split.scheme == WILDS:
        splits = np.asarray(dataset.official_splits)
        return (
            {"test": np.flatnonzero(splits == "test")},
            {"val": np.flatnonzero(splits == "val")},
        )
    return (
        {d: dataset.indices_of(d) for d in split.test},
        {d: dataset.indices_of(d) for d in split.val},
    )


def _wilds_indices(
    cfg: ExperimentConfig, dataset: DomainDataset, split: DomainSplit, params: dict[str, float]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """WILDS: each source location's ``train`` images are partitioned over clients (at lambda
    = 0 with as many clients as locations, one location each); its ``id_val`` images follow
    each client's share of that location (``share_like``); ``id_test`` is not used."""
    p = cfg.partition
    splits, domain_ids = np.asarray(dataset.official_splits), dataset.domain_ids.numpy()
    sources = [dataset.domain_index(d) for d in split.train]
    train_groups = [np.flatnonzero((domain_ids == d) & (splits == "train")) for d in sources]
    val_groups = [np.flatnonzero((domain_ids == d) & (splits == "id_val")) for d in sources]
    train = partition(p.name, train_groups, p.n_clients, seed=cfg.seed, **params)
    group_of = np.full(len(dataset), -1, dtype=np.int64)
    for j, group in enumerate(train_groups):
        group_of[group] = j
    val = share_like(val_groups, train, group_of, seed=derive_seed(cfg.seed, VAL_SPLIT))
    return train, val


def _add_few_shot(
    cfg: ExperimentConfig,
    dataset: DomainDataset,
    train_parts: list[np.ndarray],
    target_sets: dict[str, np.ndarray],
) -> list[np.ndarray]:
    """Give each client k labelled target samples and remove them from the ood sets (in place)."""
    labels = dataset.labels.numpy()
    out = [np.asarray(p) for p in train_parts]
    for j, (domain, idx) in enumerate(target_sets.items()):
        shots, remaining = few_shot(
            idx,
            labels[idx],
            cfg.split.few_shot,
            len(out),
            seed=derive_seed(cfg.seed, FEW_SHOT, j),
            per_class=cfg.split.few_shot_per_class,
        )
        out = [np.concatenate([p, s]) for p, s in zip(out, shots, strict=True)]
        target_sets[domain] = remaining
    return out
