"""Local-only: every client trains alone from the common initialisation; nothing is averaged.

The server sends the initial model once to each client (so all methods start from the same
weights) and never receives parameters back. Each client evaluates its own model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from feddomain.algorithms.base import (
    Arrays,
    ClientAlgorithm,
    ClientContext,
    Hparams,
    MethodSpec,
    ServerAlgorithm,
    fit_together,
)
from feddomain.algorithms.registry import register
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import get_arrays, model_arrays


class LocalServer(ServerAlgorithm):
    def __init__(self, ctx, hp) -> None:
        super().__init__(ctx, hp)
        self.initial: Arrays = get_arrays(ctx.model_factory())
        self.started: set[int] = set()

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Message]:
        plan = {
            c: Message("fit") if c in self.started else Message("fit", self.initial)
            for c in clients
        }
        self.started.update(clients)
        return plan

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        """Nothing to aggregate; draining the replies is what makes the clients train."""
        for _ in replies:
            pass

    def eval_arrays(self, cid: int | None) -> Arrays | None:
        """The initial model (each client evaluates its own instead); no unseen-domain model."""
        return None if cid is None else self.initial

    def state_dict(self) -> dict[str, Any]:
        return {"initial": self.initial, "started": sorted(self.started)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial, self.started = state["initial"], set(state["started"])


class LocalClient(ClientAlgorithm):
    def run(self, msg: Message, ctx: ClientContext) -> Message:
        stats = ctx.fit(msg.arrays or model_arrays(ctx.state))
        ctx.state.arrays.update(get_arrays(ctx.model))
        return Message("fit", {}, {"num_examples": len(ctx.train), "loss": stats.mean_loss})

    def run_batch(self, msgs: list[Message], ctxs: list[ClientContext]) -> list[Message]:
        """``run`` for a round's clients trained together: each from its own model."""
        starts = [m.arrays or model_arrays(c.state) for m, c in zip(msgs, ctxs, strict=True)]
        replies = []
        for (arrays, stats), ctx in zip(fit_together(ctxs, starts), ctxs, strict=True):
            ctx.state.arrays.update(arrays)
            replies.append(
                Message("fit", {}, {"num_examples": len(ctx.train), "loss": stats.mean_loss})
            )
        return replies

    def uploads(self, n_clients: int) -> Uploads:
        """No weights ever leave the client: only its sample count and mean training loss."""
        return Uploads(scalars=("num_examples", "loss"))

    def eval_arrays(self, arrays: Arrays | None, ctx: ClientContext) -> Arrays:
        return model_arrays(ctx.state) or arrays


register(
    MethodSpec(
        "local",
        LocalServer,
        LocalClient,
        Hparams,
        description="Local-only: each client trains alone (no communication)",
        batchable=True,
    )
)
