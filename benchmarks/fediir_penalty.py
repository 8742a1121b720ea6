"""How much FedIIR's penalty moves its clients: the penalty's share of each batch's loss and of
its gradient, per block of rounds.

FedIIR's clients minimise CE + γ·Σ‖∇_cls CE − ḡ‖² per batch. When the two methods' rows match
(FedIIR against FedAvg clients), either the penalty is too weak to act or it acts without
changing the result. This reruns a FedIIR configuration (a campaign run's ``config.yaml``, any
overrides after it) with the clients' loss wrapped to record, per batch, CE, γ·penalty and the
norms of their gradients with respect to the trained parameters, and prints their means over
each block of rounds. The run itself is unchanged (same seeds, same updates); it writes into
``--out``. Run:

    run=results/campaign/pacs-effnet-frozen-stations-lam0.1/hfedavg_fediir/confirm/seed=0
    python benchmarks/fediir_penalty.py $run/lodo-sketch/config.yaml rounds=30 \
        --out /tmp/fediir-penalty
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import feddomain
import feddomain.algorithms.fediir as fediir

BLOCKS = 6  # rows printed


def recording_loss(log: dict[str, list[float]]):
    """A stand-in for ``fediir.fediir_loss`` that computes the same loss and logs its parts."""

    def make(gamma: float, grad_mean: Tensor):
        def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            ce = F.cross_entropy(model.classifier(model.featurizer(x)), y)
            grads = fediir.classifier_gradients(model.classifier, ce, create_graph=True)
            penalty = gamma * fediir.penalty(grads, grad_mean)
            params = [p for p in model.parameters() if p.requires_grad]
            for name, term in (("ce", ce), ("penalty", penalty)):
                parts = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
                norm = torch.cat([g.reshape(-1) for g in parts if g is not None]).norm()
                log[name].append(float(term))
                log[f"grad_{name}"].append(float(norm))
            return ce + penalty

        return loss

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a FedIIR (or +Avg with FedIIR clients) config.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rounds=30")
    parser.add_argument("--out", required=True, help="a new directory for the run")
    args = parser.parse_args()
    cfg = feddomain.load_config(args.config, *args.overrides)
    log: dict[str, list[float]] = defaultdict(list)
    fediir.fediir_loss = recording_loss(log)  # the client looks it up at each round's fit
    feddomain.run(cfg, args.out, quiet=True)
    if not log["ce"] or len(log["ce"]) % cfg.rounds:
        raise SystemExit(
            f"{len(log['ce'])} batches over {cfg.rounds} rounds: this needs a FedIIR run with "
            "gamma > 0 and the same batches every round (full participation, drop_last)"
        )
    per_round = {k: np.asarray(v).reshape(cfg.rounds, -1).mean(1) for k, v in log.items()}
    print("rounds | CE | γ·penalty | share of loss | ‖∇ γ·penalty‖ / ‖∇ CE‖")
    for block in np.array_split(np.arange(cfg.rounds), min(BLOCKS, cfg.rounds)):
        ce, pen = (per_round[k][block].mean() for k in ("ce", "penalty"))
        grads = per_round["grad_penalty"][block].mean() / per_round["grad_ce"][block].mean()
        span = f"{block[0] + 1}-{block[-1] + 1}"
        print(f"{span} | {ce:.4f} | {pen:.2e} | {pen / ce:.1%} | {grads:.3f}")


if __name__ == "__main__":
    main()
