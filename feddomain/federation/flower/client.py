"""The ClientApp: one SuperNode's share of a feddomain run.

A node serves the client whose ``partition-id`` its node config names. It rebuilds that client's
data from the config the ServerApp sends (dataset, split, seeded partition — the same code as
``feddomain run``), or, in a sites federation, reads it from its own ``site-root``. It executes
tasks through the simulator's own client path (``Simulation.execute``: the same seeding from
(seed, purpose, round, client), the same copies), so a deployed client trains exactly as a
simulated one. The client's persistent state lives in
the node's ``Context.state`` between messages (and on its disk with ``state-dir``: see
``node_state``), never in the server.

Message types: ``query`` (describe the data this node holds), ``train`` (any task of the method:
"fit", "collect", ...; the task name travels in the envelope) and ``evaluate``. A ``train``
message whose envelope names a ``pilot`` domain runs the method's pilot task on that target's
unlabeled pilot set, and an ``evaluate`` message marked ``unseen`` scores the server's
unseen-domain model on the target set; both go to nodes holding the target set only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from feddomain.algorithms import get_method
from feddomain.algorithms.base import Arrays
from feddomain.config import ExperimentConfig, validate_config
from feddomain.data.federated import (
    build_federated_data,
    build_site_data,
    experiment_splits,
    load_experiment_dataset,
)
from feddomain.errors import ConfigError, FeddomainError
from feddomain.federation.flower.node_state import StateStore
from feddomain.federation.flower.records import (
    ENVELOPE,
    from_content,
    has_state,
    load_state,
    result_to_json,
    results_to_json,
    store_state,
    to_content,
)
from feddomain.federation.flower.settings import (
    NodeSite,
    node_overrides,
    node_partition,
)
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation

app = ClientApp()

DESCRIBE, TRAIN, EVALUATE = "query", "train", "evaluate"


class NodeRunner:
    """The data and client machinery of one (config, split) on a node. Under Flower's
    simulation engine one worker serves many virtual nodes, so it is built once per worker
    and shared; each message names its client."""

    def __init__(self, cfg: ExperimentConfig, split_index: int, site: NodeSite) -> None:
        torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.split_index = split_index
        self.sites = cfg.partition.name == "sites"
        if self.sites:
            if get_method(cfg.algorithm.name).pooled:
                raise ConfigError(
                    f"{cfg.algorithm.name} pools every client's data in one place, which a sites "
                    "federation never does; run it with `feddomain run` where the data is"
                )
            self.n_splits = 1
            data = build_site_data(cfg, site.folders(cfg), site.targets(cfg))
        else:
            dataset = load_experiment_dataset(cfg)
            splits = experiment_splits(cfg, dataset)
            self.n_splits = len(splits)
            if not 0 <= split_index < len(splits):
                raise ConfigError(f"split index {split_index} out of range: {len(splits)} split(s)")
            data = build_federated_data(cfg, dataset, splits[split_index])
        # The simulator's client half: model object, client part, contexts, seeding. Its
        # server part is built too (cheap) but never driven here.
        self.sim = Simulation(cfg, data, Path("."))

    def state_key(self, cid: int) -> str:
        return f"feddomain.split{self.split_index}.client{cid}"

    def run(self, cid: int, envelope: dict[str, Any], msg: Message, context: Context) -> Message:
        """Carry out one task exactly as the simulator would for this client; keep its state
        in the node's ``Context.state`` (and on disk with ``state-dir``)."""
        rnd = int(envelope["rnd"])
        self.sim.states[cid] = self._state(cid, envelope, context)
        steps = int(envelope["station_round"]), int(envelope["purpose"])
        reply = self.sim.execute(cid, rnd, msg, *steps)
        state = self.sim.states[cid]
        store_state(context.state, self.state_key(cid), state)
        store = self._store(cid, envelope, context)
        if store is not None:
            store.record(rnd, state, int(envelope["checkpoint_round"]))
        return reply

    def evaluate(
        self, cid: int, envelope: dict[str, Any], offered: Arrays | None, context: Context
    ) -> dict[str, Any]:
        """Score the model this client would use on its validation split (id) and, if it is the
        client's own model or the server asked this node to (``held_out``), on every held-out
        domain (ood), as ``Simulation.evaluate`` does for one client. ``own`` says whether the
        client replaced the offered arrays with its own model."""
        sim = self.sim
        sim.states[cid] = self._state(cid, envelope, context)
        arrays = sim.load_eval_model(cid, offered)
        own = arrays is not offered
        ood, held_out_val = sim.score_held_out() if own or envelope["held_out"] else ({}, {})
        return {
            "own": own,
            "id": result_to_json(sim.score_id(cid)),
            "ood": results_to_json(ood),
            "val": results_to_json(held_out_val),
        }

    def run_pilot(self, envelope: dict[str, Any], msg: Message) -> Message:
        """The pilot task of target ``envelope["pilot"]``, as the simulator runs it: on the
        unlabeled pilot set this node holds, touching no client's state."""
        return self.sim.execute_pilot(str(envelope["pilot"]), int(envelope["rnd"]), msg)

    def evaluate_unseen(self, arrays: Arrays) -> dict[str, Any]:
        """The server's unseen-domain model on this node's target set."""
        return {"ood": results_to_json(self.sim.score_unseen(arrays))}

    def _state(self, cid: int, envelope: dict[str, Any], context: Context) -> Message:
        """The client's state: from ``Context.state`` within a Flower run; in the first message
        of a resumed run, from the node's disk copy as of the checkpoint resumed from."""
        key = self.state_key(cid)
        resumed_from = int(envelope["restore_round"])
        if has_state(context.state, key) or resumed_from < 0 or not envelope["stateful"]:
            return load_state(context.state, key)  # empty for a client without state then
        store = self._store(cid, envelope, context)
        saved = store.restore(resumed_from) if store is not None else None
        if saved is None:
            raise FeddomainError(
                f"the run resumes after round {resumed_from}, when client {cid} kept state, "
                "but this SuperNode has no copy of it: start the node with the 'state-dir' "
                "it had when the run began"
            )
        return saved

    def _store(self, cid: int, envelope: dict[str, Any], context: Context) -> StateStore | None:
        return StateStore.of(context, str(envelope["run_key"]), self.split_index, cid)

    def describe(self, cid: int) -> dict[str, Any]:
        """What the server needs to know about the federation's data, without the data. A site
        also says what it holds itself: its domains' training counts and its target domains."""
        data = self.sim.data
        stations = data.stations or []
        own = {}
        if self.sites:
            row = data.client_domain_counts[cid]
            own = {d: int(n) for d, n in zip(data.domains, row, strict=True) if n}
        return {
            "cid": cid,
            "serves": cid < data.n_clients,  # a pooled method (Central) uses client 0 only
            "sites": self.sites,
            "own_counts": json.dumps(own),
            "target_sizes": json.dumps({d: len(s) for d, s in data.targets.items()}),
            "pilot_sizes": json.dumps({d: len(s) for d, s in data.pilots.items()}),
            "n_splits": self.n_splits,
            "n_clients": data.n_clients,
            "dataset": data.dataset,
            "domains": list(data.domains),
            "classes": list(data.classes),
            "train": list(data.split.train),
            "val": list(data.split.val),
            "test": list(data.split.test),
            "input_shape": [int(s) for s in data.train[0].inputs.shape[1:]],
            "counts": [int(c) for c in data.client_domain_counts.reshape(-1)],
            "stations": [int(c) for s in stations for c in s],
            "station_sizes": [len(s) for s in stations],
        }


