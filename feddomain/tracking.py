"""Experiment tracking: a run's config, rounds and summary sent to TensorBoard and MLflow.

The runner calls one ``RunTracker`` per run (``open_tracker``): ``log_round`` with every round's
record as it is written to ``rounds.jsonl`` (evaluated rounds carry their accuracies, ECE and
losses too), ``log_summary`` with ``summary.json``, and ``close``. Values go through the
libraries' own writers (``torch.utils.tensorboard.SummaryWriter``, ``mlflow.MlflowClient``), which
are imported only when a backend is configured (MLflow alone takes seconds to import).

Tracking is a copy for watching runs, never the record: a backend that fails (an unreachable
server, a full disk) warns once, naming itself, and is dropped for the rest of the run; the run
and its own files go on unaffected. A sweep's or a tuning study's runs are tracked each as its
own run, under the name the caller gives (``open_tracker(cfg, name, run_dir)``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from feddomain.config import ExperimentConfig

log = logging.getLogger("feddomain")

EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # backend -> module it needs
# record fields too large or too fine-grained for a tracker (per-client lists, histograms)
SKIPPED = frozenset(
    {"per_client", "calibration", "reliability", "confidence_hist", "client_domain_counts",
     "rejected_updates", "server_state", "client_ood_acc"}
)  # fmt: skip
Flat = dict[str, float]
PROBE_TIMEOUT_S = 5.0  # how long a tracking server may take to answer before it is dropped


def missing_package(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its package is not installed), or None; a lookup, not
    an import."""
    module = EXTRAS[backend]
    if importlib.util.find_spec(module) is None:
        return f"needs the {module} package: pip install 'feddomain[{backend}]'"
    return None


def flat_metrics(record: Mapping[str, Any], prefix: str = "") -> Flat:
    """Every finite number in a (nested) record, keyed by its path joined with ``/``
    (``ledger/up/model``, ``time/train``, ``per_domain/sketch/acc``); lists, strings and the
    per-client and histogram fields are left out."""
    out: Flat = {}
    for key, value in record.items():
        if key in SKIPPED:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_metrics(value, f"{name}/"))
        elif _is_number(value) and math.isfinite(value):
            out[name] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The resolved config as dotted keys (``train.lr``) with scalar values; lists and nulls
    as their YAML text."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
    return {k: (v.strip() if isinstance(v, str) else v) for k, v in out.items()}


class Backend:
    """One tracking destination for one run."""

    name = "backend"

    def log_round(self, rnd: int, metrics: Flat) -> None:
        raise NotImplementedError

    def log_summary(self, step: int, metrics: Flat) -> None:
        raise NotImplementedError

    def close(self, status: str) -> None:
        raise NotImplementedError


