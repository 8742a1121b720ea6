"""FedVR (Gupta, Shanker, Sethi): a variance-regularised hypernetwork conditioned on data
statistics.

hFedF's synchronous hypernetwork trainer (``hfedf.SynchronousServer``) with three pieces swapped
in (fedvr.md §3):

- **Conditioning**: each client reports once the mean of its frozen-backbone features x̄_i; the
  server's domain encoder g_φ (2-layer MLP) maps it to the embedding e_i, replacing hFedF's
  embedding table (``HyperNetwork(encoder=...)``). An unseen site's model is synthesised from the
  statistics of an unlabeled pilot set of its images: θ_new = h_ψ(g_φ(x̄_pilot)) — the run's
  ood model (``ood_model: zero_shot``) and what ``feddomain adapt`` writes.
- **Weights**: clients report the mean L̄_i and population variance V_i of their round's
  mini-batch losses; α = softmax(−τ·V) (stable: torch's softmax subtracts the maximum).
- **Variance regulariser**: ψ's direction is Σ_i c_i g_ψ,i with c_i = α_i + (2λ_var/N)(L̄_i − L̄),
  the gradient of λ_var·(1/N)Σ(L̄_i − L̄)² added to Σ α_i g_ψ,i (Σ c_i = 1); φ gets Σ α_i g_φ,i
  (literal Alg. 1; ``var_reg_on_phi`` adds it there too). One plain SGD step on ψ and φ.

The VJPs are the shared factored ones (``hfedf.client_gradients``), computed on the server from
each client's Δ_i = θ_i^0 − θ_i^final and the x̄_i it holds (the server-side-VJP protocol of §5.8:
numerically identical to clients sending g_ψ,i, g_φ,i). A client sends Δ_i, three loss scalars
and once its feature statistics (one vector of length F, or 2F with ``stats: mean+std``), never a
feature of a single image. With ``conditioning: table``, ``tau: 0``, ``lambda_var: 0`` and
GradAlign + EMA + Adam it is hFedF's round, bit for bit (tested).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from feddomain.algorithms.base import (
    Arrays,
    ClientContext,
    MethodSpec,
    ServerContext,
)
from feddomain.algorithms.hfedf import (
    ClientGradients,
    DomainEncoder,
    HypernetworkClient,
    SynchronousHparams,
    SynchronousServer,
)
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform, Space
from feddomain.errors import ConfigError, DataError, FeddomainError
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import get_arrays, set_arrays

log = logging.getLogger("feddomain")

STATS_TASK = "stats"
STATS_ARRAY = "feature_stats"
DOMINANT_SHARE = 0.5  # a client holding more than this share of α dominates the round
ACTIVE_RATIO = 1.05  # fedvr.md B3: α weighs the clients when max/min α exceeds this


class FedVRHparams(SynchronousHparams):
    """fedvr.md §4 (CHOICE values where the paper gives none)."""

    embed_dim: int | None = Field(128, ge=1)
    """Embedding length (PAPER: 128)."""
    hidden: int = Field(100, ge=1)
    """Width of the hypernetwork's trunk (CHOICE: 100)."""
    server_optimizer: Literal["adam", "sgd"] = "sgd"
    """Plain SGD on ψ and φ (the paper's Algorithm 1, step 12)."""
    lr_s: float = Field(1e-1, gt=0.0)
    """Server learning rate η (CHOICE 0.1: 1e-2 moved each generated model only 1-2% of the way
    along its client's update; the tuning grid is 3e-2 .. 1)."""
    wd_s: float = Field(0.0, ge=0.0)
    """Server weight decay (none in the paper)."""
    gradalign: bool = False
    """GradAlign weights instead of softmax(−τ·V) (hFedF's; needs `tau: 0`)."""
    ema: bool = False
    """hFedF's EMA write-back (not in FedVR)."""
    ood_model: Literal["zero_shot", "own", "mean_embedding", "parameter_average", "ensemble"] = (
        "zero_shot"
    )
    """Unseen-domain model: `zero_shot` (θ_new = h(g(x̄_pilot)) from the target's unlabeled
    pilot set; needs `split.pilot_fraction`), or one of hFedF's choices."""
    conditioning: Literal["encoder", "table"] = "encoder"
    """`encoder`: g_φ over each client's feature statistics; `table`: hFedF's learned
    embeddings (no zero-shot model)."""
    encoder_hidden: int = Field(256, ge=1)
    """Hidden width of the 2-layer domain encoder (CHOICE: 256)."""
    stats: Literal["mean", "mean+std"] = "mean"
    """Encoder input: per-dimension mean of the frozen features, or mean and std (2F)."""
    tau: float = Field(10.0, ge=0.0, allow_inf_nan=False)
    """Temperature τ of the weights softmax(−τ·V_i) (CHOICE: 10; 0: uniform)."""
    lambda_var: float = Field(0.5, ge=0.0, allow_inf_nan=False)
    """Weight λ_var of the inter-client loss-variance penalty (CHOICE: 0.5)."""
    var_reg_on_phi: bool = False
    """Add the variance term to the encoder's update too (Alg. 1: ψ only)."""
    var_loss_source: Literal["batch_mean", "init_model_full_pass", "gap"] = "batch_mean"
    """L̄_i in the penalty: the round's mean mini-batch loss, the loss of θ_i^0 on all of
    D_i^tr before training, or that loss minus θ_i^final's (a generalisation gap)."""

    @model_validator(mode="after")
    def _consistent(self) -> FedVRHparams:
        if self.gradalign and self.tau > 0:
            raise ValueError(
                "gradalign=true replaces the softmax(-tau*V) weights; set tau=0 "
                f"(got tau={self.tau})"
            )
        if self.conditioning == "table" and self.ood_model == "zero_shot":
            raise ValueError(
                "ood_model='zero_shot' needs conditioning='encoder' (a table has no embedding "
                "for a new domain); pick ood_model own, mean_embedding, parameter_average or "
                "ensemble"
            )
        if self.conditioning == "table" and self.stats != "mean":
            raise ValueError("stats only applies to conditioning='encoder'")
        return self


