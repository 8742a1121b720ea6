"""The ServerApp: a feddomain run driven over Flower's Grid instead of in-process calls.

``FlowerRunner`` is the simulator (``Simulation``) with one thing replaced: where the simulator
calls a client, it sends the message to the SuperNode holding that client and waits. Round
structure, server and station parts (stations run here, in the ServerApp's process), the
sampling stream, NaN rejection, evaluation cadence, ``metrics.jsonl`` and ``summary.json`` are
the simulator's own code, which is what makes a deployed run equal to a simulated one.

Tolerance: a round closes when every reply arrived, or when ``round-timeout`` seconds passed and
at least ``min-replies`` replies arrived; every missing client is logged by id and listed in
``summary.json["lost_clients"]``. Fewer replies than that stops the run with an error.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flwr
import numpy as np
import torch
import yaml
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid, ServerApp

import feddomain
from feddomain.algorithms.base import Arrays, Plan
from feddomain.config import ExperimentConfig, load_config
from feddomain.data.federated import FederatedData
from feddomain.data.splits import DomainSplit
from feddomain.errors import FeddomainError
from feddomain.evaluation.metrics import EvalResult
from feddomain.federation.data import ClientData
from feddomain.federation.flower.client import DESCRIBE, EVALUATE, TRAIN
from feddomain.federation.flower.records import (
    ENVELOPE,
    from_content,
    result_from_json,
    results_from_json,
    to_content,
)
from feddomain.federation.flower.settings import FlowerSettings
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation, _summarise_eval
from feddomain.federation.topology import CLIENT_TRAIN

log = logging.getLogger("feddomain")
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = FlowerSettings.from_run_config(context.run_config)
    cfg = resumed_experiment(settings.out) if settings.resume else settings.experiment()
    console = logging.StreamHandler(sys.stderr)  # shown by `flwr run --stream`
    console.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(console)
    log.setLevel(logging.INFO)
    try:
        run_deployment(grid, cfg, settings, run_id=context.run_id)
    finally:
        log.removeHandler(console)


# ------------------------------------------------------------------ transport
class NodeLink:
    """Sends feddomain messages to the SuperNodes holding given clients and collects replies,
    with the run's minimum-replies / timeout rule."""

    def __init__(self, grid: Grid, settings: FlowerSettings, cfg: ExperimentConfig) -> None:
        self.grid = grid
        self.settings = settings
        self.config_json = json.dumps(cfg.to_dict())
        self.nodes: dict[int, int] = {}  # client id -> SuperNode id
        self.target_clients: list[int] = []  # clients whose SuperNode holds the target set
        self.pilot_sizes: dict[str, int] = {}  # images in each target's pilot set
        self.lost: list[dict[str, Any]] = []
        self.gone: dict[int, int] = {}  # client id -> round in which it timed out

    def exchange(
        self,
        kind: str,
        items: list[tuple[int, RecordDict]],
        rnd: int,
        *,
        required: int | None = None,
    ) -> dict[int, RecordDict]:
        """Send each client its content and return the replies by client id. Waits for all, or
        until ``round-timeout`` has passed with at least ``required`` replies (default: the
        run's ``min-replies``, capped at the number sent). Missing clients are logged as lost."""
        timeout = self.settings.round_timeout
        online = set(self.grid.get_node_ids())
        messages, cids = [], []
        for cid, content in items:
            node = self.nodes[cid]
            if node not in online:
                self._lose(kind, rnd, cid, "its SuperNode is offline")
                continue
            if self.gone.get(cid) == rnd:  # one timeout per round, not one per exchange
                self._lose(kind, rnd, cid, "it timed out earlier in this round")
                continue
            messages.append(
                FlowerMessage(content, dst_node_id=node, message_type=kind, group_id=str(rnd))
            )
            cids.append(cid)
        pending = dict(zip(self.grid.push_messages(messages), cids, strict=True))
        required = min(self.settings.min_replies if required is None else required, len(cids))
        replies: dict[int, RecordDict] = {}
        start = time.monotonic()
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                cid = pending.pop(reply.metadata.reply_to_message_id, None)
                if cid is None:
                    continue
                if reply.has_error():
                    self._lose(kind, rnd, cid, f"its node failed: {reply.error.reason}")
                else:
                    replies[cid] = reply.content
            if pending and time.monotonic() - start >= timeout:
                if len(replies) < required:
                    missing = sorted(pending.values())
                    raise FeddomainError(
                        f"{kind} round {rnd}: {len(replies)} of {len(cids)} replies after "
                        f"{timeout:g} s, fewer than min-replies={required}; no reply from "
                        f"clients {missing}"
                    )
                for cid in sorted(pending.values()):
                    self._lose(kind, rnd, cid, f"no reply within {timeout:g} s")
                    self.gone[cid] = rnd
                break
            if pending:
                time.sleep(self.settings.poll_interval)
        if len(replies) < required:
            reasons = "; ".join(
                f"client {e['client']}: {e['reason']}"
                for e in self.lost
                if e["round"] == rnd and e["task"] == kind and e["client"] in cids
            )
            raise FeddomainError(
                f"{kind} round {rnd}: only {len(replies)} of {len(cids)} clients replied, "
                f"fewer than min-replies={required} ({reasons})"
            )
        return replies

    def _lose(self, kind: str, rnd: int, cid: int, why: str) -> None:
        node = self.nodes.get(cid)
        log.warning("round %d (%s): lost client %d (SuperNode %s): %s", rnd, kind, cid, node, why)
        self.lost.append({"round": rnd, "task": kind, "client": cid, "node": node, "reason": why})


