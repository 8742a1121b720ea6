"""Issue 15's tables from run directories (scripts/fedvr_pacs_effnet.sh, laid out as
``ROOT/<method folder>/seed<k>/<target>``): per method, the final-round ood accuracy per target
(mean ± std over seeds), and over targets: id and ood accuracy, the worst target, the worst
client's id accuracy and the std of client id accuracy (fedvr.md §5.3 b), the variance of the
clients' training losses at the last round (§5.3 a, logged by the engine for every method), ood
ECE-15 and NLL; for FedVR runs the B-check shares: rounds with max/min α > 1.05 (B3), with a
negative coefficient c_i (B6), and the mean cosine of each client's g_ψ to the step.

    python benchmarks/fedvr_table.py OUT/runs [SEED ...] > tables.md   # only those seeds
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

TARGETS = ("art_painting", "cartoon", "photo", "sketch")


def run_row(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    diag = [r.get("diagnostics", {}) for r in records]
    alpha = [d["alpha"] for d in diag if "alpha" in d]
    return {
        "target": summary["target_domains"][0],
        "seed": summary["seed"],
        "id": final["id_acc"],
        "ood": final["ood_acc"],
        "worst_client_id": final["id_spread"]["min"],
        "std_client_id": final["id_spread"]["std"],
        "loss_var": final.get("client_loss_var"),
        "ece": final["ood_ece"],
        "nll": final["ood_nll"],
        "b3": np.mean([max(a) / min(a) > 1.05 for a in alpha]) if alpha else None,
        "b6": np.mean([d["coef_min"] < 0 for d in diag if "coef_min" in d]) if alpha else None,
        "cos": np.mean(final["diagnostics"]["cos_to_update"]) if alpha else None,
        "wall": summary["wall_time_s"],
    }


def collect(root: Path, seeds: set[int] | None = None) -> dict[str, list[dict]]:
    """Rows by method folder (``fedvr_lambda0`` and ``fedvr`` are both FedVR runs)."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    for summary in sorted(root.glob("*/seed*/*/summary.json")):
        row = run_row(summary.parent)
        if seeds is None or row["seed"] in seeds:
            by_method[summary.parents[2].name].append(row)
    return by_method


def mean_std(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    if not values:
        return "—"
    v = scale * np.asarray(values, dtype=np.float64)
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def per_target_table(by_method: dict[str, list[dict]]) -> None:
    print("| method | seeds | " + " | ".join(TARGETS) + " | avg |")
    print("|---|---:|" + "---:|" * (len(TARGETS) + 1))
    for method, rows in sorted(by_method.items()):
        cells, seeds = [], sorted({r["seed"] for r in rows})
        for t in TARGETS:
            cells.append(mean_std([r["ood"] for r in rows if r["target"] == t]))
        # the average over targets, per seed that has all four, then over seeds
        done = {s: {r["target"] for r in rows if r["seed"] == s} for s in seeds}
        complete = [s for s in seeds if done[s] >= set(TARGETS)]
        avg = [np.mean([r["ood"] for r in rows if r["seed"] == s]) for s in complete]
        print(f"| {method} | {len(seeds)} | " + " | ".join(cells) + f" | {mean_std(avg)} |")


def sci(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def summary_table(by_method: dict[str, list[dict]]) -> None:
    print(
        "| method | runs | id | ood | worst target ood | worst-client id | std client id | "
        "client loss var | ood ECE | ood NLL | B3 share | B6 share | cos(g_i, step) | wall (s) |"
    )
    print("|---|---:|" + "---:|" * 12)
    for method, rows in sorted(by_method.items()):

        def avg(key: str, rows: list[dict] = rows) -> float | None:
            values = [r[key] for r in rows if r[key] is not None]
            return float(np.mean(values)) if values else None

        worst = [
            min(r["ood"] for r in rows if r["seed"] == s) for s in sorted({r["seed"] for r in rows})
        ]

        def fmt(x: float | None, scale: float = 100.0, digits: int = 1) -> str:
            return "—" if x is None else f"{scale * x:.{digits}f}"

        print(
            f"| {method} | {len(rows)} | {fmt(avg('id'))} | {fmt(avg('ood'))} | "
            f"{fmt(float(np.mean(worst)))} | {fmt(avg('worst_client_id'))} | "
            f"{fmt(avg('std_client_id'))} | {sci(avg('loss_var'))} | {fmt(avg('ece'))} | "
            f"{fmt(avg('nll'), 1, 2)} | {fmt(avg('b3'))} | {fmt(avg('b6'))} | "
            f"{fmt(avg('cos'), 1, 3)} | {avg('wall'):.0f} |"
        )


def main(root: Path, seeds: set[int] | None) -> None:
    by_method = collect(root, seeds)
    print("Final-round ood accuracy (%), mean ± std over seeds:\n")
    per_target_table(by_method)
    print("\nMeans over every run of a method (targets x seeds):\n")
    summary_table(by_method)


if __name__ == "__main__":
    main(Path(sys.argv[1]), {int(s) for s in sys.argv[2:]} or None)
