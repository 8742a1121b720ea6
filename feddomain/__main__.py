"""``feddomain`` and ``python -m feddomain``: the command line, imported inside the Ctrl-C
guard, so an interrupt at any moment of start-up (torch, the methods, the data) ends with the
same one line as one during a run, never a traceback."""

from __future__ import annotations

import os
import signal
import sys


def _exit_now(signum: int, frame: object) -> None:
    """Ctrl-C while the libraries load: leave at once. A KeyboardInterrupt raised inside
    torch's or NumPy's import can be swallowed there and leave NumPy half-initialised, so a
    later, unrelated error would print a traceback; nothing of a run exists yet to clean up."""
    os.write(2, b"interrupted\n")
    os._exit(130)


def main() -> int:
    signal.signal(signal.SIGINT, _exit_now)  # until the CLI has its libraries (cli.main)
    try:
        from feddomain.cli import main as cli_main

        status = cli_main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    except Exception as err:
        if not _from_interrupt(err):
            raise
        print("interrupted", file=sys.stderr)  # a library turned the interrupt into its error
        status = 130
    if status == 130:
        _forget_handled_interrupt()
    return status


def _forget_handled_interrupt() -> None:
    """Exit with 130, not by SIGINT. CPython marks a KeyboardInterrupt raised inside ``exec``
    of a string (a dataclass being built during a library's lazy import, e.g. torch._dynamo at
    the first optimizer) as unhandled even though the CLI handled it, and ends a
    ``python -m feddomain`` process by re-raising SIGINT after the exit; executing any string
    clears that mark."""
    exec("pass")


def _from_interrupt(err: BaseException) -> bool:
    """Whether ``err`` was raised while a KeyboardInterrupt was being handled: a library's lazy
    import (NumPy's) that catches the interrupt mid-import and raises an AttributeError."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
