"""Shared local-training mechanics: the hot loop every client part reuses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from feddomain.federation.data import ClientData

Arrays = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainStats:
    steps: int
    examples: int
    mean_loss: float


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def train_epochs(
    model: nn.Module,
    data: ClientData,
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    loss_fn: LossFn = cross_entropy_loss,
    regularizer: Callable[[], torch.Tensor] | None = None,
    grad_clip: float | None = None,
) -> TrainStats:
    """Plain minibatch training; ``regularizer()`` is added to every batch loss (e.g. FedProx);
    ``grad_clip`` bounds each step's gradient L2 norm (pFedHN's reference code clips to 50)."""
    model.train()
    steps, examples = 0, 0
    loss_sum = torch.zeros(())
    for _ in range(epochs):
        for x, y in data.batches(batch_size, generator):
            loss = loss_fn(model, x, y)
            if regularizer is not None:
                loss = loss + regularizer()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            loss_sum += loss.detach()
            steps += 1
            examples += int(y.shape[0])
    return TrainStats(steps, examples, float(loss_sum) / max(steps, 1))


def get_arrays(model: nn.Module) -> Arrays:
    """A detached copy of the model's parameters and buffers, by name."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def set_arrays(model: nn.Module, arrays: Arrays) -> None:
    """Load arrays into the (shared, reused) model object in place."""
    model.load_state_dict(arrays, strict=True)


@torch.no_grad()
def predict_probs(model: nn.Module, data: ClientData, batch_size: int) -> torch.Tensor:
    """Softmax outputs over ``data`` in evaluation mode, in data order."""
    model.eval()
    out = [F.softmax(model(x), dim=1) for x, _ in data.batches(batch_size, shuffle=False)]
    return torch.cat(out) if out else torch.zeros(0)
