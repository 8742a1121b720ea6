"""The algorithm contract: a method is a server part, a client part and an optional station part.

The engine (``federation/``) drives these objects and never names a method. Parts talk only through
``Message`` objects (named arrays + scalars), which is what lets the same classes run in the
in-process simulator and on Flower.

Round protocol, as the runner executes it::

    server.collect(clients) -> {cid: Message}      # once before round 1 (statistics), optional
    client.run(msg, ctx)    -> Message
    server.on_collect(replies)
    server.broadcast(clients) -> {cid: Message}    # once: what every client keeps, optional
    client.run(msg, ctx)    -> Message             # (its reply is checked, then dropped)
    for each round:
        [server.pre_round(rnd, participants) -> Plan; client.run; server.on_pre_round(...)]
        server.configure(rnd, sampled) -> {cid: Message}     # "fit" tasks (to sampled stations
                                                             # in hierarchical topologies)
        client.run(msg, ctx)           -> Message           # trains; returns update + num_examples
        server.aggregate(rnd, replies)
    evaluation, for each target domain d with a pilot task:
        server.pilot_task(d)    -> Message | None
        client.run(msg, ctx)    -> Message        # ctx: the unlabeled pilot set, cid PILOT_CID
        server.on_pilot(d, reply)
    then server.eval_arrays(cid) -> arrays | None, client.eval_arrays(arrays, ctx) per client,
    and server.eval_arrays(None) -> the unseen-domain model, if the method has one

With stations, each sampled station s stands between the server and its clients::

        station[s].begin(rnd, msg)                           # the server's message
        for r in range(station_rounds):
            [station[s].pre_round(rnd, r, clients) -> Plan]  # optional task, replies to
            [client.run(...); station[s].on_pre_round(...)]  #   on_pre_round
            station[s].downlink(rnd, r)  -> Message          # what its clients receive
            client.run(msg, ctx)         -> Message
            station[s].aggregate(rnd, r, replies)
        station[s].uplink(rnd)           -> Message | None   # its reply to the server

Every client reply is checked against the client part's ``uploads()`` declaration (the privacy
contract, ``federation/privacy.py``) before the server sees it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from feddomain.algorithms.space import Space
from feddomain.errors import ConfigError
from feddomain.federation.batched import FunctionalRegularizer, OptimizerSettings, fit_clients
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import (
    LossFn,
    TrainStats,
    cross_entropy_loss,
    load_optimizer_state,
    recalibrate_batchnorm,
    save_optimizer_state,
    set_arrays,
    train_epochs,
)

Arrays = dict[str, torch.Tensor]
# A round's plan: one message per client, as a dict, or lazily as (client id, message) pairs.
Plan = Mapping[int, Message] | Iterator[tuple[int, Message]]


def plan_items(plan: Plan) -> Iterable[tuple[int, Message]]:
    return plan.items() if isinstance(plan, Mapping) else plan


class Hparams(BaseModel):
    """Base for a method's hyper-parameters: unknown keys are errors, values are typed."""

    # attribute docstrings become the hyper-parameters' meanings in docs/config.md
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


@dataclass
class ServerContext:
    """What a server part may know: how to build the model, and the federation's shape."""

    model_factory: Callable[[], nn.Module]  # a freshly initialised model (seeded by the runner)
    n_clients: int
    seed: int
    rounds: int
    stations: int = 0  # stations of a hierarchical federation; 0 when flat


