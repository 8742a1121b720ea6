"""Checks on a finished FedVR run's final model (fedvr.md §8 A8 second part, B4), from its
exported server state and the cached features:

- A8: for each source client, the zero-shot model from the statistics of its own validation
  split scored on that split, against the client's generated model (its id accuracy);
- B4: the final ood accuracy of every unseen-domain model: zero-shot, own (mean over the client
  models), mean embedding, parameter average and ensemble.

    python benchmarks/fedvr_posthoc.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from feddomain.adapt import load_run
from feddomain.algorithms.fedvr import feature_statistics
from feddomain.data.federated import federations
from feddomain.federation.simulation import Simulation
from feddomain.federation.training import set_arrays

CHOICES = ("zero_shot", "own", "mean_embedding", "parameter_average", "ensemble")


def main(run_dir: Path) -> None:
    run = load_run(run_dir)
    torch.set_num_threads(run.cfg.torch_threads)
    (data,) = federations(run.cfg)
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(run.cfg, data, Path(tmp))
    sim.server.load_state_dict(torch.load(run_dir / "server_state.pt", weights_only=False))
    server = sim.server
    a8 = []
    for cid in range(data.n_clients):
        val = data.val[cid]
        set_arrays(sim.model, server.generated(cid))
        acc_own = sim.score(val).acc
        with torch.no_grad():
            zero = server.synthesise(feature_statistics(val, "mean"))
        set_arrays(sim.model, {k: v.detach() for k, v in zero.items()})
        acc_zero = sim.score(val).acc
        a8.append({"client": cid, "id_own": acc_own, "id_zero_shot_from_val": acc_zero})
    b4 = {}
    configured = server.hp
    for choice in CHOICES:
        server.hp = configured.model_copy(update={"ood_model": choice})
        server._generated.clear()
        unseen = sim.unseen_scores()
        if unseen is None:
            accs = [
                np.mean([r.acc for r in sim.score_unseen(server.generated(c)).values()])
                for c in range(data.n_clients)
            ]
            b4[choice] = float(np.mean(accs))
        else:
            b4[choice] = float(np.mean([r.acc for r in unseen.values()]))
    server.hp = configured
    print(json.dumps({"run": str(run_dir), "A8": a8, "B4_final_ood": b4}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
