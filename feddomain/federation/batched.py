"""Clients trained together: one round's clients as one batched computation (``torch.func``).

The sequential path trains the clients of a round one after another on the shared model object.
For methods whose local step is the plain one (FedAvg, FedProx, Local-only: cross-entropy,
optionally a functional regulariser of the parameters, the configured SGD or Adam), the clients
can instead be trained as one computation: their parameters are stacked along a leading client
axis, ``vmap`` of ``grad`` of ``functional_call`` gives every client's gradient at once, and the
optimiser update is applied to the stacked tensors. Semantics are the sequential path's:

* **Same batches.** Each client draws its batch order and augmentation from its own generator in
  the order the sequential loop does (epoch by epoch, batch by batch), so both paths see the same
  batches. A last partial batch is padded and weighted out of the mean loss.
* **Unequal sizes.** A client whose batches are exhausted leaves the computation: later steps
  gather only the active clients' rows and write back only theirs, so its parameters and
  optimiser state stay exactly as its last step left them.
* **Same optimiser math.** ``StackedSGD`` and ``StackedAdam`` are torch's SGD (momentum, weight
  decay, no dampening or Nesterov, as the project configures it) and Adam (non-AMSGrad), over a
  client axis; gradient clipping is per client, as ``clip_grad_norm_``.

Results equal the sequential path's within float rounding (the summation order of the batched
kernels differs): tests/test_batched_clients.py bounds it in float64 and float32.

Models whose training step has state or randomness of its own are refused, with the reason:
BatchNorm (running statistics move with every batch), active dropout (masks drawn from torch's
global generator, which the sequential path reseeds per client).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from feddomain.federation.data import ClientData
from feddomain.federation.training import Arrays, TrainStats

Stacked = dict[str, torch.Tensor]  # name -> [clients, *shape]
# (one client's parameters, the same client's anchor arrays) -> a scalar added to its loss
FunctionalRegularizer = Callable[[Arrays, Arrays], torch.Tensor]
MODES = ("auto", "off", "on")


@dataclass(frozen=True)
class OptimizerSettings:
    """The configured client optimiser (``train.optimizer``, ``momentum``, ``weight_decay``):
    called with (parameters, lr) it is the torch optimiser of the sequential path; the batched
    path reads the same settings for its stacked update."""

    kind: str  # "sgd" | "adam"
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __call__(self, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        if self.kind == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(
            params, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay
        )


def model_problem(model: nn.Module) -> str | None:
    """Why ``model``'s training step cannot be batched across clients exactly, or None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return (
                f"has BatchNorm layer {name!r}, whose running statistics move with every "
                "training batch"
            )
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return (
                f"has dropout {name!r} (p={module.p}), whose masks come from torch's global "
                "generator, reseeded per client on the sequential path"
            )
    return None


class StackedSGD:
    """torch.optim.SGD (dampening 0, no Nesterov) over stacked parameters: with weight decay
    g ← g + λ·w; with momentum b ← m·b + g (b starts at 0, so the first step's b = g as
    torch's); w ← w − lr·b."""

    def __init__(self, params: Stacked, lr: float, momentum: float, weight_decay: float) -> None:
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers = {k: torch.zeros_like(p) for k, p in params.items()} if momentum else {}

    def step(self, params: Stacked, grads: Stacked, rows: torch.Tensor | None) -> None:
        """Update ``params`` (and the state) in place at ``rows`` (None: every client) from
        ``grads`` (the active rows only)."""
        for k, g in grads.items():
            p = _rows(params[k], rows)
            if self.weight_decay:
                g = g.add(p, alpha=self.weight_decay)
            if self.momentum:
                buf = _rows(self.buffers[k], rows).mul_(self.momentum).add_(g)
                _put(self.buffers[k], rows, buf)
                g = buf
            _put(params[k], rows, p.add(g, alpha=-self.lr))