@dataclass
class ClientContext:
    """What a client part gets for one task. ``state`` persists across rounds (kept by the runner,
    or by the node under Flower); ``model`` is one object reused by every simulated client.
    ``lr`` is this round's learning rate (after ``train.schedule``); ``normalization`` the
    (mean, std) the inputs were normalised with, None for inputs in [0, 1]."""

    cid: int
    rnd: int
    model: nn.Module
    train: ClientData
    val: ClientData
    state: Message
    generator: torch.Generator
    local_epochs: int
    batch_size: int
    make_optimizer: Callable[[list[nn.Parameter], float], torch.optim.Optimizer]
    grad_clip: float | None = None
    rounds: int = 1
    station_round: int = 0
    station_rounds: int = 1
    lr: float = 1e-3
    normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    drop_last: bool = False
    persistent_optimizer: bool = False
    precise_bn: bool = False
    max_steps: int | None = None

    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The configured optimiser over ``params`` at this round's lr; with
        ``train.persistent_optimizer`` it resumes the state this client's last fit left."""
        optimizer = self.make_optimizer(params, self.lr)
        if self.persistent_optimizer:
            load_optimizer_state(optimizer, self.state)
        return optimizer

    def fit(
        self,
        arrays: Arrays,
        *,
        loss_fn: LossFn = cross_entropy_loss,
        regularizer: Callable[[], torch.Tensor] | None = None,
        params: list[nn.Parameter] | None = None,
        extra_optimizers: Sequence[torch.optim.Optimizer] = (),
        on_step: Callable[[int, torch.Tensor], None] | None = None,
    ) -> TrainStats:
        """Load ``arrays`` into the shared model and train it for the configured local epochs
        or ``train.max_steps`` (the usual client step of every FedAvg-family method): the
        configured optimiser over ``params`` (default: all parameters), plus any
        ``extra_optimizers`` of the method's own (e.g. an adapter's), stepped together by the
        shared loop. With ``train.precise_bn`` the BatchNorm statistics are then re-estimated
        with the final weights."""
        set_arrays(self.model, arrays)
        optimizer = self.optimizer(list(self.model.parameters()) if params is None else params)
        stats = train_epochs(
            self.model,
            self.train,
            [optimizer, *extra_optimizers],
            epochs=self.local_epochs,
            batch_size=self.batch_size,
            generator=self.generator,
            loss_fn=loss_fn,
            regularizer=regularizer,
            grad_clip=self.grad_clip,
            drop_last=self.drop_last,
            on_step=on_step,
            max_steps=self.max_steps,
        )
        if self.persistent_optimizer:
            save_optimizer_state(optimizer, self.state)
        if self.precise_bn:
            recalibrate_batchnorm(self.model, self.train, self.batch_size, self.generator)
        return stats


def fit_together(
    ctxs: Sequence[ClientContext],
    starts: Sequence[Arrays],
    *,
    regularizer: FunctionalRegularizer | None = None,
    anchors: Sequence[Arrays] | None = None,
) -> list[tuple[Arrays, TrainStats]]:
    """``ctx.fit`` for several clients of one round as one batched computation
    (``federation/batched.py``): client i trains from ``starts[i]`` on its own data and
    generator; returns each one's final arrays and statistics. The plain step only (the
    configured optimiser over every parameter, cross-entropy, plus an optional functional
    ``regularizer(params, anchor)``), which is what a method opts in to with
    ``MethodSpec(batchable=True)``."""
    if not ctxs:
        return []
    first = ctxs[0]
    settings = first.make_optimizer
    if not isinstance(settings, OptimizerSettings):
        raise TypeError("fit_together needs the engine's OptimizerSettings as make_optimizer")
    shared = ("lr", "local_epochs", "batch_size", "drop_last", "grad_clip", "model")
    for ctx in ctxs[1:]:
        for key in shared:
            if getattr(ctx, key) != getattr(first, key):
                raise ValueError(f"clients trained together must share {key}")
    return fit_clients(
        first.model,
        starts,
        [c.train for c in ctxs],
        [c.generator for c in ctxs],
        settings=settings,
        lr=first.lr,
        epochs=first.local_epochs,
        batch_size=first.batch_size,
        drop_last=first.drop_last,
        grad_clip=first.grad_clip,
        regularizer=regularizer,
        anchors=anchors,
    )


