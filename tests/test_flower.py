"""Flower deployment: every registered method as a Flower App, equal to the in-process simulator.

Loopback tests drive the real ServerApp code (``run_deployment``) and the real ClientApp object in
this process through a Grid that serialises every message to Flower's wire objects and back and
runs each node with its own RNG state (as a separate process would): parity for every method in
seconds, plus the tolerance rules. Process tests start a real SuperLink and SuperNodes on
127.0.0.1 — insecure, then TLS with certificates and SuperNode keys made here — and kill a
SuperNode in the middle of round 2. Every process a test starts is stopped by ``LocalFederation``
(a context manager), also when the test fails.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from flwr.app import Context, Error, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import MethodSpec
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.cli import main as cli_main
from feddomain.cli import run_experiment
from feddomain.config import ExperimentConfig, load_config
from feddomain.data.export import SiteExport, export_sites
from feddomain.data.federated import federations
from feddomain.errors import ConfigError, FeddomainError
from feddomain.evaluation.metrics import evaluate_probs
from feddomain.evaluation.report import build_report
from feddomain.federation.flower.client import app as client_app
from feddomain.federation.flower.deploy import (
    CONNECTION,
    LocalFederation,
    TLSFiles,
    session_members,
)
from feddomain.federation.flower.records import (
    arrays_to_record,
    from_content,
    load_state,
    result_from_json,
    result_to_json,
    store_state,
    to_content,
)
from feddomain.federation.flower.server import run_deployment
from feddomain.federation.flower.settings import FlowerSettings, node_partition
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import PrivacyViolation
from feddomain.federation.simulation import Simulation
from tests.test_engine_contract import COUNTING, LABEL_MEAN

PROJECT = Path(__file__).resolve().parents[1]
DEMO = PROJECT / "configs" / "demo.yaml"
# The federation these tests deploy: the demo's data and clients, with LeNet-5 (the cheapest model;
# `model.options={}` drops the demo's small-CNN options) and no augmentation (rounds by hand).
BASE = [
    "model.name=lenet5",
    "model.options={}",
    "train.augment.invert_p=0",
    "rounds=2",
    "split.targets=[grey]",
    "checkpoint.every=0",
    "train.batch_size=128",
]


def demo_config(*overrides: str) -> ExperimentConfig:
    return load_config(DEMO, [*BASE, *overrides])


def simulate(cfg: ExperimentConfig, out: Path) -> Simulation:
    """The reference: the in-process simulator on the same config, with the config's torch
    threads as `feddomain run` and every node set them (another thread count sums some
    kernels in another order: 100 clients' FedAvg then differs from a deployed run by 1e-7)."""
    (data,) = federations(cfg)
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    sim = Simulation(cfg, data, out)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        sim.run()
    finally:
        torch.set_num_threads(threads)
    return sim


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> SiteExport:
    """The demo federation written as site folders, one per client, plus the target set."""
    return export_sites(demo_config(), tmp_path_factory.mktemp("sites") / "export")


def site_nodes(export: SiteExport, without_target: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Node configs of real sites: each names only its own folder (and the target set)."""
    return [
        {"partition-id": i, "site-root": str(site)}
        | ({} if i in without_target else {"target-root": str(export.target)})
        for i, site in enumerate(export.sites)
    ]


def sites_config(export: SiteExport, *overrides: str, server: bool = False) -> ExperimentConfig:
    """The exported sites config; the ServerApp's copy names no folder (``server``)."""
    hidden = ["partition.sites=null", "split.target_root=null"] if server else []
    return load_config(export.config, [*BASE, *hidden, *overrides])


def records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without the phase times (wall clock, which differs between runs)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]


def assert_same_run(out: Path, sim: Simulation, sim_dir: Path) -> None:
    """A deployed run equal to the simulator's: final server state, every metrics record and
    the summary, exactly (wall time and the deployment's own summary keys aside)."""
    assert_same_state(
        torch.load(out / "server_state.pt", weights_only=False), sim.server.state_dict()
    )
    assert records(out) == records(sim_dir)
    summary = json.loads((out / "summary.json").read_text())
    reference = json.loads((sim_dir / "summary.json").read_text())
    assert summary.pop("runner") == "flower"
    summary.pop("lost_clients")
    for timed in (summary, reference):  # seconds: no two runs share them
        timed.pop("wall_time_s"), timed.pop("phase_seconds")
    assert summary == reference


def assert_same_state(a: Any, b: Any, tol: float = 0.0, path: str = "state") -> None:
    """Nested server states agree: tensors within ``tol`` (max absolute difference; 0: exact),
    everything else (numbers, names, RNG states) exactly."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        assert diff <= tol, f"{path}: max abs diff {diff}"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_state(a[k], b[k], tol, f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, tol, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


# ------------------------------------------------------------------------- loopback
def over_the_wire(msg: FlowerMessage) -> FlowerMessage:
    """Deflate a message into Flower's content-addressed objects and inflate it again, as the
    SuperLink and SuperNode transport it; the id is the message's object id, as there."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    out = inflate_object_from_contents(msg.object_id, contents)
    out.metadata.__dict__["_message_id"] = msg.object_id
    return out


class ServerCrash(Exception):
    """The ServerApp's process ending mid-run (power cut, OOM kill, Ctrl-C)."""


class LoopbackGrid(Grid):
    """Nodes in this process: node ``i`` (id 100+i) holds ``partition-id`` i; ``silent`` nodes
    describe themselves but never answer a task (a machine gone after joining); ``mute`` nodes
    are connected but answer nothing, not even the description (a node still busy with an
    earlier run's task); ``broken`` nodes answer training with an error (their ClientApp
    raised)."""

    def __init__(
        self,
        node_configs: list[dict[str, Any]],
        silent: tuple[int, ...] = (),
        mute: tuple[int, ...] = (),
        broken: tuple[int, ...] = (),
        crash_in_round: int | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.contexts = {
            100 + i: Context(
                run_id=1,
                node_id=100 + i,
                node_config=c,
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i, c in enumerate(node_configs)
        }
        self.silent = {100 + i for i in silent}
        self.mute = {100 + i for i in mute}
        self.broken = {100 + i for i in broken}
        self.crash_in_round = crash_in_round  # the ServerApp's machine dies sending this round
        self.replies: dict[str, FlowerMessage] = {}
        self.received: list[tuple[int, str, str]] = []  # (node, message type, group id)

    def set_run(self, run: Any) -> None:  # pragma: no cover - not used by the ServerApp
        raise NotImplementedError

    @property
    def run(self) -> Any:  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args: Any, **kwargs: Any) -> FlowerMessage:  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Any) -> list[str]:
        ids = []
        for msg in messages:
            if msg.metadata.group_id == str(self.crash_in_round):
                raise ServerCrash(f"the ServerApp died in round {self.crash_in_round}")
            wire = over_the_wire(msg)
            node = wire.metadata.dst_node_id
            ids.append(wire.metadata.message_id)
            self.received.append((node, wire.metadata.message_type, wire.metadata.group_id))
            if node in self.mute or (node in self.silent and wire.metadata.message_type != "query"):
                continue
            with torch.random.fork_rng(devices=[]):  # a node's RNG is its own
                try:
                    if node in self.broken and wire.metadata.message_type == "train":
                        raise OSError("disk full")
                    reply = client_app(wire, self.contexts[node])
                except Exception as err:  # what Flower's runtime does with a ClientApp error
                    reply = FlowerMessage(Error(code=0, reason=repr(err)), reply_to=wire)
            self.replies[wire.metadata.message_id] = over_the_wire(reply)
        return ids

    def pull_messages(self, message_ids: Any) -> list[FlowerMessage]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ServerApp process knows about itself (set by Flower's runtime there)."""
    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


def deploy_loopback(
    cfg: ExperimentConfig,
    out: Path,
    *,
    nodes: list[dict[str, Any]] | None = None,
    silent: tuple[int, ...] = (),
    mute: tuple[int, ...] = (),
    broken: tuple[int, ...] = (),
    crash_in_round: int | None = None,
    run_config: dict[str, Any] | None = None,
    **settings: Any,
) -> LoopbackGrid:
    configs = nodes or [{"partition-id": i} for i in range(cfg.partition.n_clients)]
    grid = LoopbackGrid(configs, silent, mute, broken, crash_in_round, run_config)
    values = {"round_timeout": 30.0, "node_timeout": 5.0, "poll_interval": 0.01, **settings}
    run_deployment(grid, cfg, FlowerSettings(config=DEMO, overrides=(), out=out, **values))
    return grid


# ------------------------------------------------------------------------ records
def test_messages_cross_the_wire_unchanged(task_identity: None) -> None:
    arrays = {
        "w": torch.randn(3, 2),
        "a.bias": torch.tensor([1.5, -2.0], dtype=torch.float64),
        "count": torch.tensor(7),
        "mask": torch.tensor([True, False]),
        "img": torch.arange(6, dtype=torch.uint8).view(2, 3),
    }
    scalars = {"n": 3, "loss": 0.25, "ok": True, "name": "x", "v": [1.0, 2.5], "none": []}
    msg = Message("fit", arrays, scalars)
    wire = over_the_wire(FlowerMessage(to_content(msg, cid=2, rnd=5), 7, "train"))
    back, envelope = from_content(wire.content)
    assert back.task == "fit" and envelope == {"cid": 2, "rnd": 5}
    assert list(back.arrays) == list(arrays)  # order kept: replies flatten like the simulator's
    for name, t in arrays.items():
        assert back.arrays[name].dtype == t.dtype and torch.equal(back.arrays[name], t), name
    assert back.scalars == scalars
    assert [type(v) for v in back.scalars.values()] == [type(v) for v in scalars.values()]
    back.arrays["w"] += 1  # the receiver owns writable memory, not the sender's
    assert not torch.equal(back.arrays["w"], arrays["w"])


def test_a_models_tensors_travel_as_one_object_per_dtype(task_identity: None) -> None:
    """Catches the message content going back to one Flower object per tensor: every object is
    a separate request on each hop of the transport (measured: ~5 ms each on loopback, 28 for
    the demo model), which made a deployed round trip several tenths of a second slower."""
    arrays = {f"layer{i}.weight": torch.randn(4, i + 1) for i in range(12)}
    arrays["bn.num_batches_tracked"] = torch.tensor(3)
    content = to_content(Message("fit", arrays, {}), cid=0)
    flower_msg = FlowerMessage(content, 7, "train")
    objects = get_all_nested_objects(flower_msg)
    per_tensor = FlowerMessage(RecordDict({"a": arrays_to_record(arrays)}), 7, "train")
    assert len(content.array_records["arrays"]) == 2  # float32 and int64
    # the message, its RecordDict, the ArrayRecord, 2 Arrays and their 2 chunks, 3 ConfigRecords
    assert len(objects) == 10
    assert len(get_all_nested_objects(per_tensor)) == 29  # 13 Arrays, 13 chunks, 3 containers


def test_a_none_scalar_is_refused_with_its_name() -> None:
    with pytest.raises(FeddomainError, match="scalar 'lr' is None"):
        to_content(Message("fit", {}, {"lr": None}))  # type: ignore[dict-item]


def test_node_state_and_eval_results_round_trip() -> None:
    state = RecordDict()
    assert load_state(state, "k") == Message("state")  # first use: empty
    kept = Message("state", {"m": torch.ones(2, 2)}, {"steps": 4})
    store_state(state, "k", kept)
    got = load_state(state, "k")
    assert torch.equal(got.arrays["m"], kept.arrays["m"]) and got.scalars == {"steps": 4}
    probs = torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    result = evaluate_probs(probs, torch.tensor([0, 1, 1]))
    assert result_from_json(result_to_json(result)) == result
    assert result_from_json(result_to_json(None)) is None


def test_run_config_and_node_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="needs 'config'"):
        FlowerSettings.from_run_config({"out": "x"})
    with pytest.raises(ConfigError, match="unknown run config keys \\['rounds'\\]"):
        FlowerSettings.from_run_config({"config": str(DEMO), "out": "x", "rounds": 3})
    with pytest.raises(ConfigError, match="'min-replies' must be >= 1, got 0"):
        FlowerSettings.from_run_config({"config": str(DEMO), "out": "x", "min-replies": 0})
    with pytest.raises(ConfigError, match=r"no file 'missing\.yaml'"):
        FlowerSettings.from_run_config({"config": "missing.yaml", "out": "x"})
    relative = FlowerSettings.from_run_config(
        {"config": "configs/demo.yaml", "out": "x", "overrides": "rounds=2 'split.targets=[a]'"}
    )
    assert relative.config == DEMO  # resolved inside the App's folder
    assert relative.overrides == ("rounds=2", "split.targets=[a]")
    inline = FlowerSettings.from_run_config(
        {"config-yaml": "seed: 4\nrounds: 9\n", "out": "x", "overrides": "rounds=3"}
    )
    assert inline.config is None
    assert (inline.experiment().seed, inline.experiment().rounds) == (4, 3)
    broken = FlowerSettings.from_run_config({"config-yaml": "rounds: [", "out": "x"})
    with pytest.raises(ConfigError, match="'config-yaml' is not valid YAML"):
        broken.experiment()
    typo = FlowerSettings.from_run_config({"config-yaml": "roundz: 3", "out": "x"})
    with pytest.raises(ConfigError, match="unknown key 'roundz'; did you mean 'rounds'"):
        typo.experiment()
    with pytest.raises(ConfigError, match="--node-config 'partition-id=N'"):
        node_partition({}, 3)
    with pytest.raises(ConfigError, match=r"'partition-id'=3 .* valid ids are 0\.\.2"):
        node_partition({"partition-id": 3}, 3)


# ----------------------------------------------------------------- loopback parity
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_on_flower_equals_the_simulator(
    method: str, tmp_path: Path, task_identity: None
) -> None:
    """Same config and seed: identical server state, metrics.jsonl and summary (all exact)."""
    cheap = {
        "hfedf_ae_embed": ["algorithm.ae_epochs=2"],  # its autoencoder: 50 epochs
        "fedbn": ["model.name=small_cnn"],  # BatchNorm methods refuse LeNet-5
        "silobn": ["model.name=small_cnn"],
        "fedfd": ["model.name=small_cnn", "model.options.widths=[8, 16]"],
        "fedfd_a": ["model.name=small_cnn", "model.options.widths=[8, 16]"],
        "scaffold": ["train.optimizer=sgd", "train.lr=0.05"],  # plain SGD only
        # hierarchical only, plain SGD
        "mtgc": ["topology.stations=1", "train.optimizer=sgd", "train.momentum=0"],
    }
    if method.startswith("fedvr"):  # cached features, the adapter head, a pilot set
        cheap[method] = [
            "model.frozen=true",
            "model.head_adapter=8",
            "split.pilot_fraction=0.1",
            "train.drop_last=true",
            f"dataset.cache_dir={tmp_path / 'cache'}",
        ]
    cfg = demo_config(f"algorithm.name={method}", *cheap.get(method, []))
    sim = simulate(cfg, tmp_path / "sim")
    # a node featurising its data (frozen mode) takes longer than 5 s to describe it under load
    slow = {"node_timeout": 60.0} if cfg.model.frozen else {}
    grid = deploy_loopback(cfg, tmp_path / "flower", **slow)
    out = tmp_path / "flower"
    # per-client state lives in each node's Context.state, under its own client only
    for node, context in grid.contexts.items():
        cid = 0 if METHODS[method].pooled else node - 100
        kept = load_state(context.state, f"feddomain.split0.client{cid}")
        assert set(context.state) <= {
            f"feddomain.split0.client{cid}.{k}" for k in ("arrays", "scalars")
        }
        assert_same_state(kept.arrays, sim.states[cid].arrays)
    assert_same_run(out, sim, tmp_path / "sim")
    assert json.loads((out / "summary.json").read_text())["lost_clients"] == []


@pytest.mark.parametrize(
    ("spec", "overrides"),
    [
        (COUNTING, ["algorithm.name=_counting"]),  # a model hook adding a buffer and a parameter
        (LABEL_MEAN, ["algorithm.name=_label_mean", "topology.sample_fraction=0.67"]),
        (None, ["algorithm.name=fedavg", "algorithm.client.name=fedprox", "algorithm.client.mu=1"]),
        (None, ["algorithm.name=local", "train.optimizer=sgd", "train.momentum=0.9",
                "train.persistent_optimizer=true", "train.schedule=cosine"]),
    ],
    ids=["model-hook", "pre-round-task", "composed", "persistent-optimizer"],
)  # fmt: skip
def test_engine_contract_features_on_flower_equal_the_simulator(
    spec: MethodSpec | None, overrides: list[str], tmp_path: Path, task_identity: None
) -> None:
    """Catches: a hook, pre-round task, composed client or node-kept optimiser state that the
    ServerApp/ClientApp path handles differently from the simulator."""
    with registered(spec):
        cfg = demo_config(*overrides)
        sim = simulate(cfg, tmp_path / "sim")
        deploy_loopback(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")


@contextmanager
def registered(spec: MethodSpec | None) -> Iterator[None]:
    if spec is not None:
        register(spec)
    try:
        yield
    finally:
        if spec is not None:
            del METHODS[spec.name]


@pytest.mark.parametrize(
    "overrides",
    [
        ["topology.stations=2", "topology.station_rounds=2"],  # station tier in the ServerApp
        ["topology.sample_fraction=0.67", "rounds=3"],  # 2 of 3 clients per round
    ],
    ids=["stations", "sampling"],
)
def test_topologies_on_flower_equal_the_simulator(
    overrides: list[str], tmp_path: Path, task_identity: None
) -> None:
    cfg = demo_config(*overrides)
    sim = simulate(cfg, tmp_path / "sim")
    grid = deploy_loopback(cfg, tmp_path / "flower")
    assert_same_state(torch.load(tmp_path / "flower" / "server_state.pt"), sim.server.state_dict())
    assert records(tmp_path / "flower") == records(tmp_path / "sim")
    trained = sorted((node - 100, int(g)) for node, kind, g in grid.received if kind == "train")
    expected = [(c, r + 1) for r, units in enumerate(sim.schedule) for c in _clients(sim, units)]
    assert trained == sorted(expected * cfg.topology.station_rounds)


def test_a_leave_one_domain_out_config_runs_every_split_like_feddomain_run(
    tmp_path: Path, task_identity: None
) -> None:
    """Two targets: one run directory per split, each equal to `feddomain run`'s."""
    cfg = demo_config("split.targets=[grey,sketch]", "rounds=1")
    reference = run_experiment(cfg, tmp_path / "sim", quiet=True)
    deploy_loopback(cfg, tmp_path / "flower")
    assert [d.name for d in reference] == ["lodo-grey", "lodo-sketch"]
    for run_dir in reference:
        deployed = tmp_path / "flower" / run_dir.name
        assert records(deployed) == records(run_dir)
        assert yaml.safe_load((deployed / "config.yaml").read_text()) == cfg.to_dict()
    with pytest.raises(FeddomainError, match="already holds files"):
        deploy_loopback(cfg, tmp_path / "flower")


@pytest.mark.parametrize("method", ["fedavg", "local", "hfedf"])
def test_sites_holding_only_their_own_folders_equal_the_simulator(
    method: str, sites: SiteExport, tmp_path: Path, task_identity: None
) -> None:
    """Real sites: the ServerApp's config names no folder, each node only its own; the run
    equals the simulator given every folder (server state, metrics and summary, exactly)."""
    sim = simulate(sites_config(sites, f"algorithm.name={method}"), tmp_path / "sim")
    cfg = sites_config(sites, f"algorithm.name={method}", server=True)
    deploy_loopback(cfg, tmp_path / "flower", nodes=site_nodes(sites))
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")


def test_virtual_nodes_without_a_site_root_read_the_folders_the_config_lists(
    sites: SiteExport, tmp_path: Path, task_identity: None
) -> None:
    """The simulation engine's virtual SuperNodes have only a partition-id: a sites config
    that lists every folder (partition.sites) runs there as in the simulator."""
    cfg = sites_config(sites)
    sim = simulate(cfg, tmp_path / "sim")
    deploy_loopback(cfg, tmp_path / "flower")
    assert_same_state(torch.load(tmp_path / "flower" / "server_state.pt"), sim.server.state_dict())
    assert records(tmp_path / "flower") == records(tmp_path / "sim")


def test_a_site_without_the_target_set_is_scored_in_distribution_only(
    sites: SiteExport, tmp_path: Path, task_identity: None
) -> None:
    """Local-only: client 2 keeps its own model and has no target set, so it has no ood
    number and the ood mean is over clients 0 and 1; FedAvg's one shared model is scored by
    a node that has the target set, so every number equals the simulator's."""
    simulate(sites_config(sites, "algorithm.name=local"), tmp_path / "sim")
    cfg = sites_config(sites, "algorithm.name=local", server=True)
    deploy_loopback(cfg, tmp_path / "local", nodes=site_nodes(sites, without_target=(2,)))
    deployed, simulated = records(tmp_path / "local")[-1], records(tmp_path / "sim")[-1]
    ood = simulated["per_client"]["ood_acc"]
    assert deployed["per_client"]["ood_acc"] == [ood[0], ood[1], None]
    assert deployed["ood_acc"] == pytest.approx((ood[0] + ood[1]) / 2, abs=1e-12)
    assert deployed["per_client"]["id_acc"] == simulated["per_client"]["id_acc"]
    simulate(sites_config(sites), tmp_path / "sim-fedavg")
    deploy_loopback(
        sites_config(sites, server=True), tmp_path / "fedavg", nodes=site_nodes(sites, (0, 2))
    )
    assert records(tmp_path / "fedavg") == records(tmp_path / "sim-fedavg")


def test_sites_deployments_that_cannot_work_are_refused_by_name(
    sites: SiteExport, tmp_path: Path, task_identity: None
) -> None:
    cfg = sites_config(sites, server=True)
    with pytest.raises(FeddomainError, match="no SuperNode holds the target set"):
        deploy_loopback(cfg, tmp_path / "a", nodes=site_nodes(sites, without_target=(0, 1, 2)))
    with pytest.raises(FeddomainError, match="pools every client's data in one place"):
        pooled = sites_config(sites, "algorithm.name=central", server=True)
        deploy_loopback(pooled, tmp_path / "b", nodes=site_nodes(sites))
    with pytest.raises(FeddomainError, match="this SuperNode has no site folder"):
        deploy_loopback(cfg, tmp_path / "c")
    fewer = shutil.copytree(sites.target, tmp_path / "fewer")
    next((fewer / "grey" / "3").iterdir()).unlink()  # one image short of the others' copy
    nodes = site_nodes(sites)
    nodes[1]["target-root"] = str(fewer)
    with pytest.raises(FeddomainError, match=r"hold different target sets \(\{'grey': 1250\}"):
        deploy_loopback(cfg, tmp_path / "d", nodes=nodes)


@pytest.mark.parametrize(
    ("method", "kept_by"),
    [("local", "node"), ("fedavg", "node"), ("hfedf", "node"), ("local", "run")],
)
def test_an_interrupted_deployed_run_resumes_to_the_uninterrupted_result(
    method: str, kept_by: str, tmp_path: Path, task_identity: None
) -> None:
    """The ServerApp dies in round 4 after checkpointing round 2 (round 3's client updates
    already on the nodes). Resumed as a new Flower run (fresh Context.state on every node),
    it ends exactly as the simulator's uninterrupted run: Local-only's per-client models come
    back as of round 2, not round 3, from each node's state-dir (node config) or the run's
    (run config, as the simulation engine's virtual nodes use)."""
    cfg = demo_config(f"algorithm.name={method}", "rounds=4", "checkpoint.every=2", "eval.every=1")
    sim = simulate(cfg, tmp_path / "sim")
    out = tmp_path / "flower"
    nodes = [{"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(3)]
    run_config = None
    if kept_by == "run":
        nodes, run_config = None, {"state-dir": str(tmp_path / "shared")}
    with pytest.raises(ServerCrash):
        deploy_loopback(cfg, out, nodes=nodes, crash_in_round=4, run_config=run_config)
    assert [r["round"] for r in records(out)] == [1, 2, 3]
    assert torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 2
    deploy_loopback(cfg, out, nodes=nodes, resume=True, run_config=run_config)
    assert_same_run(out, sim, tmp_path / "sim")
    assert not (out / "checkpoint.pt").exists()


def test_a_restart_before_any_checkpoint_never_reads_the_abandoned_attempts_state(
    tmp_path: Path, task_identity: None
) -> None:
    """Crash in round 2 before the first checkpoint: the resumed run starts from round 1 under
    a new run key, so the nodes' copies from the first attempt (rounds 1-2) are never read;
    crashing again in round 4 and resuming still ends as the uninterrupted run."""
    cfg = demo_config("algorithm.name=local", "rounds=4", "checkpoint.every=2", "eval.every=1")
    sim = simulate(cfg, tmp_path / "sim")
    out = tmp_path / "flower"
    nodes = [{"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(3)]
    with pytest.raises(ServerCrash):
        deploy_loopback(cfg, out, nodes=nodes, crash_in_round=2)
    assert not (out / "checkpoint.pt").exists()
    with pytest.raises(ServerCrash):
        deploy_loopback(cfg, out, nodes=nodes, crash_in_round=4, resume=True)
    deploy_loopback(cfg, out, nodes=nodes, resume=True)
    assert_same_run(out, sim, tmp_path / "sim")
    assert len(list((tmp_path / "node0").iterdir())) == 2  # one key per start from round 1


def test_resuming_state_a_node_did_not_keep_is_refused_by_name(
    tmp_path: Path, task_identity: None
) -> None:
    cfg = demo_config("algorithm.name=local", "rounds=3", "checkpoint.every=1")
    out = tmp_path / "flower"
    with pytest.raises(ServerCrash):
        deploy_loopback(cfg, out, crash_in_round=3)  # the nodes keep no state-dir
    with pytest.raises(
        FeddomainError,
        match=r"after round 2, when client 0 kept state, .*"
        r"start the node with the 'state-dir'",
    ):
        deploy_loopback(cfg, out, resume=True)
    with pytest.raises(FeddomainError, match="nothing to resume in"):
        run_deployment(
            LoopbackGrid([]), cfg, FlowerSettings(None, (), tmp_path / "empty", resume=True)
        )


def _clients(sim: Simulation, units: list[int]) -> list[int]:
    if sim.data.stations is None:
        return units
    return [int(c) for s in units for c in sim.data.stations[s]]


# ------------------------------------------------------------------- tolerance
def fedavg_by_hand(cfg: ExperimentConfig, clients: list[int], rounds: int) -> dict:
    """FedAvg over the given clients only: the simulator's client step for each, then the plain
    sample-weighted mean — what a round that lost the other clients must produce."""
    (data,) = federations(cfg)
    sim = Simulation(cfg, data, Path("."))
    model = sim.server.global_arrays
    for rnd in range(1, rounds + 1):
        model, _ = weighted_mean(sim._run_client(c, rnd, Message("fit", model)) for c in clients)
    return model


def test_a_silent_node_is_dropped_after_the_timeout_and_named(
    tmp_path: Path, task_identity: None
) -> None:
    cfg = demo_config()
    out = tmp_path / "flower"
    deploy_loopback(cfg, out, silent=(1,), round_timeout=0.5, min_replies=2)
    lost = json.loads((out / "summary.json").read_text())["lost_clients"]
    assert [(e["round"], e["task"], e["client"], e["reason"]) for e in lost] == [
        (1, "train", 1, "no reply within 0.5 s"),
        (2, "train", 1, "no reply within 0.5 s"),
        (2, "evaluate", 1, "it timed out earlier in this round"),  # one timeout per round
    ]
    log = (out / "flower.log").read_text()
    assert "round 2 (train): lost client 1 (SuperNode 101): no reply within 0.5 s" in log
    assert len(records(out)[-1]["per_client"]["id_acc"]) == 2  # clients 0 and 2 were scored
    # each round closed with the two replies that arrived
    final = torch.load(out / "server_state.pt")["global"]
    assert_same_state(final, fedavg_by_hand(cfg, [0, 2], rounds=2))


def _count_held_out_scorings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of ``Simulation.score_held_out`` (the nodes here run in this process)."""
    calls: list[int] = []
    score = Simulation.score_held_out

    def counted(self: Simulation) -> Any:
        calls.append(1)
        return score(self)

    monkeypatch.setattr(Simulation, "score_held_out", counted)
    return calls


def test_a_shared_model_is_scored_on_the_target_by_one_node(
    tmp_path: Path, task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches every node scoring FedAvg's one global model on the target domains (the same
    work three times in parallel, measured as most of a deployed evaluation's time) while the
    server keeps one of the answers."""
    calls = _count_held_out_scorings(monkeypatch)
    cfg = demo_config("eval.every=1")
    deploy_loopback(cfg, tmp_path / "flower")
    assert len(calls) == 2  # two evaluations, one scoring each (before: one per node, 6)


def test_a_lost_scorer_of_the_shared_model_is_replaced(
    tmp_path: Path, task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the held-out scores going missing when the node asked to compute them (client
    0's) never answers: another node that evaluated the same model scores it, and the ood
    accuracy is that of the round's global model."""
    calls = _count_held_out_scorings(monkeypatch)
    cfg = demo_config("eval.every=1")
    out = tmp_path / "flower"
    deploy_loopback(cfg, out, silent=(0,), round_timeout=0.5, min_replies=2)
    final = records(out)[-1]
    (data,) = federations(cfg)
    sim = Simulation(cfg, data, Path("."))
    sim.load_eval_model(1, torch.load(out / "server_state.pt")["global"])
    (target,) = sim.score_held_out()[0].values()
    assert final["ood_acc"] == target.acc
    assert len(calls) == 2 + 1  # one per evaluation (by client 1 or 2), and ours


def test_a_failing_client_is_named_with_its_error(tmp_path: Path, task_identity: None) -> None:
    cfg = demo_config()
    out = tmp_path / "flower"
    deploy_loopback(cfg, out, broken=(2,))
    lost = json.loads((out / "summary.json").read_text())["lost_clients"]
    assert [(e["round"], e["task"], e["client"]) for e in lost] == [
        (1, "train", 2),
        (2, "train", 2),
    ]
    assert lost[0]["reason"] == "its node failed: OSError('disk full')"
    assert_same_state(
        torch.load(out / "server_state.pt")["global"], fedavg_by_hand(cfg, [0, 1], rounds=2)
    )
    assert len(records(out)[-1]["per_client"]["id_acc"]) == 3  # it still evaluates


class _LeaksLabels(FedAvgClient):
    """A FedAvg client that also uploads its training labels (one per sample)."""

    def run(self, msg: Message, ctx: Any) -> Message:
        reply = super().run(msg, ctx)
        reply.arrays["labels"] = ctx.train.labels.clone()
        return reply


class _InfFromClient1(FedAvgClient):
    """Client 1 sends +Inf in one weight and -Inf in another."""

    def run(self, msg: Message, ctx: Any) -> Message:
        reply = super().run(msg, ctx)
        if ctx.cid == 1:
            reply.arrays["classifier.bias"][0] = float("inf")
            reply.arrays["classifier.weight"][0, 0] = float("-inf")
        return reply


def test_an_undeclared_upload_stops_a_deployed_run_by_name(
    tmp_path: Path, task_identity: None
) -> None:
    """Catches: the privacy check running in the simulator only, not on replies from nodes."""
    with (
        registered(MethodSpec("_leaks_labels", FedAvgServer, _LeaksLabels, FedAvgHparams)),
        pytest.raises(
            PrivacyViolation,
            match=r"_leaks_labels: client 0 sent array 'labels' \[\d+\].*one row per training",
        ),
    ):
        deploy_loopback(demo_config("algorithm.name=_leaks_labels"), tmp_path / "flower")
    assert not (tmp_path / "flower" / "summary.json").exists()


def test_infinite_updates_from_a_node_are_rejected_and_the_run_goes_on(
    tmp_path: Path, task_identity: None
) -> None:
    """Catches: +Inf/-Inf from a deployed client reaching the average (only NaN was tested)."""
    with registered(MethodSpec("_inf", FedAvgServer, _InfFromClient1, FedAvgHparams)):
        cfg = demo_config("algorithm.name=_inf")
        deploy_loopback(cfg, tmp_path / "flower")
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert [
        (r["round"], r["client"], sorted(r["arrays"])) for r in summary["rejected_updates"]
    ] == [
        (1, 1, ["classifier.bias", "classifier.weight"]),
        (2, 1, ["classifier.bias", "classifier.weight"]),
    ]
    final = torch.load(tmp_path / "flower" / "server_state.pt")["global"]
    assert_same_state(final, fedavg_by_hand(demo_config(), [0, 2], rounds=2))


def test_too_few_replies_stop_the_run_with_the_missing_clients(
    tmp_path: Path, task_identity: None
) -> None:
    with pytest.raises(
        FeddomainError, match=r"fewer than min-replies=3; no reply from clients \[1\]"
    ):
        deploy_loopback(
            demo_config(), tmp_path / "flower", silent=(1,), round_timeout=0.2, min_replies=3
        )


def test_misconfigured_nodes_are_refused_by_name(tmp_path: Path, task_identity: None) -> None:
    cfg = demo_config()
    twice = [{"partition-id": 0}, {"partition-id": 0}, {"partition-id": 2}]
    with pytest.raises(FeddomainError, match="SuperNodes 100 and 101 both hold client 0"):
        deploy_loopback(cfg, tmp_path / "a", nodes=twice)
    outside = [{"partition-id": 0}, {"partition-id": 5}, {"partition-id": 2}]
    with pytest.raises(FeddomainError, match=r"SuperNode 101 cannot serve this run: .*valid ids"):
        deploy_loopback(cfg, tmp_path / "b", nodes=outside)
    missing = [{"partition-id": 0}, {"partition-id": 2}]
    with pytest.raises(FeddomainError, match=r"hold clients \[0, 2\] of 3") as gone:
        deploy_loopback(cfg, tmp_path / "c", nodes=missing, node_timeout=0.5)
    assert "did not answer" not in str(gone.value)  # every connected node answered


def test_a_connected_node_that_never_answers_is_named_apart_from_missing_clients(
    tmp_path: Path, task_identity: None
) -> None:
    """Catches a discovery timeout that blames a missing SuperNode ("start one SuperNode per
    client") when the node holding client 1 is connected but answers nothing (still busy with
    an earlier run's task): the message names the connected, silent node."""
    with pytest.raises(FeddomainError) as busy:
        deploy_loopback(demo_config(), tmp_path / "a", mute=(1,), node_timeout=0.5)
    assert "hold clients [0, 2] of 3" in str(busy.value)
    assert "connected SuperNode 101 did not answer" in str(busy.value)


def test_the_warm_executor_serves_on_after_an_error_and_ends_on_exit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a node's warm SuperExec ending for good on one unexpected error (a 500 from the
    node's Runtime API): the node would stay connected but never start another ClientApp, and
    every later run would wait for it in vain. The error is printed, Flower's loop starts again
    (without a second parent monitor), and an exit (a signal, the node gone) still ends it.
    Also catches a misconfiguration (an error as the executor starts) retried forever instead
    of ending the executor with its error."""
    from feddomain.federation.flower import warm

    calls: list[int | None] = []

    def run_superexec(**kwargs: Any) -> None:
        calls.append(kwargs["parent_pid"])
        if len(calls) == 1:
            raise RuntimeError("500 Internal Server Error from the Runtime API")
        raise SystemExit(0)

    monkeypatch.setattr(warm.superexec, "get_executor", warm.superexec.get_executor)
    monkeypatch.setattr(warm.superexec, "run_superexec", run_superexec)
    target = warm.Target("127.0.0.1:9094", parent_pid=4242)
    with pytest.raises(SystemExit):
        warm._serve_one(target, retry_after=0, startup=0)
    assert calls == [4242, None]
    err = capsys.readouterr().err
    assert "SuperExec for 127.0.0.1:9094 failed" in err and "500 Internal Server Error" in err
    calls.clear()
    with pytest.raises(RuntimeError, match="500 Internal Server Error"):
        warm._serve_one(target, retry_after=0, startup=60)  # the same error while starting
    assert calls == [4242]


# -------------------------------------------------------------------- processes
def make_tls(folder: Path) -> TLSFiles:
    """A throw-away CA and a SuperLink certificate for 127.0.0.1, as PEM files."""
    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, issuer: str, key: Any, signer: Any, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = (
        ec.generate_private_key(ec.SECP384R1()),
        ec.generate_private_key(ec.SECP384R1()),
    )
    files = TLSFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    ca = certificate("feddomain test CA", "feddomain test CA", ca_key, ca_key, ca=True)
    server = certificate("127.0.0.1", "feddomain test CA", server_key, ca_key, ca=False)
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


def make_node_keys(folder: Path, n: int) -> list[Path]:
    """SuperNode authentication keys (NIST P-384, OpenSSH format): ``nodeI`` + ``nodeI.pub``."""
    keys = []
    for i in range(n):
        key = ec.generate_private_key(ec.SECP384R1())
        path = folder / f"node{i}"
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
        )
        path.with_suffix(".pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )
        keys.append(path)
    return keys


def submit(fed: LocalFederation, out: Path, *overrides: str, **run_config: Any) -> None:
    """``flwr run`` the App on ``fed`` with the demo config (or ``config=``) and BASE +
    ``overrides``."""
    values = {
        "config": str(DEMO),
        "overrides": " ".join(repr(o) for o in [*BASE, *overrides]),
        "out": str(out),
        "round-timeout": 120.0,
        "node-timeout": 120.0,
        **run_config,
    }
    res = fed.submit(values, timeout=420, name=out.name)
    log = (fed.workdir / f"{out.name}.log").read_text(errors="replace")
    assert res.returncode == 0, log[-4000:] + federation_state(fed)
    assert (out / "summary.json").is_file(), log[-4000:] + federation_state(fed)


def federation_state(fed: LocalFederation) -> str:
    """Each SuperNode and the warm executor: running or its exit code, and its log's last
    lines (the ServerApp's log alone cannot say why a node stopped answering)."""
    parts = []
    for proc in [*fed.nodes, *([fed.executor] if fed.executor else [])]:
        code = proc.popen.poll()
        text = re.sub(r"\x1b\[[0-9;]*m", "", proc.log_text())  # Flower's colour codes
        tail = [line for line in text.splitlines() if not re.fullmatch(r"\s*(INFO\s*:)?\s*", line)]
        state = "running" if code is None else f"exited with {code}"
        parts.append(f"\n--- {proc.name} ({state}):\n" + "\n".join(tail[-12:]))
    return "".join(parts)


def assert_deployed_equals_simulated(out: Path, sim: Simulation, sim_dir: Path) -> None:
    """Final server state (FedAvg's global model, hFedF's hypernetwork) within 1e-5 of the
    simulator's; the evaluated metrics equal."""
    deployed = torch.load(out / "server_state.pt", weights_only=False)
    assert_same_state(deployed, sim.server.state_dict(), tol=1e-5)
    assert records(out) == records(sim_dir)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (out / name).is_file()


@pytest.fixture(scope="module")
def insecure_federation(tmp_path_factory: pytest.TempPathFactory, sites: SiteExport):
    """A SuperLink and 3 SuperNodes on 127.0.0.1 without TLS, shared by the tests below (the
    kill test comes last: it takes one node away). Node i also names site i's folder and the
    target set, which only a sites config reads, and a state-dir."""
    workdir = tmp_path_factory.mktemp("insecure")
    state = {"state-dir": str(workdir / "node-state")}  # the nodes keep client state: resumable
    with LocalFederation(3, workdir, sites=sites.config.parent, node_config=state) as fed:
        yield fed
    assert session_members(fed.sessions) == []  # nothing it started is left running


@pytest.mark.slow
def test_deployed_fedavg_equals_the_simulator(
    insecure_federation: LocalFederation, tmp_path: Path
) -> None:
    sim = simulate(demo_config(), tmp_path / "sim")
    out = insecure_federation.workdir / "fedavg"
    submit(insecure_federation, out)
    assert_deployed_equals_simulated(out, sim, tmp_path / "sim")
    # `feddomain report` reads the deployed run as it reads the simulated one
    (deployed,), (simulated,) = (build_report([d]).runs for d in (out, tmp_path / "sim"))
    assert deployed.algorithm == simulated.algorithm == "fedavg"
    assert deployed.records == [
        {**r, "time": deployed.records[i]["time"]} for i, r in enumerate(simulated.records)
    ]


@pytest.mark.slow
def test_feddomain_flower_run_reports_a_failed_serverapp_instead_of_exit_0(
    insecure_federation: LocalFederation, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flwr run` exits 0 whatever became of the run; `feddomain flower run` asks the
    SuperLink and fails with the ServerApp's own error. The ServerApp fails when it loads its
    data: a folder dataset at a missing root passes the config checks `flower run` makes before
    submitting (a folder's domains are known only once it is scanned)."""
    missing = insecure_federation.workdir / "no-such-root"
    overrides = ["dataset.name=folder", f"dataset.root={missing}"]
    out = insecure_federation.workdir / "failed"
    argv = ["flower", "run", str(DEMO), *BASE, *overrides, "--out", str(out)]
    argv += ["--flwr-home", str(insecure_federation.flwr_home)]
    assert cli_main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "ended as finished:failed" in err and f"data root {missing} does not exist" in err


@pytest.mark.slow
def test_a_stopped_deployed_run_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    """Real processes: `flwr stop` ends the ServerApp of a Local-only run in round 3; a new
    Flower run with resume=true goes on from the last checkpoint, each node restoring its
    client's model from its state-dir, and ends exactly as the simulator's uninterrupted run.
    The federation is this test's own: what a stop leaves on the nodes (the stopped run's
    ClientApps finishing their task) never reaches the tests sharing `insecure_federation`."""
    overrides = ["algorithm.name=local", "rounds=3", "checkpoint.every=1", "eval.every=1"]
    sim = simulate(demo_config(*overrides), tmp_path / "sim")
    state = {"state-dir": str(tmp_path / "node-state")}  # the nodes keep client state: resumable
    with LocalFederation(3, tmp_path / "fed", node_config=state) as fed:
        _stop_and_resume(fed, overrides, sim, tmp_path / "sim")
    assert session_members(fed.sessions) == []


def _stop_and_resume(
    fed: LocalFederation, overrides: list[str], sim: Simulation, sim_dir: Path
) -> None:
    out = fed.workdir / "stopped"
    values = {"config": str(DEMO), "overrides": " ".join(repr(o) for o in [*BASE, *overrides])}
    values |= {"out": str(out), "round-timeout": 120.0, "node-timeout": 120.0}
    log = fed.workdir / "stopped.log"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(fed.submit, values, timeout=420, name="stopped")
        deadline = time.monotonic() + 300
        while "round 2:" not in (text := log.read_text(errors="replace") if log.exists() else ""):
            assert not first.done() and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.1)
        run_id = re.search(r"Successfully started run (\d+)", text).group(1)
        assert fed.flwr("stop", run_id, CONNECTION, name="stop").returncode == 0
        first.result(timeout=120)
    assert not (out / "summary.json").exists()
    kept = torch.load(out / "checkpoint.pt", weights_only=False)["round"]
    res = fed.submit({"out": str(out), "resume": True}, timeout=420, name="resumed")
    resumed = (fed.workdir / "resumed.log").read_text(errors="replace")
    assert res.returncode == 0 and f"resumed {out} after round {kept}" in resumed, (
        resumed[-3000:] + federation_state(fed)
    )
    assert_deployed_equals_simulated(out, sim, sim_dir)


@pytest.mark.slow
def test_deployed_sites_with_only_their_own_folders_equal_the_simulator(
    insecure_federation: LocalFederation, sites: SiteExport, tmp_path: Path
) -> None:
    """Real processes: the ServerApp's config names no folder; SuperNode i reads only
    site<i>/ (its --node-config site-root) and the target set."""
    sim = simulate(sites_config(sites), tmp_path / "sim")
    out = insecure_federation.workdir / "sites"
    hidden = ("partition.sites=null", "split.target_root=null")
    submit(insecure_federation, out, *hidden, config=str(sites.config))
    assert_deployed_equals_simulated(out, sim, tmp_path / "sim")
    assert json.loads((out / "summary.json").read_text())["client_domain_counts"] == (
        sim.data.client_domain_counts.tolist()
    )


@pytest.mark.slow
def test_deployed_with_tls_and_node_authentication_equals_the_simulator(tmp_path: Path) -> None:
    """TLS from certificate files made here, SuperNodes admitted by registered keys; hFedF."""
    tls = make_tls(tmp_path)
    keys = make_node_keys(tmp_path, 3)
    sim = simulate(demo_config("algorithm.name=hfedf"), tmp_path / "sim")
    with LocalFederation(3, tmp_path / "fed", tls=tls, node_keys=keys) as fed:
        out = fed.workdir / "hfedf"
        submit(fed, out, "algorithm.name=hfedf")
        assert "insecure" not in fed.flwr_home.joinpath("config.toml").read_text()
    assert session_members(fed.sessions) == []
    assert_deployed_equals_simulated(out, sim, tmp_path / "sim")


@pytest.mark.slow
def test_flower_simulation_engine_equals_the_simulator(tmp_path: Path) -> None:
    """The same App under Flower's simulation engine (Ray): 3 virtual SuperNodes, one CPU
    each, as set with --federation-config; every process (Ray's too) stopped afterwards."""
    sim = simulate(demo_config(), tmp_path / "sim")
    with LocalFederation(0, tmp_path / "ray", simulation=True, warm=False) as fed:
        out = fed.workdir / "fedavg"
        values = {
            "config": str(DEMO),
            "overrides": " ".join(repr(o) for o in BASE),
            "out": str(out),
            "node-timeout": 120.0,
        }
        res = fed.submit(
            values, federation_config="num-supernodes=3 client-resources-num-cpus=1", name="ray"
        )
        log = (fed.workdir / "ray.log").read_text(errors="replace")
        assert res.returncode == 0 and "3 simulated SuperNodes" in log, log[-4000:]
    assert session_members(fed.sessions) == []
    assert_deployed_equals_simulated(out, sim, tmp_path / "sim")


@pytest.mark.slow
def test_a_supernode_killed_mid_run_is_named_and_the_run_finishes(
    insecure_federation: LocalFederation,
) -> None:
    """Catches a run that hangs or fails when a SuperNode dies mid-run, one that records no
    lost client, and one that names the wrong client or a round before the kill. The node is
    killed once its log shows round 2; on a loaded machine that sighting can lag a round, so
    the run has 4 rounds and the loss is asserted in round 2 or later. The round timeout is
    45 s: on a 2-core machine busy with other work, three ClientApps each loading their data
    took over 15 s to answer round 1, and the run stopped before any node was killed."""
    fed = insecure_federation
    out = fed.workdir / "killed"
    node_log = fed.nodes[1].log
    seen = len(node_log.read_text(errors="replace"))  # earlier runs' lines do not count
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(submit, fed, out, "rounds=4", **{"round-timeout": 45.0, "min-replies": 2})
        deadline = time.monotonic() + 300
        while "ROUND 2]" not in node_log.read_text(errors="replace")[seen:]:
            assert not run.done(), f"the run ended before round 2 reached node 1: {run.exception()}"
            assert time.monotonic() < deadline, "round 2 never reached node 1"
            time.sleep(0.05)
        fed.kill_node(1)
        assert not run.done(), f"the run ended before node 1 was killed: {run.exception()}"
        run.result(timeout=420)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4 and records(out)[-1]["round"] == 4
    lost = {(e["round"], e["client"]) for e in summary["lost_clients"]}
    assert lost and {c for _, c in lost} == {1} and min(r for r, _ in lost) >= 2
    assert "lost client 1 (SuperNode" in (out / "flower.log").read_text()