class StackedAdam:
    """torch.optim.Adam (non-AMSGrad, β = (0.9, 0.999), ε = 1e-8, L2 weight decay added to the
    gradient) over stacked parameters. Every active client has taken the same number of steps
    (a client leaves for good when its batches are exhausted), so the bias corrections are one
    scalar per step."""

    def __init__(self, params: Stacked, lr: float, weight_decay: float) -> None:
        self.lr, self.weight_decay = lr, weight_decay
        self.beta1, self.beta2, self.eps = 0.9, 0.999, 1e-8
        self.exp_avg = {k: torch.zeros_like(p) for k, p in params.items()}
        self.exp_avg_sq = {k: torch.zeros_like(p) for k, p in params.items()}
        self.steps = 0

    def step(self, params: Stacked, grads: Stacked, rows: torch.Tensor | None) -> None:
        self.steps += 1
        step_size = self.lr / (1 - self.beta1**self.steps)
        bias_correction2_sqrt = (1 - self.beta2**self.steps) ** 0.5
        for k, g in grads.items():
            p = _rows(params[k], rows)
            if self.weight_decay:
                g = g.add(p, alpha=self.weight_decay)
            m = _rows(self.exp_avg[k], rows).lerp_(g, 1 - self.beta1)
            v = (
                _rows(self.exp_avg_sq[k], rows)
                .mul_(self.beta2)
                .addcmul_(g, g, value=1 - self.beta2)
            )
            _put(self.exp_avg[k], rows, m)
            _put(self.exp_avg_sq[k], rows, v)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)
            _put(params[k], rows, p.addcdiv(m, denom, value=-step_size))


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The active clients' rows of a stacked tensor (a copy when some clients are done)."""
    return t if rows is None else t.index_select(0, rows)


def _put(t: torch.Tensor, rows: torch.Tensor | None, value: torch.Tensor) -> None:
    """Write the active rows back; the other clients' rows are not touched."""
    if rows is None:
        if value is not t:
            t.copy_(value)
    else:
        t.index_copy_(0, rows, value)


def make_stacked_optimizer(
    settings: OptimizerSettings, params: Stacked, lr: float
) -> StackedSGD | StackedAdam:
    if settings.kind == "adam":
        return StackedAdam(params, lr, settings.weight_decay)
    return StackedSGD(params, lr, settings.momentum, settings.weight_decay)


def _stack(arrays: Sequence[Arrays], names: Sequence[str]) -> Stacked:
    return {k: torch.stack([a[k] for a in arrays]) for k in names}


