"""``feddomain flower local | run``: the deployment commands of docs/deployment.md, shortened.

``add_commands(subparsers)`` adds the ``flower`` command to feddomain's CLI. Nothing here imports
Flower or torch at import time, so the CLI stays quick to start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import yaml

from feddomain.config import load_config
from feddomain.errors import FeddomainError, Interrupted

# `flower local`'s nodes poll every 0.05 s, not Flower's 3 s: a few nodes on loopback, where
# the fixed waits were most of a round trip (docs/performance.md, "Flower deployment overhead").
LOCAL_NODE_POLL = 0.05


def add_commands(sub: argparse._SubParsersAction) -> None:
    flower = sub.add_parser("flower", help="deploy on Flower: a local federation, submit runs")
    fsub = flower.add_subparsers(dest="flower_command", required=True)

    local = fsub.add_parser("local", help="a SuperLink and N SuperNodes on this machine")
    local.add_argument("--nodes", type=int, default=3, help="SuperNodes (node i holds client i)")
    local.add_argument(
        "--workdir",
        type=Path,
        default=Path("flower-local"),
        help="folder for the processes' logs and the Flower home (default: flower-local)",
    )
    local.add_argument("--tls-dir", type=Path, help="folder with ca.pem, server.pem, server.key")
    local.add_argument("--cold", action="store_true", help="Flower's own executor (no warm fork)")
    local.add_argument(
        "--node-poll",
        type=float,
        default=LOCAL_NODE_POLL,
        metavar="SECONDS",
        help="SuperNodes ask for work this often instead of Flower's fixed 3 s, and message "
        f"objects are retried this often instead of after 1 s, 2 s, ... (default "
        f"{LOCAL_NODE_POLL}; 0: Flower's own waits; see feddomain/federation/flower/supernode.py)",
    )
    local.add_argument(
        "--state-dir",
        type=Path,
        help="where the nodes keep their clients' state, so an interrupted run can --resume",
    )
    local.add_argument(
        "--simulation",
        action="store_true",
        help="a SuperLink running Flower's simulation engine (Ray) instead of SuperNodes",
    )
    local.add_argument(
        "--sites",
        type=Path,
        help="a `feddomain data export` folder: node i holds only site<i>/ and target/",
    )
    local.set_defaults(func=cmd_local)

    run = fsub.add_parser("run", help="submit an experiment to a SuperLink (flwr run)")
    run.add_argument("config", type=Path, nargs="?", help="experiment YAML (not with --resume)")
    run.add_argument("overrides", nargs="*", help="dotted overrides, as for `feddomain run`")
    run.add_argument(
        "--state-dir",
        help="where nodes without their own state-dir keep client state (path on each node)",
    )
    run.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the interrupted run in DIR from its checkpoint, with its own config "
        "(as `feddomain run --resume DIR`)",
    )
    run.add_argument("--out", type=Path, help="new run directory (on the SuperLink)")
    run.add_argument(
        "--superlink", help="connection name in the Flower config (default: its default)"
    )
    run.add_argument(
        "--flwr-home",
        type=Path,
        help="Flower home holding that config, as `feddomain flower local` prints it",
    )
    run.add_argument(
        "--min-replies", type=int, default=1, help="replies a round may close with (default 1)"
    )
    run.add_argument(
        "--round-timeout",
        type=float,
        default=600.0,
        help="seconds a round waits for missing replies once --min-replies came (default 600)",
    )
    run.add_argument(
        "--node-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the SuperNodes holding the clients (default 300)",
    )
    run.add_argument(
        "--poll-interval",
        type=float,
        default=0.05,
        help="seconds between the ServerApp's pulls of replies from the SuperLink (default 0.05)",
    )
    run.add_argument(
        "--federation-config",
        help="simulation engine settings, e.g. 'num-supernodes=3 client-resources-num-cpus=1'",
    )
    run.set_defaults(func=cmd_run)


def cmd_local(args: argparse.Namespace) -> None:
    from feddomain.federation.flower.deploy import LocalFederation, TLSFiles
    from feddomain.federation.flower.node_state import STATE_DIR

    tls = None
    if args.tls_dir is not None:
        tls = TLSFiles(
            args.tls_dir / "ca.pem", args.tls_dir / "server.pem", args.tls_dir / "server.key"
        )
        missing = [str(p) for p in (tls.ca, tls.cert, tls.key) if not p.is_file()]
        if missing:
            raise FeddomainError(f"--tls-dir {args.tls_dir}: missing {', '.join(missing)}")
    if args.sites is not None:
        missing = [f"site{i}" for i in range(args.nodes) if not (args.sites / f"site{i}").is_dir()]
        if missing or not (args.sites / "target").is_dir():
            raise FeddomainError(
                f"--sites {args.sites}: no folder(s) {missing or ['target']}; write them with "
                "`feddomain data export CONFIG --out DIR`"
            )
    node_poll = args.node_poll or None  # 0: Flower's own waits
    if node_poll is not None:
        from feddomain.federation.flower.supernode import check_poll

        check_poll(node_poll)
    nodes = 0 if args.simulation else args.nodes
    with LocalFederation(
        nodes,
        args.workdir.resolve(),
        tls=tls,
        warm=not (args.cold or args.simulation),
        node_poll=node_poll,
        sites=args.sites,
        simulation=args.simulation,
        node_config={STATE_DIR: str(args.state_dir.resolve())} if args.state_dir else {},
    ) as fed:
        engine = (
            "--federation-config 'num-supernodes=N client-resources-num-cpus=1' "
            if args.simulation
            else ""
        )
        print(
            f"SuperLink on {fed.host}:{fed.port}, {nodes} SuperNodes; logs in {fed.workdir}\n"
            f"submit with: feddomain flower run CONFIG --out DIR {engine}"
            f"--flwr-home {fed.flwr_home}\nCtrl-C stops everything.",
            flush=True,
        )
        # `kill` (SIGTERM) stops everything as Ctrl-C does; a background job ignores SIGINT
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            while all(p.popen.poll() is None for p in [fed.superlink, *fed.nodes] if p):
                time.sleep(1.0)
            raise FeddomainError(f"a Flower process exited; see the logs in {fed.workdir}")
        except KeyboardInterrupt:
            pass


def cmd_run(args: argparse.Namespace) -> None:
    """Validate the config here, send it inline, stream the run, check it wrote its summary."""
    import tomli_w

    from feddomain.federation.flower.deploy import QUIET_ENV, stage_app
    from feddomain.federation.flower.node_state import STATE_DIR

    resume = args.resume is not None
    if resume and args.config is not None:
        raise FeddomainError(
            "--resume DIR continues the run in DIR with its own config; omit CONFIG"
        )
    if resume and args.out is not None and args.out != args.resume:
        raise FeddomainError("--resume DIR names the run directory; omit --out")
    if not resume and (args.config is None or args.out is None):
        raise FeddomainError("feddomain flower run needs CONFIG and --out DIR (or --resume DIR)")
    if not args.poll_interval > 0:
        raise FeddomainError(f"--poll-interval must be positive, got {args.poll_interval}")
    out = (args.resume if resume else args.out).expanduser().resolve()
    run_config: dict[str, object] = {
        "out": str(out),
        "min-replies": args.min_replies,
        "round-timeout": args.round_timeout,
        "node-timeout": args.node_timeout,
        "poll-interval": args.poll_interval,
        "resume": resume,
        **({STATE_DIR: args.state_dir} if args.state_dir else {}),
    }
    if not resume:
        cfg = load_config(args.config, args.overrides)  # errors surface before anything is sent
        if out.exists() and any(out.iterdir()):
            raise FeddomainError(
                f"output directory {out} already holds files; choose a new --out, or continue "
                f"it with --resume {args.out}"
            )
        run_config["config-yaml"] = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    flwr_home = _federation(args.superlink, args.flwr_home)
    staging = Path(tempfile.mkdtemp(prefix="feddomain-flower-"))
    overrides_file = staging / "run-config.toml"
    overrides_file.write_text(tomli_w.dumps(run_config))
    app = stage_app(staging / "app")  # a lean copy: Flower bundles it in milliseconds
    cmd = ["flwr", "run", str(app), *([args.superlink] if args.superlink else [])]
    cmd += ["--run-config", str(overrides_file), "--stream"]
    if args.federation_config:
        cmd += ["--federation-config", args.federation_config]
    env = {**os.environ, **QUIET_ENV}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["FLWR_HOME"] = str(flwr_home)
    # `kill` (SIGTERM) stops this command as Ctrl-C does: flwr run is stopped with it
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_id = _stream(cmd, env, args.superlink)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if run_id is None:
        raise FeddomainError("flwr run did not start a run (see its output above)")
    status, details = _run_status(run_id, args.superlink, env)
    if status != "finished:completed":
        # `flwr run` exits 0 whatever became of the run; the SuperLink knows
        raise FeddomainError(f"Flower run {run_id} ended as {status}: {details}")


def _federation(superlink: str | None, flwr_home: Path | None) -> Path:
    """The Flower home whose connection ``superlink`` (or its default) names a SuperLink by
    address. Anything else is refused before ``flwr`` runs: without an address, ``flwr run``
    starts Flower's local simulation runtime, which installs the App's dependencies (gigabytes
    of CUDA packages) into the Flower home and leaves a SuperLink and Ray running."""
    start = (
        "start a federation with `feddomain flower local --nodes 3 --workdir /tmp/fl` and "
        "pass the --flwr-home it prints, or name a SuperLink of your Flower config with "
        "--superlink (docs/deployment.md)"
    )
    if flwr_home is None and superlink is None and "FLWR_HOME" not in os.environ:
        raise FeddomainError(f"no federation named: {start}")
    home = (flwr_home or Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr"))).expanduser()
    config = home / "config.toml"
    if not config.is_file():
        raise FeddomainError(f"no Flower config at {config}: {start}")
    try:
        links = tomllib.loads(config.read_text()).get("superlink", {})
    except tomllib.TOMLDecodeError as err:
        raise FeddomainError(f"{config} is not valid TOML: {err}") from None
    name = superlink or links.get("default")
    connection = links.get(name) if isinstance(name, str) else None
    if not isinstance(connection, dict):
        names = sorted(k for k, v in links.items() if isinstance(v, dict))
        raise FeddomainError(f"{config} has no SuperLink connection {name!r} (it has {names})")
    if "address" not in connection:
        raise FeddomainError(
            f"connection {name!r} in {config} has no address: `flwr run` would start Flower's "
            f"local simulation runtime and install packages; {start}"
        )
    return home.resolve()


def _stream(cmd: list[str], env: dict[str, str], superlink: str | None) -> int | None:
    """Run ``flwr run --stream``, echoing its output; the id of the run it started. However
    this ends (Ctrl-C, SIGTERM, an error), ``flwr run`` is stopped, and a run it started is
    stopped on the SuperLink when this command is interrupted."""
    run_id = None
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            started = re.search(r"Successfully started run (\d+)", line)
            if started:
                run_id = int(started.group(1))
        proc.wait()
    except KeyboardInterrupt:
        if run_id is None:
            raise Interrupted("flwr run stopped before it started a run") from None
        link = [superlink] if superlink else []
        stop = ["flwr", "stop", str(run_id), *link]
        subprocess.run(stop, env=env, capture_output=True, timeout=60, check=False)
        raise Interrupted(
            f"Flower run {run_id} stopped; with checkpoints, continue it with `feddomain "
            "flower run --resume DIR`"
        ) from None
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return run_id


def _run_status(run_id: int, superlink: str | None, env: dict[str, str]) -> tuple[str, str]:
    """(status, details) of a run as the SuperLink reports it, e.g. ``finished:failed``."""
    cmd = ["flwr", "ls", *([superlink] if superlink else []), "--run-id", str(run_id)]
    res = subprocess.run(
        [*cmd, "--format", "json"], env=env, capture_output=True, text=True, check=False
    )
    try:
        (run,) = json.loads(res.stdout)["runs"]
    except (ValueError, KeyError, TypeError):
        return "unknown", f"`{' '.join(cmd)}` said: {(res.stdout + res.stderr).strip()[-500:]}"
    return str(run["status"]), str(run.get("status-details", ""))
