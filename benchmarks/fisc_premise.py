"""Is FISC's premise met in a federation? Where its interpolation style sits between the clients'.

FISC renders every client's images in one interpolation style (the lower median of the FINCH
cluster means of the clients' styles) and learns what stays the same. Its premise: the style is
new to every client. A review found that on PACS cs-a-p it fell inside the majority domain's
range, so most clients barely changed their images. This runs only the style phase of the given
FISC configuration (each client's style from its training images, the server's interpolation
style; no training) and prints, per client domain (the majority domain of a client's images),
the clients' style shift (distance to the interpolation style in units of the median distance
between two clients' styles; ``FISCServer.run_summary`` reports the same per run) and the share
below 0.25. Run:

    python benchmarks/fisc_premise.py configs/protocols/digits3-bn.yaml dataset.root=/data \
        algorithm=fisc algorithm.freeze_bn=false split.targets=[mnist_m]
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
from feddomain.style.backends import build_backend
from feddomain.style.statistics import (
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
    for fed in federations(cfg):
        rows = []
        for data in fed.train:
            batches = ((x, None) for x in client_images(data))
            features = encode_all(batches, backend, lambda x: x)
            mean, std, _ = client_style(features, hp.local_clustering, hp.client_style_agg)
            rows.append(torch.cat([mean, std]))
        styles = torch.stack(rows)
        s_mean, s_std, clusters = interpolation_style(styles, hp.server_clustering)
        shift = style_shift(styles, torch.cat([s_mean, s_std]))
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
        print(f"  all clients: below {BARELY}: {100 * overall:.0f}%", flush=True)


if __name__ == "__main__":
    main()