# ------------------------------------------------------------------ discovery
@dataclass
class Federation:
    """What the nodes told the server about one split: the data's shape, never the data."""

    data: FederatedData
    n_splits: int


def discover(link: NodeLink, split_index: int) -> Federation:
    """Ask every connected SuperNode what it holds for this split; wait until some node holds
    each client. Nodes must agree on the data (same config, same files), or the run stops."""
    settings, grid = link.settings, link.grid
    log.info("split %d: asking the connected SuperNodes what they hold", split_index)
    deadline = time.monotonic() + settings.node_timeout
    infos: dict[int, dict[str, Any]] = {}  # SuperNode id -> its description
    link.nodes = {}
    while True:
        new = sorted(set(grid.get_node_ids()) - set(infos))
        if new:
            infos.update(_describe(link, new, split_index, deadline))
            if infos:  # no node may have answered before the deadline
                _map_clients(link, infos)
        reference = next(iter(infos.values()), None)
        if reference is not None and len(link.nodes) == reference["n_clients"]:
            _note_target_holders(link, infos)
            if reference["sites"]:
                return Federation(_site_shell(reference, infos, link.nodes), 1)
            return Federation(_shell_data(reference), int(reference["n_splits"]))
        if time.monotonic() > deadline:
            raise _discovery_timeout(link, reference, sorted(set(grid.get_node_ids()) - set(infos)))
        time.sleep(1.0)


def _discovery_timeout(
    link: NodeLink, reference: dict[str, Any] | None, silent: list[int]
) -> FeddomainError:
    """Which clients no node holds; a connected node that never answered is named apart from
    a node that never joined (it may still be busy with an earlier run's task)."""
    wanted = reference["n_clients"] if reference else "?"
    held = sorted(link.nodes)
    why = f"after {link.settings.node_timeout:g} s, SuperNodes hold clients {held} of {wanted}"
    if silent:
        names = ", ".join(str(node) for node in silent)
        why += (
            f"; connected SuperNode {names} did not answer (still busy with an earlier run's "
            "task, or its ClientApp cannot start: see its log)"
        )
    return FeddomainError(
        f"{why}; start one SuperNode per client with --node-config 'partition-id=N'"
    )


def _describe(
    link: NodeLink, nodes: list[int], split_index: int, deadline: float
) -> dict[int, dict[str, Any]]:
    envelope = {"task": "describe", "split": split_index, "config": link.config_json, "cid": -1}
    messages = [
        FlowerMessage(
            RecordDict({ENVELOPE: ConfigRecord(envelope)}),
            dst_node_id=node,
            message_type=DESCRIBE,
            group_id="0",
        )
        for node in nodes
    ]
    pending = dict(zip(link.grid.push_messages(messages), nodes, strict=True))
    out: dict[int, dict[str, Any]] = {}
    while pending and time.monotonic() < deadline:
        for reply in link.grid.pull_messages(list(pending)):
            node = pending.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            if reply.has_error():
                raise FeddomainError(
                    f"SuperNode {node} cannot serve this run: {reply.error.reason}"
                )
            out[node] = dict(reply.content.config_records[ENVELOPE])
        time.sleep(link.settings.poll_interval)
    return out