class NoVarHparams(FedVRHparams):
    lambda_var: Literal[0.0] = 0.0


class UniformHparams(FedVRHparams):
    tau: Literal[0.0] = 0.0


class PlainHparams(FedVRHparams):
    lambda_var: Literal[0.0] = 0.0
    tau: Literal[0.0] = 0.0


class TableHparams(FedVRHparams):
    conditioning: Literal["table"] = "table"
    ood_model: Literal["own", "mean_embedding", "parameter_average", "ensemble"] = "own"


class MeanStdHparams(FedVRHparams):
    stats: Literal["mean+std"] = "mean+std"


# ----------------------------------------------------------------------------- the maths


def feature_statistics(data: ClientData, kind: str) -> Tensor:
    """x̄: the per-dimension mean of a set's features (with ``mean+std`` also the population
    std), accumulated in float64, sent as float32. Labels are not read."""
    x = data.inputs
    if x.dim() != 2:
        raise ConfigError(
            f"fedvr: the domain statistics are means of cached backbone features, but the "
            f"inputs are {list(x.shape)}; set model.frozen: true"
        )
    if len(x) == 0:
        raise DataError("fedvr: cannot compute feature statistics of an empty set")
    x = x.double()
    stats = x.mean(0) if kind == "mean" else torch.cat([x.mean(0), x.std(0, correction=0)])
    return stats.float()


def loss_statistics(batch_losses: Tensor) -> tuple[float, float]:
    """(L̄, V): mean and population variance of the recorded mini-batch losses, in float64
    (fedvr.md §3.2 step 6)."""
    losses = batch_losses.double()
    mean = losses.mean()
    return float(mean), float(((losses - mean) ** 2).mean())


