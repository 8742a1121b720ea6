"""Every ``ood_model`` choice of a hypernetwork method scored on one training run (issue 15,
item 5). The choice changes only which model scores the unseen domain, never training, so one
run evaluates them all: at each evaluated round the server's ``ood_model`` is switched to each
choice in turn and the target scored (the run's own record keeps the configured choice).

    python benchmarks/ood_model_choices.py configs/pacs/hfedf_cpu.yaml dataset.root=DATA \\
        split.targets=[sketch] --out runs/ood-choices

Prints the ood accuracy of each choice per evaluated round and its mean over rounds 20-100.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from scored_run import scored_run

from feddomain.evaluation.report import read_metrics
from feddomain.federation.simulation import Simulation

CHOICES = ("own", "mean_embedding", "parameter_average", "ensemble")


class ChoiceScoring(Simulation):
    """The simulator, with every ood_model choice scored at each evaluation."""

    def evaluate(self) -> dict[str, Any]:
        record = super().evaluate()
        configured = self.server.hp
        scores = {}
        for choice in CHOICES:
            self.server.hp = configured.model_copy(update={"ood_model": choice})
            unseen = self.unseen_scores()
            if unseen is None:  # own: the mean over the clients' models
                scores[choice] = float(np.mean(record["per_client"]["ood_acc"]))
            else:
                scores[choice] = float(np.mean([r.acc for r in unseen.values()]))
        self.server.hp = configured
        record["ood_by_choice"] = scores
        return record


def main() -> None:
    run_dir = scored_run(ChoiceScoring, __doc__)
    records = read_metrics(run_dir / "metrics.jsonl")
    for r in records:
        print(r["round"], json.dumps({k: round(v, 4) for k, v in r["ood_by_choice"].items()}))
    rounds = [r for r in records if 20 <= r["round"] <= 100]
    means = {c: float(np.mean([r["ood_by_choice"][c] for r in rounds])) for c in CHOICES}
    print("mean over rounds 20-100:", json.dumps({k: round(100 * v, 1) for k, v in means.items()}))


if __name__ == "__main__":
    main()
