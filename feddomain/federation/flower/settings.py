"""What a Flower run is told from outside: the App's run config (``[tool.flwr.app.config]`` in
``pyproject.toml``, overridden with ``flwr run --run-config``) and each SuperNode's node config
(``flower-supernode --node-config``)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import feddomain
from feddomain.config import ExperimentConfig, apply_override, load_config, validate_config
from feddomain.errors import ConfigError

# The App's directory: the folder holding pyproject.toml (and configs/) in a clone, and the
# unpacked bundle (FAB) when Flower runs the App.
APP_DIR = Path(feddomain.__file__).resolve().parents[1]

PARTITION_ID = "partition-id"  # node config: which client of the partition this node holds
DATA_ROOT = "data-root"  # node config: the node's own copy of the dataset (dataset.root)
CACHE_DIR = "cache-dir"  # node config: the node's decode cache (dataset.cache_dir)
SITE_ROOT = "site-root"  # node config, partition `sites`: this node's own data folder
TARGET_ROOT = "target-root"  # node config, partition `sites`: this node's copy of the target set


@dataclass(frozen=True)
class FlowerSettings:
    """The ServerApp's run config, validated."""

    config: Path | None  # feddomain experiment YAML, the same file `feddomain run` takes
    overrides: tuple[str, ...]  # dotted overrides, as after `feddomain run CONFIG`
    out: Path  # run directory, written on the machine running the ServerApp
    config_yaml: str = ""  # or the config itself, inline (needs no file where the ServerApp runs)
    min_replies: int = 1  # a round may close without the missing replies once this many arrived
    round_timeout: float = 600.0  # ...and this many seconds have passed since it was sent
    node_timeout: float = 300.0  # how long to wait for the SuperNodes holding the clients
    poll_interval: float = 0.05  # seconds between pulls of replies from the SuperLink
    resume: bool = False  # continue the run in `out` from its checkpoint (its own config)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FlowerSettings:
        known = {
            "config",
            "config-yaml",
            "overrides",
            "out",
            "min-replies",
            "round-timeout",
            "node-timeout",
            "poll-interval",
            "resume",
            "state-dir",  # read by the nodes (node_state.py), not here
        }
        unknown = sorted(set(run_config) - known)
        if unknown:
            raise ConfigError(f"unknown run config keys {unknown}; known: {sorted(known)}")
        inline = str(run_config.get("config-yaml", ""))
        resume = bool(run_config.get("resume", False))
        if not (inline or run_config.get("config") or resume) or not run_config.get("out"):
            raise ConfigError(
                "the run config needs 'config' (a feddomain YAML) or 'config-yaml', and 'out'"
            )
        named = not inline and run_config.get("config") and not resume
        settings = cls(
            config=resolve_config_path(str(run_config["config"])) if named else None,
            config_yaml=inline,
            overrides=tuple(shlex.split(str(run_config.get("overrides", "")))),
            out=Path(str(run_config["out"])).expanduser(),
            min_replies=int(run_config.get("min-replies", 1)),
            round_timeout=float(run_config.get("round-timeout", 600.0)),
            node_timeout=float(run_config.get("node-timeout", 300.0)),
            poll_interval=float(run_config.get("poll-interval", 0.05)),
            resume=resume,
        )
        if settings.min_replies < 1:
            raise ConfigError(f"run config 'min-replies' must be >= 1, got {settings.min_replies}")
        for key, value in (
            ("round-timeout", settings.round_timeout),
            ("node-timeout", settings.node_timeout),
            ("poll-interval", settings.poll_interval),
        ):
            if value <= 0:
                raise ConfigError(f"run config {key!r} must be positive, got {value}")
        return settings

    def experiment(self) -> ExperimentConfig:
        """The experiment config: the inline YAML or the file, with the overrides applied."""
        if not self.config_yaml:
            return load_config(self.config, list(self.overrides))
        try:
            raw = yaml.safe_load(self.config_yaml) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"run config 'config-yaml' is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError("run config 'config-yaml' must hold a mapping of keys")
        for item in self.overrides:
            apply_override(raw, item)
        return validate_config(raw, source="run config 'config-yaml'")


def resolve_config_path(text: str) -> Path:
    """An absolute path as given; a relative one inside the App's directory (it travels in the
    App bundle), else relative to the working directory."""
    path = Path(text).expanduser()
    candidates = [path] if path.is_absolute() else [APP_DIR / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"run config 'config': no file {text!r} (looked at {tried})")


def node_partition(node_config: Mapping[str, Any], n_clients: int) -> int:
    """The client this SuperNode holds; Flower's simulation engine sets ``partition-id``
    itself, a deployed SuperNode gets it from ``--node-config``."""
    if PARTITION_ID not in node_config:
        raise ConfigError(
            "this SuperNode has no 'partition-id' in its node config; start it with "
            "--node-config 'partition-id=N' (N = 0 .. partition.n_clients-1)"
        )
    value = node_config[PARTITION_ID]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"node config 'partition-id' must be an integer >= 0, got {value!r}")
    if value >= n_clients:
        raise ConfigError(
            f"node config 'partition-id'={value} but the config has {n_clients} client(s) "
            f"(partition.n_clients); valid ids are 0..{n_clients - 1}"
        )
    return value


def node_overrides(node_config: Mapping[str, Any]) -> dict[str, Any]:
    """Dataset paths that are the node's own business (where its copy of the data lives)."""
    out: dict[str, Any] = {}
    if DATA_ROOT in node_config:
        out["root"] = str(node_config[DATA_ROOT])
    if CACHE_DIR in node_config:
        out["cache_dir"] = str(node_config[CACHE_DIR])
    return out


@dataclass(frozen=True)
class NodeSite:
    """Where a SuperNode of a sites federation (partition ``sites``) keeps its data."""

    node_config: Mapping[str, Any]

    @property
    def root(self) -> str | None:
        value = self.node_config.get(SITE_ROOT)
        return None if value is None else str(value)

    @property
    def target_root(self) -> str | None:
        value = self.node_config.get(TARGET_ROOT)
        return None if value is None else str(value)

    @property
    def key(self) -> list[Any]:
        """What the node's data depends on. Without a ``site-root`` every client's folder comes
        from the config, so one runner serves all the virtual nodes a worker hosts."""
        holder = self.node_config.get(PARTITION_ID) if self.root else None
        return [holder, self.root, self.target_root]

    def folders(self, cfg: ExperimentConfig) -> list[str | None]:
        """Each client's folder as far as this node knows it: its own ``site-root`` only, or,
        when it has none (virtual nodes of the simulation engine), ``partition.sites``."""
        n = cfg.partition.n_clients
        if self.root is None:
            if not cfg.partition.sites:
                raise ConfigError(
                    "this SuperNode has no site folder: start it with --node-config "
                    "'partition-id=N site-root=\"/path/to/its/data\"' (and target-root for "
                    "the target set), or list partition.sites in the config"
                )
            return list(cfg.partition.sites)
        folders: list[str | None] = [None] * n
        folders[node_partition(self.node_config, n)] = self.root
        return folders

    def targets(self, cfg: ExperimentConfig) -> str | None:
        return self.target_root or cfg.split.target_root
