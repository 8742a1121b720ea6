"""A SuperNode's copy of its client's state on disk, so that a resumed run goes on exactly.

Flower keeps a ClientApp's state in ``Context.state`` for one Flower run, and a run resumed from
the ServerApp's checkpoint is a new Flower run. With ``state-dir`` in its node config, a node
also writes its client's state to ``<state-dir>/<run key>/split<k>/client<cid>/`` after every
task (atomically), in two files:

- ``latest.pt``: the state after the client's last task (and the round it ran in);
- ``checkpoint.pt``: the state as of the ServerApp's last checkpoint.

Each message says which round the ServerApp last checkpointed (``checkpoint_round``). Before a
task overwrites ``latest.pt``, a ``latest.pt`` from that round or earlier is the state as of the
checkpoint and is kept as ``checkpoint.pt``. A run resumed from round ``c`` needs the state as of
``c``: ``latest.pt`` if it is no newer than ``c``, else ``checkpoint.pt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context

from feddomain.federation import checkpoint
from feddomain.federation.messages import Message

STATE_DIR = "state-dir"  # node or run config: where client state is kept between runs
LATEST, AT_CHECKPOINT = "latest.pt", "checkpoint.pt"


@dataclass(frozen=True)
class StateStore:
    """One client's state files on one node."""

    folder: Path

    @classmethod
    def of(cls, context: Context, run_key: str, split: int, cid: int) -> StateStore | None:
        """The store under the node's ``state-dir`` (node config), else the run's (run config:
        for the simulation engine's virtual nodes, which have no node config of their own);
        None when neither names one."""
        root = context.node_config.get(STATE_DIR) or context.run_config.get(STATE_DIR)
        if not root:
            return None
        return cls(Path(str(root)).expanduser() / run_key / f"split{split}" / f"client{cid}")

    def record(self, rnd: int, state: Message, checkpoint_round: int) -> None:
        """Keep the state after a task of round ``rnd``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        previous = self._read(LATEST)
        if previous is not None and previous[0] <= checkpoint_round:
            kept = self._read(AT_CHECKPOINT)
            if kept is None or kept[0] < previous[0]:
                checkpoint.write_atomic(self.folder / AT_CHECKPOINT, previous)
        checkpoint.write_atomic(self.folder / LATEST, (rnd, state.arrays, state.scalars))

    def restore(self, checkpoint_round: int) -> Message | None:
        """The state as of the end of ``checkpoint_round``, or None if none was kept."""
        for name in (LATEST, AT_CHECKPOINT):
            saved = self._read(name)
            if saved is not None and saved[0] <= checkpoint_round:
                return Message("state", saved[1], saved[2])
        return None

    def _read(self, name: str) -> tuple[int, dict, dict] | None:
        return checkpoint.read(
            self.folder / name, "the run cannot resume with it: start it again without resume"
        )
