"""The table of FISC's acceptance comparison (scripts/fisc_compare.sh): per method, the test-domain
accuracy of each leave-two-domains-out scheme at the last round (the paper's rule), their
average (Test AVG), the held-out validation domains' average (Val AVG), and Test AVG under
source-validation selection (the round with the best id accuracy); mean ± std over the seeds.
Then fisc.md §8's relative checks without pretrained weights: FISC ≥ FedAvg, FISC ≥ CCST,
FISC > FISC-v3, on the mean Test AVG.

    python scripts/fisc_table.py OUT
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

SCHEMES = ("cs-a-p", "ac-p-s", "ps-c-a", "pa-s-c")
METHODS = ("fedavg", "fedsr", "feddg_ga", "ccst", "fpl", "fisc", "fisc_v3")


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def scores(run: Path) -> dict[str, float]:
    """Last-round test and validation-domain accuracy, and the test accuracy of the round with
    the best id accuracy (ties: the latest)."""
    recs = records(run)
    last = recs[-1]
    best = max(recs, key=lambda r: (r["id_acc"], r["round"]))
    return {"test": last["ood_acc"], "val": last["ood_val_acc"], "test_sv": best["ood_acc"]}


def cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.fmean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def main(out: Path) -> None:
    seeds = sorted({p.name for p in out.glob("*/*/s*") if (p / "summary.json").exists()})
    header = "| method | " + " | ".join(f"{s}: test {s[-1].upper()}" for s in SCHEMES)
    print(header + " | Test AVG | Val AVG | Test AVG (source-val) | seeds |")
    print("|---" * (len(SCHEMES) + 5) + "|")
    means = {}
    for m in METHODS:
        per_seed = {}
        for seed in seeds:
            runs = [out / s / m / seed for s in SCHEMES]
            if all((r / "summary.json").exists() for r in runs):
                per_seed[seed] = [scores(r) for r in runs]
        if not per_seed:
            continue
        cols = [cell([v[i]["test"] for v in per_seed.values()]) for i in range(len(SCHEMES))]
        avg = {k: [statistics.fmean(x[k] for x in v) for v in per_seed.values()]
               for k in ("test", "val", "test_sv")}  # fmt: skip
        means[m] = statistics.fmean(avg["test"])
        print(f"| {m} | " + " | ".join(cols) + f" | {cell(avg['test'])} | {cell(avg['val'])} | "
              f"{cell(avg['test_sv'])} | {len(per_seed)} |")  # fmt: skip
    print()
    for other, rel in (("fedavg", ">="), ("ccst", ">="), ("fisc_v3", ">")):
        if "fisc" in means and other in means:
            a, b = 100 * means["fisc"], 100 * means[other]
            holds = a >= b if rel == ">=" else a > b
            verdict = "holds" if holds else "does not hold"
            print(f"- FISC {rel} {other}: {a:.2f} vs {b:.2f} -> {verdict}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
