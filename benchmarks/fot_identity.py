"""Does HFedATM's filter alignment (FOT) move any filter? Per global round of finished HFedATM
runs: the share of filter matches that are the identity, averaged over conv groups and the
non-reference stations; the identity cost (the stations' filter distances to the reference's in
their own order: how far they drifted apart) and the matched cost against it (hfedatm.md §8 M1).
A share of 1 in every round means FOT is a no-op and every difference to +Avg is RegMean's: the
review's finding on LeNet-5, where every station starts a global round from the same model.

The runs' ``metrics.jsonl`` holds these records (``diagnostics.merge``, one per round, logged
with the next evaluated round). Conv stations from scratch on Digits3, at this profile's
schedule and at the paper's (R = 5 station rounds of E = 10 local epochs):

    feddomain run configs/protocols/digits3-bn.yaml dataset.root=/data algorithm=hfedatm \
        topology.stations=3 topology.station_rounds=2 partition.n_clients=12 partition.lam=1.0 \
        "split.targets=[mnist_m]" rounds=10 eval.every=2 --out runs/fot/r2e1
    feddomain run configs/protocols/digits3-bn.yaml dataset.root=/data algorithm=hfedatm \
        topology.stations=3 topology.station_rounds=5 train.local_epochs=10 partition.n_clients=12 \
        partition.lam=0.1 "split.targets=[mnist_m]" rounds=3 eval.every=3 --out runs/fot/r5e10
    feddomain run configs/protocols/digits3-bn.yaml dataset.root=/data algorithm=hfedatm \
        algorithm.fot_solver=exact topology.stations=3 topology.station_rounds=2 \
        partition.n_clients=12 partition.lam=1.0 "split.targets=[mnist_m]" rounds=10 eval.every=2 \
        --out runs/fot/r2e1-exact
    python benchmarks/fot_identity.py runs/fot/r2e1 runs/fot/r5e10 runs/fot/r2e1-exact
"""

from __future__ import annotations

import argparse
from pathlib import Path

from feddomain.evaluation.report import read_metrics


def merge_records(metrics: Path) -> list[dict]:
    """HFedATM's per-round merge diagnostics of one run, in round order."""
    records = [m for r in read_metrics(metrics) for m in r.get("diagnostics", {}).get("merge", [])]
    return sorted(records, key=lambda r: r["round"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="HFedATM run directories")
    args = parser.parse_args()
    for path in sorted(p for d in args.dirs for p in d.rglob("metrics.jsonl")):
        records = [r for r in merge_records(path) if "identity_fraction" in r]
        if not records:
            print(f"{path.parent}: no filter alignment logged (no conv layer, or FOT off)")
            continue
        print(f"{path.parent}")
        print("  round  identity share  identity cost  matched / identity  J(RegMean) / J(mean)")
        for r in records:
            ratios = ", ".join(f"{v:.2f}" for v in r.get("regmean_ratio", {}).values())
            cost = r["matched_cost"] / r["identity_cost"] if r["identity_cost"] else 1.0
            print(
                f"  {r['round']:5d}  {r['identity_fraction']:14.3f}  {r['identity_cost']:13.3f}"
                f"  {cost:18.3f}  {ratios}"
            )
        moved = sum(r["identity_fraction"] < 1 for r in records)
        print(f"  rounds where FOT moved a filter: {moved} of {len(records)}")


if __name__ == "__main__":
    main()
