"""A child that must die with its parent (sweep workers, Flower's warm tasks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = (
    "import os, signal; from feddomain.lifetime import die_with_parent; die_with_parent(); "
    "print('ready', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
)
PARENT = (
    "import subprocess, sys, time; "
    f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdout=subprocess.PIPE); "
    "child.stdout.readline(); print(child.pid, flush=True); time.sleep(600)"
)


def _state(pid: int) -> str | None:
    """The process's state letter (T stopped, Z zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's parent-death signal is Linux's")
def test_a_stopped_child_dies_the_moment_its_parent_is_killed():
    """Catches a child that outlives its killed parent because it could not run its own watch
    (stopped, or busy in a round): a sweep worker in that state would finish and write a run
    the rerun takes over. The child is stopped throughout, so only the kernel can end it."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        deadline = time.time() + 10
        while _state(child) != "T" and time.time() < deadline:
            time.sleep(0.01)
        assert _state(child) == "T"
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.time() + 5
        while _state(child) not in (None, "Z") and time.time() < deadline:
            time.sleep(0.01)
        assert _state(child) in (None, "Z"), "the stopped child outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        parent.kill()
