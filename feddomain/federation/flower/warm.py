"""A warm SuperExec: each ClientApp / ServerApp task runs in a forked copy of a process that has
already imported torch and feddomain.

Flower's default SuperExec starts a fresh ``flwr-clientapp`` process for every message (and a
``flwr-serverapp`` per run); importing torch, torchvision and feddomain there costs ~5 s per
message on a laptop CPU (more on a busy one), which dominates a round of a small model. Start the
SuperNode (or SuperLink) with ``--isolation process`` and this executor next to it::

    flower-supernode --isolation process --port 9094 ...
    python -m feddomain.federation.flower.warm --runtime-api-address 127.0.0.1:9094 --insecure

Tasks then start in milliseconds. The forked App is the feddomain installed on the machine
(the modules are already imported), not the copy inside the App bundle: keep every machine's
feddomain at the same version. Linux/macOS only (``fork``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from queue import Queue
from typing import NoReturn

import flwr.supercore.superexec.run_superexec as superexec
import flwr.supernode.runtime.run_clientapp as clientapp_runtime
from flwr.cli.install import install_from_fab
from flwr.common.constant import APP_DIR
from flwr.supercore.constant import TaskType
from flwr.supercore.logger import mirror_output_to_queue, restore_output
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supercore.utils import get_flwr_home
from flwr.superlink.runtime import run_serverapp
from flwr.supernode.runtime.run_clientapp import run_clientapp

import feddomain.federation.flower.server  # noqa: F401 - warm-up: torch, models, both Apps
from feddomain.data.cache import write_atomic
from feddomain.federation.flower.deploy import READY
from feddomain.federation.flower.supernode import cap_pull_backoff
from feddomain.lifetime import die_with_parent

WARM_TASKS = (TaskType.CLIENT_APP, TaskType.SERVER_APP)


class ForkExecutor(SubprocessExecutor):
    """Launches ClientApp and ServerApp tasks with ``fork`` (other task types as Flower does)."""

    def __init__(self) -> None:
        self.children: set[int] = set()

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        if spec.task_type not in WARM_TASKS:
            return super().launch(spec)
        pid = os.fork()
        if pid == 0:  # the child runs one task and never returns into the loop
            run_forked(partial(run_task, spec))
        self.children.add(pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap finished tasks so they leave no zombies."""
        for pid in list(self.children):
            try:
                finished, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                finished = pid
            if finished:
                self.children.discard(pid)


def run_task(spec: ExecutionSpec) -> None:
    """What ``flwr-clientapp`` / ``flwr-serverapp`` do after their imports."""
    kwargs = {
        "runtime_api_address": spec.runtime_api_address,
        "token": spec.token,
        "insecure": spec.insecure,
        "certificates": validate_and_resolve_root_certificates(
            spec.root_certificates_path, spec.insecure
        ),
        "parent_pid": spec.parent_pid,
        "runtime_dependency_install": spec.runtime_dependency_install,
    }
    if spec.task_type == TaskType.CLIENT_APP:
        run_clientapp(**kwargs)
        return
    log_queue: Queue[str | None] = Queue()  # the ServerApp's output goes to `flwr run --stream`
    mirror_output_to_queue(log_queue)
    try:
        run_serverapp(log_queue=log_queue, **kwargs)
    finally:
        restore_output()


def install_once(fab: bytes, install_dir: Path | None = None, skip_prompt: bool = False) -> Path:
    """Flower's ``install_from_fab``, skipped when this FAB (by its SHA-256) was installed
    completely before. Flower unzips the App and checks every file's hash for each message
    (~45 ms here) even when the App is already installed; a task forked from this executor
    runs the installed feddomain, not the App's copy, so the FAB only locates the App. The
    marker is written after a complete install, so an interrupted one is redone."""
    base = install_dir.expanduser() if install_dir else get_flwr_home()
    marker = base / APP_DIR / ".feddomain-installed" / hashlib.sha256(fab).hexdigest()
    if marker.is_file() and Path(marker.read_text()).is_dir():
        return Path(marker.read_text())
    path = install_from_fab(fab, install_dir, skip_prompt)
    marker.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, str(path).encode())
    return path


