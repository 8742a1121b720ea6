"""FedRC, the Gaussian hierarchical method (Kou, Lin, Tang, Wang, Zhu & Wu, "FedRC: A
Rapid-Converged Hierarchical Federated Learning Framework in Street Scene Semantic Understanding",
IROS 2024; a baseline of HFedATM, hfedatm.md §6): hierarchical FedAvg whose aggregation weights,
at the station and at the server, count each party's data volume *and* how typical its data's
Gaussian is. (Not the robust-clustering FedRC of Guo, Tang & Lin 2023, a different method.)

Each client summarises its training images as a diagonal Gaussian N(μ_i, diag σ_i²): per RGB
channel, over every pixel of every image (per dimension for feature inputs). A party with
children k (a station's clients, the server's stations), each with n_k samples and N_k, weighs
them, with τ the temperature (``tau``)::

    barycentre     μ̄ = Σ_k n_k μ_k / Σ_k n_k,   σ̄² = Σ_k n_k (σ_k² + (μ_k − μ̄)²) / Σ_k n_k
    distance       d_k = D_B(N_k, N̄) = Σ_c (μ_kc − μ̄_c)² / (8 v_c) + ½ ln(v_c / √(σ_kc² σ̄_c²)),
                   v_c = (σ_kc² + σ̄_c²) / 2                                  (Bhattacharyya)
    weight         w_k ∝ n_k · exp(−d_k / τ)
    model          x = Σ_k w_k x_k / Σ_k w_k

The barycentre is the moment-matched Gaussian of the pooled data (the station's Gaussian that
goes up to the server is its clients' barycentre, with n = its samples), so a child whose data
look like its siblings' counts by its volume and an atypical one is damped. τ → ∞ (``tau:
.inf``) gives w_k = n_k exactly: sample-weighted hierarchical FedAvg, i.e. ``hfedavg`` wherever
the stations' sample counts are proportional to their clients (+Avg weighs stations by clients).

CHOICES (the paper's text gives the Gaussians and the Bhattacharyya distance, hfedatm.md §6 and
the HFedATM code the exp(−d/τ) form): statistics of the stored, un-augmented pixels scaled to
[0, 1] (D_B is invariant to the per-channel normalisation the model sees), the client's own
images in the cached modes too (frozen prefix, frozen backbone), where its inputs are maps or
features, so a run weighs its data alike whether the backbone is trained or frozen (features
would sum D_B over 1280 dimensions, not 3, and τ's range would mean another thing); each
client computes its Gaussian once and keeps it in its state (the data do not change); variances
are floored at 1e-12 (a constant channel); the distances are shifted by their minimum before
the exponential (the same normalised weights, and none underflows to 0). In a flat federation
the server weighs the clients themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from feddomain.algorithms.base import ClientContext, Hparams, MethodSpec, StationAlgorithm
from feddomain.algorithms.fedavg import FedAvgClient
from feddomain.algorithms.hfedatm import HFedAvgServer, station_layer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads

MEAN, VAR = "fedrc_mean", "fedrc_var"  # a Gaussian's [1, C] mean and variance, in replies
SUMMARY = (MEAN, VAR)
VAR_FLOOR = 1e-12
CHUNK = 256  # images per slice when summarising (no whole-dataset float copy)


class FedRCHparams(Hparams):
    """FedRC's temperature."""

    tau: float = Field(1.0, gt=0.0)
    """τ: weights ∝ n·exp(−D_B(N, barycentre)/τ) at the station and the server; `.inf`: the
    sample counts alone (hierarchical FedAvg)."""


Gaussian = tuple[Tensor, Tensor]  # (mean [C], variance [C]), float64


def data_gaussian(data: ClientData) -> Gaussian:
    """Per-channel mean and variance over every pixel of every image ([N, C, H, W]; uint8 read
    as [0, 1]), or per dimension for feature inputs ([N, F]) that come without images. In the
    cached modes (``data.pixels``) the client's own images are summarised, not its maps or
    features: the Gaussian is of its data, and τ's scale is set by 3 channels."""
    if data.pixels is not None:
        return _channel_gaussian(data.pixels.source, data.pixels.index)
    x = data.inputs
    if not (x.dim() == 4 or (x.dim() == 2 and x.is_floating_point())):
        raise ValueError(
            f"fedrc summarises images [N, C, H, W] or features [N, F]; got inputs of shape "
            f"{list(x.shape)} ({x.dtype})"
        )
    return _channel_gaussian(x)


def _channel_gaussian(source: Tensor, index: Tensor | None = None) -> Gaussian:
    """Population mean and variance of axis 1 over all other axes of ``source[index]`` (all of
    ``source`` without an index), accumulated in float64 slice by slice on the data's device
    (no whole-dataset float copy, one transfer at the end)."""
    size = source.shape[0] if index is None else len(index)
    channels = source.shape[1]
    scale = 255.0 if source.dtype == torch.uint8 else 1.0
    total = torch.zeros(channels, dtype=torch.float64, device=source.device)
    squares = torch.zeros_like(total)
    count = 0
    for start in range(0, size, CHUNK):
        part = slice(start, start + CHUNK)
        chunk = source[part] if index is None else source[index[part]]
        values = (chunk.double() / scale).transpose(0, 1).reshape(channels, -1)  # [C, values]
        total += values.sum(1)
        squares += values.square().sum(1)
        count += values.shape[1]
    if not count:
        raise ValueError("fedrc: a client without training data has no Gaussian")
    mean = total.cpu() / count
    return mean, (squares.cpu() / count - mean.square()).clamp_min(0)