# What every node must describe alike: the whole federation's data when each node rebuilds it
# from the config; only its shape in a sites federation, where each node holds its own folder.
SHAPE = ("sites", "n_splits", "n_clients", "dataset", "classes", "input_shape", "test")
SHAPE += ("stations", "station_sizes")
AGREED = (*SHAPE, "domains", "train", "val", "counts")


def _map_clients(link: NodeLink, infos: dict[int, dict[str, Any]]) -> None:
    """Client id -> SuperNode, after checking that every node describes the same data."""
    reference_node, reference = next(iter(infos.items()))
    for node, info in infos.items():
        for key in SHAPE if reference["sites"] else AGREED:
            if info[key] != reference[key]:
                hint = "give every node the same dataset files"
                if reference["sites"] and key == "classes":
                    hint = "list the classes in the config (dataset.classes)"
                raise FeddomainError(
                    f"SuperNodes {reference_node} and {node} disagree on '{key}' of the data "
                    f"({reference[key]} vs {info[key]}): {hint}"
                )
        if not info["serves"]:
            continue
        cid = int(info["cid"])
        other = link.nodes.get(cid)
        if other is not None and other != node:
            raise FeddomainError(
                f"SuperNodes {other} and {node} both hold client {cid} (partition-id={cid}); "
                "give each node its own partition-id"
            )
        link.nodes[cid] = node


def _note_target_holders(link: NodeLink, infos: dict[int, dict[str, Any]]) -> None:
    """The clients whose node holds the target set (every node, unless the federation is
    sites), where pilot tasks run and the unseen-domain model is scored, and the pilot sizes."""
    holders = {
        cid: infos[node]
        for cid, node in sorted(link.nodes.items())
        if json.loads(str(infos[node]["target_sizes"]))
    }
    link.target_clients = list(holders)
    first = next(iter(holders.values()), None)
    link.pilot_sizes = json.loads(str(first["pilot_sizes"])) if first else {}


def _shell_data(info: dict[str, Any]) -> FederatedData:
    """A FederatedData with the federation's shape and no samples: what the server side of the
    simulator reads (client count, classes, stations, domain counts for the summary)."""
    n = int(info["n_clients"])
    empty = ClientData(torch.empty(0, *info["input_shape"]), torch.empty(0, dtype=torch.int64))
    stations, offset = None, 0
    if info["station_sizes"]:
        stations = []
        for size in info["station_sizes"]:
            stations.append(np.asarray(info["stations"][offset : offset + size], dtype=np.int64))
            offset += size
    return FederatedData(
        dataset=str(info["dataset"]),
        domains=tuple(info["domains"]),
        classes=tuple(info["classes"]),
        split=DomainSplit(tuple(info["train"]), tuple(info["val"]), tuple(info["test"])),
        train=[empty] * n,
        val=[empty] * n,
        client_domain_counts=np.asarray(info["counts"], dtype=np.int64).reshape(n, -1),
        targets={},
        ood_val={},
        stations=stations,
    )


def _site_shell(
    reference: dict[str, Any], infos: dict[int, dict[str, Any]], nodes: dict[int, int]
) -> FederatedData:
    """The shape of a sites federation, assembled from what each site says it holds."""
    own = {cid: json.loads(str(infos[node]["own_counts"])) for cid, node in nodes.items()}
    holders = {n: json.loads(str(i["target_sizes"])) for n, i in infos.items()}
    holders = {n: sizes for n, sizes in holders.items() if sizes}
    if not holders:
        raise FeddomainError(
            "no SuperNode holds the target set, so no model could be scored on the unseen "
            "domain(s); give at least one node a target-root"
        )
    (first, sizes), *_ = holders.items()
    for node, other in holders.items():
        if other != sizes:
            raise FeddomainError(
                f"SuperNodes {first} and {node} hold different target sets ({sizes} vs "
                f"{other} images): give every node that has one the same files"
            )
    train = sorted({d for counts in own.values() for d in counts})
    test = tuple(reference["test"])
    domains = tuple(sorted({*train, *test}))
    counts = [own[cid].get(d, 0) for cid in range(len(own)) for d in domains]  # row-major
    return _shell_data(
        {**reference, "domains": domains, "train": train, "val": [], "counts": counts}
    )


