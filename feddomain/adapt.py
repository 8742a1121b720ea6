"""`feddomain adapt` and `feddomain evaluate`: a model for a site that joins after training.

``adapt`` takes a finished FedVR run and a folder of the new site's images. With no labels and no
gradient step it computes the frozen backbone's mean feature of those images (the pilot set),
encodes it and lets the trained hypernetwork generate the site's adapter and classifier,
θ_new = h_ψ(g_φ(x̄_pilot)) (fedvr.md §3.6) — the same code path as a run's zero-shot model. The
few-shot variant then fine-tunes θ_new on a few labelled images of the site (``--shots``), with
the run's client optimiser. The result is one standalone file: the generated arrays, the run's
config (to rebuild the backbone and head), the class list and where it came from. Nothing of the
site's images leaves the machine it runs on.

``evaluate`` scores such a file on any image folder: ``<class>/<image>`` (accuracy, ECE) or a
flat folder of unlabeled images (predicted class counts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from feddomain.config import ExperimentConfig, text_dataset, validate_config
from feddomain.errors import DataError, FeddomainError
from feddomain.federation import checkpoint
from feddomain.federation.data import UNLABELED, ClientData
from feddomain.federation.training import predict_probs, set_arrays, train_epochs

FORMAT = "feddomain-model/1"


@dataclass
class ImageFolder:
    """Images of a folder as uint8 [N, 3, R, R]; labels (-1 without class folders)."""

    path: Path
    images: torch.Tensor
    labels: torch.Tensor
    classes: tuple[str, ...] | None  # the class folders found, None for a flat folder


@dataclass
class TrainedRun:
    """What `adapt` needs of a finished FedVR run."""

    path: Path
    cfg: ExperimentConfig
    summary: dict[str, Any]
    server: Any  # FedVRServer with the final state loaded
    classes: tuple[str, ...]


# ----------------------------------------------------------------------------- images


def read_images(
    folder: Path, resolution: int, *, classes: tuple[str, ...] | None, resize: bool, what: str
) -> ImageFolder:
    """The images of ``folder``: ``<class>/<image>`` or flat. Refuses, naming them, a missing or
    unreadable folder, a folder without images, class folders outside ``classes``, an image
    that cannot be decoded, and (without ``resize``) an image not ``resolution`` px square."""
    from feddomain.data.sources import IMAGE_SUFFIXES, decode_image

    if not folder.is_dir():
        raise DataError(f"{what} folder {folder} does not exist or is not a folder")
    try:
        entries = sorted(folder.iterdir())
    except OSError as err:
        raise DataError(f"{what} folder {folder} cannot be read: {err}") from None
    subfolders = [e for e in entries if e.is_dir()]
    if subfolders:
        found = tuple(e.name for e in subfolders)
        unknown = sorted(set(found) - set(classes or found))
        if unknown:
            raise DataError(
                f"{what} folder {folder} has class folders {unknown} that the model does not "
                f"know; its classes are {list(classes or ())}"
            )
        files = [
            (f, (classes or found).index(d.name))
            for d in subfolders
            for f in _images(d, IMAGE_SUFFIXES)
        ]
    else:
        found = None
        files = [(f, UNLABELED) for f in _images(folder, IMAGE_SUFFIXES)]
    if not files:
        raise DataError(f"{what} folder {folder} holds no images (.png, .jpg, ...)")
    arrays = []
    for path, _ in files:
        try:
            with Image.open(path) as img:
                size = img.size
            if size != (resolution, resolution) and not resize:
                raise DataError(
                    f"{what} image {path} is {size[0]}x{size[1]} px, but the run was trained on "
                    f"{resolution}x{resolution} images; pass --resize to resize every image to it"
                )
            arrays.append(torch.from_numpy(decode_image(path, resolution).copy()))
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"{what} image {path} cannot be decoded: {err}") from None
    labels = torch.tensor([label for _, label in files], dtype=torch.int64)
    return ImageFolder(folder, torch.stack(arrays), labels, found)


def _images(folder: Path, suffixes: frozenset[str]) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)


# ----------------------------------------------------------------------------- the run


def load_run(run_dir: Path) -> TrainedRun:
    """A finished run's config, summary and final server state, checked to belong together."""
    from feddomain.algorithms import resolve_method
    from feddomain.algorithms.base import ServerContext
    from feddomain.algorithms.fedvr import FedVRServer
    from feddomain.models.frozen import head_model

    config, summary_file = run_dir / "config.yaml", run_dir / "summary.json"
    if not config.exists() or not summary_file.exists():
        raise FeddomainError(
            f"{run_dir} is not a finished run directory (config.yaml and summary.json expected; "
            "a leave-one-domain-out run has one per target: <out>/lodo-<target>)"
        )
    import yaml

    cfg = validate_config(yaml.safe_load(config.read_text()))
    if text_dataset(cfg):
        raise FeddomainError(
            f"{run_dir} trained on the text dataset {text_dataset(cfg)}; adapt and evaluate read "
            "image folders"
        )
    summary = json.loads(summary_file.read_text())
    method = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams)
    exported = summary.get("server_state")
    if method.spec.server is not FedVRServer:
        raise FeddomainError(
            f"{run_dir} is a {cfg.algorithm.name} run; adapt needs a FedVR run (its trained "
            "hypernetwork and domain encoder)"
        )
    if exported is None:
        raise FeddomainError(
            f"{summary_file} names no exported server state (a run made before feddomain "
            "exported it); run it again to get server_state.pt"
        )
    if method.hp.conditioning != "encoder":
        raise FeddomainError(
            f"{run_dir}: {cfg.algorithm.name} with conditioning 'table' cannot embed a new site"
        )
    state_file = run_dir / exported["file"]
    state = checkpoint.read(state_file, "it is not a server state written by feddomain")
    if state is None:
        raise FeddomainError(f"{state_file} is missing: the run's trained hypernetwork")
    if checkpoint.fingerprint(state) != exported["fingerprint"]:
        raise FeddomainError(
            f"{state_file} is not this run's model: its fingerprint differs from the one in "
            f"{summary_file} (a server_state.pt copied from another run?)"
        )
    classes = tuple(exported["classes"])
    width = state["hnet"]["statistics"].shape[1] // (2 if method.hp.stats == "mean+std" else 1)
    m = cfg.model

    def factory() -> torch.nn.Module:
        return head_model(width, len(classes), hidden=m.head_hidden, adapter=m.head_adapter)

    ctx = ServerContext(factory, int(summary["n_clients"]), cfg.seed, cfg.rounds)
    server = FedVRServer(ctx, method.hp)
    server.load_state_dict(state)
    return TrainedRun(run_dir, cfg, summary, server, classes)


