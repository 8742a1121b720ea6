"""Local deployment helpers: a SuperLink and N SuperNodes as real processes, and ``flwr run``.

These are the commands of ``docs/deployment.md`` as functions, for trying a deployment on one
machine and for the tests. Every process starts in its own session; ``stop`` ends the whole
process tree of each (SuperExec and ClientApp/ServerApp children included), first with SIGTERM,
then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from feddomain.errors import FeddomainError
from feddomain.federation.flower.settings import APP_DIR, SITE_ROOT, TARGET_ROOT

CONNECTION = "feddomain-local"
READY = "feddomain warm executor ready"  # printed by ``warm.py`` once its imports are done

# No update checks or telemetry calls from Flower's processes (CI machines have no network).
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
}


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: the CA that signed the SuperLink's certificate, the certificate, its key."""

    ca: Path
    cert: Path
    key: Path


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class LocalFederation:
    """A SuperLink and ``n_nodes`` SuperNodes on this machine; node ``i`` holds client ``i``.

    ``workdir`` receives the logs, the Flower home (config, installed App bundles) and run
    configs. Use as a context manager so every process is stopped, also on errors.
    """

    n_nodes: int
    workdir: Path
    tls: TLSFiles | None = None
    node_keys: list[Path] | None = None  # SuperNode private keys (enables node authentication)
    host: str = "127.0.0.1"
    node_config: dict[str, Any] = field(default_factory=dict)  # extra keys for every node
    sites: Path | None = None  # an export (`feddomain data export`): node i serves site<i>/
    simulation: bool = False  # a SuperLink running Flower's simulation engine (Ray), no nodes
    warm: bool = True  # ClientApps forked from a warm process (``warm.py``), not started cold
    node_poll: float | None = None  # SuperNodes poll this often, not every 3 s (``supernode.py``)
    superlink: Process | None = None
    executor: Process | None = None
    nodes: list[Process] = field(default_factory=list)
    port: int = 0

    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------- environment
    @property
    def flwr_home(self) -> Path:
        return self.workdir / "flwr-home"

    def env(self) -> dict[str, str]:
        """Environment for every Flower process: this Python's scripts first on PATH (Flower
        starts ``flower-superexec`` / ``flwr-clientapp`` by name), a private Flower home."""
        env = {**os.environ, **QUIET_ENV, "FLWR_HOME": str(self.flwr_home)}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        if self.simulation and (self.n_nodes or self.warm):
            raise FeddomainError(
                "a simulation SuperLink hosts virtual SuperNodes (n_nodes=0) and starts its "
                "simulation process with Flower's executor (warm=False)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.port = free_port(self.host)
        self.superlink = self._spawn("superlink", self.superlink_command())
        wait_for_port(self.host, self.port, self.superlink, timeout=60)
        self._write_connection()
        if self.node_keys:  # admit the nodes' public keys (the three CLI calls run at once)
            registrations = [
                self.flwr(
                    "supernode",
                    "register",
                    str(key.with_suffix(".pub")),
                    CONNECTION,
                    name=f"register{i}",
                    wait=False,
                )
                for i, key in enumerate(self.node_keys)
            ]
            try:
                for i, popen in enumerate(registrations):
                    if popen.wait(timeout=120) != 0:
                        log = (self.workdir / f"register{i}.log").read_text()
                        raise FeddomainError(f"registering node key {i} failed:\n{log[-3000:]}")
            finally:
                for popen in registrations:
                    if popen.poll() is None:
                        popen.kill()
        ports = [free_port(self.host) for _ in range(self.n_nodes)]
        self.nodes = [
            self._spawn(f"supernode{i}", self.supernode_command(i, port))
            for i, port in enumerate(ports)
        ]
        if self.warm:
            self.executor = self._spawn("executor", self.executor_command(ports))
            wait_for_text(self.executor, READY, timeout=180)

    def executor_command(self, node_ports: list[int]) -> list[str]:
        """One warm SuperExec (``warm.py``) serving the SuperLink's and every node's Runtime
        API (the nodes' are local, without TLS)."""
        assert self.superlink is not None
        link = {"address": f"{self.host}:{self.port}", "parent_pid": self.superlink.popen.pid}
        if self.tls is not None:
            link["root_certificates"] = str(self.tls.ca)
        targets = [link] + [
            {"address": f"{self.host}:{port}", "parent_pid": node.popen.pid}
            for port, node in zip(node_ports, self.nodes, strict=True)
        ]
        cmd = [sys.executable, "-m", "feddomain.federation.flower.warm"]
        for target in targets:
            cmd += ["--serve", json.dumps(target)]
        if self.node_poll is not None:
            cmd += ["--poll", str(self.node_poll)]
        return cmd

    def superlink_command(self) -> list[str]:
        cmd = [
            "flower-superlink",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        if self.tls is None:
            cmd.append("--insecure")
        else:
            cmd += [
                "--ssl-ca-certfile",
                str(self.tls.ca),
                "--ssl-certfile",
                str(self.tls.cert),
                "--ssl-keyfile",
                str(self.tls.key),
            ]
        if self.node_keys:
            cmd.append("--enable-supernode-auth")
        if self.simulation:
            cmd.append("--simulation")
        if self.warm:
            cmd += ["--isolation", "process"]
        return cmd

    def supernode_command(self, i: int, runtime_port: int) -> list[str]:
        config = {"partition-id": i, **self.node_config}
        if self.sites is not None:
            config[SITE_ROOT] = str((self.sites / f"site{i}").resolve())
            config[TARGET_ROOT] = str((self.sites / "target").resolve())
        pairs = " ".join(f"{k}={_toml_value(v)}" for k, v in config.items())
        cmd = ["flower-supernode"]
        if self.node_poll is not None:
            cmd = [sys.executable, "-m", "feddomain.federation.flower.supernode"]
            cmd += ["--poll", str(self.node_poll), "--"]
        cmd += [
            "--superlink",
            f"{self.host}:{self.port}",
            "--port",
            str(runtime_port),
            "--node-config",
            pairs,
        ]
        cmd += ["--insecure"] if self.tls is None else ["--root-certificates", str(self.tls.ca)]
        if self.node_keys:
            cmd += ["--auth-supernode-private-key", str(self.node_keys[i])]
        if self.warm:
            cmd += ["--isolation", "process"]
        return cmd

    def _write_connection(self) -> None:
        """The ``flwr`` CLI's connection to this SuperLink, in the private Flower home."""
        connection: dict[str, Any] = {"address": f"{self.host}:{self.port}"}
        if self.tls is None:
            connection["insecure"] = True
        else:
            connection["root-certificates"] = str(self.tls.ca)
        config = {"superlink": {"default": CONNECTION, CONNECTION: connection}}
        (self.flwr_home / "config.toml").write_text(tomli_w.dumps(config))

    def _spawn(self, name: str, cmd: list[str]) -> Process:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.workdir,
                start_new_session=True,
            )
        return Process(name, popen, log)

    # -------------------------------------------------------------------- runs
    def flwr(
        self, *args: str, timeout: float = 600, name: str = "flwr", wait: bool = True
    ) -> subprocess.CompletedProcess | subprocess.Popen:
        """Run the ``flwr`` CLI against this federation; output goes to ``<name>.log``. With
        ``wait=False`` the started process is returned instead."""
        with open(self.workdir / f"{name}.log", "wb") as fh:
            popen = subprocess.Popen(
                ["flwr", *args],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.workdir,
                start_new_session=True,
            )
        if not wait:
            return popen
        try:
            return subprocess.CompletedProcess(popen.args, popen.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for pid in process_tree(popen.pid):
                _signal(pid, signal.SIGKILL)
            popen.wait()
            raise FeddomainError(
                f"flwr {' '.join(args)} did not end within {timeout:g} s"
            ) from None

    def submit(
        self,
        run_config: dict[str, Any],
        *,
        app: Path | None = None,
        federation_config: str | None = None,
        timeout: float = 600,
        name: str = "run",
    ) -> subprocess.CompletedProcess:
        """``flwr run APP`` with these run-config values, streaming its log until it ends.
        ``app`` defaults to a staged copy of this App (see ``stage_app``);
        ``federation_config`` sets the simulation engine ('num-supernodes=3 ...')."""
        if app is None:
            app = self.workdir / "app"
            if not app.exists():
                stage_app(app)
        overrides = self.workdir / f"{name}.toml"
        overrides.write_text(tomli_w.dumps(run_config))
        return self.flwr(
            "run",
            str(app),
            CONNECTION,
            "--run-config",
            str(overrides),
            "--stream",
            *(["--federation-config", federation_config] if federation_config else []),
            timeout=timeout,
            name=name,
        )

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` and its ClientApp processes: a machine that disappears."""
        for pid in process_tree(self.nodes[i].popen.pid):
            _signal(pid, signal.SIGKILL)
        self.nodes[i].popen.wait(timeout=10)

    # -------------------------------------------------------------------- stop
    @property
    def sessions(self) -> set[int]:
        """Session ids of everything started here (each process was started as a session
        leader; what it starts stays in its session)."""
        started = [*self.nodes, self.executor, self.superlink]
        return {p.popen.pid for p in started if p is not None}

    def stop(self, grace: float = 5.0) -> None:
        processes = [*self.nodes]
        processes += [p for p in (self.executor, self.superlink) if p is not None]
        sessions = self.sessions
        trees = [pid for p in processes for pid in process_tree(p.popen.pid)]
        trees += [pid for pid in session_members(sessions) if pid not in trees]  # orphans too
        for pid in trees:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for pid in {*trees, *session_members(sessions)}:  # and anything forked meanwhile
            _signal(pid, signal.SIGKILL)
        for p in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
        deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
        while session_members(sessions) and time.monotonic() < deadline:
            time.sleep(0.1)


# ----------------------------------------------------------------- utilities
def stage_app(dest: Path, source: Path = APP_DIR) -> Path:
    """A copy of the App holding only what its bundle holds (``pyproject.toml``, the package's
    ``.py`` files, ``configs/``). ``flwr run`` walks the App folder to build the bundle, which in
    a clone with its virtual environment inside takes seconds; the copy takes milliseconds."""
    keep = shutil.ignore_patterns("__pycache__", "*.pyc")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(source / "feddomain", dest / "feddomain", ignore=keep, dirs_exist_ok=True)
    if (source / "configs").is_dir():
        shutil.copytree(source / "configs", dest / "configs", ignore=keep, dirs_exist_ok=True)
    return dest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, process: Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise FeddomainError(f"{process.name} exited early:\n{process.log_text()[-3000:]}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise FeddomainError(f"{process.name} did not listen on {host}:{port} within {timeout:.0f} s")


def wait_for_text(process: Process, text: str, timeout: float) -> None:
    """Wait until ``text`` appears in the process's log (e.g. a readiness line)."""
    deadline = time.monotonic() + timeout
    while text not in process.log_text():
        if process.popen.poll() is not None:
            raise FeddomainError(f"{process.name} exited early:\n{process.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise FeddomainError(f"{process.name}: no {text!r} within {timeout:.0f} s")
        time.sleep(0.2)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (Linux ``/proc``; only ``root`` elsewhere). Collected
    before signalling, since orphans are re-parented and could no longer be found."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def session_members(sessions: set[int]) -> list[int]:
    """Processes in these sessions (Linux ``/proc``): what a started process and everything
    it started are, even after their parent died and they were re-parented."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            state, session = fields[0], int(fields[3])
        except (OSError, IndexError, ValueError):
            continue
        if session in sessions and state not in "ZX":  # exited ones wait only to be reaped
            out.append(int(stat.parent.name))
    return out


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _toml_value(value: Any) -> str:
    """A node-config value as Flower parses it (TOML): strings quoted, booleans lower-case."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)