def generalisation_weights(variances: Tensor, tau: float) -> Tensor:
    """α_i = softmax_i(−τ·V_i) in float64 (Eq. 7); the softmax subtracts the maximum, so any τ
    is finite, and τ = 0 gives exactly 1/N."""
    return torch.softmax(-tau * variances.double(), dim=0)


def variance_shift(losses: Tensor, lambda_var: float) -> Tensor:
    """(2λ_var/N)(L̄_i − L̄): the coefficients of λ_var·∇(1/N)Σ(L̄_i − L̄)² on the clients'
    gradients (Eq. 6, Alg. 1 step 10); they sum to zero."""
    losses = losses.double()
    return (2.0 * lambda_var / len(losses)) * (losses - losses.mean())


def mean_loss(model: nn.Module, arrays: Arrays, data: ClientData, batch_size: int) -> float:
    """Cross-entropy of ``arrays`` over all of ``data`` (no augmentation, eval mode)."""
    set_arrays(model, arrays)
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for x, y in data.batches(batch_size, shuffle=False):
            total += F.cross_entropy(model(x), y, reduction="sum").double().cpu()
    return float(total) / len(data)


def cosine_diagnostics(gram: Tensor, weights: Tensor) -> dict[str, Any]:
    """Gradient alignment from the Gram matrix of the clients' g_ψ (fedvr.md §5.5): each client's
    cosine to the combined direction Σ c_j g_j and to the unweighted mean, and the mean pairwise
    cosine."""
    gram, w = gram.double(), weights.double()
    norms = gram.diagonal().clamp_min(0).sqrt()
    n = len(norms)

    def cos_to(v: Tensor) -> Tensor:
        return (gram @ v) / (norms * (v @ gram @ v).clamp_min(0).sqrt() + 1e-12)

    pair = gram / (norms[:, None] * norms[None, :] + 1e-12)
    off = pair[~torch.eye(n, dtype=torch.bool)]
    return {
        "grad_norm": norms.tolist(),
        "cos_to_update": cos_to(w).tolist(),
        "cos_to_mean": cos_to(torch.full((n,), 1.0 / n, dtype=torch.float64)).tolist(),
        "cos_pairwise_mean": float(off.mean()) if n > 1 else 1.0,
    }


def embedding_geometry(embeddings: Tensor, new: Tensor | None) -> dict[str, Any]:
    """Spread of the clients' embeddings (fedvr.md §5.6): mean pairwise L2 distance and cosine,
    and, with a zero-shot embedding, its distance to each client's and to their centroid."""
    e = embeddings.double()
    out: dict[str, Any] = {}
    if len(e) > 1:
        out["embedding_l2_mean"] = float(torch.pdist(e).mean())
        unit = F.normalize(e, dim=1)
        cos = unit @ unit.T
        out["embedding_cos_mean"] = float(cos[~torch.eye(len(e), dtype=torch.bool)].mean())
    if new is not None:
        out["zero_shot_l2_to_clients"] = (e - new.double()).norm(dim=1).tolist()
        out["zero_shot_l2_to_centroid"] = float((e.mean(0) - new.double()).norm())
    return out


def input_width(model: nn.Module) -> int:
    """The feature width a head takes: its first linear layer's input."""
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ConfigError("fedvr: the model has no linear layer to take the cached features")
    return int(first.in_features)


# ----------------------------------------------------------------------------- server


