"""Issue 14's tables from run directories (scripts/fedfd_pacs_effnet64_budget.sh, laid out as
``ROOT/<method folder>/seed<k>/<target>``): final-round ood and id accuracy per method and
target, and for the runs of benchmarks/fedfd_test_modes.py the ood accuracy of the same trained
model under each test mode (``ood_by_test_mode``).

    python benchmarks/fedfd_table.py OUT/runs > tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = ("art_painting", "cartoon", "photo", "sketch")
MODES = ("global", "instance", "fixed", "random", "adapter")


def final_records(root: Path) -> dict[tuple[str, str], dict]:
    """The last metrics.jsonl record of each finished run, by (method folder, target)."""
    out = {}
    for summary in sorted(root.glob("*/seed*/*/summary.json")):
        lines = (summary.parent / "metrics.jsonl").read_text().splitlines()
        target = json.loads(summary.read_text())["target_domains"][0]
        out[summary.parents[2].name, target] = json.loads(lines[-1])
    return out


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def main(root: Path) -> None:
    records = final_records(root)
    methods = sorted({m for m, _ in records})
    print("| method | " + " | ".join(f"{t} ood / id" for t in TARGETS) + " | avg ood / id |")
    print("|---|" + "---:|" * (len(TARGETS) + 1))
    for m in methods:
        runs = [records.get((m, t)) for t in TARGETS]
        cells = ["—" if r is None else f"{pct(r['ood_acc'])} / {pct(r['id_acc'])}" for r in runs]
        if all(runs):  # the mean over targets only when every target has run
            ood, id_ = (sum(r[k] for r in runs) / len(runs) for k in ("ood_acc", "id_acc"))
            cells.append(f"{pct(ood)} / {pct(id_)}")
        else:
            cells.append("—")
        print(f"| {m} | " + " | ".join(cells) + " |")
    print()
    print("Test modes on one trained model (ood %):\n")
    print("| model | target | " + " | ".join(MODES) + " |")
    print("|---|---|" + "---:|" * len(MODES))
    for (m, t), r in sorted(records.items()):
        modes = r.get("ood_by_test_mode")
        if modes:
            print(f"| {m} | {t} | " + " | ".join(pct(modes.get(k)) for k in MODES) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