class ServerAlgorithm(ABC):
    # True: the runner writes the final state_dict() to the run directory (server_state.pt) with
    # its fingerprint in summary.json, for tools that build on a finished run (`feddomain adapt`)
    exports_state: bool = False

    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        self.ctx = ctx
        self.hp = hp

    def collect(self, clients: list[int]) -> Plan:
        """Messages for a one-time statistics task before round 1 (none by default)."""
        return {}

    def on_collect(self, replies: dict[int, Message]) -> None:  # noqa: B027 - optional hook
        """Receive the replies of the one-time ``collect`` task."""

    def broadcast(self, clients: list[int]) -> Plan:
        """Messages every client receives once, after ``on_collect`` and before round 1, to keep
        in its state (FISC's interpolation style); replies are checked, counted and dropped
        (none by default)."""
        return {}

    def pre_round(self, rnd: int, clients: list[int]) -> Plan:
        """Messages for a task this round's participating clients run before ``configure``
        (none by default); their accepted replies go to ``on_pre_round``."""
        return {}

    def on_pre_round(self, rnd: int, replies: dict[int, Message]) -> None:  # noqa: B027
        """Receive the accepted replies of this round's ``pre_round`` task."""

    @abstractmethod
    def configure(self, rnd: int, clients: list[int]) -> Plan:
        """One message per participating client for this round. Return an iterator of
        (client id, message) to build each message only when that client is about to train
        (sequential methods: the server state may change between clients)."""

    @abstractmethod
    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        """Update server state from the accepted (finite) replies, which arrive lazily as
        (client id, message) pairs: fold them into a running sum to stay streaming, or collect
        them with ``dict(replies)`` when the method needs all at once."""

    @abstractmethod
    def eval_arrays(self, cid: int | None) -> Arrays | None:
        """Model arrays to evaluate for client ``cid``. Returning the same object for every
        client tells the runner it is one shared model.

        ``cid=None`` asks for the method's model for the unseen (target) domain, e.g. one built
        from the pilot set: when it returns arrays, the run-level ood numbers score that model and
        the clients' own ood scores stay as a diagnostic. ``None`` means the method has no such
        model (FedAvg's clients already share the global model): the ood numbers are the clients'.
        """

    def pilot_task(self, domain: str) -> Message | None:
        """A task for the client part on target ``domain``'s unlabeled pilot set, asked before
        every evaluation (``None``: nothing to ask, e.g. once the reply is known)."""
        return None

    def on_pilot(self, domain: str, reply: Message) -> None:  # noqa: B027 - optional hook
        """Receive the (privacy-checked, finite) reply to ``pilot_task(domain)``."""

    def diagnostics(self) -> dict[str, Any]:
        """JSON-ready values logged with every evaluated round (e.g. GradAlign weights)."""
        return {}

    def timings(self) -> dict[str, float]:
        """Wall-clock seconds of parts of the latest ``aggregate`` (HFedATM: alignment and
        RegMean), added to that round's phase times in rounds.jsonl (``time``, which no
        comparison of runs reads). None by default."""
        return {}

    def round_record(self) -> dict[str, Any]:
        """What the latest ``aggregate`` computed that a user follows round by round (FedVR:
        α_i, c_i, L_var, gradient cosines), written to that round's record as ``server``
        (rounds.jsonl every round; metrics.jsonl at evaluated rounds). None by default."""
        return {}

    def run_summary(self) -> dict[str, Any]:
        """What the server's whole run comes to (FedVR: the share of rounds one client held
        more than half of α), written as ``server`` to ``summary.json``. None by default."""
        return {}

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ClientAlgorithm(ABC):
    def __init__(self, hp: Hparams) -> None:
        self.hp = hp

    @abstractmethod
    def run(self, msg: Message, ctx: ClientContext) -> Message:
        """Carry out ``msg.task`` ("fit", "collect", ...) and reply."""

    @abstractmethod
    def uploads(self, n_clients: int) -> Uploads:
        """Everything a reply of this client may hold, over all its tasks (the privacy
        contract): the runner stops a run whose client sends anything else."""

    def run_batch(self, msgs: list[Message], ctxs: list[ClientContext]) -> list[Message]:
        """``run`` for several clients of one round at once (``fit_together``), one reply per
        client in order. Called only for methods registered with ``batchable=True``."""
        raise NotImplementedError(f"{type(self).__name__} cannot train clients together")

    def eval_arrays(self, arrays: Arrays | None, ctx: ClientContext) -> Arrays:
        """The arrays this client would predict with, given what the server offers."""
        if arrays is None:
            raise ValueError(f"client {ctx.cid}: the server offered no model to evaluate")
        return arrays


@dataclass(frozen=True)
class StationContext:
    """What a station part may know: which station it is, its clients, and the run's shape."""

    sid: int
    clients: tuple[int, ...]  # its member clients, sorted
    station_rounds: int
    seed: int
    # a freshly initialised model, as the server's ``model_factory``: for a station that needs
    # the model's structure (e.g. which arrays its clients keep local); call it at construction
    model_factory: Callable[[], nn.Module] | None = None


