"""What writing a report costs with and without its plots (`feddomain report --out DIR` against
`--no-plots`, `scripts/campaign.py --report` against `--report --plots`).

The report is read once (`build_report`, timed on its own); then its files are written into a
fresh folder with the plots (PNG and PDF of every figure) and without them, alternating, the
median of the repeats taken for each. One thread. Run, e.g. over a campaign profile's
confirmation runs:

    python benchmarks/report_outputs.py results/campaign/pacs-effnet-frozen/*/confirm --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from feddomain.evaluation.report import build_report, write_outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", type=Path, nargs="+", help="run directories (searched recursively)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    report = build_report(args.dirs)
    read = time.perf_counter() - t0
    seconds: dict[bool, list[float]] = {True: [], False: []}
    files: dict[bool, int] = {}
    for _ in range(args.repeats):
        for plots in (True, False):
            with tempfile.TemporaryDirectory() as out:
                report.files = []
                t0 = time.perf_counter()
                write_outputs(report, Path(out), plots=plots)
                seconds[plots].append(time.perf_counter() - t0)
                files[plots] = len(report.files)
    with_plots, tables = (statistics.median(seconds[k]) for k in (True, False))
    print(f"{len(report.runs)} runs read in {read:.1f} s")
    print("| written | files | seconds (median) |")
    print("|---|---:|---:|")
    print(f"| tables and plots | {files[True]} | {with_plots:.2f} |")
    print(f"| tables only (`--no-plots`) | {files[False]} | {tables:.3f} |")
    print(f"with plots / without: {with_plots / tables:.0f}x")


if __name__ == "__main__":
    main()
