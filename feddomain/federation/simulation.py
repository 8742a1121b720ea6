"""In-process simulator: drives any registered method over clients (and optional stations).

One model object serves every simulated client (memory does not grow with the number of
clients); only per-client *state* that a method keeps (e.g. Local-only's models) does. Messages
are copied on delivery, so client code can never alias server state. Every random draw derives
from (seed, purpose, round, client), so a run resumed from a checkpoint replays exactly.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from feddomain.algorithms import resolve_method
from feddomain.algorithms.base import (
    Arrays,
    ClientContext,
    Plan,
    ServerContext,
    StationAlgorithm,
    StationContext,
    plan_items,
)
from feddomain.config import ExperimentConfig
from feddomain.data.federated import FederatedData
from feddomain.errors import DIVERGED_RECORD, ConfigError, DivergedError, FeddomainError
from feddomain.evaluation.metrics import EvalResult, evaluate_probs, spread, worst_domain
from feddomain.evaluation.selection import select
from feddomain.evaluation.trailing import trailing_means
from feddomain.federation import checkpoint
from feddomain.federation.batched import OptimizerSettings, batching_problem
from feddomain.federation.data import ClientData
from feddomain.federation.device import apply_determinism, autocast, move, resolve_device
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Ledger, Links, UploadCheck, non_finite_scalars
from feddomain.federation.topology import (
    CLIENT_PRE_ROUND,
    CLIENT_TRAIN,
    EVALUATION,
    INIT,
    PILOT_CID,
    PILOT_TASK,
    SERVER,
    derive_seed,
    generator,
    sampling_stream,
)
from feddomain.federation.training import predict_probs, round_lr, set_arrays, unpack_ensemble
from feddomain.models import build_model
from feddomain.models.base import with_memory_format
from feddomain.models.frozen import head_model
from feddomain.models.prefix import split_at

log = logging.getLogger("feddomain")
CPU = torch.device("cpu")
SERVER_STATE = "server_state.pt"  # the final server state of a method that exports it


def make_optimizer_factory(cfg: ExperimentConfig) -> OptimizerSettings:
    """(parameters, learning rate) -> the configured client optimiser."""
    t = cfg.train
    return OptimizerSettings(t.optimizer, t.momentum, t.weight_decay)


class Simulation:
    """Runs one (config, split, seed) and writes ``metrics.jsonl``, checkpoints and the summary."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        data: FederatedData,
        out_dir: Path,
        *,
        progress: Callable[[int, dict[str, Any] | None], None] | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        apply_determinism(cfg.deterministic)
        self.method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
        self.data = (data.pooled() if self.method.spec.pooled else data).to(self.device)
        self.out = out_dir
        self.progress = progress
        self.on_round = on_round  # every round's record once written (experiment tracking)
        n_classes = len(data.classes)
        if cfg.model.frozen:  # clients hold cached backbone features: train only a head
            n_features = int(data.train[0].inputs.shape[1])
            build = lambda: head_model(  # noqa: E731
                n_features, n_classes, hidden=cfg.model.head_hidden, adapter=cfg.model.head_adapter
            )
        else:
            build = lambda: build_model(  # noqa: E731
                cfg.model.name, n_classes, resolution=cfg.dataset.resolution, **cfg.model.options
            )
        if cfg.model.frozen_prefix is not None:  # clients hold the prefix's maps: train the tail
            whole, stage = build, cfg.model.frozen_prefix
            build = lambda: split_at(whole(), stage)[1]  # noqa: E731
        self._build = lambda: self.method.prepare_model(build())
        self.model = with_memory_format(  # initialised on the CPU, then moved
            self._init_model().to(self.device), cfg.model.memory_format, self.device
        )
        model_shapes = {k: v.shape for k, v in self.model.state_dict().items()}
        self.client = self.method.make_client(self.model)
        self.upload_check = UploadCheck(
            self.method.name, self.client.uploads(self.data.n_clients), model_shapes
        )
        self.server = self.method.make_server(
            ServerContext(
                self._init_model,
                self.data.n_clients,
                cfg.seed,
                cfg.rounds,
                stations=len(self.data.stations or []),
            )
        )
        self.stations = self._build_stations()
        self.states = [Message("state") for _ in range(self.data.n_clients)]
        self.pilot_sizes = {d: len(s) for d, s in self.data.pilots.items()}  # images per pilot set
        units = len(self.data.stations) if self.data.stations is not None else self.data.n_clients
        self.schedule = sampling_stream(units, cfg.topology.sample_fraction, cfg.rounds, cfg.seed)
        self.make_optimizer = make_optimizer_factory(cfg)
        self.batched = self._batched_clients()
        self.records: list[dict[str, Any]] = []  # evaluated rounds (metrics.jsonl)
        self.diverged: dict[str, Any] | None = None  # where the model stopped being finite
        self.round_log: list[dict[str, Any]] = []  # every round: phase times, bytes (rounds.jsonl)
        self.rejected: list[dict[str, Any]] = []
        self.links = Links(self.data.stations is not None)  # bytes by link, direction, kind
        self.elapsed = 0.0  # wall time of earlier sessions of this run (resume)
        self.rounds_written = 0  # round_log entries already in rounds.jsonl
        self.client_losses: dict[int, float] = {}  # this round's clients' training losses

    def _batched_clients(self) -> bool:
        """Whether a round's clients train together (``train.batched_clients``): ``auto`` on
        CUDA when nothing stands in the way, ``on`` or a ConfigError naming what does. Only
        where this process runs the clients (not the Flower runner, whose nodes do)."""
        mode = self.cfg.train.batched_clients
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return False
        if type(self).execute is not Simulation.execute:
            return False
        problem = batching_problem(
            self.method.not_batchable, self.model, self.cfg.train, self.cfg.precision
        )
        if problem is None:
            return True
        if mode == "on":
            raise ConfigError(f"invalid configuration: 'train.batched_clients' = 'on': {problem}")
        log.info("clients train one after another: %s", problem)
        return False

    def _init_model(self) -> nn.Module:
        """A fresh model with the run's seeded initialisation (the same for every method)."""
        torch.manual_seed(derive_seed(self.cfg.seed, INIT))
        return self._build()

    def _build_stations(self) -> list[StationAlgorithm]:
        """One station part per station (none in a flat federation), kept for the whole run."""
        return [
            self.method.make_station(
                StationContext(
                    sid,
                    tuple(int(c) for c in members),
                    self.cfg.topology.station_rounds,
                    self.cfg.seed,
                    self._init_model,
                )
            )
            for sid, members in enumerate(self.data.stations or [])
        ]

    @property
    def ledger(self) -> Ledger:
        """Bytes over the server's own link (the only link of a flat federation)."""
        return self.links.server

    # ------------------------------------------------------------------ running
    def run(self) -> dict[str, Any]:
        start_round = self._restore()
        session_start = time.perf_counter()
        if start_round == 1:
            self._collect()
        for rnd in range(start_round, self.cfg.rounds + 1):
            record = self._round(rnd)
            self.round_log.append(record)
            last, scheduled = rnd == self.cfg.rounds, rnd % self.cfg.eval.every == 0
            if last and not scheduled and self.cfg.checkpoint.keep_final:
                # the state a longer run has after this round: before the evaluation (and
                # pilot) that only the last round gets, so an extension replays that run
                self._save(rnd, self.elapsed + time.perf_counter() - session_start)
            if scheduled or last:
                t0 = time.perf_counter()
                self._pilot(rnd)
                if self.cfg.checkpoint.keep_evaluated:
                    checkpoint.save_evaluated(self.out, rnd, self._training_state(rnd))
                evaluated = self._evaluated(rnd, record, t0)
                if evaluated is None:
                    self._append_rounds()
                    break
                record = evaluated
            self._append_rounds()
            if self.on_round:
                self.on_round(record)
            if self.progress:
                self.progress(rnd, record if "id_acc" in record else None)
            every = self.cfg.checkpoint.every
            if (every and rnd % every == 0 and not last) or (
                last and scheduled and self.cfg.checkpoint.keep_final
            ):
                self._save(rnd, self.elapsed + time.perf_counter() - session_start)
        wall = self.elapsed + time.perf_counter() - session_start
        summary = self.summary(wall)
        if self.server.exports_state:
            summary["server_state"] = self._export_state()
        _write_json_atomic(self.out / "summary.json", summary)
        if self.cfg.checkpoint.keep_final and not self.diverged:
            checkpoint.keep_final(self.out)
        else:  # nothing to extend a diverged run from
            checkpoint.remove(self.out)
        return summary

    def _round(self, rnd: int) -> dict[str, Any]:
        units = self.schedule[rnd - 1]
        timing = {"train": 0.0, "aggregate": 0.0, "evaluate": 0.0}
        ledger_before = self.links.snapshot()
        self._pre_round(rnd, units, timing)
        plan = self.server.configure(rnd, units)
        if self.data.stations is None:
            replies = self._client_replies(rnd, plan, timing)
        else:
            replies = self._station_replies(rnd, plan, timing)
        # Replies are produced lazily: a streaming server (FedAvg) folds each one into a running
        # mean and drops it, so memory does not grow with the number of clients.
        t0 = time.perf_counter()
        self.server.aggregate(rnd, _then_seed(replies, derive_seed(self.cfg.seed, SERVER, rnd)))
        timing["aggregate"] = time.perf_counter() - t0 - timing["train"]  # incl. stations
        timing.update({f"server_{k}": v for k, v in self.server.timings().items()})
        server = self.server.round_record()
        return {
            "round": rnd,
            "time": timing,
            **self._sent(ledger_before),
            "participants": len(units),
            **self._loss_spread(),
            **({"server": server} if server else {}),
        }

    def _loss_spread(self) -> dict[str, Any]:
        """The round's clients' mean training losses (the ``loss`` their replies report; the
        last station round's for a client under a station) and their population variance
        across clients, the fairness quantity FedVR regularises (fedvr.md §5.3 a), logged for
        every method so that methods can be compared on it."""
        losses, self.client_losses = self.client_losses, {}
        if not losses:
            return {}
        values = np.array([losses[c] for c in sorted(losses)], dtype=np.float64)
        return {
            "client_loss": {str(c): losses[c] for c in sorted(losses)},
            "client_loss_var": float(values.var()),
        }

    def _sent(self, before: dict[str, dict[str, dict[str, int]]]) -> dict[str, Any]:
        """Bytes since ``before`` (a ``links.snapshot()``): over the server's link, the array
        payload each way and the ledger by kind; with stations, ``links``: every link's ledger
        (a flat federation has one link, the ledger itself)."""
        links = self.links.since(before)
        ledger = links[self.links.server_link]
        arrays = {d: ledger[d]["model"] + ledger[d]["statistics"] for d in ledger}
        sent = {"bytes_up": arrays["up"], "bytes_down": arrays["down"], "ledger": ledger}
        return {**sent, "links": links} if len(links) > 1 else sent

    def _pre_round(self, rnd: int, units: list[int], timing: dict[str, float]) -> None:
        """The server's optional task for this round's participating clients before it
        configures the round (FedIIR's mean classifier gradient, FedDG-GA's pre-training
        losses): replies checked and rejected like any reply."""
        clients = units
        if self.data.stations is not None:
            clients = [int(c) for s in units for c in self.data.stations[s]]
        plan = self.server.pre_round(rnd, clients)
        if plan:
            replies = self._client_replies(rnd, plan, timing, purpose=CLIENT_PRE_ROUND)
            self.server.on_pre_round(rnd, dict(replies))

    def _client_replies(
        self,
        rnd: int,
        plan: Plan,
        timing: dict[str, float],
        station_round: int = 0,
        purpose: int = CLIENT_TRAIN,
    ) -> Iterator[tuple[int, Message]]:
        """Train each planned client in turn; yield the finite replies, reject the others.

        A lazy plan (an iterator) is pulled one client at a time, interleaved with the server's
        consumption of replies, so a sequential method (pFedHN) can build client i+1's message
        from the state that client i's reply produced."""
        if self.batched and purpose == CLIENT_TRAIN and isinstance(plan, Mapping):
            yield from self._batched_replies(rnd, plan, timing, station_round)
            return
        for cid, msg in self._deliver(rnd, plan, timing, station_round, purpose):
            t0 = time.perf_counter()
            reply = self._run_client(cid, rnd, msg, station_round, purpose)
            timing["train"] += time.perf_counter() - t0
            if not self._rejected(rnd, "client", cid, reply):
                if purpose == CLIENT_TRAIN and "loss" in reply.scalars:
                    self.client_losses[cid] = float(reply.scalars["loss"])
                yield cid, reply

    def _batched_replies(
        self, rnd: int, plan: Mapping[int, Message], timing: dict[str, float], station_round: int
    ) -> Iterator[tuple[int, Message]]:
        """The planned clients trained together (``execute_batch``), then each reply checked,
        counted and rejected as ``_run_client`` and ``_client_replies`` do one by one."""
        items = list(plan.items())
        t0 = time.perf_counter()
        replies = self.execute_batch(rnd, items, station_round) if items else []
        timing["train"] += time.perf_counter() - t0
        for (cid, msg), reply in zip(items, replies, strict=True):
            n_samples = int(self.data.client_domain_counts[cid].sum())
            reply = self._checked(self.links.clients, cid, n_samples, msg, lambda r=reply: r)
            if not self._rejected(rnd, "client", cid, reply):
                yield cid, reply

    def execute_batch(
        self, rnd: int, items: list[tuple[int, Message]], station_round: int = 0
    ) -> list[Message]:
        """``execute`` for several clients at once: each with the context (generator, state) it
        would have had alone, trained by the client part's ``run_batch``."""
        ctxs = [
            self._context(
                cid,
                rnd,
                generator(self.cfg.seed, CLIENT_TRAIN, rnd, cid, station_round),
                station_round,
            )
            for cid, _ in items
        ]
        for ctx in ctxs:
            move(ctx.state, self.device)
        replies = self.client.run_batch([move(m.copy(), self.device) for _, m in items], ctxs)
        for ctx in ctxs:
            move(ctx.state, CPU)
        return [move(r.copy(), CPU) for r in replies]

    def _rejected(self, rnd: int, sender: str, uid: int, msg: Message) -> bool:
        """Whether ``msg`` holds non-finite values: then it is logged, listed in the summary's
        ``rejected_updates`` and dropped, and the round goes on without it."""
        bad = msg.has_non_finite() + non_finite_scalars(msg)
        if bad:
            log.warning(
                "round %d: %s %d sent non-finite values in %s; update rejected",
                rnd,
                sender,
                uid,
                bad[:5],
            )
            self.rejected.append({"round": rnd, sender: uid, "arrays": bad})
        return bool(bad)

    def _deliver(
        self,
        rnd: int,
        plan: Plan,
        timing: dict[str, float],
        station_round: int,
        purpose: int = CLIENT_TRAIN,
    ) -> Iterator[tuple[int, Message]]:
        """The planned (client, message) pairs whose task can run now: all of them in-process
        (``execute`` runs each when asked). The Flower runner sends them to the nodes here and
        passes on the clients that replied."""
        yield from plan_items(plan)

    def _station_replies(
        self, rnd: int, plan: Plan, timing: dict[str, float]
    ) -> Iterator[tuple[int, Message]]:
        """Each planned station runs its round when the server pulls its reply (lazily, as
        clients do in a flat federation); stations with nothing to send are skipped."""
        for sid, msg in plan_items(plan):
            reply = self._run_station(sid, rnd, msg, timing)
            if reply is not None:
                yield sid, reply

    def _run_station(
        self, sid: int, rnd: int, msg: Message, timing: dict[str, float]
    ) -> Message | None:
        """Station ``sid``'s part of round ``rnd``: the server's message goes down, R station
        rounds run over its clients, and its uplink comes up (``None``: it sends nothing, or
        every client reply of a station round was rejected, or the uplink was)."""
        station = self.stations[sid]
        self.links.server.add("down", self.upload_check.message_bytes(msg))
        station.begin(rnd, msg.copy())
        clients = list(station.ctx.clients)
        for r in range(self.cfg.topology.station_rounds):
            task = station.pre_round(rnd, r, clients)
            if task is not None:
                replies = self._client_replies(rnd, task, timing, r, CLIENT_PRE_ROUND)
                station.on_pre_round(rnd, r, dict(replies))
            accepted = _Counted(
                self._client_replies(
                    rnd, dict.fromkeys(clients, station.downlink(rnd, r)), timing, r
                )
            )
            station.aggregate(rnd, r, iter(accepted))
            if not accepted.n:  # every client of the station was rejected
                return None
        up = station.uplink(rnd)
        if up is None:
            return None
        self.links.server.add("up", self.upload_check.message_bytes(up))
        return None if self._rejected(rnd, "station", sid, up) else up.copy()

    def _run_client(
        self,
        cid: int,
        rnd: int,
        msg: Message,
        station_round: int = 0,
        purpose: int = CLIENT_TRAIN,
    ) -> Message:
        """One client task as its server (or station) sees it: the message goes down, the reply
        comes up and is held against the method's privacy declaration before anything reads it."""
        n_samples = int(self.data.client_domain_counts[cid].sum())
        return self._checked(
            self.links.clients,
            cid,
            n_samples,
            msg,
            lambda: self.execute(cid, rnd, msg, station_round, purpose),
        )

    def _checked(
        self,
        ledger: Ledger,
        sender: int,
        n_samples: int,
        msg: Message,
        run: Callable[[], Message],
    ) -> Message:
        """``msg`` goes down, ``run()`` produces the reply, which is held against the method's
        privacy declaration (``n_samples``: the sender's sample count, for the per-sample
        check) before anything reads it; both are counted on ``ledger``."""
        ledger.add("down", self.upload_check.message_bytes(msg))
        reply = run()
        self.upload_check.check(sender, reply, n_samples)
        ledger.add("up", self.upload_check.message_bytes(reply))
        return reply

    def execute(
        self,
        cid: int,
        rnd: int,
        msg: Message,
        station_round: int = 0,
        purpose: int = CLIENT_TRAIN,
    ) -> Message:
        """Run client ``cid``'s part on ``msg`` with its seeded context (the client side).
        ``purpose`` keeps the seeds of a pre-round task apart from the round's training."""
        keys = (purpose, rnd, cid, station_round)
        torch.manual_seed(derive_seed(self.cfg.seed, *keys))
        ctx = self._context(cid, rnd, generator(self.cfg.seed, *keys), station_round)
        return self._on_device(msg, ctx)

    def _on_device(self, msg: Message, ctx: ClientContext) -> Message:
        """Run the client part with its message and state on the run's device (and its
        precision); the reply and the state it keeps come back to the CPU."""
        move(ctx.state, self.device)
        with autocast(self.device, self.cfg.precision):
            reply = self.client.run(move(msg.copy(), self.device), ctx)
        move(ctx.state, CPU)
        return move(reply.copy(), CPU)

    def _context(
        self, cid: int, rnd: int, gen: torch.Generator, station_round: int = 0
    ) -> ClientContext:
        t = self.cfg.train
        lr = round_lr(
            t.lr,
            max(rnd, 1),
            self.cfg.rounds,
            t.schedule,
            min_lr=t.min_lr,
            step_at=t.step_at,
            gamma=t.step_gamma,
        )
        return ClientContext(
            cid=cid,
            rnd=rnd,
            model=self.model,
            train=self.data.train[cid],
            val=self.data.val[cid],
            state=self.states[cid],
            generator=gen,
            local_epochs=t.local_epochs,
            batch_size=t.batch_size,
            make_optimizer=self.make_optimizer,
            grad_clip=t.grad_clip,
            rounds=self.cfg.rounds,
            station_round=station_round,
            station_rounds=self.cfg.topology.station_rounds,
            lr=lr,
            normalization=(t.mean, t.std) if t.mean is not None and t.std is not None else None,
            drop_last=t.drop_last,
            persistent_optimizer=t.persistent_optimizer,
            precise_bn=t.precise_bn,
            max_steps=t.max_steps,
        )

    def _collect(self) -> None:
        """Round 0: the one-time statistics task to every client (``collect``), then the
        server's one-time message to every client (``broadcast``, e.g. FISC's interpolation
        style), whose replies are checked and counted like any reply, then dropped."""
        clients = list(range(self.data.n_clients))
        before = self.links.snapshot()
        timing = {"train": 0.0, "aggregate": 0.0, "evaluate": 0.0}
        t0 = time.perf_counter()
        plan = self.server.collect(clients)
        if plan:
            delivered = self._deliver(0, plan, timing, 0, CLIENT_TRAIN)
            replies = {c: self._run_client(c, 0, m) for c, m in delivered}
            timing["train"] = time.perf_counter() - t0  # the clients' part
            t1 = time.perf_counter()
            self.server.on_collect(replies)
            timing["aggregate"] = time.perf_counter() - t1  # the server's part
        sent = self.server.broadcast(clients)
        if sent:
            t1 = time.perf_counter()
            for c, m in self._deliver(0, sent, timing, 0, CLIENT_PRE_ROUND):
                self._run_client(c, 0, m, 0, CLIENT_PRE_ROUND)
            timing["train"] += time.perf_counter() - t1
        if plan or sent:
            self.round_log.append(
                {"round": 0, "task": "collect", "time": timing, **self._sent(before)}
            )

    # ------------------------------------------------------------------ pilot
    def _pilot(self, rnd: int) -> None:
        """Before an evaluation, run the server's pilot task of each target domain on that
        domain's unlabeled pilot set and hand the finite reply back (``on_pilot``); its bytes
        are a ``"task": "pilot"`` record of this round in rounds.jsonl."""
        before, t0, asked = self.links.snapshot(), time.perf_counter(), False
        for domain in self.data.split.test:
            task = self.server.pilot_task(domain)
            if task is None:
                continue
            asked = True
            if domain not in self.pilot_sizes:
                raise ConfigError(
                    f"{self.method.name} asks for a pilot set of target {domain!r}, but there is "
                    "none: set split.pilot_fraction (e.g. 0.1, FedVR's choice)"
                )
            reply = self._run_pilot(domain, rnd, task)
            bad = reply.has_non_finite() + non_finite_scalars(reply)
            if bad:
                log.warning("round %d: the pilot task of %s sent non-finite %s", rnd, domain, bad)
                self.rejected.append({"round": rnd, "client": PILOT_CID, "arrays": bad})
                continue
            self.server.on_pilot(domain, reply)
        if asked:
            timing = {"train": time.perf_counter() - t0, "aggregate": 0.0, "evaluate": 0.0}
            self.round_log.append(
                {"round": rnd, "task": "pilot", "time": timing, **self._sent(before)}
            )

    def _run_pilot(self, domain: str, rnd: int, msg: Message) -> Message:
        """A pilot task as the server sees it, like ``_run_client``: its reply is held against
        the privacy declaration (sender ``PILOT_CID``; one row per pilot image is per-sample
        data) and its bytes are counted."""
        return self._checked(
            self.ledger,
            PILOT_CID,
            self.pilot_sizes[domain],
            msg,
            lambda: self.execute_pilot(domain, rnd, msg),
        )

    def execute_pilot(self, domain: str, rnd: int, msg: Message) -> Message:
        """Run the client part on ``domain``'s pilot set (the client side; on Flower, a node
        holding the target set runs this)."""
        keys = (PILOT_TASK, rnd, self.data.split.test.index(domain))
        torch.manual_seed(derive_seed(self.cfg.seed, *keys))
        ctx = self._pilot_context(domain, rnd, generator(self.cfg.seed, *keys))
        return self._on_device(msg, ctx)

    def _pilot_context(self, domain: str, rnd: int, gen: torch.Generator) -> ClientContext:
        """A context whose data is the pilot set (labels withheld: all UNLABELED), with no
        validation data and a fresh state: no client's data or state is in reach."""
        pilot = self.data.pilots[domain]
        return ClientContext(
            cid=PILOT_CID,
            rnd=rnd,
            model=self.model,
            train=pilot,
            val=ClientData(pilot.inputs[:0], pilot.labels[:0], pilot.transform),
            state=Message("state"),
            generator=gen,
            local_epochs=self.cfg.train.local_epochs,
            batch_size=self.cfg.train.batch_size,
            make_optimizer=self.make_optimizer,
            grad_clip=self.cfg.train.grad_clip,
        )

    # --------------------------------------------------------------- evaluation
    def _evaluated(self, rnd: int, record: dict[str, Any], t0: float) -> dict[str, Any] | None:
        """``record`` with round ``rnd``'s evaluation (scores, the server's diagnostics, the
        time since ``t0``), appended to the records and metrics.jsonl; None when the model
        diverged (the run stops). An evaluation draws from its own stream, seeded from (seed,
        round) and restored after it (FedFD's random test-time mix draws), so training never
        depends on what it drew and a rescore draws the same."""
        try:
            with torch.random.fork_rng(devices=self._cuda_devices()):
                torch.manual_seed(derive_seed(self.cfg.seed, EVALUATION, rnd))
                scores = self.evaluate()
        except DivergedError as err:
            self._diverged_at(rnd, err)
            return None
        record = {**record, **scores}
        diagnostics = self.server.diagnostics()
        if diagnostics:
            record["diagnostics"] = diagnostics
        record["time"]["evaluate"] = time.perf_counter() - t0
        self.records.append(record)
        self._append_metrics(record)
        return record

    def _cuda_devices(self) -> list[int]:
        """The CUDA device whose generator an evaluation forks (none on the CPU)."""
        if self.device.type != "cuda":
            return []
        return [self.device.index if self.device.index is not None else torch.cuda.current_device()]

    def rescore(self, source: Path) -> dict[str, Any]:
        """Score the evaluated states kept by the finished run ``source``
        (``checkpoint.keep_evaluated``) under this config, which differs from its own only in
        settings that act at evaluation (``feddomain.rescore`` checks): the run that training
        with this config writes, without the training. The rounds' log, bytes and rejected
        updates are ``source``'s; the evaluations, their times and the wall time this one's.
        Settings under which the model diverges are refused: the run trained with them stops
        there, and the source's later rounds cannot be taken back."""
        # report.py loads SciPy and matplotlib: a run that does not rescore must not pay for them
        from feddomain.evaluation.report import read_metrics

        start = time.perf_counter()
        finished = json.loads((source / "summary.json").read_text())
        self.round_log = read_metrics(source / "rounds.jsonl")
        scored = {r["round"] for r in read_metrics(source / "metrics.jsonl")}
        for entry in (r for r in self.round_log if "task" not in r):
            rnd, record = entry["round"], entry
            if rnd in scored:
                t0 = time.perf_counter()
                path = checkpoint.evaluated_path(source, rnd)
                state = checkpoint.read(path, "rerun the source to rescore it")
                if state is None:
                    raise FeddomainError(f"rescore {source}: {path} is missing")
                self._load_training_state(state)
                record = self._evaluated(rnd, entry, t0)
                if record is None:
                    raise FeddomainError(
                        f"rescore {source}: {self.diverged['message']}; the run trained with "
                        "these settings stops there, which a rescore cannot stand for: train "
                        "it (`feddomain run`)"
                    )
            if self.on_round:
                self.on_round(record)
        self.rejected = finished["rejected_updates"]
        self.links.load(finished["links"])
        _write_json_lines(self.out / "rounds.jsonl", self.round_log)
        summary = self.summary(time.perf_counter() - start)
        summary["rescored_from"] = {"run": str(source), "wall_time_s": finished["wall_time_s"]}
        if self.server.exports_state:
            summary["server_state"] = self._export_state()
        _write_json_atomic(self.out / "summary.json", summary)
        return summary

    def evaluate(self) -> dict[str, Any]:
        """id accuracy per client on its own validation split with the model it would use; ood
        accuracy of the same models on every target domain (one shared model is scored once),
        and of the method's unseen-domain model if it has one."""
        by_model: dict[int, tuple[dict[str, EvalResult], dict[str, EvalResult]]] = {}
        keep = []  # hold references so id() stays unique while grouping
        id_results: list[EvalResult | None] = []
        ood_per_client: list[dict[str, EvalResult]] = []
        ood_val_per_client: list[dict[str, EvalResult]] = []
        for cid in range(self.data.n_clients):
            arrays = self.load_eval_model(cid, self.server.eval_arrays(cid))
            keep.append(arrays)
            id_results.append(self.score_id(cid))
            if id(arrays) not in by_model:
                by_model[id(arrays)] = self.score_held_out()
            ood, ood_val = by_model[id(arrays)]
            ood_per_client.append(ood)
            ood_val_per_client.append(ood_val)
        return _summarise_eval(
            id_results, ood_per_client, ood_val_per_client, len(by_model), self.unseen_scores()
        )

    def unseen_scores(self) -> dict[str, EvalResult] | None:
        """The method's unseen-domain model (``server.eval_arrays(None)``) on every target
        domain; None when it has none."""
        offered = self.server.eval_arrays(None)
        return None if offered is None else self.score_unseen(offered)

    def score_unseen(self, arrays: Arrays) -> dict[str, EvalResult]:
        """``arrays`` on every target domain, loaded as given (no client chooses its model); a
        packed ensemble (``training.pack_ensemble``) is scored by its members' mean predicted
        probabilities."""
        members = unpack_ensemble(arrays)
        if members is None:
            set_arrays(self.model, arrays)
            return {d: self.score(s) for d, s in self.data.targets.items()}
        out = {}
        for domain, data in self.data.targets.items():
            probs = []
            for member in members:
                set_arrays(self.model, member)
                with autocast(self.device, self.cfg.precision):
                    probs.append(predict_probs(self.model, data, self.cfg.eval.batch_size).cpu())
            out[domain] = evaluate_probs(torch.stack(probs).mean(0), data.labels.cpu())
        return out

    def load_eval_model(self, cid: int, offered: Arrays | None) -> Arrays:
        """Load the model client ``cid`` would use, given the server's offer, into the shared
        model object; returns its arrays (the offer itself unless the client keeps its own)."""
        arrays = self.client.eval_arrays(offered, self._context(cid, 0, torch.Generator()))
        set_arrays(self.model, arrays)
        return arrays

    def score_id(self, cid: int) -> EvalResult | None:
        """The loaded model on client ``cid``'s validation split (None if it has none)."""
        val = self.data.val[cid]
        return self.score(val) if len(val) else None

    def score(self, data: ClientData) -> EvalResult:
        """Metrics of the model now loaded in the shared model object, on ``data`` (predicted
        on the run's device, scored on the CPU)."""
        with autocast(self.device, self.cfg.precision):
            probs = predict_probs(self.model, data, self.cfg.eval.batch_size)
        if not bool(torch.isfinite(probs).all()):
            raise DivergedError(
                f"the model to evaluate gives non-finite outputs: training diverged "
                f"({self.method.spec.name}, train.lr {self.cfg.train.lr:g}; a smaller step, "
                "the client's or the method's own, may keep it finite)"
            )
        return evaluate_probs(probs.cpu(), data.labels.cpu())

    def _diverged_at(self, rnd: int, err: DivergedError) -> None:
        """Stop a run whose model diverged at evaluation round ``rnd``: with earlier evaluations
        it finishes on them (summary.json says where it diverged; selection picks among them);
        without any, ``diverged.json`` records the outcome (a tune scores it as the worst
        trial, a sweep does not rerun it) and the error is raised."""
        message = f"round {rnd}: {err}"
        if not self.records:
            _write_json_atomic(self.out / DIVERGED_RECORD, {"round": rnd, "message": message})
            raise DivergedError(message) from None
        log.warning("%s; the run stops and keeps its evaluations up to round %d", message,
                    self.records[-1]["round"])  # fmt: skip
        self.diverged = {"round": rnd, "message": message}

    def score_held_out(self) -> tuple[dict[str, EvalResult], dict[str, EvalResult]]:
        """The loaded model on every held-out domain: (test domains, validation domains)."""
        return (
            {d: self.score(s) for d, s in self.data.targets.items()},
            {d: self.score(s) for d, s in self.data.ood_val.items()},
        )

    # ------------------------------------------------------------------ outputs
    def summary(self, wall_time: float) -> dict[str, Any]:
        cfg = self.cfg
        chosen = select(self.records, cfg.eval.selection)
        final = self.records[-1]
        headline = ("id_acc", "ood_acc", "ood_macro_f1", "ood_ece", "ood_nll", "ood_brier")
        out: dict[str, Any] = {
            "algorithm": cfg.algorithm.label or cfg.algorithm.name,
            "method": cfg.algorithm.name,
            "dataset": self.data.dataset,
            "split": self.data.split.name,
            "source_domains": list(self.data.split.train),
            "target_domains": list(self.data.split.test),
            "val_domains": list(self.data.split.val),
            "seed": cfg.seed,
            "rounds": cfg.rounds,
            "n_clients": self.data.n_clients,
            "classes": list(self.data.classes),  # chance is 1 / len: report marks results below it
            "selection": chosen["selection"],
            "selected_round": chosen["selected_round"],
            **{k: chosen.get(k) for k in headline},
            "per_domain": chosen["per_domain"],
            "worst_domain_acc": chosen["worst_domain_acc"],
            "per_client": chosen["per_client"],
            **({"client_ood_acc": chosen["client_ood_acc"]} if "client_ood_acc" in chosen else {}),
            "final": {k: final.get(k) for k in (*headline, "per_domain")},
            "reliability": {"ood": chosen["calibration"]["reliability"]},
            "confidence_hist": chosen["calibration"]["confidence_hist"],
            "bytes_up": self.ledger.array_bytes("up"),
            "bytes_down": self.ledger.array_bytes("down"),
            "ledger": self.ledger.snapshot(),
            "links": self.links.snapshot(),
            "rejected_updates": self.rejected,
            "client_domain_counts": self.data.client_domain_counts.tolist(),
            "wall_time_s": round(wall_time, 3),
        }
        trailing = trailing_means(self.round_log)
        if trailing:
            out["trailing"] = trailing
        out["phase_seconds"] = phase_seconds(self.round_log)
        server = self.server.run_summary()
        if server:
            out["server"] = server
        if self.diverged:
            out["diverged"] = self.diverged
        return out

    def _export_state(self) -> dict[str, Any]:
        """The final server state for tools built on a finished run, and what identifies it."""
        state = self.server.state_dict()
        checkpoint.write_atomic(self.out / SERVER_STATE, state)
        return {
            "file": SERVER_STATE,
            "fingerprint": checkpoint.fingerprint(state),
            "classes": list(self.data.classes),
        }

    def _append_rounds(self) -> None:
        """Append the round log's new entries to rounds.jsonl once the round (its evaluation
        time included) is complete, so the file can be followed while the run goes on."""
        new = self.round_log[self.rounds_written :]
        with open(self.out / "rounds.jsonl", "a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in new))
        self.rounds_written = len(self.round_log)

    def _append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    # --------------------------------------------------------------- checkpoints
    def _save(self, rnd: int, elapsed: float) -> None:
        checkpoint.save(self.out, self._checkpoint(rnd, elapsed))

    def _checkpoint(self, rnd: int, elapsed: float) -> dict[str, Any]:
        """Everything a resumed run needs to go on exactly as if never stopped."""
        return {
            **self._training_state(rnd),
            "records": self.records,
            "round_log": self.round_log,
            "rejected": self.rejected,
            "links": self.links.snapshot(),
            "elapsed": elapsed,
        }

    def _training_state(self, rnd: int) -> dict[str, Any]:
        """What training has made of the server, stations and clients after round ``rnd``:
        all an evaluation reads (kept per evaluated round for ``feddomain rescore``)."""
        return {
            "round": rnd,
            "server": self.server.state_dict(),
            "stations": [s.state_dict() for s in self.stations],
            "states": [(s.arrays, s.scalars) for s in self.states],
        }

    def _restore(self) -> int:
        """Load the latest checkpoint if there is one; returns the round to start from."""
        state = checkpoint.load(self.out)
        if state is None:
            for name in ("metrics.jsonl", "rounds.jsonl"):
                (self.out / name).unlink(missing_ok=True)
            return 1
        self._load_checkpoint(state)
        # rewrite both logs to what the checkpoint knows: later lines are recomputed
        _write_json_lines(self.out / "metrics.jsonl", self.records)
        _write_json_lines(self.out / "rounds.jsonl", self.round_log)
        self.rounds_written = len(self.round_log)
        log.info("resumed %s after round %d", self.out, state["round"])
        return int(state["round"]) + 1

    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        self._load_training_state(state)
        self.records, self.rejected = state["records"], state["rejected"]
        self.round_log = state["round_log"]
        self.links.load(state["links"])
        self.elapsed = state["elapsed"]

    def _load_training_state(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state["server"])
        for station, saved in zip(self.stations, state["stations"], strict=True):
            station.load_state_dict(saved)
        self.states = [Message("state", a, s) for a, s in state["states"]]


class _Counted:
    """Replies passed through once, counting them (a station round with none ends early)."""

    def __init__(self, replies: Iterator[tuple[int, Message]]) -> None:
        self.replies = replies
        self.n = 0

    def __iter__(self) -> Iterator[tuple[int, Message]]:
        for item in self.replies:
            self.n += 1
            yield item


def _then_seed(replies: Iterator[tuple[int, Message]], seed: int) -> Iterator[tuple[int, Message]]:
    """Pass replies through, then reseed torch's global RNG for the server's own step, so the
    server's randomness does not depend on how many clients trained before it."""
    yield from replies
    torch.manual_seed(seed)


def phase_seconds(round_log: list[dict[str, Any]]) -> dict[str, float]:
    """Each phase's seconds (``time`` of every round and one-time task: train, aggregate,
    evaluate and a method's own parts, such as HFedATM's ``server_merge``) summed over the run,
    kept in the summary because the campaign commits no per-round log."""
    totals: dict[str, float] = {}
    for record in round_log:
        for phase, seconds in record.get("time", {}).items():
            totals[phase] = totals.get(phase, 0.0) + seconds
    return {phase: round(seconds, 3) for phase, seconds in totals.items()}


def _summarise_eval(
    id_results: list[EvalResult | None],
    ood: list[dict[str, EvalResult]],
    ood_val: list[dict[str, EvalResult]],
    distinct_models: int,
    unseen: dict[str, EvalResult] | None = None,
) -> dict[str, Any]:
    """Run-level numbers: unweighted means over clients (hFedF §2.5), plus spreads. A client
    with no ood results (a site of a Flower run without the target set) is left out of the ood
    means; if no client has any, the ood numbers are None. With the scores of an unseen-domain
    model (``unseen``), the run-level ood numbers are that model's; the clients' stay in
    ``per_client.ood_acc`` and their mean in ``client_ood_acc``."""
    scored = [c for c in ood if c]
    targets = list(scored[0]) if scored else []
    per_client_ood = [float(np.mean([c[d].acc for d in targets])) if c else None for c in ood]
    ood_accs = [a for a in per_client_ood if a is not None]
    models = [unseen] if unseen else scored  # what the run-level ood numbers score
    domains = list(models[0]) if models else []
    model_accs = [float(np.mean([c[d].acc for d in domains])) for c in models]
    per_domain = {d: float(np.mean([c[d].acc for c in models])) for d in domains}
    worst_name, worst_acc = worst_domain(per_domain) if per_domain else (None, None)
    ids = [r.acc for r in id_results if r is not None]
    pooled_ood = [c[d] for c in models for d in domains]
    per_image = 1 / len(models) if models else 1.0  # each target image once over the models
    out: dict[str, Any] = {
        "id_acc": float(np.mean(ids)) if ids else None,
        "ood_acc": float(np.mean(model_accs)) if model_accs else None,
        "ood_ece": _mean_over(models, "ece"),
        "ood_nll": _mean_over(models, "nll"),
        "ood_brier": _mean_over(models, "brier"),
        "ood_macro_f1": _mean_over(models, "macro_f1"),
        "per_domain": per_domain,
        "worst_domain": worst_name,
        "worst_domain_acc": worst_acc,
        "per_client": {
            "id_acc": [r.acc if r else None for r in id_results],
            "ood_acc": per_client_ood,
        },
        "ood_spread": spread(ood_accs) if ood_accs else None,
        "distinct_models": distinct_models,
        "calibration": {
            "reliability": _pooled_reliability(pooled_ood, per_image) if pooled_ood else {},
            "confidence_hist": {
                "id": _pooled_hist([r for r in id_results if r is not None]),
                "ood": _pooled_hist(pooled_ood, per_image),
            },
        },
    }
    if ids:
        out["id_spread"] = spread(ids)
    val_scored = [c for c in ood_val if c]
    if val_scored:
        out["ood_val_acc"] = float(
            np.mean([np.mean([r.acc for r in c.values()]) for c in val_scored])
        )
    if unseen:
        out["client_ood_acc"] = float(np.mean(ood_accs)) if ood_accs else None
    return out


def _mean_over(per_client: list[dict[str, EvalResult]], field: str) -> float | None:
    if not per_client:
        return None
    return float(np.mean([np.mean([getattr(r, field) for r in c.values()]) for c in per_client]))


def _counts(total: np.ndarray, weight: float) -> list[float] | list[int]:
    """Bin counts scaled by ``weight``: ints where that is exact (one model, or all alike)."""
    scaled = total * weight
    rounded = np.rint(scaled)
    return rounded.astype(int).tolist() if np.allclose(scaled, rounded) else scaled.tolist()


def _pooled_reliability(results: list[EvalResult], weight: float = 1.0) -> dict[str, list[float]]:
    """Reliability bins of ``results`` pooled, counts scaled by ``weight``: the ood results of
    every client's model over every target, each image counted once (weight 1/clients: a model
    shared by all clients is one model, distinct models each count for a share, as the
    run-level ood numbers average them)."""
    count = np.sum([r.reliability.count for r in results], axis=0).astype(np.float64)
    conf = np.sum([np.multiply(r.reliability.count, r.reliability.conf) for r in results], axis=0)
    acc = np.sum([np.multiply(r.reliability.count, r.reliability.acc) for r in results], axis=0)
    safe = np.maximum(count, 1)
    return {
        "count": _counts(count, weight),
        "conf": (conf / safe).tolist(),
        "acc": (acc / safe).tolist(),
    }


def _pooled_hist(results: list[EvalResult], weight: float = 1.0) -> dict[str, list[int]]:
    if not results:
        return {}
    return {
        k: _counts(np.sum([r.conf_hist[k] for r in results], axis=0).astype(np.float64), weight)
        for k in ("correct", "incorrect")
    }


def _write_json_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    """``lines`` as JSON lines, replacing ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    os.replace(tmp, path)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
