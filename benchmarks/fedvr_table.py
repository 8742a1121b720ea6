"""Issue 15's table from run directories (scripts/fedvr_pacs_effnet.sh): per method and target,
the final-round id and ood accuracy, the clients' own mean ood (FedVR's diagnostic), the
worst client's and the std over clients of id accuracy (fedvr.md §5.3 b), ood ECE-15, and for
FedVR the cross-client loss variance L_var, the share of rounds with max/min α > 1.05 (B3), the
share with a negative coefficient (B6) and the mean cosine of each client's g_ψ to the step.

    python benchmarks/fedvr_table.py OUT/runs > table.md
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def run_rows(root: Path) -> list[dict]:
    rows = []
    for summary_file in sorted(root.rglob("summary.json")):
        run = summary_file.parent
        summary = json.loads(summary_file.read_text())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        final = records[-1]
        diag = [r.get("diagnostics", {}) for r in records]
        alpha = [d["alpha"] for d in diag if "alpha" in d]
        rows.append(
            {
                "method": summary["algorithm"],
                "target": summary["target_domains"][0],
                "seed": summary["seed"],
                "round": final["round"],
                "id": final["id_acc"],
                "ood": final["ood_acc"],
                "client_ood": final.get("client_ood_acc"),
                "worst_client_id": final["id_spread"]["min"],
                "std_client_id": final["id_spread"]["std"],
                "ece": final["ood_ece"],
                "l_var": final.get("diagnostics", {}).get("loss_var_across_clients"),
                "b3": np.mean([max(a) / min(a) > 1.05 for a in alpha]) if alpha else None,
                "b6": np.mean([d["coef_min"] < 0 for d in diag if "coef_min" in d])
                if alpha
                else None,
                "cos": np.mean(final["diagnostics"]["cos_to_update"]) if alpha else None,
                "wall": summary["wall_time_s"],
            }
        )
    return rows


def main(root: Path) -> None:
    rows = run_rows(root)
    print(
        "| method | target | seed | round | id | ood | clients' own ood | worst-client id | "
        "std client id | ood ECE | L_var | B3 share | B6 share | cos(g_i, step) | wall (s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: (r["method"], r["target"], r["seed"])):
        by_method[r["method"]].append(r)
        l_var = "—" if r["l_var"] is None else f"{r['l_var']:.4f}"
        cos = "—" if r["cos"] is None else f"{r['cos']:.3f}"
        print(
            f"| {r['method']} | {r['target']} | {r['seed']} | {r['round']} | {pct(r['id'])} | "
            f"{pct(r['ood'])} | {pct(r['client_ood'])} | {pct(r['worst_client_id'])} | "
            f"{pct(r['std_client_id'])} | {pct(r['ece'])} | {l_var} | {pct(r['b3'])} | "
            f"{pct(r['b6'])} | {cos} | {r['wall']:.0f} |"
        )
    print()
    print("| method | targets | mean id | mean ood | mean worst-client id | mean ood ECE |")
    print("|---|---:|---:|---:|---:|---:|")
    for method, rs in sorted(by_method.items()):

        def mean(key: str, rs: list[dict] = rs) -> float:
            return float(np.mean([r[key] for r in rs]))

        print(
            f"| {method} | {len(rs)} | {pct(mean('id'))} | {pct(mean('ood'))} | "
            f"{pct(mean('worst_client_id'))} | {pct(mean('ece'))} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