_RUNNERS: dict[str, NodeRunner] = {}


def node_runner(envelope: dict[str, Any], node_config: dict[str, Any]) -> NodeRunner:
    """The runner for the message's (config, split) on this node, built on first use. Only
    the latest one is kept, so a worker's memory holds one run's data."""
    overrides = node_overrides(node_config)
    site = NodeSite(node_config)
    key = json.dumps([envelope["config"], envelope["split"], overrides, site.key], sort_keys=True)
    if key not in _RUNNERS:
        _RUNNERS.clear()
        raw = json.loads(str(envelope["config"]))
        raw.setdefault("dataset", {}).update(overrides)
        cfg = validate_config(raw, source="config sent by the ServerApp")
        _RUNNERS[key] = NodeRunner(cfg, int(envelope["split"]), site)
    return _RUNNERS[key]


def _client(runner: NodeRunner, envelope: dict[str, Any], context: Context) -> int:
    """The client this node holds; the server must have addressed that one."""
    cid = node_partition(context.node_config, runner.cfg.partition.n_clients)
    if int(envelope["cid"]) != cid:
        raise ConfigError(f"message for client {envelope['cid']} reached the node holding {cid}")
    return cid


@app.query()
def describe(message: FlowerMessage, context: Context) -> FlowerMessage:
    envelope = dict(message.content.config_records[ENVELOPE])
    runner = node_runner(envelope, dict(context.node_config))
    cid = node_partition(context.node_config, runner.cfg.partition.n_clients)
    content = RecordDict({ENVELOPE: ConfigRecord(runner.describe(cid))})
    return FlowerMessage(content, reply_to=message)


@app.train()
def train(message: FlowerMessage, context: Context) -> FlowerMessage:
    msg, envelope = from_content(message.content)
    runner = node_runner(envelope, dict(context.node_config))
    cid = _client(runner, envelope, context)
    if envelope.get("pilot"):
        return FlowerMessage(to_content(runner.run_pilot(envelope, msg)), reply_to=message)
    reply = runner.run(cid, envelope, msg, context)
    state = runner.sim.states[cid]
    stateful = bool(state.arrays or state.scalars)  # the server notes who must be restored
    return FlowerMessage(to_content(reply, stateful=stateful), reply_to=message)


@app.evaluate()
def evaluate(message: FlowerMessage, context: Context) -> FlowerMessage:
    msg, envelope = from_content(message.content)
    runner = node_runner(envelope, dict(context.node_config))
    cid = _client(runner, envelope, context)
    if envelope.get("unseen"):
        result = runner.evaluate_unseen(msg.arrays)
        return FlowerMessage(RecordDict({ENVELOPE: ConfigRecord(result)}), reply_to=message)
    offered = msg.arrays if envelope["has_model"] else None
    result = runner.evaluate(cid, envelope, offered, context)
    return FlowerMessage(RecordDict({ENVELOPE: ConfigRecord(result)}), reply_to=message)
