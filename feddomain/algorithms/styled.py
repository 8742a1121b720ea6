"""What FISC and CCST share: a one-time style phase and on-the-fly style transfer.

Round 0 (``ServerAlgorithm.collect`` / ``broadcast``): every client encodes its training images
with the style backend and uploads one style (mean, std: 2 x C floats, nothing per image); the
server derives what each client should render its batches in (FISC: one interpolation style;
CCST: other clients' styles) and sends it once; each client keeps it in its persistent state
(``ctx.state``: checkpointed, kept by the node on Flower). From round 1 on, traffic is FedAvg's.
The method modules supply the server's derivation (``derive``) and the training loss.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from feddomain.algorithms.base import Arrays, ClientContext, Hparams, ServerContext
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgServer
from feddomain.errors import ConfigError, DataError, FeddomainError
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.models.base import warn_small_instance_map
from feddomain.models.frozen import PixelVariant
from feddomain.style.backends import StyleBackend, backend_channels, build_backend
from feddomain.style.statistics import (
    ClientAggregation,
    Clustering,
    client_style,
    encode_all,
    stylize,
)

COLLECT, STYLE = "collect", "style"  # round 0: the clients' styles up, the server's down
log = logging.getLogger(__name__)
STACKED_NDIM = 5  # a batch of cached maps with their styled views: [B, 1 + K, C, h, w]
MEAN, STD = "style_mean", "style_std"  # what a client uploads, and what it receives
KEPT = "style/"  # prefix of what a client keeps of the server's message in its state


class StyleHparams(Hparams):
    """Style-backend and style-phase settings of FISC and CCST."""

    alpha: float = Field(0.5, ge=0.0, le=1.0)
    """AdaIN content/style trade-off α in [0, 1]: 0 keeps the image, 1 takes the style fully."""
    backend: Literal["adain_dct", "adain_vgg"] = "adain_dct"
    """Style encoder/decoder: `adain_dct` (weight-free 8x8 block DCT, exactly invertible;
    needs image sides divisible by 8) or `adain_vgg` (AdaIN's VGG-19 relu4_1 encoder and decoder
    from local files)."""
    encoder_weights: str | None = None
    """`adain_vgg`: path of AdaIN's `vgg_normalised.pth` (the first 31 modules are used)."""
    decoder_weights: str | None = None
    """`adain_vgg`: path of AdaIN's `decoder.pth`."""
    local_clustering: Clustering = "finch"
    """How a client groups its images' feature maps before weighting groups equally: `finch`
    (coarsest FINCH partition) or `mean` (one group: the pooled style)."""
    client_style_agg: ClientAggregation = "mixture_moments"
    """Client style from its clusters: `mixture_moments` (FISC's code: σ of the equal-weight
    mixture) or `mean_of_stats` (the paper's text: mean of the clusters' μ and σ)."""
    style_noise: float = Field(0.0, ge=0.0)
    """Std of the Gaussian noise added to the uploaded style (ρ·s of the FISC paper's Table 10);
    0: off."""

    @model_validator(mode="after")
    def _weights_match_backend(self) -> StyleHparams:
        given = [k for k in ("encoder_weights", "decoder_weights") if getattr(self, k)]
        if self.backend == "adain_vgg" and len(given) < 2:
            raise ValueError(
                "backend 'adain_vgg' needs both encoder_weights (vgg_normalised.pth) and "
                "decoder_weights (decoder.pth)"
            )
        if self.backend != "adain_vgg" and given:
            raise ValueError(f"{given[0]} is set but backend is {self.backend!r} (no weights)")
        return self


def check_style_config(cfg: Any, hp: Hparams) -> None:
    """Refuse, when the config loads, what style transfer cannot run on: cached features, DCT
    on sides not divisible by 8 (or a one-cell grid), weight files that are missing or wrong."""
    if cfg.model.frozen:
        raise ConfigError(
            "'model.frozen': style transfer re-renders images, which frozen-backbone mode "
            "replaces by cached features; set model.frozen: false"
        )
    if cfg.model.frozen_prefix is not None and not cfg.model.prefix_cache:
        raise ConfigError(
            "'model.prefix_cache' = false: style transfer re-renders the images before the "
            "frozen prefix, which this mode has already applied to every batch; set "
            "model.prefix_cache: true (each style's maps are then cached once)"
        )
    if cfg.model.frozen_prefix is not None and cfg.train.precise_bn:
        raise ConfigError(
            "'train.precise_bn' with 'model.frozen_prefix': the re-estimation would see the "
            "batches of cached maps stacked with their styled versions; turn one off"
        )
    side = cfg.dataset.resolution
    if hp.backend == "adain_dct" and (side % 8 or side < 16):
        raise ConfigError(
            f"'dataset.resolution' = {side}: the adain_dct style backend needs a multiple of 8 "
            "of at least 16 (8x8 blocks, at least a 2x2 grid for a channel's std)"
        )
    if hp.backend == "adain_vgg":
        build_backend(hp.backend, hp.encoder_weights, hp.decoder_weights)