clientapp_runtime.install_from_fab = install_once  # the name run_clientapp calls


@dataclass(frozen=True)
class Target:
    """One Runtime API to serve: a SuperNode's (or SuperLink's) ``host:port``."""

    address: str
    root_certificates: str | None = None  # CA file when the Runtime API uses TLS
    parent_pid: int | None = None  # stop serving when this process (the node) exits


def serve(targets: list[Target]) -> None:
    """Serve every target from one warm import: the first here, the others in forked copies
    (one machine pays the imports once, however many SuperNodes it runs)."""
    print(READY, flush=True)
    for target in targets[1:]:
        if os.fork() == 0:
            run_forked(partial(_serve_one, target))
    _serve_one(targets[0])


def run_forked(work: Callable[[], None]) -> NoReturn:
    """A forked child's whole life: ``work``, then ``os._exit`` with its exit code (never back
    into the parent's loop). It dies with its parent (elsewhere Flower's parent_pid monitor
    ends it); an error is printed first, not lost with ``os._exit``."""
    code = 1
    try:
        die_with_parent()
        work()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0
    except Exception:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _serve_one(target: Target, retry_after: float = 1.0, startup: float = 10.0) -> None:
    """Flower's SuperExec loop for one Runtime API, restarted after an unexpected error.

    Flower's loop ends on the first HTTP error it does not retry (a 500 from the node's
    Runtime API, say): a node whose executor ended stays connected and heartbeating but never
    starts another ClientApp, so every later run waits for it in vain. Such an error is printed
    and the loop goes on. An error in the first ``startup`` seconds (a missing CA file, a bad
    address) is a misconfiguration and ends the executor; so do a signal and the node's exit."""
    executor = ForkExecutor()
    superexec.get_executor = lambda *_, **__: executor  # Flower offers no executor plug-in
    parent_pid = target.parent_pid
    serving_since = time.monotonic()  # a restart comes only after `startup`: no error is early
    while True:
        try:
            superexec.run_superexec(
                runtime_api_address=target.address,
                insecure=target.root_certificates is None,
                root_certificates_path=target.root_certificates,
                parent_pid=parent_pid,
            )
            return
        except Exception:  # any error but an exit: report it and serve on
            if time.monotonic() - serving_since < startup:
                raise
            print(f"SuperExec for {target.address} failed; serving on:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
        parent_pid = None  # the first call's monitor thread still watches the node
        time.sleep(retry_after)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", help="the SuperNode's host:port")
    parser.add_argument("--insecure", action="store_true", help="Runtime API without TLS")
    parser.add_argument("--root-certificates", default=None, help="CA of the Runtime API's TLS")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it exits")
    parser.add_argument(
        "--serve",
        action="append",
        default=[],
        metavar="JSON",
        help='more targets, e.g. \'{"address": "127.0.0.1:9095", "parent_pid": 123}\'',
    )
    parser.add_argument(
        "--poll",
        type=float,
        metavar="SECONDS",
        help="retry a message's objects after this long, not Flower's 1 s (see supernode.py)",
    )
    args = parser.parse_args(argv)
    if args.poll is not None:
        cap_pull_backoff(args.poll)
    targets = [Target(**json.loads(text)) for text in args.serve]
    if args.runtime_api_address:
        if not args.insecure and args.root_certificates is None:
            parser.error("give --root-certificates CA for a TLS Runtime API, or --insecure")
        targets.insert(0, Target(args.runtime_api_address, args.root_certificates, args.parent_pid))
    if not targets:
        parser.error("nothing to serve: give --runtime-api-address or --serve")
    serve(targets)


if __name__ == "__main__":
    main()
