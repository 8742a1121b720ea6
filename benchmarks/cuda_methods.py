"""Every registered method for two rounds on the CPU, on CUDA in fp32 and on CUDA in bf16.

Each method runs the same small experiment on every device (the embedded digits at 32 px, target
``grey``, 3 clients with one source domain each, 2 rounds of at most 15 local steps, plain SGD,
evaluation every round; methods that need BatchNorm train ``small_cnn``, FedVR's family trains its
head on cached features), and the table gives, per method, whether each device ran, the largest
difference of the run's accuracies (id, ood, and every evaluated round's) from the CPU run, and
the wall times. CUDA and CPU are never bit-comparable (other kernels, other summation orders;
bf16 rounds matmul inputs to 8 bits of mantissa): docs/performance.md states the tolerance.

    PYTHONPATH=. python benchmarks/cuda_methods.py --out cuda_methods.json   # cpu, cuda, cuda-bf16
    PYTHONPATH=. python benchmarks/cuda_methods.py --devices cpu cpu --methods fedavg  # dry run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from feddomain.algorithms import METHODS
from feddomain.config import validate_config
from feddomain.data.federated import federations
from feddomain.federation.simulation import Simulation
from tests.method_configs import ACCURACIES, method_config


def accuracies(sim_out: Path) -> dict[str, float]:
    """The run's accuracies: its summary's and every evaluated round's."""
    summary = json.loads((sim_out / "summary.json").read_text())
    values = {k: float(summary[k]) for k in ACCURACIES if summary.get(k) is not None}
    for line in (sim_out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for k in ACCURACIES:
            if record.get(k) is not None:
                values[f"r{record['round']}_{k}"] = float(record[k])
    return values


def run_once(method: str, device: str, precision: str, work: Path) -> dict:
    """One run; its accuracies and wall time, or the error that stopped it."""
    out = work / f"{method}-{device}-{precision}"
    out.mkdir(parents=True)
    try:
        cfg = validate_config(method_config(method, device, precision, work / "cache"))
        t0 = time.perf_counter()
        Simulation(cfg, federations(cfg)[0], out).run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return {"ok": True, "seconds": time.perf_counter() - t0, "acc": accuracies(out)}
    except Exception as e:  # a method that fails on a device is this table's finding
        return {"ok": False, "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=-4)}


def largest_difference(run: dict, reference: dict) -> float | None:
    if not (run["ok"] and reference["ok"]):
        return None
    keys = run["acc"].keys() & reference["acc"].keys()
    return max(abs(run["acc"][k] - reference["acc"][k]) for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda", "cuda-bf16"],
                    help="cpu, cuda or cuda-bf16; the first is the reference")
    ap.add_argument("--methods", nargs="*", default=None, help="default: every registered one")
    ap.add_argument("--out", type=Path, default=None, help="JSON file of every run")
    args = ap.parse_args()
    methods = args.methods or sorted(METHODS)
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            results[method] = {}
            for i, label in enumerate(args.devices):
                device, _, bf16 = label.partition("-")
                work = Path(tmp) / f"{i}"
                work.mkdir(exist_ok=True)
                results[method][label] = run_once(method, device, bf16 or "fp32", work)
            row = results[method]
            ref = row[args.devices[0]]
            cells = []
            for label in args.devices[1:]:
                diff = largest_difference(row[label], ref)
                cells.append("FAIL" if not row[label]["ok"] else f"{100 * diff:.1f}" if diff
                             is not None else "-")
            times = " ".join(f"{row[d]['seconds']:.1f}" if row[d]["ok"] else "-"
                             for d in args.devices)
            print(f"{method:28s} {' '.join(f'{c:>6s}' for c in cells)}   s: {times}", flush=True)
            for label in args.devices:
                if not row[label]["ok"]:
                    print(f"    {label}: {row[label]['error']}\n{row[label]['trace']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