# --------------------------------------------------------------------- runner
class FlowerRunner(Simulation):
    """The simulator, with clients reached through ``NodeLink``. Per-client state is kept by
    the nodes (``Context.state``, and on disk with ``state-dir`` so a resumed run finds it); the
    ServerApp checkpoints the rest like the simulator."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        data: FederatedData,
        out_dir: Path,
        link: NodeLink,
        split_index: int,
    ) -> None:
        super().__init__(cfg, data, out_dir, progress=_log_progress)
        self.link = link
        self.split_index = split_index
        # Names the nodes' copies of their clients' state: new for every start from round 1
        # (so no copy from an abandoned attempt is ever read), kept in the checkpoint.
        self.run_key = uuid.uuid4().hex
        self.states = []  # never used here: each node keeps its client's state
        self.stateful: set[int] = set()  # clients whose last reply said they keep state
        self.checkpoint_round = -1  # the last round checkpointed (-1: none yet)
        self.restore_round = -1  # the checkpoint this run resumed from (-1: not resumed)
        self.restored_stateful: set[int] = set()
        self._replies: dict[int, Message] = {}
        self._rnd = 0
        self.pilot_sizes = dict(link.pilot_sizes)

    def _round(self, rnd: int) -> dict[str, Any]:
        self._rnd = rnd
        return super()._round(rnd)

    def _envelope(
        self, cid: int, rnd: int, station_round: int = 0, purpose: int = CLIENT_TRAIN
    ) -> dict[str, Any]:
        return {
            "cid": cid,
            "rnd": rnd,
            "station_round": station_round,
            "purpose": purpose,
            "split": self.split_index,
            "config": self.link.config_json,
            "run_key": self.run_key,
            "checkpoint_round": self.checkpoint_round,
            "restore_round": self.restore_round,
            "stateful": cid in self.restored_stateful,
        }

    def _deliver(
        self,
        rnd: int,
        plan: Plan,
        timing: dict[str, float],
        station_round: int,
        purpose: int = CLIENT_TRAIN,
    ) -> Iterator[tuple[int, Message]]:
        """Send the plan to the nodes — a fixed plan all at once, a lazy (sequential) plan one
        client at a time — and pass on the clients that replied; the simulator's loop then
        takes each reply from ``execute``. A station's tasks (its pre-round task, its station
        rounds) go to the nodes here like the server's."""
        batches = [list(plan.items())] if isinstance(plan, Mapping) else ([i] for i in plan)
        for batch in batches:
            t0 = time.perf_counter()
            items = [
                (c, to_content(m, **self._envelope(c, rnd, station_round, purpose)))
                for c, m in batch
            ]
            # a sequential method skips a lost client instead of failing the round
            required = None if isinstance(plan, Mapping) else 0
            replies = self.link.exchange(TRAIN, items, rnd, required=required)
            timing["train"] += time.perf_counter() - t0
            for cid, msg in batch:
                if cid in replies:
                    self._replies[cid], envelope = from_content(replies[cid])
                    (self.stateful.add if envelope["stateful"] else self.stateful.discard)(cid)
                    yield cid, msg

    def execute(
        self,
        cid: int,
        rnd: int,
        msg: Message,
        station_round: int = 0,
        purpose: int = CLIENT_TRAIN,
    ) -> Message:
        """The reply the client's node sent (``_exchanged`` fetched it); the simulator's
        ``_run_client`` then checks it against the privacy declaration and counts its bytes."""
        return self._replies.pop(cid)

    def execute_pilot(self, domain: str, rnd: int, msg: Message) -> Message:
        """The pilot task's reply from a node holding the target set; the simulator's
        ``_run_pilot`` then checks it against the privacy declaration and counts its bytes."""
        reply, _ = from_content(self._at_target(TRAIN, msg, rnd, pilot=domain))
        return reply

    def score_unseen(self, arrays: Arrays) -> dict[str, EvalResult]:
        """The unseen-domain model, scored where the target set is."""
        msg = Message("evaluate", arrays)
        content = self._at_target(EVALUATE, msg, self._rnd, has_model=True, unseen=True)
        return results_from_json(str(content.config_records[ENVELOPE]["ood"]))

    def _at_target(self, kind: str, msg: Message, rnd: int, **extra: Any) -> RecordDict:
        """The reply to ``msg`` (envelope plus ``extra``) of the first node holding the target
        set that answers, addressed as its client; a lost node is logged and the next asked."""
        for cid in self.link.target_clients:
            content = to_content(msg, **self._envelope(cid, rnd), **extra)
            replies = self.link.exchange(kind, [(cid, content)], rnd, required=0)
            if cid in replies:
                return replies[cid]
        raise FeddomainError(
            f"{kind} round {rnd}: no SuperNode holding the target set answered (those of "
            f"clients {self.link.target_clients})"
        )

    def evaluate(self) -> dict[str, Any]:
        """Each node scores the model its client would use on its validation split. A model
        the server offers to several clients is scored on the held-out domains once, as in the
        simulator: by the first node holding the target set that it is offered to (the others
        would repeat the same work in parallel), or, if that node is lost or keeps its own
        model, by one that answered using it. A client's own model is scored by its node. The
        unseen-domain model, if the method has one, is scored by a node holding the target
        set."""
        offers = {cid: self.server.eval_arrays(cid) for cid in range(self.data.n_clients)}
        scorers = self._held_out_scorers(offers)
        items = []
        for cid, arrays in offers.items():
            items.append((cid, self._eval_content(cid, arrays, held_out=cid in scorers)))
        replies = self.link.exchange(EVALUATE, items, self._rnd)
        decoded = {cid: dict(replies[cid].config_records[ENVELOPE]) for cid in sorted(replies)}
        models = {
            cid: ("client", cid) if r["own"] else ("server", id(offers[cid]))
            for cid, r in decoded.items()
        }
        held_out: dict[tuple[str, int], tuple[dict, dict]] = {}  # model -> its scores
        for cid, reply in decoded.items():
            targets = results_from_json(str(reply["ood"]))
            if targets and models[cid] not in held_out:  # sites without the target set: none
                held_out[models[cid]] = (targets, results_from_json(str(reply["val"])))
        for cid in self.link.target_clients:
            if cid in models and models[cid] not in held_out:
                self._score_held_out_at(cid, offers[cid], models[cid], held_out)
        id_results = [result_from_json(str(r["id"])) for r in decoded.values()]
        per_client = [held_out.get(models[cid], ({}, {})) for cid in decoded]
        return _summarise_eval(
            id_results,
            [ood for ood, _ in per_client],
            [val for _, val in per_client],
            len(set(models.values())),
            self.unseen_scores(),
        )

    def _held_out_scorers(self, offers: dict[int, Arrays | None]) -> set[int]:
        """For each model the server offers, the first client holding the target set it is
        offered to."""
        first: dict[int, int] = {}
        for cid in self.link.target_clients:
            if offers[cid] is not None:
                first.setdefault(id(offers[cid]), cid)
        return set(first.values())

    def _eval_content(self, cid: int, arrays: Arrays | None, *, held_out: bool) -> RecordDict:
        msg = Message("evaluate", arrays or {})
        envelope = {**self._envelope(cid, 0), "has_model": arrays is not None}
        return to_content(msg, **envelope, held_out=held_out)

    def _score_held_out_at(
        self, cid: int, arrays: Arrays | None, model: tuple[str, int], held_out: dict
    ) -> None:
        """Ask client ``cid``'s node (which answered with ``model``) to score it on the held-out
        domains too; kept only if the node used that model again."""
        content = self._eval_content(cid, arrays, held_out=True)
        reply = self.link.exchange(EVALUATE, [(cid, content)], self._rnd, required=0).get(cid)
        if reply is None:
            return
        answer = dict(reply.config_records[ENVELOPE])
        if bool(answer["own"]) == (model[0] == "client"):
            ood, val = results_from_json(str(answer["ood"])), results_from_json(str(answer["val"]))
            held_out[model] = (ood, val)

    def _save(self, rnd: int, elapsed: float) -> None:
        """The server's checkpoint; each client's state is kept by its node (``state-dir``),
        which learns of this checkpoint from the next message's ``checkpoint_round``."""
        super()._save(rnd, elapsed)
        self.checkpoint_round = rnd

    def _checkpoint(self, rnd: int, elapsed: float) -> dict[str, Any]:
        return {
            **super()._checkpoint(rnd, elapsed),
            "stateful": sorted(self.stateful),
            "lost": self.link.lost,
            "run_key": self.run_key,
        }

    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        super()._load_checkpoint(state)
        self.checkpoint_round = self.restore_round = int(state["round"])
        self.stateful = set(state["stateful"])
        self.restored_stateful = set(self.stateful)
        self.link.lost = list(state["lost"])
        self.run_key = str(state["run_key"])

    def summary(self, wall_time: float) -> dict[str, Any]:
        out = super().summary(wall_time)
        out["runner"] = "flower"
        out["lost_clients"] = list(self.link.lost)
        return out