class TensorBoardBackend(Backend):
    """Event files in ``<dir>/<run name>``: every metric a scalar over rounds, the config as
    the run's hyper-parameters (TensorBoard's HParams tab) and as text."""

    name = "tensorboard"

    def __init__(self, folder: Path, params: dict[str, Any], config_text: str) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(folder))
        # the hparams summaries written into this run's own event file (SummaryWriter's
        # add_hparams would open a second run beside it)
        experiment, start, end = hparams(
            params,
            {f"summary/{k}": 0.0 for k in ("ood_acc", "id_acc", "ood_ece")},
        )
        for summary in (experiment, start, end):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", f"```yaml\n{config_text}```")

    def log_round(self, rnd: int, metrics: Flat) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, rnd)
        self.writer.flush()

    def log_summary(self, step: int, metrics: Flat) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"summary/{key}", value, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class MlflowBackend(Backend):
    """One MLflow run per feddomain run: the config as parameters, every metric per round
    (step = round), the summary as ``summary/...`` metrics and ``config.yaml``/``summary.json``
    as artifacts. A resumed run continues the unfinished MLflow run of its directory."""

    name = "mlflow"
    RUN_DIR_TAG = "feddomain.run_dir"

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str,
        run_dir: Path,
        params: dict[str, Any],
    ) -> None:
        from mlflow import MlflowClient

        _check_reachable(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""))
        self.client = MlflowClient(tracking_uri)
        self.run_dir = run_dir
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self._unfinished(exp_id) or self._create(exp_id, run_name, params)

    def _unfinished(self, exp_id: str) -> str | None:
        """The MLflow run an earlier session of this run directory left unfinished."""
        path = str(self.run_dir.resolve()).replace("'", "\\'")
        runs = self.client.search_runs(
            [exp_id], f"tags.`{self.RUN_DIR_TAG}` = '{path}' and attributes.status != 'FINISHED'"
        )
        if not runs:
            return None
        self.client.update_run(runs[0].info.run_id, status="RUNNING")
        return runs[0].info.run_id

    def _create(self, exp_id: str, run_name: str, params: dict[str, Any]) -> str:
        from mlflow.entities import Param

        tags = {self.RUN_DIR_TAG: str(self.run_dir.resolve())}
        run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(run_id, params=items[i : i + 100])
        self.client.log_artifact(run_id, str(self.run_dir / "config.yaml"))
        return run_id

    def _metrics(self, metrics: Flat, step: int, prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_mlflow_key(prefix + k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_round(self, rnd: int, metrics: Flat) -> None:
        self._metrics(metrics, rnd)

    def log_summary(self, step: int, metrics: Flat) -> None:
        self._metrics(metrics, step, prefix="summary/")
        self.client.log_artifact(self.run_id, str(self.run_dir / "summary.json"))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _check_reachable(uri: str) -> None:
    """Fail fast on a tracking server that does not answer: MLflow's client retries a refused
    connection with back-off for minutes before it gives up, which would hold the run's start.
    Any HTTP answer (even an error status) counts as reachable."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return
    except OSError as err:  # URLError, a timeout, a refused connection
        reason = getattr(err, "reason", err)
        waited = f"{PROBE_TIMEOUT_S:.0f} s"
        raise ConnectionError(f"no answer from {uri} in {waited} ({reason})") from None


def _mlflow_key(key: str) -> str:
    """MLflow's allowed characters: letters, digits, ``_-. :/``; anything else becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)


class RunTracker:
    """The callbacks a runner calls for one run; each backend's failure is caught, warned about
    once and ends that backend only."""

    def __init__(self, run_dir: Path, openers: list[tuple[str, Callable[[], Backend]]]) -> None:
        self.run_dir = run_dir
        self.backends: list[Backend] = []
        for name, opener in openers:
            backend = self._guard(name, "start", opener)
            if backend is not _FAILED:
                self.backends.append(backend)

    def log_round(self, record: Mapping[str, Any]) -> None:
        """One round's record (``rounds.jsonl``; evaluated rounds with their scores)."""
        metrics = flat_metrics(record)
        metrics.pop("round", None)
        losses = record.get("client_loss") or {}
        if losses:  # the round's mean training loss over its clients
            metrics["train_loss"] = sum(losses.values()) / len(losses)
        self._each("log round", lambda b: b.log_round(int(record["round"]), metrics))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (``summary.json``), at its selected round."""
        metrics = flat_metrics(summary)
        step = int(summary.get("selected_round") or summary.get("rounds") or 0)
        self._each("log the summary", lambda b: b.log_summary(step, metrics))

    def close(self, status: str = "FINISHED") -> None:
        """End every backend's run: ``FINISHED``, ``FAILED`` or ``KILLED`` (interrupted)."""
        self._each("close", lambda b: b.close(status))
        self.backends = []

    def _each(self, what: str, call: Callable[[Backend], None]) -> None:
        for backend in list(self.backends):
            if self._guard(backend.name, what, lambda b=backend: call(b)) is _FAILED:
                self.backends.remove(backend)

    def _guard(self, name: str, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as err:  # tracking is a copy: nothing it does may stop the run
            log.warning(
                "tracking: %s failed to %s (%s: %s); the run goes on without %s, and its own "
                "files in %s are unaffected",
                name,
                what,
                type(err).__name__,
                _first_line(err),
                name,
                self.run_dir,
            )
            return _FAILED


_FAILED = object()


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def resolved_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """``cfg.to_dict()`` with the method's hyper-parameters complete (defaults included), as
    the run uses them."""
    from feddomain.algorithms import resolve_method

    raw = cfg.to_dict()
    method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
    algorithm = {**raw["algorithm"], **method.hp.model_dump(mode="json")}
    if method.client_spec is not method.spec:
        given = algorithm["client"] if isinstance(algorithm["client"], dict) else {}
        algorithm["client"] = {
            **given,
            "name": method.client_spec.name,
            **method.client_hp.model_dump(mode="json"),
        }
    return {**raw, "algorithm": algorithm}


def open_tracker(cfg: ExperimentConfig, run_name: str, run_dir: Path) -> RunTracker:
    """The tracker of one run of ``cfg`` (no backend when ``cfg.tracking`` names none)."""
    t = cfg.tracking
    openers: list[tuple[str, Callable[[], Backend]]] = []
    if t.tensorboard is None and t.mlflow is None:
        return RunTracker(run_dir, openers)
    params = flat_params(resolved_config(cfg))
    if t.tensorboard is not None:
        folder = Path(t.tensorboard).expanduser() / run_name
        text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        openers.append(("tensorboard", lambda: TensorBoardBackend(folder, params, text)))
    if t.mlflow is not None:
        m = t.mlflow
        experiment = m.experiment or cfg.name
        openers.append(
            (
                "mlflow",
                lambda: MlflowBackend(m.tracking_uri, experiment, run_name, run_dir, params),
            )
        )
    return RunTracker(run_dir, openers)