class StyleClient(FedAvgClient):
    """FedAvg's client with the round-0 tasks: ``collect`` (compute and upload this client's
    style) and ``style`` (keep the server's message in ``ctx.state``)."""

    def __init__(self, hp: Hparams) -> None:
        super().__init__(hp)
        self._backend: StyleBackend | None = None
        self._style_maps: dict[tuple[int, str], torch.Tensor] = {}  # (cid, style): its maps

    def backend(self, device: torch.device) -> StyleBackend:
        """The frozen style backend on ``device``, built (weights read) once per client part."""
        if self._backend is None:
            self._backend = build_backend(
                self.hp.backend, self.hp.encoder_weights, self.hp.decoder_weights
            )
        return self._backend.to(device)

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task == COLLECT:
            return self.collect(ctx)
        if msg.task == STYLE:
            for name, value in msg.arrays.items():
                ctx.state.arrays[KEPT + name] = value
            return Message(STYLE)
        if ctx.train.pixels is not None:
            ctx = replace(ctx, train=self.stacked(ctx))
        return super().run(msg, ctx)

    def styles(self, ctx: ClientContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (mean, std) styles this client renders its images in (CCST: one per row)."""
        kept = self.kept(ctx)
        if kept[MEAN].ndim == 1:
            return [(kept[MEAN], kept[STD])]
        return list(zip(kept[MEAN], kept[STD], strict=True))

    def stacked(self, ctx: ClientContext) -> ClientData:
        """Frozen-prefix mode: the client's cached maps with those of its images in each of its
        styles, stacked per image [N, 1 + K, C, h, w], so one batch carries every view (a
        style is fixed for the whole run, so its maps are computed once and cached)."""
        train = ctx.train
        views = [train.inputs]
        for mean, std in self.styles(ctx):
            key = (ctx.cid, _digest(mean, std))
            if key not in self._style_maps:
                self._style_maps[key] = train.pixels.variant_maps(self.variant(mean, std))
            views.append(self._style_maps[key].to(train.inputs.device))
        return ClientData(torch.stack(views, dim=1), train.labels)

    def variant(self, mean: torch.Tensor, std: torch.Tensor) -> PixelVariant:
        """Rendering in the style (mean, std) as a pixel variant, named by everything that
        changes its output (backend, weights, alpha, the style's values)."""
        hp = self.hp
        key = f"style:{hp.backend}:{hp.encoder_weights}:{hp.decoder_weights}:{hp.alpha!r}:"
        return PixelVariant(
            key + _digest(mean, std),
            lambda unit: stylize(unit, self.backend(unit.device), mean.to(unit.device),
                                 std.to(unit.device), hp.alpha),
        )  # fmt: skip

    def views(self, x: torch.Tensor, ctx: ClientContext) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A batch's model inputs and their restyled versions, one per style: sliced from a
        batch of stacked cached maps (frozen prefix), else rendered now from the pixels."""
        if x.ndim == STACKED_NDIM:
            return x[:, 0], list(x[:, 1:].unbind(1))
        return x, [self.restyle(x, ctx, mean, std) for mean, std in self.styles(ctx)]

    def collect(self, ctx: ClientContext) -> Message:
        """This client's style from its training images (train-time augmentation, seeded),
        with optional Gaussian noise. Any failure is re-raised naming the client."""
        try:
            if len(ctx.train) == 0:
                raise DataError("it has no training images (the style needs at least one)")
            if len(ctx.train) < 3 and self.hp.local_clustering == "finch":
                log.warning(
                    "client %d has %d training image(s), fewer than FINCH needs to split (3): "
                    "its style is one cluster's",
                    ctx.cid,
                    len(ctx.train),
                )
            device = ctx.train.inputs.device
            batches, unit = self._images(ctx)
            features = encode_all(batches, self.backend(device), unit)
            warn_small_instance_map(
                self,
                f"the {self.hp.backend} style backend (AdaIN)",
                features.shape[2],
                features.shape[3],
            )
            mean, std, _ = client_style(
                features, self.hp.local_clustering, self.hp.client_style_agg
            )
        except Exception as exc:
            raise FeddomainError(
                f"{type(self).__name__.removesuffix('Client').lower()}: the style phase of "
                f"client {ctx.cid} ({len(ctx.train)} training images) failed: {exc}"
            ) from exc
        if self.hp.style_noise > 0:
            style = torch.cat([mean, std])
            noise = torch.randn(style.shape, generator=ctx.generator) * self.hp.style_noise
            mean, std = (style + noise.to(style.device)).chunk(2)
            std = std.clamp_min(1e-3)  # a noisy std must stay a std
        return Message(COLLECT, {MEAN: mean, STD: std}, {"num_examples": len(ctx.train)})

    def _images(
        self, ctx: ClientContext
    ) -> tuple[Iterator[tuple[torch.Tensor, torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]]:
        """The client's training batches for the style phase and their map to [0, 1] images:
        the model inputs, or, in frozen-prefix mode, the images the cached maps came from."""
        pixels = ctx.train.pixels
        if pixels is None:
            return ctx.train.batches(ctx.batch_size, ctx.generator), lambda x: to_unit(x, ctx)
        images = ClientData(pixels.images, ctx.train.labels)
        return images.batches(ctx.batch_size, ctx.generator), lambda x: x.float().div(255.0)

    def kept(self, ctx: ClientContext) -> Arrays:
        """What this client kept of the server's round-0 message (error if it never came)."""
        kept = {k.removeprefix(KEPT): v for k, v in ctx.state.arrays.items() if k.startswith(KEPT)}
        if not kept:
            raise FeddomainError(
                f"client {ctx.cid} trains without the server's style: the round-0 style phase "
                "did not reach it (was its state lost?)"
            )
        return kept

    def restyle(
        self, x: torch.Tensor, ctx: ClientContext, mean: torch.Tensor, std: torch.Tensor
    ) -> torch.Tensor:
        """Model inputs ``x`` re-rendered in the style (mean, std), as model inputs again."""
        unit = stylize(to_unit(x, ctx), self.backend(x.device), mean, std, self.hp.alpha)
        return from_unit(unit, ctx)

    def uploads(self, n_clients: int) -> Uploads:
        """The trained model, its sample count and loss; once, the client's style (2 x C floats:
        channel means and stds of its feature maps, no per-image values)."""
        c = backend_channels(self.hp.backend)
        return Uploads(
            model=("*",), statistics={MEAN: (c,), STD: (c,)}, scalars=("num_examples", "loss")
        )


class StyleServer(FedAvgServer):
    """FedAvg's server with the style phase: asks every client for its style, derives what each
    client keeps (``derive``), sends it once; that stays in its checkpoint."""

    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.styles: dict[int, Arrays] = {}  # what each client receives in round 0

    def collect(self, clients: list[int]) -> dict[int, Message]:
        return dict.fromkeys(clients, Message(COLLECT))

    def on_collect(self, replies: dict[int, Message]) -> None:
        if not replies:
            raise FeddomainError("no client replied to the style phase; nothing to derive from")
        order = sorted(replies)
        rows = torch.stack(
            [torch.cat([replies[c].arrays[MEAN], replies[c].arrays[STD]]) for c in order]
        )
        bad = [c for c, row in zip(order, rows, strict=True) if not torch.isfinite(row).all()]
        if bad:
            raise FeddomainError(f"clients {bad} uploaded non-finite styles in the style phase")
        self.styles = self.derive(order, rows)

    def derive(self, clients: list[int], rows: torch.Tensor) -> dict[int, Arrays]:
        """What each client receives, from the clients' [N, 2C] style rows (mean ‖ std)."""
        raise NotImplementedError

    def broadcast(self, clients: list[int]) -> dict[int, Message]:
        return {c: Message(STYLE, self.styles[c]) for c in clients if c in self.styles}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "styles": self.styles}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.styles = state["styles"]


def _normalization(x: torch.Tensor, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = ctx.normalization
    return tuple(
        torch.tensor(v, dtype=x.dtype, device=x.device).view(1, -1, 1, 1) for v in (mean, std)
    )


def to_unit(x: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
    """Model inputs back to images in [0, 1] (undo ``train.mean``/``train.std``)."""
    if ctx.normalization is None:
        return x
    mean, std = _normalization(x, ctx)
    return x * std + mean


def from_unit(x: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
    """Images in [0, 1] as model inputs (``train.mean``/``train.std`` applied)."""
    if ctx.normalization is None:
        return x
    mean, std = _normalization(x, ctx)
    return (x - mean) / std


def _digest(mean: torch.Tensor, std: torch.Tensor) -> str:
    """A short name of a style's values, for caches."""
    values = torch.cat([mean.flatten(), std.flatten()]).double().cpu().numpy().tobytes()
    return hashlib.sha256(values).hexdigest()[:16]
