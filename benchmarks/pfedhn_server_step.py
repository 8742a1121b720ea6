"""Why pFedHN's SGD server step stalls on the hFedF CNN and trains on frozen features (hfedf.md §6).

Runs pFedHN for a few rounds and records, at every server step (one per client reply): the norm
of the client's generated model against the norm of the model's own initialisation, the cosine of
the client's update Δ (initial − final) with its generated weights (positive: local training
shrinks them), the gradient norms of the hypernetwork's conditioning (ν), trunk and heads before
the clip, and the factor the clip scales every gradient by; ``max φ`` is the largest generated
weight in magnitude. A diagnostic of the baseline's optimiser, not of the method: it reads the
server's state and changes nothing.

    python benchmarks/pfedhn_server_step.py configs/protocols/pacs-hfedf-cnn.yaml \
        dataset.root=../shared/data "split.targets=[sketch]" algorithm=pfedhn \
        algorithm.server_grad_clip=50 train.lr=0.0012296 algorithm.lr_s=0.0070357 \
        algorithm.wd_s=0.00019579
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch
from torch import Tensor

from feddomain.algorithms.hfedf import HypernetworkServer, flat
from feddomain.config import load_config
from feddomain.data.federated import federations
from feddomain.federation.simulation import Simulation


def norm(tensors: list[Tensor]) -> float:
    return float(torch.linalg.vector_norm(flat([t.double() for t in tensors])))


@contextmanager
def probed(rows: list[dict[str, Any]], reference: dict[str, float]) -> Iterator[None]:
    """Within the block, the shared server's VJP and step log one row per step (and the norm
    of the model's own initialisation into ``reference``)."""
    gradients, apply = HypernetworkServer.gradients, HypernetworkServer.apply

    def probed_gradients(self: HypernetworkServer, deltas: dict) -> Any:
        if not reference:
            initial = dict(self.ctx.model_factory().named_parameters())
            reference["init"] = norm([initial[k].detach() for k in self.hnet.shapes])
        (cid,) = deltas  # pFedHN steps after each client
        phi = self.generated(cid)
        update, weights = flat([deltas[cid][k] for k in phi]), flat(list(phi.values()))
        rows.append(
            {
                "client": cid,
                "norm": norm([weights]),
                "largest": float(weights.abs().max()),
                "cosine": float(torch.nn.functional.cosine_similarity(update, weights, dim=0)),
            }
        )
        return gradients(self, deltas)

    def probed_apply(self: HypernetworkServer, grads: list[Tensor]) -> None:
        n_cond = sum(p.requires_grad for p in self.hnet.conditioning())
        n_trunk = len(list(self.hnet.trunk.parameters()))
        clip = self.hp.server_grad_clip
        rows[-1] |= {
            "nu": norm(grads[:n_cond]) if n_cond else 0.0,
            "trunk": norm(grads[n_cond : n_cond + n_trunk]),
            "heads": norm(grads[n_cond + n_trunk :]),
            "clip_scale": min(1.0, clip / norm(grads)) if clip is not None else 1.0,
        }
        apply(self, grads)

    with (
        patch.object(HypernetworkServer, "gradients", probed_gradients),
        patch.object(HypernetworkServer, "apply", probed_apply),
    ):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="a profile; pass algorithm=pfedhn and its values")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(args.config, [*args.overrides, f"rounds={args.rounds}", "checkpoint.every=0"])
    if cfg.algorithm.name != "pfedhn":
        parser.error(f"algorithm is {cfg.algorithm.name!r}; this probe reads pFedHN's steps")
    torch.set_num_threads(cfg.threads or 1)
    (data,) = federations(cfg)
    rows: list[dict[str, Any]] = []
    reference: dict[str, float] = {}
    with probed(rows, reference), tempfile.TemporaryDirectory() as out:
        Simulation(cfg, data, Path(out)).run()
    print(f"# {args.config} {' '.join(args.overrides)}; {args.rounds} rounds")
    print(f"norm of the model's own initialisation: {reference['init']:.1f}")
    header = ("step", "client", "‖φ‖/‖φ_init‖", "max φ", "cos(Δ, φ)", "‖g_ν‖", "‖g_trunk‖")
    header += ("‖g_heads‖", "clip scale")
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    for step, r in enumerate(rows, 1):
        print(
            f"| {step} | {r['client']} | {r['norm'] / reference['init']:.2f} | "
            f"{r['largest']:.2f} | {r['cosine']:.2f} | "
            f"{r['nu']:.2f} | {r['trunk']:.1f} | {r['heads']:.1f} | {r['clip_scale']:.2f} |"
        )
    for key in ("largest", "cosine", "trunk", "heads", "clip_scale"):
        values = [r[key] for r in rows]
        print(f"{key}: {min(values):.3g} to {max(values):.3g}")


if __name__ == "__main__":
    main()