# ------------------------------------------------------------------ the run
def run_deployment(
    grid: Grid, cfg: ExperimentConfig, settings: FlowerSettings, *, run_id: int = 0
) -> list[Path]:
    """Every split of ``cfg`` over the connected SuperNodes, written like ``feddomain run``
    writes it: ``out/`` for one split, ``out/<split>/`` for several. With ``resume``, finished
    splits are skipped and an interrupted one goes on from its checkpoint. Returns the run dirs."""
    out = settings.out
    if settings.resume:
        _saved_config(out)
    else:
        if out.exists() and any(out.iterdir()):
            raise FeddomainError(
                f"output directory {out} already holds files; choose a new 'out', or continue "
                "it with resume=true"
            )
        out.mkdir(parents=True, exist_ok=True)
        _write_run_config(out, cfg, run_id)
    torch.set_num_threads(cfg.torch_threads)
    run_dirs: list[Path] = []
    index, n_splits = 0, 1
    while index < n_splits:
        link = NodeLink(grid, settings, cfg)
        federation = discover(link, index)
        n_splits = federation.n_splits
        run_dir = out if n_splits == 1 else out / federation.data.split.name
        run_dirs.append(run_dir)
        if (run_dir / "summary.json").exists():
            log.info("%s already finished", run_dir)
        else:
            if not run_dir.exists():
                run_dir.mkdir(parents=True)
                _write_run_config(run_dir, cfg, run_id)
            runner = FlowerRunner(cfg, federation.data, run_dir, link, index)
            _run_split(runner, link)
        index += 1
    return run_dirs


