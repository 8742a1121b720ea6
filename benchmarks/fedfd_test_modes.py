"""FedFD's test-time variants scored on one trained model (fedfda.md §8 check 9; issue 14).

The test mode only decides which BatchNorm statistics an evaluation uses, never training, so
one FedFD (or FedFD-A) run scores them all: at each evaluated round the unseen domains are also
scored with every layer's eval mode switched to each of ``global`` (FedFD's inference),
``instance`` (TBN: the test sample's statistics only), ``fixed`` (α = ``test_alpha``) and
``random`` (α ~ U(0, 1) per layer and sample; torch's RNG seeded from the run's seed), plus
``adapter`` on a FedFD-A model. The run's own record keeps its configured mode; the scores are
added to metrics.jsonl as ``ood_by_test_mode``.

    python benchmarks/fedfd_test_modes.py configs/fedfd/pacs_effnet64_budget.yaml \\
        dataset.root=DATA split.targets=[sketch] algorithm.name=fedfd --out runs/fedfd-sketch
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from scored_run import scored_run

from feddomain.algorithms.fedfd import evaluation_mode
from feddomain.evaluation.report import read_metrics
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import derive_seed
from feddomain.models.fedfd_bn import adapter_parameters, set_bn_mode

MODES = ("global", "instance", "fixed", "random")


class TestModeScoring(Simulation):
    """The simulator, with every test mode scored on the unseen domains at each evaluation."""

    def evaluate(self) -> dict[str, Any]:
        record = super().evaluate()
        hp = self.server.hp
        modes = MODES + (("adapter",) if adapter_parameters(self.model) else ())
        self.load_eval_model(0, self.server.eval_arrays(0))  # the shared global model
        scores = {}
        for mode in modes:
            set_bn_mode(self.model, evaluation_mode(hp.model_copy(update={"test_mode": mode})),
                        training=False)  # fmt: skip
            torch.manual_seed(derive_seed(self.cfg.seed, len(self.records)))
            held_out, _ = self.score_held_out()
            scores[mode] = float(np.mean([r.acc for r in held_out.values()]))
        set_bn_mode(self.model, evaluation_mode(hp), training=False)
        record["ood_by_test_mode"] = scores
        return record


def main() -> None:
    run_dir = scored_run(TestModeScoring, __doc__)
    for record in read_metrics(run_dir / "metrics.jsonl"):
        print(json.dumps({"round": record["round"], **record["ood_by_test_mode"]}))


if __name__ == "__main__":
    main()
