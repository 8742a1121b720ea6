"""Sweep throughput: the same `feddomain sweep` with ``--jobs 1`` and ``--jobs 2``, side by side.

Each measurement is the real command in a fresh process and a fresh output directory, timed from
launch to exit (worker start-up, training, evaluation, the final report: everything a user
waits for). The two settings alternate (1, 2, 2, 1, ...) so that load from other processes hits
both alike; runs/hour is the median over repeats. The load average is printed beside the
figures, because on a shared machine it decides what a second worker can gain. Run:

    python benchmarks/sweep_throughput.py                  # demo config, 2 rounds, 2 seeds
    python benchmarks/sweep_throughput.py --repeats 2 --seeds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def sweep_seconds(jobs: int, rounds: int, seeds: int, out: Path) -> float:
    """Wall seconds of one `feddomain sweep` of the demo config into the new folder ``out``."""
    grid = "seed=[" + ",".join(str(s) for s in range(seeds)) + "]"
    command = [
        *(sys.executable, "-m", "feddomain.cli", "sweep", str(PROJECT / "configs" / "demo.yaml")),
        *(f"rounds={rounds}", "eval.every=1", "--grid", grid),
        *("--jobs", str(jobs), "--out", str(out), "--quiet"),
    ]
    start = time.perf_counter()
    subprocess.run(command, cwd=PROJECT, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seeds", type=int, default=2, help="seeds x 4 targets runs per sweep")
    p.add_argument("--repeats", type=int, default=1, help="measurements per --jobs setting")
    args = p.parse_args()
    runs = 4 * args.seeds  # the embedded digits have 4 target domains
    order = [j for r in range(args.repeats) for j in ((1, 2) if r % 2 == 0 else (2, 1))]
    times: dict[int, list[float]] = {1: [], 2: []}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for i, jobs in enumerate(order):
            times[jobs].append(sweep_seconds(jobs, args.rounds, args.seeds, Path(tmp) / str(i)))
            print(f"--jobs {jobs}: {times[jobs][-1]:.1f} s for {runs} runs", flush=True)
    rate = {j: 3600 * runs / statistics.median(t) for j, t in times.items()}
    print(f"\n{os.cpu_count()} CPUs; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")  # fmt: skip
    print("| --jobs | runs | wall (s, median) | runs/hour |")
    print("|---:|---:|---:|---:|")
    for j in (1, 2):
        print(f"| {j} | {runs} | {statistics.median(times[j]):.1f} | {rate[j]:.0f} |")
    print(f"\nratio --jobs 2 / --jobs 1: {rate[2] / rate[1]:.2f}x")


if __name__ == "__main__":
    main()
