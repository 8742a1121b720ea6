"""hFedF (Bartholet et al., 2024): a server-side hypernetwork generates every client's model.

Each round the server sends client i the parameters ``φ_i = h(θ, ν[i])``; the client trains them
E epochs and returns ``Δ_i = φ_i0 − φ~_i`` (initial − final, hfedf.md §3.6). The server turns
every Δ_i into a hypernetwork gradient by a vector–Jacobian product, combines the clients'
gradients with GradAlign's softmax-of-cosine weights (§3.7), takes one Adam step (§3.8) and writes
an EMA of the hypernetwork back into it after a warm-up (§3.9). Only client-model-sized tensors
cross the wire; θ and ν never leave the server.

The VJPs are kept in factored form (``ClientGradients``): the heads are linear, so GradAlign's
inner products and the weighted sum never build the N per-client gradients of θ (47 M floats
each for the hFedF CNN). ``HFedFServer.diagnostics()`` exposes GradAlign's cosines and weights,
the embeddings and the per-layer weight divergence between client models (§5.3-5.4).

The hypernetwork, the VJP and the server optimiser are shared with pFedHN (``pfedhn.py``), which
is the sequential, one-client-per-step ancestor of this method, and with FedVR (``fedvr.py``),
which conditions the same hypernetwork on client statistics through an encoder and replaces
GradAlign by its own weights. Which model scores the unseen domain is the explicit option
``ood_model`` (default ``own``: each client's generated model, hfedf.md §2.5).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from feddomain.algorithms.base import (
    Arrays,
    ClientAlgorithm,
    ClientContext,
    Hparams,
    MethodSpec,
    ServerAlgorithm,
    ServerContext,
)
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform, Space, Uniform
from feddomain.config import text_dataset
from feddomain.errors import ConfigError
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.federation.topology import INIT, SERVER, derive_seed
from feddomain.federation.training import get_arrays, pack_ensemble
from feddomain.models.frozen import identity_outputs

# Extra keys of derive_seed that keep the server's draws apart from the runner's.
_HNET_INIT, _AE_INIT = 1, 2

# ----------------------------------------------------------------------------- hyper-parameters


OodModel = Literal["own", "mean_embedding", "parameter_average", "ensemble"]


class HypernetworkHparams(Hparams):
    """Hypernetwork shape and server optimiser (hfedf.md §3.3, §3.8; Table 10, PACS defaults)."""

    embed_dim: int | None = Field(None, ge=1)
    """Embedding length L; null: floor(1 + N/4) (pFedHN's rule)."""
    hidden: int = Field(50, ge=1)
    """Width of the hypernetwork's trunk."""
    layers: int = Field(4, ge=1)
    """Linear layers in the trunk; LeakyReLU after all but the last."""
    server_optimizer: Literal["adam", "sgd"] = "adam"
    """Optimiser of the hypernetwork on the server."""
    lr_s: float = Field(1e-3, gt=0.0)
    """Server learning rate."""
    wd_s: float = Field(1e-5, ge=0.0)
    """Coupled L2 weight decay on the hypernetwork and its conditioning (table or encoder)."""
    server_momentum: float = Field(0.0, ge=0.0)
    """Momentum of the server's SGD (SGD only)."""
    server_grad_clip: float | None = Field(None, gt=0.0)
    """Clip the hypernetwork's gradient to this global norm before each server step (pFedHN's
    reference code clips to 50); null: no clipping, as hFedF's paper describes none."""
    ood_model: OodModel = "own"
    """Which model the unseen (target) domain is scored with: `own` (each client's generated
    model, ood = their mean: the hFedF paper's protocol), `mean_embedding` (the model generated
    from the clients' mean embedding), `parameter_average` (the mean of the clients' generated
    models) or `ensemble` (the clients' generated models' mean predicted probabilities)."""


class SynchronousHparams(HypernetworkHparams):
    """All clients' VJPs per round, one combined step (hFedF, FedVR)."""

    gradalign: bool = True
    """Weight the clients' gradients by GradAlign (softmax of their cosine to the mean)."""
    gradalign_sign: Literal[1, -1] = 1
    """+1: Alg. 3 / the analysis text; -1: §4.2's equation."""
    ema: bool = True
    """Write an EMA of the hypernetwork back into it after every step from `ema_warmup` on."""
    ema_alpha: float = Field(0.95, gt=0.0, le=1.0)
    """EMA weight on the NEW parameters."""
    ema_warmup: int = Field(10, ge=0)
    """Server step at which the EMA starts."""


class HFedFHparams(SynchronousHparams):
    embedding: Literal["learned", "random", "autoencoder"] = "learned"
    """Client embeddings: a learned table, N(0, 1) re-drawn after every step, or fixed
    autoencoder latents (C.2, C.3)."""
    ae_images: int = Field(100, ge=1)
    """Autoencoder embeddings: local images it trains on (Table 6)."""
    ae_epochs: int = Field(50, ge=1)
    """Autoencoder embeddings: training epochs."""
    ae_batch_size: int = Field(32, ge=1)
    """Autoencoder embeddings: batch size."""
    ae_lr: float = Field(1e-3, gt=0.0)
    """Autoencoder embeddings: Adam learning rate."""


# The §3.11 ablations as names: each presets (and pins) one or two switches.
class NoGradAlignHparams(HFedFHparams):
    gradalign: Literal[False] = False


class NoEmaHparams(HFedFHparams):
    ema: Literal[False] = False


class NoGradAlignNoEmaHparams(HFedFHparams):
    gradalign: Literal[False] = False
    ema: Literal[False] = False


class RandEmbedHparams(HFedFHparams):
    embedding: Literal["random"] = "random"


class AeEmbedHparams(HFedFHparams):
    embedding: Literal["autoencoder"] = "autoencoder"


# ----------------------------------------------------------------------------- the hypernetwork


def default_embed_dim(n_clients: int) -> int:
    """L = floor(1 + N/4): 1 for 3 clients, 4 for 12 (hfedf.md §3.3, after pFedHN)."""
    return int(1 + n_clients / 4)


def parameter_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Names and shapes the hypernetwork must emit: the model's ``state_dict`` entries.

    Generated models have no running statistics, so a model with buffers (BatchNorm) is refused.
    """
    params = dict(model.named_parameters())
    buffers = [k for k in model.state_dict() if k not in params]
    if buffers:
        raise ConfigError(
            f"hypernetwork methods need a model without buffers, but this model has "
            f"{len(buffers)} (e.g. {buffers[0]!r}); use a model without BatchNorm "
            "(model.name: hfedf_cnn or lenet5)"
        )
    return {k: v.shape for k, v in params.items()}


class DomainEncoder(nn.Module):
    """g_φ: a client's data statistics -> its embedding, ``W2 ReLU(W1 x + b1) + b2``
    (fedvr.md §3.1): a 2-layer MLP that replaces the embedding table, so a domain never seen in
    training gets an embedding from its statistics alone."""

    def __init__(self, in_features: int, hidden: int, embed_dim: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim)
        )

    def forward(self, stats: Tensor) -> Tensor:
        return self.net(stats)


class HyperNetwork(nn.Module):
    """Conditioning -> MLP trunk -> one linear head per client-model tensor (hfedf.md Table 8).

    The conditioning is hFedF's learned table ν = Embedding(N, L) by default; with ``encoder``
    it is FedVR's g_φ over each client's statistics, held in the ``statistics`` buffer (set once
    the clients report them). Heads named in ``identity`` (a residual adapter's output layer)
    start at zero, weight and bias, so every generated adapter starts as the identity; their
    random draws still happen, so the other heads are initialised as without them.
    """

    def __init__(
        self,
        n_clients: int,
        shapes: dict[str, torch.Size],
        embed_dim: int,
        hidden: int = 50,
        layers: int = 4,
        *,
        encoder: DomainEncoder | None = None,
        identity: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        if encoder is None:
            self.embeddings = nn.Embedding(n_clients, embed_dim)  # N(0, 1) init (CHOICE)
        else:
            self.encoder = encoder
            self.register_buffer("statistics", torch.zeros(n_clients, encoder.in_features))
        trunk: list[nn.Module] = []
        width = embed_dim
        for k in range(layers):
            trunk.append(nn.Linear(width, hidden))
            width = hidden
            if k < layers - 1:
                trunk.append(nn.LeakyReLU())
        self.trunk = nn.Sequential(*trunk)
        self.shapes = dict(shapes)
        self.heads = nn.ModuleList(nn.Linear(hidden, math.prod(s)) for s in self.shapes.values())
        with torch.no_grad():
            for name, head in zip(self.shapes, self.heads, strict=True):
                if name in identity:
                    head.weight.zero_()
                    head.bias.zero_()

    @property
    def encoded(self) -> bool:
        return hasattr(self, "encoder")

    def embedding(self, cid: int) -> Tensor:
        """Client ``cid``'s embedding: its table row, or g_φ of its statistics."""
        if self.encoded:
            return self.encoder(self.statistics[cid])
        return self.embeddings.weight[cid]

    def embeddings_of(self, cids: list[int]) -> Tensor:
        """[len(cids), L]: the clients' embeddings, with the graph to the conditioning."""
        if self.encoded:
            return torch.stack([self.embedding(c) for c in cids])
        return self.embeddings.weight[cids]

    def generate(self, embedding: Tensor) -> dict[str, Tensor]:
        """The client-model parameters for one embedding vector of length L."""
        z = self.trunk(embedding)
        return {
            name: head(z).view(shape)
            for (name, shape), head in zip(self.shapes.items(), self.heads, strict=True)
        }

    def forward(self, cid: int) -> dict[str, Tensor]:
        return self.generate(self.embedding(cid))

    def conditioning(self) -> list[nn.Parameter]:
        """The conditioning's parameters: ν (the table) or φ (the encoder)."""
        if self.encoded:
            return list(self.encoder.parameters())
        return [self.embeddings.weight]

    def theta(self) -> list[nn.Parameter]:
        """θ (ψ in FedVR's notation): trunk and heads (everything but the conditioning)."""
        return [*self.trunk.parameters(), *self.heads.parameters()]


@dataclass
class ClientGradients:
    """The clients' VJPs ``g_i = (∂φ_i/∂(ν, θ))^T Δ_i`` in factored form (hfedf.md §3.6).

    Every head is linear in the trunk output z, so client i's gradient for head P is
    ``Δ_i^P z_iᵀ`` (weight) and ``Δ_i^P`` (bias). Inner products between clients then need only
    ⟨Δ_i, Δ_j⟩ and ⟨z_i, z_j⟩, and ``Σ_i w_i g_i`` is one matrix product per head, so the N
    full-size gradients (47 M floats each for the hFedF CNN) are never materialised; only the
    small trunk and embedding gradients are kept per client. Rows follow ``cids``.
    """

    cids: list[int]
    z: Tensor  # [N, hidden] trunk outputs
    deltas: list[Tensor]  # per head: [N, numel_P]
    trunk: Tensor  # [N, |trunk|] trunk-parameter gradients
    trunk_sizes: list[int]
    nu: Tensor | None  # [N, |ν| or |φ|] conditioning gradients; None when it is fixed
    nu_sizes: list[int] = field(default_factory=list)  # the conditioning's tensors' sizes

    def theta_gram(self) -> Tensor:
        """G_ij = ⟨g_θ,i, g_θ,j⟩ over trunk and heads, in float64."""
        dd = sum(d.double() @ d.double().T for d in self.deltas)
        z, t = self.z.double(), self.trunk.double()
        return dd * (z @ z.T + 1) + t @ t.T

    def nu_gram(self) -> Tensor:
        assert self.nu is not None
        nu = self.nu.double()
        return nu @ nu.T

    def combine(self, w_theta: Tensor, w_nu: Tensor | None) -> list[Tensor]:
        """``Σ_i w_i g_i`` per trainable tensor, flat or shaped, in ``trainable()`` order: the
        conditioning (ν, or φ flat), the trunk's tensors, then each head's weight and bias."""
        w = w_theta.to(self.z.dtype)
        out: list[Tensor] = []
        if self.nu is not None:
            assert w_nu is not None, "learned embeddings need their own weights"
            out += torch.split(w_nu.to(self.z.dtype) @ self.nu, self.nu_sizes)
        out += torch.split(w @ self.trunk, self.trunk_sizes)
        wz = w[:, None] * self.z
        for d in self.deltas:
            out += [d.T @ wz, w @ d]
        return out


def client_gradients(
    hnet: HyperNetwork, deltas: dict[int, Arrays], learn_nu: bool = True
) -> ClientGradients:
    """Factored VJPs of the clients' Δ (initial − final) through the hypernetwork and, when
    ``learn_nu``, its conditioning (ν, or the encoder g_φ: the chain rule through e_i = g_φ(x̄_i)
    with x̄_i constant, fedvr.md §3.3). With that sign, a descent step moves each generated
    model toward its locally trained one (§3.6)."""
    cids = list(deltas)
    cond = hnet.conditioning() if learn_nu else []
    trunk = list(hnet.trunk.parameters())
    inputs = [*cond, *trunk]
    z = hnet.trunk(hnet.embeddings_of(cids))
    stacked = [torch.stack([deltas[c][name].reshape(-1) for c in cids]) for name in hnet.shapes]
    with torch.no_grad():  # ∂L/∂z_i = Σ_P W_Pᵀ Δ_i^P
        dz = sum(d @ head.weight for d, head in zip(stacked, hnet.heads, strict=True))
    rows = torch.stack(
        [
            flat(torch.autograd.grad(z[i], inputs, grad_outputs=dz[i], retain_graph=True))
            for i in range(len(cids))
        ]
    )
    n_nu = sum(p.numel() for p in cond)
    return ClientGradients(
        cids,
        z.detach(),
        stacked,
        rows[:, n_nu:],
        [p.numel() for p in trunk],
        rows[:, :n_nu] if learn_nu else None,
        [p.numel() for p in cond],
    )


def flat(tensors: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def make_server_optimizer(
    params: list[nn.Parameter], hp: HypernetworkHparams
) -> torch.optim.Optimizer:
    """Adam (hFedF, C.7) or SGD (pFedHN). Fused kernels: on CPU they step the 47 M-parameter
    hypernetwork about ten times faster than the per-tensor loop (measured 0.52 s -> 0.04 s)."""
    if hp.server_optimizer == "adam":
        return torch.optim.Adam(params, lr=hp.lr_s, weight_decay=hp.wd_s, fused=True)
    return torch.optim.SGD(
        params, lr=hp.lr_s, momentum=hp.server_momentum, weight_decay=hp.wd_s, fused=True
    )


def weight_divergence(models: list[Arrays], prefix: str) -> dict[str, float]:
    """Per-layer ``mean_{i<j} ||φ_i^l − φ_j^l||`` and its value over ``mean_i ||φ_i^l||`` (§5.4)."""
    if len(models) < 2:
        return {}
    out = {}
    for name in models[0]:
        stack = torch.stack([m[name].reshape(-1).float() for m in models])
        wd = float(torch.pdist(stack).mean())
        out[f"{prefix}/{name}"] = wd
        out[f"{prefix}_norm/{name}"] = wd / max(float(stack.norm(dim=1).mean()), 1e-12)
    return out


# ----------------------------------------------------------------------------- GradAlign and EMA


def gradalign_weights(gram: Tensor, sign: int = 1) -> tuple[Tensor, Tensor]:
    """GradAlign (Alg. 3) from the clients' Gram matrix ``G_ij = ⟨g_i, g_j⟩``: the cosine of each
    g_i to the mean gradient ḡ (⟨ḡ, g_i⟩ = mean_j G_ij, ||ḡ||² = mean G), then a softmax over
    clients of ``sign · cos``. Returns (weights, cosines). Cosines are invariant to the global
    sign of the gradients, so the Δ convention does not matter here.
    """
    gram = gram.double()
    dots = gram.mean(dim=1)
    mean_norm = gram.mean().clamp_min(0).sqrt()
    cosines = dots / (mean_norm * gram.diagonal().clamp_min(0).sqrt() + 1e-12)
    return torch.softmax(sign * cosines, dim=0), cosines


class ParameterEMA:
    """Alg. 4 with write-back: from step ``warmup`` on, the live parameters become the EMA.

    Since the live parameters equal the EMA before each step, the write-back is exactly a scaling
    of the optimiser's step by ``alpha`` (hfedf.md §3.9); the optimiser's moments are untouched.
    """

    def __init__(self, alpha: float, warmup: int) -> None:
        self.alpha, self.warmup = alpha, warmup
        self.shadow: list[Tensor] | None = None

    @torch.no_grad()
    def update(self, params: list[Tensor], step: int) -> None:
        if step == self.warmup:
            self.shadow = [p.detach().clone() for p in params]
        elif step > self.warmup and self.shadow is not None:
            for p, e in zip(params, self.shadow, strict=True):
                e.mul_(1.0 - self.alpha).add_(p, alpha=self.alpha)
                p.copy_(e)


# ----------------------------------------------------------------------------- server


class HypernetworkServer(ServerAlgorithm):
    """What hFedF, pFedHN and FedVR share: the hypernetwork, generation, the VJP, the optimiser
    step, the unseen-domain model (``ood_model``), diagnostics and checkpoints."""

    hp: HypernetworkHparams

    def __init__(self, ctx: ServerContext, hp: HypernetworkHparams) -> None:
        super().__init__(ctx, hp)
        model = ctx.model_factory()
        shapes = parameter_shapes(model)
        self.embed_dim = hp.embed_dim or default_embed_dim(ctx.n_clients)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.seed, INIT, _HNET_INIT))
            encoder = self.make_encoder(model)
            self.hnet = HyperNetwork(
                ctx.n_clients,
                shapes,
                self.embed_dim,
                hp.hidden,
                hp.layers,
                encoder=encoder,
                identity=identity_outputs(model),
            )
        if not self.learn_embeddings():
            for p in self.hnet.conditioning():
                p.requires_grad_(False)
        self.optimizer = make_server_optimizer(self.trainable(), hp)
        self.generator = torch.Generator().manual_seed(derive_seed(ctx.seed, SERVER, 0))
        self.steps = 0
        self.trained_divergence: dict[str, float] = {}
        self._generated: dict[int | str, Arrays] = {}

    def make_encoder(self, model: nn.Module) -> DomainEncoder | None:
        """The conditioning's encoder (FedVR's g_φ); None: a learned embedding table."""
        return None

    def learn_embeddings(self) -> bool:
        return True

    def trainable(self) -> list[nn.Parameter]:
        """Optimised tensors: the conditioning first (when learnable), then θ."""
        cond = [p for p in self.hnet.conditioning() if p.requires_grad]
        return cond + self.hnet.theta()

    # -- generation and evaluation
    def _cached(self, key: int | str, make: Callable[[], Arrays]) -> Arrays:
        """Generated arrays, kept until the next server step."""
        if key not in self._generated:
            with torch.no_grad():
                self._generated[key] = {k: v.detach().clone() for k, v in make().items()}
        return self._generated[key]

    def generated(self, cid: int) -> Arrays:
        """φ_cid from the current hypernetwork."""
        return self._cached(cid, lambda: self.hnet(cid))

    def client_models(self) -> list[Arrays]:
        return [self.generated(c) for c in range(self.ctx.n_clients)]

    def eval_arrays(self, cid: int | None) -> Arrays | None:
        """Client ``cid``'s generated model; for the unseen domain (``cid=None``) the model
        ``ood_model`` names, or None for `own` (ood = the mean over the clients' models)."""
        return self.generated(cid) if cid is not None else self.unseen_model()

    def unseen_model(self) -> Arrays | None:
        """The unseen-domain model of ``hp.ood_model`` (hfedf.md §2.5 scores `own`)."""
        choice = self.hp.ood_model
        if choice == "mean_embedding":
            n = self.ctx.n_clients
            return self._cached(
                choice, lambda: self.hnet.generate(self.hnet.embeddings_of(list(range(n))).mean(0))
            )
        if choice == "parameter_average":
            models = self.client_models()
            return self._cached(
                choice, lambda: {k: torch.stack([m[k] for m in models]).mean(0) for k in models[0]}
            )
        if choice == "ensemble":
            return pack_ensemble(self.client_models())
        return None

    # -- the server step
    def gradients(self, deltas: dict[int, Arrays]) -> ClientGradients:
        return client_gradients(self.hnet, deltas, self.learn_embeddings())

    def trained_model(self, cid: int, delta: Arrays) -> Arrays:
        """φ~ = φ0 − Δ: the client's locally trained model (before this round's step)."""
        phi0 = self.generated(cid)
        return {k: phi0[k] - delta[k] for k in phi0}

    def apply(self, grads: list[Tensor]) -> None:
        """One optimiser step with ``grads`` (aligned with ``trainable()``)."""
        params = self.trainable()
        for p, g in zip(params, grads, strict=True):
            p.grad = g.view_as(p)
        if self.hp.server_grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.hp.server_grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.after_step()
        self.steps += 1
        self._generated.clear()

    def after_step(self) -> None:
        """Post-step updates of the hypernetwork (EMA, embedding re-draws); none by default."""

    def record_trained(self, trained: dict[int, Arrays]) -> None:
        self.trained_divergence = weight_divergence(list(trained.values()), "wd_trained")

    # -- diagnostics and checkpoints
    def diagnostics(self) -> dict[str, Any]:
        """Cheap scalars for metrics: embeddings, per-layer weight divergence between the
        generated client models and between the last round's locally trained models (§5.4)."""
        with torch.no_grad():
            embeddings = self.hnet.embeddings_of(list(range(self.ctx.n_clients)))
        return {
            "server_steps": self.steps,
            "embeddings": embeddings.tolist(),
            **weight_divergence(self.client_models(), "wd_generated"),
            **self.trained_divergence,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "hnet": self.hnet.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "steps": self.steps,
            "trained_divergence": self.trained_divergence,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hnet.load_state_dict(state["hnet"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.steps = state["steps"]
        self.trained_divergence = state["trained_divergence"]
        self._generated.clear()


class SynchronousServer(HypernetworkServer):
    """Synchronous rounds: all clients' VJPs, their weights (GradAlign or the mean), one step,
    EMA (hfedf.md §3.4). FedVR replaces the weights (``client_weights``)."""

    hp: SynchronousHparams

    def __init__(self, ctx: ServerContext, hp: SynchronousHparams) -> None:
        super().__init__(ctx, hp)
        self.ema = ParameterEMA(hp.ema_alpha, hp.ema_warmup) if hp.ema else None
        self.gradalign_log: dict[str, list[float] | list[int]] = {}

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Message]:
        return {cid: Message("fit", self.generated(cid)) for cid in clients}

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        received = dict(replies)
        if not received:  # every update of the round was rejected
            return
        deltas = {cid: msg.arrays for cid, msg in received.items()}
        trained = {cid: self.trained_model(cid, d) for cid, d in deltas.items()}
        grads = self.gradients(deltas)
        w_theta, w_nu = self.client_weights(grads, received)
        self.apply(grads.combine(w_theta, w_nu))
        self.record_trained(trained)

    def client_weights(
        self, grads: ClientGradients, replies: dict[int, Message]
    ) -> tuple[Tensor, Tensor | None]:
        """Weights of the clients' gradients for θ and for the conditioning."""
        w_theta = self._weights(grads.theta_gram(), "theta", grads.cids)
        w_nu = self._weights(grads.nu_gram(), "nu", grads.cids) if grads.nu is not None else None
        return w_theta, w_nu

    def _weights(self, gram: Tensor, part: str, cids: list[int]) -> Tensor:
        """GradAlign weights (or the plain mean without GradAlign); logged for diagnostics."""
        if self.hp.gradalign:
            weights, cosines = gradalign_weights(gram, self.hp.gradalign_sign)
            self.gradalign_log[f"gradalign_c_{part}"] = cosines.tolist()
        else:
            weights = torch.full((len(cids),), 1.0 / len(cids), dtype=torch.float64)
        self.gradalign_log[f"gradalign_w_{part}"] = weights.tolist()
        self.gradalign_log["gradalign_clients"] = cids
        return weights

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update(self.trainable(), self.steps)

    def diagnostics(self) -> dict[str, Any]:
        return {**super().diagnostics(), **self.gradalign_log}

    def state_dict(self) -> dict[str, Any]:
        ema = self.ema.shadow if self.ema is not None else None
        return {**super().state_dict(), "ema": ema, "gradalign": self.gradalign_log}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.ema is not None:
            self.ema.shadow = state["ema"]
        self.gradalign_log = state["gradalign"]


class HFedFServer(SynchronousServer):
    """hFedF: a learned (or random, or autoencoder) embedding table (hfedf.md §3.4, C.2-C.3)."""

    hp: HFedFHparams

    def learn_embeddings(self) -> bool:
        return self.hp.embedding != "autoencoder"

    # -- autoencoder embeddings: one "collect" task before round 1
    def collect(self, clients: list[int]) -> dict[int, Message]:
        if self.hp.embedding != "autoencoder":
            return {}
        task = Message(
            "collect",
            {},
            {
                "ae_seed": derive_seed(self.ctx.seed, INIT, _AE_INIT),
                "latent_dim": self.embed_dim,
            },
        )
        return dict.fromkeys(clients, task)

    @torch.no_grad()
    def on_collect(self, replies: dict[int, Message]) -> None:
        for cid, reply in replies.items():
            self.hnet.embeddings.weight[cid] = reply.arrays["embedding"]
        self._generated.clear()

    def after_step(self) -> None:
        super().after_step()
        if self.hp.embedding == "random":  # C.3: fresh N(0, 1) embeddings after every step
            nu = self.hnet.embeddings.weight
            with torch.no_grad():
                nu.copy_(torch.randn(nu.shape, generator=self.generator))


# ----------------------------------------------------------------------------- client


class HypernetworkClient(ClientAlgorithm):
    """Train the received generated model E epochs; reply Δ = initial − final (§3.6)."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        stats = ctx.fit(msg.arrays)
        trained = get_arrays(ctx.model)
        delta = {k: msg.arrays[k] - trained[k] for k in msg.arrays}
        return Message("fit", delta, {"num_examples": len(ctx.train), "loss": stats.mean_loss})

    def uploads(self, n_clients: int) -> Uploads:
        """Δ, shaped like the model, plus the sample count and mean training loss."""
        return Uploads(model=("*",), scalars=("num_examples", "loss"))


class ConvAutoencoder(nn.Module):
    """Table 6's autoencoder; at 32 px the latent is Linear(32·8·8, e), as in the paper."""

    def __init__(self, latent_dim: int, resolution: int = 32) -> None:
        super().__init__()
        if resolution % 4:
            raise ConfigError(
                f"hfedf autoencoder embeddings: dataset.resolution={resolution} must be a "
                "multiple of 4 (two 2x2 poolings, two 2x transposed convolutions)"
            )
        side = resolution // 4
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * side * side, latent_dim),
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, 32 * side * side),
            nn.Unflatten(1, (32, side, side)),
            nn.ConvTranspose2d(32, 16, 2, stride=2),
            nn.ReLU(),
            nn.ConvTranspose2d(16, 3, 2, stride=2),
            nn.Sigmoid(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.encoder(x))


class HFedFClient(HypernetworkClient):
    """Adds the one-time autoencoder-embedding task (C.2) to the shared fit."""

    hp: HFedFHparams

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task == "collect":
            return Message("collect", {"embedding": self.autoencoder_embedding(msg, ctx)})
        return super().run(msg, ctx)

    def uploads(self, n_clients: int) -> Uploads:
        """Adds the autoencoder embedding: one mean latent vector of length L, never a latent
        per image."""
        base = super().uploads(n_clients)
        if self.hp.embedding != "autoencoder":
            return base
        embed_dim = self.hp.embed_dim or default_embed_dim(n_clients)
        return Uploads(base.model, {"embedding": (embed_dim,)}, base.scalars)

    def autoencoder_embedding(self, msg: Message, ctx: ClientContext) -> Tensor:
        """Train the shared-initialisation AE on a few local images (MSE, Adam) and return the
        mean latent of this client's validation images. The sigmoid output assumes inputs in
        [0, 1], i.e. no normalisation (hFedF's protocol)."""
        if ctx.train.inputs.dim() != 4 or len(ctx.val) == 0:
            raise ConfigError(
                f"hfedf embedding=autoencoder: client {ctx.cid} needs image inputs and a "
                "non-empty validation split (split.val_fraction > 0)"
            )
        pick = torch.randperm(len(ctx.train), generator=ctx.generator)[: self.hp.ae_images]
        images = ClientData(ctx.train.inputs[pick], ctx.train.labels[pick], ctx.val.transform)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(msg.scalars["ae_seed"]))
            ae = ConvAutoencoder(int(msg.scalars["latent_dim"]), int(images.inputs.shape[-1]))
        ae.to(images.inputs.device)  # initialised on the CPU, so every device starts it alike
        optimizer = torch.optim.Adam(ae.parameters(), lr=self.hp.ae_lr)
        ae.train()
        for _ in range(self.hp.ae_epochs):
            for x, _ in images.batches(self.hp.ae_batch_size, ctx.generator):
                loss = F.mse_loss(ae(x), x)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        ae.eval()
        with torch.no_grad():
            latents = [ae.encoder(x) for x, _ in ctx.val.batches(512, shuffle=False)]
        return torch.cat(latents).mean(0)


