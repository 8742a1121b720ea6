"""Flower's per-round-trip latency (issue 16 item 5): the opt-in SuperNode poll
(``feddomain.federation.flower.supernode``), how ``feddomain flower local`` starts the nodes with
it, and the ServerApp's pull interval reaching the run config."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import flwr
import flwr.supernode.start_client_internal as loop
import pytest
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

from feddomain.cli import main
from feddomain.errors import FeddomainError
from feddomain.federation.flower import commands, supernode
from feddomain.federation.flower.deploy import LocalFederation
from feddomain.federation.flower.settings import FlowerSettings

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


class _Stop(Exception):
    pass


def _idle_loop_seconds(idle_pulls: int) -> float:
    """Wall time of Flower's SuperNode loop over ``idle_pulls`` pulls that find no message
    (its connection and signal handlers stubbed; the loop itself is Flower's)."""
    pulls = []

    def receive() -> None:
        pulls.append(time.monotonic())
        if len(pulls) > idle_pulls:
            raise _Stop
        return None

    @contextlib.contextmanager
    def connection(**_: object):
        yield 1, receive, *([None] * 6)

    node_state = SimpleNamespace(set_node_id=lambda _: None)
    factory = SimpleNamespace(
        state=lambda: node_state, objectstore_factory=SimpleNamespace(store=lambda: None)
    )
    start = time.monotonic()
    with (
        pytest.MonkeyPatch.context() as mp,
        pytest.raises(_Stop),
    ):
        mp.setattr(loop, "_init_connection", connection)
        mp.setattr(loop, "register_signal_handlers", lambda **_: None)
        loop.start_client_internal(
            state_factory=factory,
            server_address="127.0.0.1:1",
            node_config={},
            isolation="process",
            runtime_api_address="127.0.0.1:1",
        )
    return time.monotonic() - start


def test_capped_node_polls_at_the_cap_instead_of_flowers_3_s(monkeypatch) -> None:
    """Catches the cap missing the sleep that Flower's idle SuperNode loop really makes (a
    renamed module, a sleep no longer called through the module's ``time``): 3 idle pulls take
    9 s uncapped, a few milliseconds capped at 0.01 s."""
    monkeypatch.setattr(loop, "time", loop.time)  # restored after the test
    supernode.cap_node_sleeps(0.01)
    assert _idle_loop_seconds(3) < 1.5
    assert loop.time.monotonic is time.monotonic  # nothing but sleep changes


def test_the_cap_is_refused_on_an_unchecked_flower_or_a_bad_value(
    monkeypatch, pull_defaults
) -> None:
    """Catches the patch being applied blind to a Flower release whose loop was never read,
    or a zero/negative interval (a busy loop) being accepted."""
    monkeypatch.setattr(loop, "time", loop.time)
    monkeypatch.setattr(flwr, "__version__", "1.99.0")
    with pytest.raises(FeddomainError, match=r"checked against flwr 1\.41\.0, not 1\.99\.0"):
        supernode.cap_node_sleeps(0.05)
    with pytest.raises(FeddomainError, match=r"not 1\.99\.0"):
        supernode.cap_pull_backoff(0.05)
    assert loop.time is time
    assert [p.__kwdefaults__["initial_backoff"] for p in pull_defaults] == [1, 1]
    monkeypatch.setattr(flwr, "__version__", supernode.CHECKED_VERSIONS[0])
    with pytest.raises(FeddomainError, match="must be positive, got 0"):
        supernode.cap_node_sleeps(0.0)


@pytest.fixture
def pull_defaults(monkeypatch):
    """Flower's object-pull defaults, restored after the test."""
    pulls = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    for pull in pulls:
        monkeypatch.setattr(pull, "__kwdefaults__", dict(pull.__kwdefaults__))
    return pulls


def _pull_seconds(missing_asks: int) -> float:
    """Seconds Flower's ``pull_objects`` takes for one object the source lacks at its first
    ``missing_asks`` asks."""
    asked = []

    def pull_object(object_id: str) -> bytes:
        asked.append(object_id)
        if len(asked) <= missing_asks:
            raise ObjectUnavailableError(object_id)
        return b"content"

    start = time.monotonic()
    assert inflatable_utils.pull_objects(["a"], pull_object) == {"a": b"content"}
    return time.monotonic() - start


def test_an_object_not_there_yet_is_retried_after_the_cap_not_1_s(pull_defaults) -> None:
    """Catches the backoff cap missing the default Flower's pulls really use (node, ClientApp
    and ServerApp leave it at 1 s): an object that is missing at the first ask arrives after
    ~1 s uncapped, after ~0.01 s capped."""
    assert _pull_seconds(1) > 0.7  # Flower's own first retry: 1 s +-20%
    supernode.cap_pull_backoff(0.01)
    assert _pull_seconds(1) < 0.5
    assert [p.__kwdefaults__["initial_backoff"] for p in pull_defaults] == [0.01, 0.01]


def test_capped_retries_do_not_double(pull_defaults) -> None:
    """Catches the retries doubling from the cap (0.05, 0.1, 0.2, 0.4 s: 0.75 s for an object
    missing at 4 asks, which overshoots its arrival): capped, they come every 0.05 s (0.2 s)."""
    supernode.cap_pull_backoff(0.05)
    assert _pull_seconds(4) < 0.45  # doubling: 0.75 s +-20%
    assert [p.__kwdefaults__["backoff_cap"] for p in pull_defaults] == [0.05, 0.05]


def test_capped_sleep_never_sleeps_longer_than_asked() -> None:
    """Catches the cap lengthening short sleeps (it must be a minimum, not a replacement)."""
    capped = supernode.CappedTime(5.0)
    start = time.monotonic()
    capped.sleep(0.01)
    assert time.monotonic() - start < 1.0


def test_local_nodes_with_a_poll_run_flowers_supernode_through_the_cap(tmp_path) -> None:
    """Catches ``flower local --node-poll`` dropping the node's own arguments, or starting
    Flower's plain ``flower-supernode`` (3 s idle poll) when a poll was asked for."""
    plain = LocalFederation(3, tmp_path, port=9092)
    fast = LocalFederation(3, tmp_path, port=9092, node_poll=0.05)
    head = [sys.executable, "-m", "feddomain.federation.flower.supernode", "--poll", "0.05", "--"]
    assert plain.supernode_command(1, 9100)[0] == "flower-supernode"
    assert fast.supernode_command(1, 9100) == head + plain.supernode_command(1, 9100)[1:]
    link = SimpleNamespace(popen=SimpleNamespace(pid=1))
    plain.superlink = fast.superlink = link  # the warm executor serves it and the nodes
    assert "--poll" not in plain.executor_command([])
    assert fast.executor_command([])[-2:] == ["--poll", "0.05"]


def test_the_poll_wrapper_hands_flower_its_arguments(monkeypatch, pull_defaults) -> None:
    """Catches the wrapper passing its own ``--poll`` or the ``--`` on to flower-supernode,
    which would refuse them."""
    seen = []
    monkeypatch.setattr(loop, "time", loop.time)
    monkeypatch.setattr("flwr.supernode.cli.flower_supernode", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["python"])
    supernode.main(["--poll", "0.05", "--", "--superlink", "127.0.0.1:9092", "--insecure"])
    assert seen == [["flower-supernode", "--superlink", "127.0.0.1:9092", "--insecure"]]
    assert isinstance(loop.time, supernode.CappedTime)
    assert [p.__kwdefaults__["initial_backoff"] for p in pull_defaults] == [0.05, 0.05]


def test_the_serverapp_pull_interval_reaches_the_run_config(monkeypatch, tmp_path) -> None:
    """Catches ``flower run --poll-interval`` being parsed but never sent, and the default
    drifting back to a value that adds a fifth of a second to every round trip."""
    sent = {}

    def stop_at_stream(cmd, env, superlink):
        run_config = Path(cmd[cmd.index("--run-config") + 1]).read_text()
        sent["poll"] = [line for line in run_config.splitlines() if "poll-interval" in line]
        return None

    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "x"\n\n[superlink.x]\naddress = "127.0.0.1:1"\ninsecure = true'
    )
    monkeypatch.setattr(commands, "_stream", stop_at_stream)
    args = ["flower", "run", DEMO, "--out", str(tmp_path / "o"), "--flwr-home", str(home)]
    assert main([*args, "--poll-interval", "0.02"]) == 2  # no run started: stops after
    assert sent["poll"] == ["poll-interval = 0.02"]
    assert main(args) == 2
    assert sent["poll"] == ["poll-interval = 0.05"]
    defaults = FlowerSettings.from_run_config({"config": DEMO, "out": "x"})
    assert defaults.poll_interval == 0.05