def _client_batches(
    data: ClientData, generator: torch.Generator, epochs: int, batch_size: int, drop_last: bool
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A client's batches over all its local epochs, drawn exactly as the sequential loop draws
    them (each epoch's order only once the previous epoch is done)."""
    return chain.from_iterable(
        data.batches(batch_size, generator, drop_last=drop_last) for _ in range(epochs)
    )


def _padded(batch: tuple[torch.Tensor, torch.Tensor], size: int):
    """(x, y, w) of ``size`` rows: a partial batch padded with zeros and weight 0."""
    x, y = batch
    n = int(y.shape[0])
    w = torch.ones(size, dtype=x.dtype if x.is_floating_point() else torch.float32, device=x.device)
    if n == size:
        return x, y, w
    w[n:] = 0
    pad = size - n
    x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    y = torch.cat([y, y.new_zeros(pad)])
    return x, y, w


def fit_clients(
    model: nn.Module,
    starts: Sequence[Arrays],
    datas: Sequence[ClientData],
    generators: Sequence[torch.Generator],
    *,
    settings: OptimizerSettings,
    lr: float,
    epochs: int,
    batch_size: int,
    drop_last: bool = False,
    grad_clip: float | None = None,
    regularizer: FunctionalRegularizer | None = None,
    anchors: Sequence[Arrays] | None = None,
) -> list[tuple[Arrays, TrainStats]]:
    """Train one client per entry of ``starts`` (its initial arrays), on its data with its
    generator, as one batched computation; returns each client's final arrays (in
    ``model.state_dict()`` order) and its training statistics, as ``train_epochs`` would.
    ``regularizer(params, anchor)`` adds a term per client (FedProx's proximal term, with that
    client's received arrays as ``anchors``). ``model`` only lends its structure."""
    problem = model_problem(model)
    if problem:
        raise ValueError(f"clients cannot be trained together: the model {problem}")
    names = list(model.state_dict())
    trainable = [k for k, p in model.named_parameters() if p.requires_grad]
    fixed = [k for k in names if k not in trainable]  # buffers, frozen parameters
    params = _stack(starts, trainable)
    constants = _stack(starts, fixed)
    anchor = _stack(anchors, trainable) if regularizer is not None and anchors else {}
    optimizer = make_stacked_optimizer(settings, params, lr)
    model.train()

    def loss(p: Arrays, c: Arrays, a: Arrays, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
        out = functional_call(model, {**p, **c}, (x,))
        value = (F.cross_entropy(out, y, reduction="none") * w).sum() / w.sum()
        if regularizer is not None:
            value = value + regularizer(p, a)
        return value, value.detach()

    gradients = vmap(grad(loss, has_aux=True))
    n = len(starts)
    streams = [
        _client_batches(d, g, epochs, batch_size, drop_last)
        for d, g in zip(datas, generators, strict=True)
    ]
    active = list(range(n))
    losses: list[list[torch.Tensor]] = [[] for _ in range(n)]
    examples = [0] * n
    while True:
        active, batches = _next_batches(streams, active, batch_size, examples)
        if not active:
            break
        rows = None if len(active) == n else torch.tensor(active, device=batches[0][0].device)
        x, y, w = (torch.stack(t) for t in zip(*batches, strict=True))
        grads, values = gradients(
            *({k: _rows(v, rows) for k, v in d.items()} for d in (params, constants, anchor)),
            x,
            y,
            w,
        )
        if grad_clip is not None:
            grads = _clipped(grads, grad_clip)
        optimizer.step(params, grads, rows)
        for j, i in enumerate(active):
            losses[i].append(values[j])
    return [
        (
            {k: (params[k][i] if k in params else constants[k][i]).clone() for k in names},
            _stats(losses[i], examples[i]),
        )
        for i in range(n)
    ]


def _next_batches(
    streams: list[Iterator[tuple[torch.Tensor, torch.Tensor]]],
    active: list[int],
    batch_size: int,
    examples: list[int],
) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The next padded batch of every active client that has one, and which clients those are
    (a client without one has finished for good); ``examples`` counts each client's images."""
    still, batches = [], []
    for i in active:
        batch = next(streams[i], None)
        if batch is not None:
            still.append(i)
            batches.append(_padded(batch, batch_size))
            examples[i] += int(batch[1].shape[0])
    return still, batches


def _stats(losses: list[torch.Tensor], examples: int) -> TrainStats:
    """``train_epochs``'s statistics of one client from its per-step losses."""
    batch_losses = torch.stack(losses) if losses else torch.zeros(0)
    return TrainStats(
        len(losses), examples, float(batch_losses.sum()) / max(len(losses), 1), batch_losses
    )


def _clipped(grads: Stacked, max_norm: float) -> Stacked:
    """``clip_grad_norm_`` per client: every client's gradient scaled by
    min(1, max_norm / (‖g‖ + 1e-6)), its norm taken over all its parameters."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], dim=1).norm(dim=1)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: g * scale.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}


def batching_problem(
    method_problem: str | None, model: nn.Module, train: object, precision: str
) -> str | None:
    """Why the clients of this run cannot be trained together (``train.batched_clients: on`` is
    refused with it), or None. ``method_problem``: the method's own reason
    (``Method.not_batchable``); ``train``: the config's ``train`` section."""
    if method_problem:
        return method_problem
    problem = model_problem(model)
    if problem:
        return f"the model {problem}"
    if getattr(train, "persistent_optimizer", False):
        return "train.persistent_optimizer keeps per-client optimiser state across rounds"
    if precision != "fp32":
        return f"precision {precision!r}: the batched path is verified in fp32 only"
    return None