class FedVRServer(SynchronousServer):
    """hFedF's synchronous trainer with encoder conditioning, loss-variance weights and the
    variance regulariser; the zero-shot model for the unseen domain."""

    hp: FedVRHparams
    exports_state = True  # `feddomain adapt` synthesises new sites' models from it

    def __init__(self, ctx: ServerContext, hp: FedVRHparams) -> None:
        super().__init__(ctx, hp)
        self.pilot: dict[str, Tensor] = {}
        self.round_log: dict[str, Any] = {}
        self.weighted_rounds = 0  # rounds whose step weighed the clients by α
        self.dominated_rounds = 0  # ... in which one client held more than half of α
        self.active_rounds = 0  # ... in which max/min α exceeded ACTIVE_RATIO

    def make_encoder(self, model: nn.Module) -> DomainEncoder | None:
        if self.hp.conditioning == "table":
            return None
        width = input_width(model) * (2 if self.hp.stats == "mean+std" else 1)
        return DomainEncoder(width, self.hp.encoder_hidden, self.embed_dim)

    # -- the clients' statistics, once before round 1
    def collect(self, clients: list[int]) -> dict[int, Message]:
        if not self.hnet.encoded:
            return {}
        return dict.fromkeys(clients, Message(STATS_TASK))

    @torch.no_grad()
    def on_collect(self, replies: dict[int, Message]) -> None:
        if not self.hnet.encoded:
            return
        missing = sorted(set(range(self.ctx.n_clients)) - set(replies))
        if missing:
            raise FeddomainError(
                f"fedvr: no usable feature statistics from client(s) {missing}; every client's "
                "embedding needs them"
            )
        for cid, reply in replies.items():
            self.hnet.statistics[cid] = reply.arrays[STATS_ARRAY]
        self._generated.clear()

    # -- weights and the variance regulariser
    def client_weights(
        self, grads: ClientGradients, replies: dict[int, Message]
    ) -> tuple[Tensor, Tensor | None]:
        cids = grads.cids
        losses = torch.tensor([replies[c].scalars["loss_mean"] for c in cids], dtype=torch.float64)
        variances = torch.tensor(
            [replies[c].scalars["loss_var"] for c in cids], dtype=torch.float64
        )
        if self.hp.gradalign:
            alpha, w_nu = super().client_weights(grads, replies)
        else:
            alpha = generalisation_weights(variances, self.hp.tau)
            w_nu = alpha if grads.nu is not None else None
        w_psi = alpha
        if self.hp.lambda_var > 0:
            shift = variance_shift(losses, self.hp.lambda_var)
            w_psi = alpha + shift
            if self.hp.var_reg_on_phi and w_nu is not None:
                w_nu = w_nu + shift
        self.log_round(cids, losses, variances, alpha, w_psi, grads)
        return w_psi, w_nu

    def log_round(
        self,
        cids: list[int],
        losses: Tensor,
        variances: Tensor,
        alpha: Tensor,
        coefficients: Tensor,
        grads: ClientGradients,
    ) -> None:
        """§5.3, §5.5, §5.9: L_var, L̄_i, V_i, α_i, c_i (warning when one is negative) and the
        gradient-alignment cosines of this round's step."""
        l_var = float(((losses - losses.mean()) ** 2).mean())
        dominated = float(alpha.max()) > DOMINANT_SHARE
        active = float(alpha.max() / alpha.min()) > ACTIVE_RATIO
        self.weighted_rounds += 1
        self.dominated_rounds += int(dominated)
        self.active_rounds += int(active)
        min_c = float(coefficients.min())
        if min_c < 0:
            log.warning("fedvr: a negative client coefficient c_i = %.4f this round", min_c)
        self.round_log = {
            "clients": cids,
            "loss_var_across_clients": l_var,
            "loss_mean": losses.tolist(),
            "loss_batch_var": variances.tolist(),
            "alpha": alpha.tolist(),
            "alpha_dominated": dominated,
            "alpha_active": active,
            **self.dominance(),
            "coef": coefficients.tolist(),
            "coef_min": min_c,
            **cosine_diagnostics(grads.theta_gram(), coefficients),
        }

    # -- the unseen domain
    def pilot_task(self, domain: str) -> Message | None:
        if self.hp.ood_model != "zero_shot" or domain in self.pilot:
            return None
        return Message(STATS_TASK)

    def on_pilot(self, domain: str, reply: Message) -> None:
        self.pilot[domain] = reply.arrays[STATS_ARRAY]

    def synthesise(self, stats: Tensor) -> dict[str, Tensor]:
        """θ_new = h_ψ(g_φ(x̄)): a model for a domain known only by its statistics (§3.6); the
        same computation as a client's generated model (``HyperNetwork.embedding``), so a
        client's own statistics give exactly its θ_i."""
        if not self.hnet.encoded:
            raise ConfigError("fedvr: a zero-shot model needs conditioning 'encoder'")
        return self.hnet.generate(self.hnet.encoder(stats))

    def unseen_model(self) -> Arrays | None:
        if self.hp.ood_model != "zero_shot":
            return super().unseen_model()
        if not self.pilot:
            return None
        if len(self.pilot) > 1:
            raise FeddomainError(
                f"fedvr zero_shot: one unseen-domain model is scored on every target, but this "
                f"split has {len(self.pilot)} targets with pilot sets ({sorted(self.pilot)}); "
                "use split.scheme: lodo (one target per run)"
            )
        (stats,) = self.pilot.values()
        return self._cached("zero_shot", lambda: self.synthesise(stats))

    # -- diagnostics and checkpoints
    def round_record(self) -> dict[str, Any]:
        """§5.3, §5.5, §5.6, §5.9 every round (the evaluated rounds' diagnostics repeat them)."""
        return {**self.round_log, **self.geometry()}

    def diagnostics(self) -> dict[str, Any]:
        return {**super().diagnostics(), **self.round_log, **self.geometry()}

    def dominance(self) -> dict[str, Any]:
        """The share of the rounds so far in which one client held more than half of α (τ too
        large makes α winner-take-all: one client's update is then the step), and in which α
        weighed the clients at all (fedvr.md B3: max/min α above 1.05; τ too small leaves α
        uniform and FedVR a plain average)."""
        n = self.weighted_rounds or 1
        return {
            "alpha_dominated_rounds": self.dominated_rounds,
            "alpha_dominated_share": self.dominated_rounds / n,
            "alpha_active_rounds": self.active_rounds,
            "alpha_active_share": self.active_rounds / n,
        }

    def run_summary(self) -> dict[str, Any]:
        return {**super().run_summary(), **self.dominance()}

    @torch.no_grad()
    def geometry(self) -> dict[str, Any]:
        """The clients' embeddings' spread, and the zero-shot embedding once a pilot set is in."""
        embeddings = self.hnet.embeddings_of(list(range(self.ctx.n_clients)))
        new = None
        if self.hnet.encoded and len(self.pilot) == 1:
            new = self.hnet.encoder(next(iter(self.pilot.values())))
        out = embedding_geometry(embeddings, new)
        return out if new is None else {**out, "zero_shot_embedding": new.tolist()}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "pilot": self.pilot,
            "round_log": self.round_log,
            "alpha_rounds": (self.weighted_rounds, self.dominated_rounds, self.active_rounds),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pilot = dict(state["pilot"])
        self.round_log = state["round_log"]
        # a checkpoint written before B3's count holds two counts; it resumes counting from 0
        self.weighted_rounds, self.dominated_rounds, *active = state["alpha_rounds"]
        self.active_rounds = active[0] if active else 0


