"""Weight divergence between client models, hFedF against Local-only (hfedf.md §5.4, B3).

For every parameter tensor l: WD_l = mean_{i<j} ||φ_i^l - φ_j^l||_2 over the clients' models
after the last round — hFedF's locally trained models φ~_i (its ``wd_trained`` diagnostic) and
Local-only's local models — and the ratio hFedF / Local-only. B3 expects the ratio to be at most
0.5 for the deeper layers. Both runs use one config (the hFedF one; Local-only replaces only the
``algorithm`` section), so the data, split, model and budget are the same.

    python benchmarks/weight_divergence.py configs/pacs/hfedf_cpu.yaml dataset.root=../shared/data \
        "split.targets=[photo]"
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from feddomain.algorithms.hfedf import weight_divergence
from feddomain.config import ExperimentConfig, load_config
from feddomain.data.federated import federations
from feddomain.federation.simulation import Simulation


def run(cfg: ExperimentConfig) -> tuple[Simulation, float]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    (data,) = federations(cfg)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        sim = Simulation(cfg, data, Path(out))
        sim.run()
    return sim, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="an hFedF config with one target")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    hfedf_cfg = load_config(args.config, [*args.overrides, "checkpoint.every=0"])
    local_cfg = load_config(args.config, [*args.overrides, "checkpoint.every=0", "algorithm=local"])
    hfedf, hfedf_s = run(hfedf_cfg)
    local, local_s = run(local_cfg)
    trained = hfedf.records[-1]["diagnostics"]
    local_wd = weight_divergence([s.arrays for s in local.states], "wd")
    rows = []
    for key, value in local_wd.items():
        kind, layer = key.split("/", 1)
        ours = trained[f"wd_trained{kind[2:]}/{layer}"]
        rows.append(
            {"layer": layer, "kind": kind, "hfedf": ours, "local": value, "ratio": ours / value}
        )
    print(
        f"# {args.config} {' '.join(args.overrides)}; hFedF {hfedf_s:.0f} s, Local {local_s:.0f} s"
    )
    print("| tensor | hFedF WD | Local-only WD | ratio | hFedF WD/‖φ‖ | Local WD/‖φ‖ |")
    print("|---|---:|---:|---:|---:|---:|")
    by_layer = {r["layer"]: {} for r in rows}
    for r in rows:
        by_layer[r["layer"]][r["kind"]] = r
    for layer, kinds in by_layer.items():
        raw, norm = kinds["wd"], kinds["wd_norm"]
        print(
            f"| {layer} | {raw['hfedf']:.3f} | {raw['local']:.3f} | {raw['ratio']:.2f} | "
            f"{norm['hfedf']:.3f} | {norm['local']:.3f} |"
        )
    print(
        json.dumps(
            {"ood": {"hfedf": hfedf.records[-1]["ood_acc"], "local": local.records[-1]["ood_acc"]}}
        )
    )


if __name__ == "__main__":
    main()