# ----------------------------------------------------------------------------- registration

_VARIANTS: list[tuple[str, type[HFedFHparams], str]] = [
    (
        "hfedf",
        HFedFHparams,
        "hFedF: hypernetwork fusion with GradAlign and EMA (Bartholet et al., 2024)",
    ),
    ("hfedf_no_gradalign", NoGradAlignHparams, "hFedF without GradAlign (mean of VJPs)"),
    ("hfedf_no_ema", NoEmaHparams, "hFedF without the EMA write-back"),
    (
        "hfedf_no_gradalign_no_ema",
        NoGradAlignNoEmaHparams,
        "hFedF without GradAlign and EMA: synchronous pFedHN with Adam",
    ),
    ("hfedf_rand_embed", RandEmbedHparams, "hFedF with embeddings re-drawn after every step"),
    ("hfedf_ae_embed", AeEmbedHparams, "hFedF with fixed autoencoder embeddings"),
]

# hfedf.md §4, PAPER Table 10 grids: lr_s {1e-1, 1e-2, 1e-3}, wd_s {1e-3, 1e-4, 1e-5}, α_ema
# {0.75, 0.85, 0.95}; α_ema only where the EMA runs
HFEDF_SPACE: Space = {"lr_s": LogUniform(1e-3, 1e-1), "wd_s": LogUniform(1e-5, 1e-3)}
EMA_SPACE: Space = {"ema_alpha": Uniform(0.75, 0.95)}
AUTOENCODER = "trains a convolutional autoencoder on images for its client embeddings"


def check_config(cfg: Any, hp: HFedFHparams) -> None:
    """Autoencoder embeddings encode images: refused on a text dataset, naming the key."""
    text = text_dataset(cfg)
    if text and hp.embedding == "autoencoder":
        raise ConfigError(
            f"invalid configuration: 'algorithm.embedding' = 'autoencoder' {AUTOENCODER}; "
            f"dataset {text!r} is text"
        )


for _name, _hparams, _description in _VARIANTS:
    register(
        MethodSpec(
            _name,
            HFedFServer,
            HFedFClient,
            _hparams,
            description=_description,
            check_config=check_config,
            image_only=AUTOENCODER if _hparams is AeEmbedHparams else None,
            space={**HFEDF_SPACE, **(EMA_SPACE if _hparams().ema else {})},
            evaluation_only=("ood_model",),
        )
    )
