"""``feddomain`` and ``python -m feddomain``: the command line, imported inside the Ctrl-C
guard, so an interrupt at any moment of start-up (torch, the methods, the data) ends with the
same one line as one during a run, never a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from feddomain.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