def features(cfg: ExperimentConfig, images: torch.Tensor, n_classes: int) -> torch.Tensor:
    """The run's frozen backbone on new images (not cached: they are the site's own)."""
    from feddomain.data.federated import backbone_features

    return backbone_features(cfg, images, n_classes, cached=False)


# ----------------------------------------------------------------------------- adapt


def adapt(
    run_dir: Path,
    pilot_dir: Path | None,
    out: Path,
    *,
    shots_dir: Path | None = None,
    epochs: int | None = None,
    resize: bool = False,
) -> str:
    """Write a model for a new site to ``out``; returns the report line."""
    from feddomain.algorithms.fedvr import feature_statistics

    if pilot_dir is None and shots_dir is None:
        raise FeddomainError("adapt needs --pilot (unlabeled images) or --shots (labelled ones)")
    if out.exists():
        raise FeddomainError(f"{out} exists; adapt never overwrites a model file")
    run = load_run(run_dir)
    cfg, n_classes = run.cfg, len(run.classes)
    torch.set_num_threads(cfg.torch_threads)  # as the run: no oversubscription
    resolution = cfg.dataset.resolution
    shots = None
    if shots_dir is not None:
        shots = read_images(shots_dir, resolution, classes=run.classes, resize=resize, what="shots")
        if shots.classes is None:
            raise DataError(f"shots folder {shots_dir} needs <class>/<image> subfolders (labels)")
    pilot = (
        read_images(pilot_dir, resolution, classes=run.classes, resize=resize, what="pilot")
        if pilot_dir is not None
        else shots
    )
    assert pilot is not None
    pilot_features = features(cfg, pilot.images, n_classes)
    unlabeled = torch.full((len(pilot_features),), UNLABELED, dtype=torch.int64)
    stats = feature_statistics(ClientData(pilot_features, unlabeled), run.server.hp.stats)
    with torch.no_grad():
        arrays = {k: v.detach().clone() for k, v in run.server.synthesise(stats).items()}
    kind = "zero-shot"
    if shots is not None:
        arrays = fine_tune(
            run, arrays, features(cfg, shots.images, n_classes), shots.labels, epochs
        )
        kind = f"few-shot ({len(shots.labels)} labelled images)"
    payload = {
        "format": FORMAT,
        "arrays": arrays,
        "config": cfg.to_dict(),
        "classes": list(run.classes),
        "n_features": int(pilot_features.shape[1]),
        "source": {
            "run": str(run_dir.resolve()),
            "method": cfg.algorithm.name,
            "seed": cfg.seed,
            "fingerprint": run.summary["server_state"]["fingerprint"],
            "target_domains": run.summary.get("target_domains"),
        },
        "pilot": {"folder": str(pilot.path.resolve()), "images": len(pilot.images)},
        "kind": kind,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomic(out, payload)
    return (
        f"adapt: {kind} model for {pilot.path} ({len(pilot.images)} pilot images, no labels "
        f"read) from {cfg.algorithm.name} run {run_dir} (seed {cfg.seed}) -> {out}"
    )


def fine_tune(
    run: TrainedRun,
    arrays: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int | None,
) -> dict[str, torch.Tensor]:
    """The few-shot variant: θ_new trained on the labelled shots with the run's client
    optimiser (SGD/Adam, lr, momentum, weight decay) for ``epochs`` (default: the run's)."""
    from feddomain.federation.simulation import make_optimizer_factory

    cfg = run.cfg
    model = run.server.ctx.model_factory()
    set_arrays(model, arrays)
    optimizer = make_optimizer_factory(cfg)(list(model.parameters()), cfg.train.lr)
    generator = torch.Generator().manual_seed(cfg.seed)
    train_epochs(
        model,
        ClientData(x, y),
        optimizer,
        epochs=epochs or cfg.train.local_epochs,
        batch_size=min(cfg.train.batch_size, len(y)),
        generator=generator,
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- evaluate


def load_model_file(path: Path) -> dict[str, Any]:
    payload = checkpoint.read(path, "it is not a model file written by `feddomain adapt`")
    if payload is None:
        raise FeddomainError(f"model file {path} does not exist")
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise FeddomainError(f"{path} is not a model file written by `feddomain adapt`")
    return payload


def evaluate(model_file: Path, folder: Path, *, resize: bool = False) -> str:
    """Score a model file on an image folder; returns the report line."""
    from feddomain.evaluation.metrics import evaluate_probs
    from feddomain.models.frozen import head_model

    payload = load_model_file(model_file)
    cfg = validate_config(payload["config"])
    torch.set_num_threads(cfg.torch_threads)
    classes = tuple(payload["classes"])
    data = read_images(folder, cfg.dataset.resolution, classes=classes, resize=resize, what="image")
    x = features(cfg, data.images, len(classes))
    m = cfg.model
    model = head_model(
        payload["n_features"], len(classes), hidden=m.head_hidden, adapter=m.head_adapter
    )
    set_arrays(model, payload["arrays"])
    probs = predict_probs(model, ClientData(x, data.labels), cfg.eval.batch_size)
    if data.classes is None:
        counts = torch.bincount(probs.argmax(1), minlength=len(classes)).tolist()
        shown = ", ".join(f"{c} {n}" for c, n in zip(classes, counts, strict=True))
        return f"evaluate: {len(x)} unlabeled images in {folder}: predicted {shown}"
    result = evaluate_probs(probs, data.labels)
    return (
        f"evaluate: {payload['kind']} model {model_file} on {folder} ({len(x)} images): "
        f"accuracy {100 * result.acc:.1f}%, ECE {100 * result.ece:.1f}%"
    )