def test_non_positive_polls_are_refused_by_name_before_anything_starts(
    tmp_path, capsys, monkeypatch
) -> None:
    """Catches a negative node poll or a zero ServerApp poll (a busy loop) reaching the
    processes instead of being refused where the user typed it."""
    started = []
    monkeypatch.setattr(
        "feddomain.federation.flower.deploy.LocalFederation.start", lambda s: started.append(s)
    )
    assert main(["flower", "local", "--node-poll", "-1", "--workdir", str(tmp_path)]) == 2
    assert "poll interval must be positive, got -1.0" in capsys.readouterr().err
    args = ["flower", "run", DEMO, "--out", str(tmp_path / "o"), "--poll-interval", "-1"]
    assert main(args) == 2
    assert "--poll-interval must be positive, got -1.0" in capsys.readouterr().err
    assert started == []


@pytest.mark.slow
def test_a_deployment_with_capped_polls_equals_the_simulator(tmp_path) -> None:
    """Catches the capped nodes or executor breaking a real deployment (a wrapper that drops a
    node argument, a pull that gives up early): 3 real SuperNodes started through the cap, a run
    through them, the simulator's result."""
    from tests.test_flower import assert_deployed_equals_simulated, demo_config, simulate, submit

    sim = simulate(demo_config(), tmp_path / "sim")
    with LocalFederation(3, tmp_path / "fed", node_poll=0.05) as fed:
        assert all("flower.supernode" in " ".join(n.popen.args) for n in fed.nodes)
        out = fed.workdir / "fedavg"
        submit(fed, out)
    assert_deployed_equals_simulated(out, sim, tmp_path / "sim")


