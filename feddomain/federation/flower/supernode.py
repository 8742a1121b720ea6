"""``flower-supernode`` with shorter waits: opt-in, for latency-bound deployments.

Two fixed waits of flwr 1.41 dominate a message round trip of a small model on loopback; neither
is a flag or an environment variable:

- The SuperNode loop (``start_client_internal`` in ``flwr/supernode/start_client_internal.py``)
  sleeps 3 s after every pull that found no message, and polls its ClientApp's reply (and the
  reply's objects) every 0.5 s. A node that has just replied polls again at once, finds nothing
  (the server is still waiting for the other nodes, then aggregating) and sleeps 3 s, so nearly
  every round trip waits most of those 3 s.
- A message's content travels as objects pulled after the message itself
  (``pull_objects`` in ``flwr/supercore/inflatable/inflatable_utils.py``). The ClientApp starts
  as soon as its node has the message, asks the node for objects the node is still fetching,
  and retries after 1 s, then 2 s (``PULL_INITIAL_BACKOFF``); the ServerApp's pull of a reply
  and the node's pull from the SuperLink race the same way.

This entry point runs Flower's own ``flower-supernode`` with both shortened to ``--poll``
seconds: every sleep of the loop's module is capped (its ``time`` replaced by one whose
``sleep`` is capped; the module uses ``time`` for nothing else) and the object pulls retry
every ``--poll`` seconds. ``warm.py --poll`` does the
latter for the ClientApps and ServerApps it forks. Nothing else changes: the same CLI, the same
loop. Both are refused on a flwr version they were not checked against::

    python -m feddomain.federation.flower.supernode --poll 0.05 -- --superlink HOST:9092 ...

The cost: an idle node asks the SuperLink for work every ``--poll`` seconds instead of every 3.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import flwr
from flwr.supercore.constant import PULL_BACKOFF_CAP, PULL_INITIAL_BACKOFF
from flwr.supercore.inflatable import inflatable_utils

from feddomain.errors import FeddomainError

CHECKED_VERSIONS = ("1.41.0",)  # flwr releases whose SuperNode loop this was checked against
LOOP_SLEEPS = ("time.sleep(3)", "time.sleep(0.5)")  # what the cap shortens, as written there


class CappedTime:
    """``time`` with ``sleep`` capped at ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def check_poll(cap: float) -> None:
    """Refuse a non-positive interval (a busy loop) and a flwr whose code was not checked."""
    if not cap > 0:
        raise FeddomainError(f"the SuperNode poll interval must be positive, got {cap}")
    if flwr.__version__ not in CHECKED_VERSIONS:
        raise FeddomainError(
            f"the SuperNode poll option was checked against flwr {', '.join(CHECKED_VERSIONS)}, "
            f"not {flwr.__version__}; run the nodes without it (Flower's own 3 s idle poll)"
        )


def cap_pull_backoff(cap: float) -> None:
    """Retry an object that is not there yet every ``cap`` seconds, not after 1 s, 2 s, 4 s
    ...: the defaults of Flower's two object-pull functions, which every caller (node,
    ClientApp, ServerApp's Grid) leaves at their default. (Doubling from ``cap`` still
    overshot: an object that arrived 0.1 s late was fetched up to 0.2 s later.)"""
    check_poll(cap)
    pulls = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    expected = {"initial_backoff": PULL_INITIAL_BACKOFF, "backoff_cap": PULL_BACKOFF_CAP}
    for pull in pulls:
        defaults = pull.__kwdefaults__ or {}
        if any(defaults.get(name) != value for name, value in expected.items()):
            raise FeddomainError(
                f"flwr's {pull.__name__} has no initial_backoff={PULL_INITIAL_BACKOFF} and "
                f"backoff_cap={PULL_BACKOFF_CAP} defaults to shorten; run without the poll option"
            )
    for pull in pulls:
        pull.__kwdefaults__.update(initial_backoff=cap, backoff_cap=cap)


def cap_node_sleeps(cap: float) -> None:
    """Cap the sleeps of Flower's SuperNode loop at ``cap`` seconds."""
    check_poll(cap)
    import flwr.supernode.start_client_internal as module

    source = inspect.getsource(module)
    missing = [s for s in LOOP_SLEEPS if s not in source]
    if missing or module.time is not time:
        raise FeddomainError(
            f"{module.__name__} has no {missing or 'time module'} to shorten; "
            "run the nodes without the poll option"
        )
    module.time = CappedTime(cap)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--poll", type=float, required=True, help="seconds between polls")
    parser.add_argument("node_args", nargs=argparse.REMAINDER, help="-- flower-supernode args")
    args = parser.parse_args(argv)
    node_args = args.node_args[1:] if args.node_args[:1] == ["--"] else args.node_args
    cap_node_sleeps(args.poll)
    cap_pull_backoff(args.poll)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *node_args]
    flower_supernode()


if __name__ == "__main__":
    main()
