"""What a rescore costs against training the run again (docs/performance.md, "FedFD's
test-time variants rescored, not trained"): one run trained with its evaluated states kept,
then each evaluation-only variant both rescored from it and trained from scratch, one after
the other in this process, with the wall times and their ratio printed per variant (and the
rescored and trained ood accuracies, which must be equal).

    python benchmarks/rescore_cost.py configs/protocols/digits3-bn.yaml dataset.root=DATA \\
        partition.lam=0.1 algorithm=fedfd algorithm.feature_loss=mean split.targets=[mnist_m] \\
        --change algorithm.test_mode=instance --change algorithm.test_mode=random --out runs/rc
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import feddomain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--change", action="append", required=True, help="an evaluation-only "
                        "override, e.g. algorithm.test_mode=instance (repeat for several)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    base = [*args.overrides, "checkpoint.keep_evaluated=true"]
    t0 = time.perf_counter()
    (source,) = feddomain.run(feddomain.load_config(args.config, *base), args.out / "source",
                              quiet=True)  # fmt: skip
    print(f"source: {time.perf_counter() - t0:.1f} s")
    for i, change in enumerate(args.change):
        t0 = time.perf_counter()
        (rescored,) = feddomain.rescore(source.run_dir, args.out / f"rescored-{i}", change)
        rescoring = time.perf_counter() - t0
        t0 = time.perf_counter()
        (trained,) = feddomain.run(feddomain.load_config(args.config, *base, change),
                                   args.out / f"trained-{i}", quiet=True)  # fmt: skip
        training = time.perf_counter() - t0
        print(f"{change}: rescored {rescoring:.1f} s, trained {training:.1f} s "
              f"({training / rescoring:.1f}x); ood {100 * rescored.ood_acc:.2f} rescored, "
              f"{100 * trained.ood_acc:.2f} trained")  # fmt: skip


if __name__ == "__main__":
    main()