def test_a_fab_is_unzipped_and_verified_once_per_content(monkeypatch, tmp_path) -> None:
    """Catches the warm executor's tasks unzipping and hash-checking the App for every message
    (~45 ms each), a different App (new content) not being installed, and an App folder
    removed since (a marker without its folder) being trusted."""
    import flwr.supernode.runtime.run_clientapp as clientapp_runtime

    from feddomain.federation.flower import warm

    installs = []

    def install(fab: bytes, install_dir: Path | None, skip_prompt: bool) -> Path:
        path = install_dir / "apps" / f"app.{len(installs)}"
        path.mkdir(parents=True)
        installs.append(fab)
        return path

    monkeypatch.setattr(warm, "install_from_fab", install)
    assert clientapp_runtime.install_from_fab is warm.install_once  # what run_clientapp calls
    first = warm.install_once(b"app v1", tmp_path, True)
    assert warm.install_once(b"app v1", tmp_path, True) == first
    assert installs == [b"app v1"]
    warm.install_once(b"app v2", tmp_path, True)
    assert installs == [b"app v1", b"app v2"]
    first.rmdir()
    assert warm.install_once(b"app v1", tmp_path, True) != first
    assert installs == [b"app v1", b"app v2", b"app v1"]


@pytest.mark.parametrize(("option", "poll"), [([], 0.05), (["--node-poll", "0"], None)])
def test_local_nodes_poll_fast_unless_told_otherwise(option, poll, tmp_path, monkeypatch) -> None:
    """Catches ``flower local`` going back to Flower's 3 s idle poll by default (3 s of every
    round trip on loopback), or ``--node-poll 0`` not giving Flower's own waits back."""
    started = []

    def start(federation: LocalFederation) -> None:
        started.append(federation.node_poll)
        raise KeyboardInterrupt  # stop before any process is started

    monkeypatch.setattr("feddomain.federation.flower.deploy.LocalFederation.start", start)
    main(["flower", "local", *option, "--workdir", str(tmp_path)])
    assert started == [poll]