def _run_split(runner: FlowerRunner, link: NodeLink) -> None:
    name = runner.data.split.name
    with _run_log(runner.out):
        log.info(
            "%s %s: clients on SuperNodes %s",
            runner.cfg.algorithm.name,
            name,
            dict(sorted(link.nodes.items())),
        )
        summary = runner.run()
        torch.save(runner.server.state_dict(), runner.out / "server_state.pt")
        log.info(
            "%s %s: id %.3f  ood %.3f  (%s, round %s)  %.1fs",
            summary["algorithm"],
            name,
            _num(summary["id_acc"]),
            _num(summary["ood_acc"]),
            summary["selection"],
            summary["selected_round"],
            summary["wall_time_s"],
        )


def resumed_experiment(out: Path) -> ExperimentConfig:
    """The experiment a run directory was started with."""
    return load_config(_saved_config(out))


def _saved_config(out: Path) -> Path:
    saved = out / "config.yaml"
    if not saved.is_file():
        raise FeddomainError(f"nothing to resume in {out}: it has no config.yaml")
    return saved


def _log_progress(rnd: int, record: dict[str, Any] | None) -> None:
    if record is not None:
        log.info(
            "round %d: id %.3f  ood %.3f", rnd, _num(record["id_acc"]), _num(record["ood_acc"])
        )


def _num(value: float | None) -> float:
    """A metric for the log; NaN when it was not measured (no target set reached)."""
    return float("nan") if value is None else value


class _run_log:
    """The feddomain log of one run, kept in ``flower.log`` in its run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.handler = logging.FileHandler(run_dir / "flower.log")
        self.handler.setFormatter(logging.Formatter(LOG_FORMAT))

    def __enter__(self) -> None:
        log.addHandler(self.handler)
        log.setLevel(logging.INFO)

    def __exit__(self, *exc: object) -> None:
        log.removeHandler(self.handler)
        self.handler.close()


def _write_run_config(run_dir: Path, cfg: ExperimentConfig, run_id: int) -> None:
    """config.yaml as ``feddomain run`` writes it, and the provenance of the deployment."""
    provenance = {
        "feddomain_version": feddomain.__version__,
        "runner": "flower",
        "flwr": flwr.__version__,
        "flower_run_id": run_id,
        "torch": str(torch.__version__),
        "python": sys.version.split()[0],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seed": cfg.seed,
    }
    (run_dir / "provenance.yaml").write_text(yaml.safe_dump(provenance, sort_keys=False))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