# ----------------------------------------------------------------------------- client


class FedVRClient(HypernetworkClient):
    """Trains the generated model E epochs and reports Δ with the round's loss statistics; on a
    ``stats`` task (its own training split once, or a target's pilot set) the feature mean."""

    hp: FedVRHparams

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task == STATS_TASK:
            stats = feature_statistics(ctx.train, self.hp.stats)
            return Message(STATS_TASK, {STATS_ARRAY: stats}, {"num_examples": len(ctx.train)})
        source = self.hp.var_loss_source
        before = None
        if source != "batch_mean":
            before = mean_loss(ctx.model, msg.arrays, ctx.train, ctx.batch_size)
        fit = ctx.fit(msg.arrays)
        if fit.steps == 0:
            raise DataError(
                f"fedvr: client {ctx.cid} ran no training step ({len(ctx.train)} training "
                f"samples, train.batch_size {ctx.batch_size}, drop_last {ctx.drop_last}); its "
                "loss statistics need at least one batch"
            )
        trained = get_arrays(ctx.model)
        loss_mean, loss_var = loss_statistics(fit.batch_losses)
        if before is not None:
            loss_mean = before
            if source == "gap":
                loss_mean = before - mean_loss(ctx.model, trained, ctx.train, ctx.batch_size)
        delta = {k: msg.arrays[k] - trained[k] for k in msg.arrays}
        scalars = {
            "num_examples": len(ctx.train),
            "loss": fit.mean_loss,
            "loss_mean": loss_mean,
            "loss_var": loss_var,
            "batches": fit.steps,
        }
        return Message("fit", delta, scalars)

    def uploads(self, n_clients: int) -> Uploads:
        """Δ (shaped like the model), the round's loss statistics and, once, the feature
        statistics of the whole training split (one vector; never a row per image)."""
        return Uploads(
            model=("*",),
            statistics={STATS_ARRAY: (None,)},
            scalars=("num_examples", "loss", "loss_mean", "loss_var", "batches"),
        )


