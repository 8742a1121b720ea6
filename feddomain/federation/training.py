"""Shared local-training mechanics: the hot loop every client part reuses."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import update_bn

from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message

Arrays = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainStats:
    steps: int
    examples: int
    mean_loss: float
    batch_losses: torch.Tensor  # [steps], each step's loss in step order (e.g. FedVR's variance)


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def train_epochs(
    model: nn.Module,
    data: ClientData,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    loss_fn: LossFn = cross_entropy_loss,
    regularizer: Callable[[], torch.Tensor] | None = None,
    grad_clip: float | None = None,
    drop_last: bool = False,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
    max_steps: int | None = None,
) -> TrainStats:
    """Minibatch training: one backward of ``loss_fn`` (+ ``regularizer()``, e.g. FedProx) per
    batch, then a step of every optimiser — a method with a second optimiser over its own
    parameters (an adapter) passes both and lets its loss reach each set. ``grad_clip`` bounds
    the L2 norm of each step's gradient over the optimised parameters; ``on_step(step, loss)``
    runs after each step (EMA updates, statistics); ``max_steps`` stops training after that
    many steps (the batches are drawn as without it, so the first steps are the same)."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    model.train()
    steps, examples = 0, 0
    loss_sum = torch.zeros(())
    losses = []
    for _ in range(epochs):
        for x, y in data.batches(batch_size, generator, drop_last=drop_last):
            if steps == max_steps:
                break
            loss = loss_fn(model, x, y)
            if regularizer is not None:
                loss = loss + regularizer()
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            for o in optimizers:
                o.step()
            loss = loss.detach()
            loss_sum = loss_sum + loss  # not +=: the CPU zero must take a CUDA loss too
            losses.append(loss)
            if on_step is not None:
                on_step(steps, loss)
            steps += 1
            examples += int(y.shape[0])
    batch_losses = torch.stack(losses) if losses else torch.zeros(0)
    return TrainStats(steps, examples, float(loss_sum) / max(steps, 1), batch_losses)


def recalibrate_batchnorm(
    model: nn.Module, data: ClientData, batch_size: int, generator: torch.Generator
) -> None:
    """Re-estimate every BatchNorm layer's running statistics with the model's final weights:
    the mean over one pass of ``data``'s batches of each batch's mean and variance (PreciseBN,
    Wu & Johnson 2021). The running averages kept during training mix statistics of weights that
    have since moved; on small BN models trained fast they can be far from the final weights'."""
    with torch.no_grad():
        update_bn((x for x, _ in data.batches(batch_size, generator)), model)


# Optimiser state kept in a client's persistent state (``train.persistent_optimizer``) lives
# under this prefix, beside whatever the method keeps there.
OPTIMIZER_PREFIX = "optimizer/"


def save_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Message, prefix: str = OPTIMIZER_PREFIX
) -> None:
    """Store the optimiser's per-parameter state (momentum, Adam moments, step counts) in
    ``state``: tensors as arrays, numbers as scalars, keyed ``<prefix><param>.<name>``
    (``prefix``: the engine's optimiser, or a method's second one, e.g. FedFD-A's adapter's)."""
    for key in [k for k in state.arrays if k.startswith(prefix)]:
        del state.arrays[key]
    for key in [k for k in state.scalars if k.startswith(prefix)]:
        del state.scalars[key]
    for index, values in optimizer.state_dict()["state"].items():
        for name, value in values.items():
            key = f"{prefix}{index}.{name}"
            if torch.is_tensor(value):
                state.arrays[key] = value.detach().clone()
            elif isinstance(value, int | float):
                state.scalars[key] = value


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Message, prefix: str = OPTIMIZER_PREFIX
) -> None:
    """Restore what ``save_optimizer_state`` kept under ``prefix`` (nothing on a client's first
    round); the optimiser's hyper-parameters (lr of this round, momentum, ...) stay as
    configured."""
    restored: dict[int, dict[str, object]] = {}
    for source in (state.arrays, state.scalars):
        for key, value in source.items():
            if key.startswith(prefix):
                index, name = key.removeprefix(prefix).split(".", 1)
                restored.setdefault(int(index), {})[name] = value
    if restored:
        current = optimizer.state_dict()
        optimizer.load_state_dict({**current, "state": restored})


@contextmanager
def gradient_offset(params: Sequence[nn.Parameter], offset: torch.Tensor) -> Iterator[None]:
    """While active, every backward adds the matching slice of the flat ``offset`` (``params``
    order) to each parameter's gradient as it is computed, so a plain SGD step is
    ``w ← w − lr·(g + offset)``: a control-variate correction (SCAFFOLD's c − c_i, MTGC's
    z_i + y_j) that ``train.grad_clip`` then clips with the gradient."""
    pieces = torch.split(offset, [p.numel() for p in params])
    hooks = [p.register_hook(_adds(d.view_as(p))) for p, d in zip(params, pieces, strict=True)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _adds(offset: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda grad: grad + offset


def model_arrays(state: Message) -> Arrays:
    """A client state's arrays without the engine's optimiser entries."""
    return {k: v for k, v in state.arrays.items() if not k.startswith(OPTIMIZER_PREFIX)}


def round_lr(
    lr: float, rnd: int, rounds: int, schedule: str, *, min_lr: float, step_at: float, gamma: float
) -> float:
    """The learning rate of global round ``rnd`` (1-based), constant within the round.
    ``cosine``: min_lr + ½(lr − min_lr)(1 + cos(π (rnd − 1) / rounds)) (HFedATM §2.6);
    ``step``: lr·gamma once ``step_at`` of the rounds are done (FedDG-GA's StepLR)."""
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * (rnd - 1) / rounds))
    if schedule == "step":
        return lr * gamma if rnd - 1 >= step_at * rounds else lr
    return lr


def get_arrays(model: nn.Module) -> Arrays:
    """A detached copy of the model's parameters and buffers, by name."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def set_arrays(model: nn.Module, arrays: Arrays) -> None:
    """Load arrays into the (shared, reused) model object in place."""
    model.load_state_dict(arrays, strict=True)


ENSEMBLE = "ensemble/"


def pack_ensemble(members: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several models as one set of arrays (``ensemble/<k>/<name>``), so an ensemble travels as
    an ordinary model offer (to a Flower node too) and is scored by :func:`unpack_ensemble`."""
    return {f"{ENSEMBLE}{k}/{name}": v for k, m in enumerate(members) for name, v in m.items()}


def unpack_ensemble(arrays: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """The members of a packed ensemble in order; None for the arrays of a single model."""
    if not arrays or not all(k.startswith(ENSEMBLE) for k in arrays):
        return None
    members: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        k, name = key[len(ENSEMBLE) :].split("/", 1)
        members.setdefault(int(k), {})[name] = value
    return [members[k] for k in sorted(members)]


@torch.no_grad()
def predict_probs(model: nn.Module, data: ClientData, batch_size: int) -> torch.Tensor:
    """Softmax outputs over ``data`` in evaluation mode, in data order."""
    model.eval()
    out = [F.softmax(model(x), dim=1) for x, _ in data.batches(batch_size, shuffle=False)]
    return torch.cat(out) if out else torch.zeros(0)
