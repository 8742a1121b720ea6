"""Is FISC's premise met in a federation? Where its interpolation style sits between the clients'.

FISC renders every client's images in one interpolation style (the lower median of the FINCH
cluster means of the clients' styles) and learns what stays the same. Its premise: the style is
new to every client. A review found that on PACS cs-a-p it fell inside the majority domain's
range, so most clients barely changed their images. This runs only the style phase of the given
FISC configuration (each client's style from its training images, the server's interpolation
style; no training) and prints, per client domain (the majority domain of a client's images),
the clients' style shift (distance to the interpolation style in units of the median distance
between two clients' styles; ``FISCServer.run_summary`` reports the same per run) and the share
below 0.25.

That unit is the clients' spread, which shrinks as lambda grows (at lambda 1 every client holds
the same mix of domains), while AdaIN restyles each image from its own statistics. So it also
prints where the interpolation style sits between the source domains: its distance to each
domain's style (all the domain's images as one cluster, from the federation where that domain
is the target) in units of the median distance between two domains' styles, and with two
sources its position on the line between them (0: the first, 1: the second). A domain at
distance under 0.25 keeps its style: its images barely change. Leave split.targets unset so
every source is some federation's target. Run:

    python benchmarks/fisc_premise.py configs/protocols/digits3-bn.yaml dataset.root=/data \
        algorithm=fisc algorithm.freeze_bn=false
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from feddomain.algorithms import resolve_method
from feddomain.config import load_config
from feddomain.data.federated import federations
from feddomain.federation.data import ClientData
from feddomain.style.backends import StyleBackend, build_backend
from feddomain.style.statistics import (
    ClientAggregation,
    Clustering,
    client_style,
    encode_all,
    interpolation_style,
    style_shift,
)

BARELY = 0.25  # FISCServer's threshold for "barely restyled"


def client_images(data: ClientData) -> Iterator[torch.Tensor]:
    """The client's training images in [0, 1], batch by batch (its pixels behind a prefix)."""
    images = data.pixels.images if data.pixels is not None else data.inputs
    return (x.float() / 255 for x in images.split(256))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(cfg.torch_threads)
    hp = resolve_method(cfg.algorithm.name, cfg.algorithm.hparams).hp
    backend = build_backend(hp.backend, hp.encoder_weights, hp.decoder_weights)
    feds = federations(cfg)
    # a whole domain's images: the target set of the federation that holds it out, in pixels
    # (under a frozen prefix a target holds the prefix's maps, so those are built again without)
    pixel_feds = feds
    if cfg.model.frozen_prefix is not None:
        pixel_feds = federations(
            load_config(args.config, [*args.overrides, "model.frozen_prefix=null"])
        )
    domain_styles = {
        domain: style_row(data, backend, "mean", hp.client_style_agg)
        for fed in pixel_feds
        for domain, data in fed.targets.items()
    }
    for fed in feds:
        rows = []
        for data in fed.train:
            rows.append(style_row(data, backend, hp.local_clustering, hp.client_style_agg))
        styles = torch.stack(rows)
        s_mean, s_std, clusters = interpolation_style(styles, hp.server_clustering)
        target_style = torch.cat([s_mean, s_std])
        shift = style_shift(styles, target_style)
        by_domain = defaultdict(list)
        for counts, d in zip(fed.client_domain_counts, shift.tolist(), strict=True):
            by_domain[fed.domains[int(counts.argmax())]].append(d)
        target = "+".join(fed.split.test)
        print(f"target {target}: {len(rows)} clients, {clusters} FINCH clusters of styles")
        for domain, shifts in sorted(by_domain.items()):
            barely = sum(d < BARELY for d in shifts) / len(shifts)
            print(f"  {domain:14s} {len(shifts):3d} clients  shift median "
                  f"{statistics.median(shifts):.2f} (min {min(shifts):.2f}, max {max(shifts):.2f})"
                  f"  below {BARELY}: {100 * barely:.0f}%")  # fmt: skip
        overall = sum(d < BARELY for d in shift.tolist()) / len(rows)
        print(f"  all clients: below {BARELY}: {100 * overall:.0f}%")
        print_between_domains(target_style, {d: domain_styles.get(d) for d in fed.split.train})


def style_row(
    data: ClientData,
    backend: StyleBackend,
    clustering: Clustering,
    aggregation: ClientAggregation,
) -> torch.Tensor:
    """The style (mean ‖ std) of a set of images, as FISC's client computes it."""
    features = encode_all(((x, None) for x in client_images(data)), backend, lambda x: x)
    mean, std, _ = client_style(features, clustering, aggregation)
    return torch.cat([mean, std])


def print_between_domains(target: torch.Tensor, centroids: dict[str, torch.Tensor | None]) -> None:
    """Where the interpolation style sits between the source domains' styles."""
    missing = [d for d, c in centroids.items() if c is None]
    if missing:
        print(f"  between domains: {', '.join(missing)} not a target here (unset split.targets)")
        return
    names = list(centroids)
    rows = torch.stack([centroids[d] for d in names]).double()
    distance = style_shift(rows, target)
    line = ", ".join(f"{d} {x:.2f}" for d, x in zip(names, distance.tolist(), strict=True))
    print(f"  interpolation style's distance to each domain's style (median pair = 1): {line}")
    if len(names) == 2:
        axis = rows[1] - rows[0]
        position = float((target.double() - rows[0]) @ axis / (axis @ axis))
        print(f"  position on the line {names[0]} (0) -> {names[1]} (1): {position:.2f}")
    print(flush=True)


if __name__ == "__main__":
    main()
