"""Atomic run checkpoints: written to a temporary file, fsynced, then renamed over the old one,
so a run killed at any instant leaves either the previous checkpoint or the new one, never half."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from feddomain.errors import FeddomainError

FILENAME = "checkpoint.pt"
FINAL = "final_checkpoint.pt"  # a finished run's last state: what extends it to more rounds
EVALUATED = "evaluated"  # folder of every evaluated round's state (checkpoint.keep_evaluated)


def save(run_dir: Path, state: dict[str, Any]) -> None:
    write_atomic(run_dir / FILENAME, state)


def write_atomic(path: Path, state: Any) -> None:
    """``torch.save`` to ``path`` so that a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_evaluated(run_dir: Path, rnd: int, state: dict[str, Any]) -> None:
    """Keep the state round ``rnd`` was evaluated in (what ``feddomain rescore`` scores)."""
    (run_dir / EVALUATED).mkdir(exist_ok=True)
    write_atomic(evaluated_path(run_dir, rnd), state)


def evaluated_path(run_dir: Path, rnd: int) -> Path:
    """Where a run keeps the state its round ``rnd`` was evaluated in."""
    return run_dir / EVALUATED / f"round_{rnd:05d}.pt"


def load(run_dir: Path) -> dict[str, Any] | None:
    """The saved state, or None when the run has no checkpoint yet."""
    (run_dir / (FILENAME + ".tmp")).unlink(missing_ok=True)  # a save interrupted mid-write
    return read(run_dir / FILENAME, "delete it to restart the run from round 1")


def read(path: Path, remedy: str) -> Any:
    """What ``write_atomic`` wrote to ``path``, or None if there is no such file."""
    if not path.exists():
        return None
    try:
        return torch.load(path, weights_only=False)
    except Exception as err:
        raise FeddomainError(
            f"{path} cannot be read ({type(err).__name__}: {err}); {remedy}"
        ) from None


def remove(run_dir: Path) -> None:
    (run_dir / FILENAME).unlink(missing_ok=True)


def keep_final(run_dir: Path) -> None:
    """Set a finished run's last checkpoint aside as its final state: ``checkpoint.pt`` means
    an unfinished run to resume, ``final_checkpoint.pt`` a finished one that may be extended."""
    os.replace(run_dir / FILENAME, run_dir / FINAL)


def reopen_final(run_dir: Path) -> None:
    """Make a finished run's final state its checkpoint again, to run more rounds from it."""
    os.replace(run_dir / FINAL, run_dir / FILENAME)


def fingerprint(state: Any) -> str:
    """SHA-256 of a nested state's content (tensors by dtype, shape and bytes; other values by
    repr): equal for equal states however they were saved, so a file can be matched to its run."""
    h = hashlib.sha256()

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{flat.dtype}{tuple(obj.shape)}".encode())
            h.update(memoryview(flat.view(torch.uint8).numpy()))
        elif isinstance(obj, dict):
            h.update(b"{")
            for k in obj:
                h.update(repr(k).encode())
                visit(obj[k])
            h.update(b"}")
        elif isinstance(obj, list | tuple):
            h.update(b"[")
            for v in obj:
                visit(v)
            h.update(b"]")
        else:
            h.update(repr(obj).encode())

    visit(state)
    return h.hexdigest()