class StationAlgorithm:
    """One station of a hierarchical federation (client -> station -> server); the runner builds
    one per station and keeps it for the whole run (checkpointed with ``state_dict``).

    In each server round ``rnd`` the station receives the server's message (``begin``), runs
    ``station_rounds`` station rounds r over its clients — an optional ``pre_round`` task whose
    replies go to ``on_pre_round``, then ``downlink`` to every client and their replies into
    ``aggregate`` — and finally sends ``uplink`` to the server. What its clients receive and what
    the server receives are separate hooks. The default is HFedAvg: the clients get the server's
    message, then the station's sample-weighted mean, which is also what goes up.
    """

    def __init__(self, ctx: StationContext, hp: Hparams) -> None:
        self.ctx = ctx
        self.hp = hp
        self.current = Message()  # the server's message, then the latest aggregate (this round)

    def begin(self, rnd: int, msg: Message) -> None:
        """Receive the server's message for round ``rnd`` (a copy the station owns)."""
        self.current = msg

    def pre_round(self, rnd: int, r: int, clients: list[int]) -> Plan | None:
        """A task for ``clients`` before station round ``r`` (none by default), e.g. a statistic
        to collect; the accepted replies go to ``on_pre_round``."""
        return None

    def on_pre_round(self, rnd: int, r: int, replies: dict[int, Message]) -> None:
        """Receive the accepted replies of the ``pre_round`` task of station round ``r``."""

    def downlink(self, rnd: int, r: int) -> Message:
        """What every client of the station receives for station round ``r``."""
        return self.current

    def aggregate(self, rnd: int, r: int, replies: Iterator[tuple[int, Message]]) -> None:
        """Fold the accepted (finite) replies of station round ``r``, which arrive lazily as
        (client id, message) pairs. A station round with no accepted reply ends the station's
        part of the round: it sends nothing to the server."""
        arrays, total = weighted_mean(msg for _, msg in replies)
        if arrays is not None:
            self.current = Message("fit", arrays, {"num_examples": total})

    def uplink(self, rnd: int) -> Message | None:
        """What goes to the server after the last station round (``None``: nothing)."""
        return self.current

    def state_dict(self) -> dict[str, Any]:
        """What the station keeps across rounds (nothing by default: each round starts afresh
        from the server's message)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` when a run resumes from a checkpoint."""


ModelHook = Callable[[nn.Module, Hparams], nn.Module]
# A check of the configured model (built on the meta device, before any model hook) at config
# time: the reason the method cannot train it, or None.
ModelCheck = Callable[[nn.Module, Hparams], "str | None"]
# (the whole experiment config, the method's hyper-parameters) -> None; raises ConfigError
ConfigCheck = Callable[[Any, Hparams], None]
# An aggregator's layer around the client part (client part, aggregator hp, the run's model):
# HFedATM's Gram capture around any client method's training.
ClientWrapper = Callable[[ClientAlgorithm, Hparams, nn.Module], ClientAlgorithm]
# An aggregator's layer around the station part (station part, its context, aggregator hp).
StationWrapper = Callable[[StationAlgorithm, StationContext, Hparams], StationAlgorithm]


def model_requirement(method: str, check: ModelCheck) -> ConfigCheck:
    """A config check from a check of the configured model (built on the meta device, no
    weights, before hooks): FedBN refuses LeNet-5 when the config loads, naming ``model.name``."""

    def check_config(cfg: Any, hp: Hparams) -> None:
        from feddomain.models import configured_skeleton  # late: models are not needed otherwise

        problem = check(configured_skeleton(cfg), hp)
        if problem:
            m = cfg.model
            where = "'model.frozen' = true (only a head on cached features trains)"
            if not m.frozen:
                options = f" (options {m.options})" if m.options else ""
                where = f"'model.name' = {m.name!r}{options}"
            raise ConfigError(f"invalid configuration: {where}: {method} {problem}")

    return check_config