def barycentre(gaussians: list[Gaussian], counts: list[float]) -> Gaussian:
    """The moment-matched Gaussian of the children's pooled data (weights ``counts``)."""
    n = torch.tensor(counts, dtype=torch.float64).view(-1, 1)
    means = torch.stack([g[0] for g in gaussians]).double()
    variances = torch.stack([g[1] for g in gaussians]).double()
    mean = (n * means).sum(0) / n.sum()
    return mean, (n * (variances + (means - mean).square())).sum(0) / n.sum()


def bhattacharyya(a: Gaussian, b: Gaussian) -> float:
    """D_B between two diagonal Gaussians."""
    va, vb = a[1].double().clamp_min(VAR_FLOOR), b[1].double().clamp_min(VAR_FLOOR)
    v = (va + vb) / 2
    shift = (a[0].double() - b[0].double()).square() / (8 * v)
    spread = 0.5 * (v.log() - 0.5 * (va.log() + vb.log()))
    return float((shift + spread).sum())


def gaussian_weights(gaussians: list[Gaussian], counts: list[float], tau: float) -> list[float]:
    """w_k ∝ n_k·exp(−d_k/τ), d_k = D_B(N_k, barycentre); unnormalised, the least distant
    child's weight is its n_k (distances shifted by their minimum)."""
    centre = barycentre(gaussians, counts)
    distances = [bhattacharyya(g, centre) for g in gaussians]
    nearest = min(distances)
    return [n * math.exp(-(d - nearest) / tau) for n, d in zip(counts, distances, strict=True)]


def summary_of(msg: Message) -> Gaussian:
    return msg.arrays[MEAN].reshape(-1).double(), msg.arrays[VAR].reshape(-1).double()


def with_summary(msg: Message, gaussian: Gaussian) -> Message:
    mean, var = gaussian
    arrays = {**msg.arrays, MEAN: mean.view(1, -1), VAR: var.view(1, -1)}
    return Message(msg.task, arrays, msg.scalars)


class FedRCClient(FedAvgClient):
    """FedAvg's local training; the reply carries the client's data Gaussian."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        reply = super().run(msg, ctx)
        if MEAN not in ctx.state.arrays:
            ctx.state.arrays[MEAN], ctx.state.arrays[VAR] = data_gaussian(ctx.train)
        return with_summary(reply, (ctx.state.arrays[MEAN], ctx.state.arrays[VAR]))

    def uploads(self, n_clients: int) -> Uploads:
        """The trained model, its sample count and mean training loss, and the client's data
        Gaussian: one mean and one variance per channel."""
        return Uploads(
            model=("*",),
            statistics={MEAN: (1, None), VAR: (1, None)},
            scalars=("num_examples", "loss"),
        )


class FedRCStation(StationAlgorithm):
    """Weighs its clients' models by n_i·exp(−D_B/τ) and sends up the mean, its sample count
    and its data's Gaussian (the clients' barycentre)."""

    def __init__(self, ctx, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.gaussian: Gaussian | None = None

    def aggregate(self, rnd: int, r: int, replies: Iterator[tuple[int, Message]]) -> None:
        got = [msg for _, msg in replies]
        if not got:
            return
        gaussians = [summary_of(m) for m in got]
        counts = [float(m.scalars["num_examples"]) for m in got]
        weights = gaussian_weights(gaussians, counts, self.hp.tau)
        models = (
            Message(m.task, {k: v for k, v in m.arrays.items() if k not in SUMMARY}, {"w": w})
            for m, w in zip(got, weights, strict=True)
        )
        arrays, _ = weighted_mean(models, weight_key="w")
        self.gaussian = barycentre(gaussians, counts)
        self.current = Message("fit", arrays, {"num_examples": sum(counts)})

    def uplink(self, rnd: int) -> Message | None:
        up = super().uplink(rnd)
        if up is None or self.gaussian is None:
            return None
        return with_summary(up, self.gaussian)


class FedRCServer(HFedAvgServer):
    """+Avg's merge with the stations (or, flat, the clients) weighted by n·exp(−D_B/τ); the
    normalised weights of every round are in the diagnostics (``merge``)."""

    def weights(self, payloads: list[Message]) -> list[float]:
        gaussians = [summary_of(p) for p in payloads]
        counts = [float(p.scalars["num_examples"]) for p in payloads]
        return gaussian_weights(gaussians, counts, self.hp.tau)

    def merge(self, models, grams, gammas, record: dict[str, Any]):
        total = sum(gammas)
        record["weights"] = [g / total for g in gammas]
        return super().merge(models, grams, gammas, record)


register(
    MethodSpec(
        "fedrc",
        FedRCServer,
        FedRCClient,
        FedRCHparams,
        station=FedRCStation,
        description="FedRC (Gaussian): clients and stations summarise their data as diagonal "
        "Gaussians, and both tiers weigh models by n·exp(−Bhattacharyya distance to the "
        "barycentre/τ) (Kou et al., IROS 2024)",
        space={"tau": LogUniform(0.1, 10.0)},  # x/10 .. x10 around HFedATM's code's τ = 1
        image_only="summarises each client's data as a Gaussian over its pixels' channels",
        station_wrapper=station_layer,
    )
)
