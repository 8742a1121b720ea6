"""Progress of a campaign of runs (``sweep``, ``tune``): runs completed out of the total, the
wall time per run so far, and the time left, as one line for a live display's title or a log.

The estimate assumes the runs still to go take as long as those finished in this session, and
that ``jobs`` of them run at once: ETA = ceil(remaining / jobs) x seconds per run, less the time
the running ones have already spent (never below zero). Runs finished by an earlier session
(skipped) count as completed but not towards the time per run: they cost nothing now.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CampaignProgress:
    """Counts and timings of a campaign of ``total`` runs on ``jobs`` workers."""

    total: int
    jobs: int = 1
    label: str = "sweep"
    clock: Callable[[], float] = time.monotonic
    skipped: int = 0  # finished before this session
    failed: int = 0
    durations: list[float] = field(default_factory=list)  # wall seconds of runs done now
    running_since: dict[str, float] = field(default_factory=dict)  # run name -> clock at start

    def skip(self, count: int = 1) -> None:
        """``count`` runs found finished: completed, at no cost."""
        self.skipped += count

    def start(self, name: str) -> None:
        self.running_since[name] = self.clock()

    def finish(self, name: str, *, failed: bool = False) -> float:
        """Run ``name`` ended (a failure ends it too); returns its wall seconds."""
        seconds = self.clock() - self.running_since.pop(name, self.clock())
        self.durations.append(seconds)
        self.failed += failed
        return seconds

    @property
    def completed(self) -> int:
        return self.skipped + len(self.durations)

    @property
    def seconds_per_run(self) -> float | None:
        """Mean wall time of the runs this session ended; None before the first."""
        return sum(self.durations) / len(self.durations) if self.durations else None

    @property
    def eta_seconds(self) -> float | None:
        """Seconds until the last run ends; None while no run of this session has ended."""
        per_run = self.seconds_per_run
        remaining = self.total - self.completed
        if per_run is None:
            return None if remaining else 0.0
        now = self.clock()
        spent = sum(now - since for since in self.running_since.values())
        waves = math.ceil(remaining / max(self.jobs, 1))
        return max(waves * per_run - spent / max(self.jobs, 1), 0.0)

    def headline(self) -> str:
        """``'sweep 5/12 (2 skipped, 1 failed), 41 s per run, ETA 4 min 47 s'``."""
        notes = [f"{n} {what}" for n, what in ((self.skipped, "skipped"), (self.failed, "failed"))]
        notes = [note for note in notes if not note.startswith("0 ")]
        text = f"{self.label} {self.completed}/{self.total}"
        if notes:
            text += f" ({', '.join(notes)})"
        per_run, eta = self.seconds_per_run, self.eta_seconds
        if per_run is not None:
            text += f", {duration(per_run)} per run"
        if self.completed < self.total:
            text += ", ETA " + (duration(eta) if eta is not None else "after the first run")
        return text


def duration(seconds: float) -> str:
    """``'48 s'``, ``'4 min 7 s'``, ``'2 h 05 min'``: precise enough for a progress line."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