# ----------------------------------------------------------------------------- registration


def check_config(cfg: Any, hp: FedVRHparams) -> None:
    """FedVR runs on cached frozen-backbone features; the zero-shot model needs a pilot set."""
    if not cfg.model.frozen:
        raise ConfigError(
            "invalid configuration: fedvr needs 'model.frozen' = true (its domain statistics "
            "are means of frozen backbone features; profile pacs-effnet-frozen)"
        )
    if hp.ood_model == "zero_shot" and cfg.split.pilot_fraction <= 0:
        raise ConfigError(
            "invalid configuration: fedvr ood_model 'zero_shot' builds the unseen domain's model "
            "from an unlabeled pilot set; set 'split.pilot_fraction' (e.g. 0.1)"
        )


_VARIANTS: list[tuple[str, type[FedVRHparams], str]] = [
    (
        "fedvr",
        FedVRHparams,
        "FedVR: variance-regularised hypernetwork with data-statistics "
        "embeddings and zero-shot models for unseen sites (Gupta et al.)",
    ),
    ("fedvr_no_var", NoVarHparams, "FedVR without the variance regulariser (lambda_var = 0)"),
    ("fedvr_uniform", UniformHparams, "FedVR with uniform client weights (tau = 0)"),
    ("fedvr_plain", PlainHparams, "FedVR with neither (synchronous pFedHN, encoder conditioning)"),
    ("fedvr_table", TableHparams, "FedVR with a learned embedding table instead of the encoder"),
    ("fedvr_mean_std_stats", MeanStdHparams, "FedVR whose encoder reads feature mean and std"),
]


def fedvr_space(hparams: type[FedVRHparams]) -> Space:
    """fedvr.md §4 (corrected): η over {3e-2, 1e-1, 3e-1, 1}, τ over {0.3, 1, 3, 10}, λ_var
    over {0.1, 0.5, 1.0}, as log ranges; an ablation that fixes τ or λ_var at 0 leaves it out."""
    fixed = hparams()
    space: dict = {"lr_s": LogUniform(3e-2, 1.0)}
    if fixed.tau > 0:
        space["tau"] = LogUniform(0.3, 10.0)
    if fixed.lambda_var > 0:
        space["lambda_var"] = LogUniform(0.1, 1.0)
    return space


for _name, _hparams, _description in _VARIANTS:
    register(
        MethodSpec(
            _name,
            FedVRServer,
            FedVRClient,
            _hparams,
            description=_description,
            check_config=check_config,
            space=fedvr_space(_hparams),
        )
    )
