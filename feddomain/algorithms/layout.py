"""FedAvg over a ``StateLayout``: the server, client and station parts that methods with local or
server-computed arrays configure instead of special-casing them (FedBN, SiloBN, later FedFD).

A method subclasses the three parts and sets ``layout`` — a function (model, hp) -> StateLayout,
the same on every part, e.g. ``StateLayout(local=batchnorm_arrays(model))`` for FedBN. Then:

* the server averages the **shared** arrays (sample-weighted; exactly FedAvg's arithmetic,
  ``server_lr`` included when the method has one) and broadcasts them with the **computed**
  arrays (``compute(local_mean)``, nothing by default) and the initial model's values of the
  **local** arrays, which only a client without local arrays of its own (one that never
  trained) loads. It keeps the sample-weighted mean of the local arrays the clients of the
  latest aggregated round uploaded (``local_mean``): input to ``compute`` and to the
  unseen-domain model ``eval_arrays(None)`` = shared + computed + ``local_mean``. That mean is
  never broadcast;
* each client trains from the broadcast with its own local arrays loaded over it, keeps the
  trained local arrays in its persistent state (``federation.layout.store_local``; on Flower,
  on its node) and sends the shared and local arrays back (not the computed ones). It evaluates
  with its own local arrays (``eval_arrays``);
* a station's clients receive the server's message, then, in later station rounds, the
  station's mean of the shared arrays with the server's computed and initial local values; its
  uplink is the sample-weighted mean of everything its clients sent, local arrays included.

With the default layout (nothing local or computed) the three parts are FedAvg, number for number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from torch import nn

from feddomain.algorithms.base import (
    Arrays,
    ClientContext,
    Hparams,
    ServerAlgorithm,
    ServerContext,
    StationAlgorithm,
    StationContext,
)
from feddomain.algorithms.fedavg import FedAvgClient
from feddomain.federation.layout import (
    COMPUTED,
    LOCAL,
    SHARED,
    StateLayout,
    load_local,
    store_local,
)
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import TrainStats, get_arrays

LayoutFn = Callable[[nn.Module, Hparams], StateLayout]


def fedavg_layout(model: nn.Module, hp: Hparams) -> StateLayout:
    """Every array shared: FedAvg."""
    return StateLayout()


class LayoutServer(ServerAlgorithm):
    layout: ClassVar[LayoutFn] = staticmethod(fedavg_layout)

    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        model = ctx.model_factory()
        self.categories = type(self).layout(model, hp)
        # shared: the running aggregate; computed: the server's; local: the initial values
        self.global_arrays: Arrays = get_arrays(model)
        self.local_mean: Arrays = self.categories.select(self.global_arrays, LOCAL)
        computed = self.compute(self.local_mean)
        self.global_arrays = {k: computed.get(k, v) for k, v in self.global_arrays.items()}

    def compute(self, local_mean: Arrays) -> Arrays:
        """The server-computed arrays from the sample-weighted mean of the clients' local arrays
        (FedFD's global statistics); called once with the initial values, then after every
        aggregation. None by default."""
        return {}

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Message]:
        return dict.fromkeys(clients, Message("fit", self.global_arrays))

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        mean, _ = weighted_mean(msg for _, msg in replies)
        if mean is None:  # every update of the round was rejected: keep everything
            return
        parts = self.categories.split(mean)
        if parts[LOCAL]:
            self.local_mean = {**self.local_mean, **parts[LOCAL]}
        computed = self.compute(self.local_mean)
        lr = getattr(self.hp, "server_lr", 1.0)
        updated = {}
        for name, old in self.global_arrays.items():
            category = self.categories.category(name)
            if category == SHARED and name in parts[SHARED]:
                new = parts[SHARED][name]
                if lr != 1.0 and old.is_floating_point():
                    new = old + lr * (new - old)
                updated[name] = new
            elif category == COMPUTED:
                updated[name] = computed.get(name, old)
            else:  # a local array: its initial value stays
                updated[name] = old
        self.global_arrays = updated

    def eval_arrays(self, cid: int | None) -> Arrays | None:
        """A client: the broadcast (it loads its own local arrays over it). The unseen domain:
        the shared and computed arrays with the mean of the clients' local arrays (None when
        nothing is local: the clients' shared model is scored, as FedAvg's)."""
        if cid is not None:
            return self.global_arrays
        if not self.local_mean:
            return None
        return {k: self.local_mean.get(k, v) for k, v in self.global_arrays.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"global": self.global_arrays, "local_mean": self.local_mean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_arrays, self.local_mean = state["global"], state["local_mean"]


class LayoutClient(FedAvgClient):
    layout: ClassVar[LayoutFn] = staticmethod(fedavg_layout)
    _categories: StateLayout | None = None

    def categories(self, model: nn.Module) -> StateLayout:
        if self._categories is None:  # one model structure per run
            self._categories = type(self).layout(model, self.hp)
        return self._categories

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        categories = self.categories(ctx.model)
        own = load_local(ctx.state)  # empty before this client's first fit
        stats = self.train({**msg.arrays, **own}, msg, ctx)
        trained = get_arrays(ctx.model)
        store_local(ctx.state, categories.select(trained, LOCAL))
        return Message(
            "fit",
            categories.select(trained, SHARED, LOCAL),
            {"num_examples": len(ctx.train), "loss": stats.mean_loss},
        )

    def train(self, arrays: Arrays, msg: Message, ctx: ClientContext) -> TrainStats:
        """Local training from ``arrays`` (the broadcast with this client's local arrays):
        ``ctx.fit`` with the method's loss and regulariser; a method with a second optimiser
        (FedFD-A's adapter) overrides it."""
        return ctx.fit(
            arrays, loss_fn=self.loss_fn(msg, ctx), regularizer=self.regularizer(msg, ctx)
        )

    def uploads(self, n_clients: int) -> Uploads:
        """The trained shared and local arrays (model arrays: ``*`` covers both; the local ones
        serve only the server's mean of them), the sample count and mean training loss."""
        return Uploads(model=("*",), scalars=("num_examples", "loss"))

    def eval_arrays(self, arrays: Arrays | None, ctx: ClientContext) -> Arrays:
        """The offered model with this client's own local arrays (the offer as it is for a
        client that never trained)."""
        offered = super().eval_arrays(arrays, ctx)
        own = load_local(ctx.state)
        return {k: own.get(k, v) for k, v in offered.items()} if own else offered


class LayoutStation(StationAlgorithm):
    layout: ClassVar[LayoutFn] = staticmethod(fedavg_layout)

    def __init__(self, ctx: StationContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        if ctx.model_factory is None:
            raise ValueError("a layout station needs StationContext.model_factory")
        self.categories = type(self).layout(ctx.model_factory(), hp)
        self.server_msg = Message()

    def begin(self, rnd: int, msg: Message) -> None:
        super().begin(rnd, msg)
        self.server_msg = msg

    def downlink(self, rnd: int, r: int) -> Message:
        """The server's message; after a station round, with the station's mean of the shared
        arrays (its clients' local arrays and their mean never go down)."""
        if r == 0 or self.current is self.server_msg:
            return self.server_msg
        mean = self.current.arrays
        arrays = {
            k: mean[k] if k in mean and self.categories.category(k) == SHARED else v
            for k, v in self.server_msg.arrays.items()
        }
        return Message(self.server_msg.task, arrays, self.server_msg.scalars)