@dataclass(frozen=True)
class MethodSpec:
    """A registered method. ``pooled`` methods (Central) train on all source data as one client.
    ``model_hook(model, hp)`` transforms every model the runner builds (a probabilistic head,
    adapters, extra buffers), so strict loading stays strict everywhere. ``takes_client``: an
    aggregator whose client part can be another method's (``algorithm.client``).
    ``check_config(cfg, hp)`` refuses, when the config loads, settings elsewhere in the config
    that the method cannot run with (SCAFFOLD: an optimiser other than plain SGD; FedBN: a model
    without BatchNorm, see ``model_requirement``), raising a ``ConfigError`` that names the key.
    ``client_wrapper`` / ``station_wrapper``: an aggregator's own layer around whichever client
    and station parts the run has (HFedATM: Gram capture on the clients, Gram averaging and
    shrinkage at the stations), so any client method keeps its own logic underneath.
    ``batchable``: its client part's "fit" is the plain step and implements ``run_batch``, so a
    round's clients may be trained together (``train.batched_clients``); not inherited by a
    method whose client subclasses it. ``space``: the hyper-parameters ``feddomain tune``
    searches and their ranges (``algorithms/space.py``), checked at registration.
    ``image_only``: why the method needs images (or the BatchNorm statistics only image models
    have); it is refused on text datasets, naming that reason, when the config loads.
    ``uses_total_rounds``: its updates depend on the run's total rounds (FedDG-GA's decaying
    step), so a finished run cannot be extended to more. ``evaluation_only``: hyper-parameters
    that act only when a model is scored (a test-time mode, the unseen-domain model), never on
    training, a pilot task or a round's record, so ``feddomain rescore`` may change them on a
    finished run's kept states instead of training it again."""

    name: str
    server: type[ServerAlgorithm]
    client: type[ClientAlgorithm]
    hparams: type[Hparams] = Hparams
    station: type[StationAlgorithm] = StationAlgorithm
    pooled: bool = False
    description: str = ""
    model_hook: ModelHook | None = None
    takes_client: bool = False
    check_config: ConfigCheck | None = None
    client_wrapper: ClientWrapper | None = None
    station_wrapper: StationWrapper | None = None
    batchable: bool = False
    space: Space = field(default_factory=dict)
    image_only: str | None = None
    uses_total_rounds: bool = False  # its updates depend on `rounds`: a run is not extensible
    evaluation_only: tuple[str, ...] = ()  # hparams a rescore may change (see above)

    def make_hparams(self, values: dict[str, Any]) -> Hparams:
        return self.hparams(**values)


@dataclass(frozen=True)
class Method:
    """What a run is built from: the server side (aggregator, stations) of ``spec`` with ``hp``,
    and the client side of ``client_spec`` with ``client_hp`` — the same method unless composed
    (``algorithm: {name: AGGREGATOR, client: {name: METHOD, ...}}``)."""

    spec: MethodSpec
    hp: Hparams
    client_spec: MethodSpec
    client_hp: Hparams

    @property
    def not_batchable(self) -> str | None:
        """Why this run's clients may not be trained together, or None: the client method has
        not opted in (its own local step), or an aggregator layer (HFedATM's Gram capture)
        wraps its training."""
        if not self.client_spec.batchable:
            return (
                f"method {self.client_spec.name!r} has a local step of its own (only methods "
                "registered batchable train together: fedavg, fedprox, local)"
            )
        if self.spec.client_wrapper is not None:
            return f"aggregator {self.spec.name!r} wraps its clients' training"
        return None

    @property
    def name(self) -> str:
        if self.client_spec is self.spec:
            return self.spec.name
        return f"{self.spec.name}+{self.client_spec.name}"

    def make_server(self, ctx: ServerContext) -> ServerAlgorithm:
        return self.spec.server(ctx, self.hp)

    def make_client(self, model: nn.Module) -> ClientAlgorithm:
        """The client method's part, inside the aggregator's ``client_wrapper`` if it has one
        (``model``: the run's model, for a wrapper that needs its structure)."""
        client = self.client_spec.client(self.client_hp)
        if self.spec.client_wrapper is not None:
            client = self.spec.client_wrapper(client, self.hp, model)
        return client

    def make_station(self, ctx: StationContext) -> StationAlgorithm:
        """The station part: when composed, the client method's own (its station logic, e.g.
        FedIIR's gradient EMA, stays with its clients), else the method's; inside the
        aggregator's ``station_wrapper`` if it has one."""
        if self.client_spec is not self.spec:
            station = self.client_spec.station(ctx, self.client_hp)
        else:
            station = self.spec.station(ctx, self.hp)
        if self.spec.station_wrapper is not None:
            station = self.spec.station_wrapper(station, ctx, self.hp)
        return station

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Apply the client method's model hook, then the aggregator's (when they differ)."""
        hooks = [(self.client_spec, self.client_hp)]
        if self.client_spec is not self.spec:
            hooks.append((self.spec, self.hp))
        for spec, hp in hooks:
            if spec.model_hook is not None:
                model = spec.model_hook(model, hp)
        return model
