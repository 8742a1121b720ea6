"""Child processes that must not outlive their parent (sweep workers, Flower's warm tasks).

An orphan would keep writing into run directories that a rerun takes over. A thread that polls
``os.getppid`` notices only while the process runs: a stopped or busy child can still finish a
run after its parent died. The kernel's parent-death signal acts at once.
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the thread that started it exits (Linux;
    elsewhere nothing happens and the caller keeps its own watch on the parent)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
