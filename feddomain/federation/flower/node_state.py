"""A SuperNode's copy of its client's state on disk, so that a resumed run goes on exactly.

Flower keeps a ClientApp's state in ``Context.state`` for one Flower run, and a run resumed from
the ServerApp's checkpoint is a new Flower run. With a ``state-dir`` (node config, else run
config), a node also writes its client's state after every task, atomically, to
``<state-dir>/<run key>/split<k>/client<cid>/state-<round>.pt``: the state after that round.

The state as of round ``c`` is the file with the highest round ``<= c``. Each message says which
round the ServerApp last checkpointed (``checkpoint_round``), so after writing a new file the
node keeps only it and the state as of that checkpoint; a run resumed from round ``c`` reads the
state as of ``c``. The round is in the file name, so deciding what to keep reads no file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context

from feddomain.federation import checkpoint
from feddomain.federation.messages import Message

STATE_DIR = "state-dir"  # node or run config: where client state is kept between runs


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
        saved = self._saved()
        as_of_checkpoint = max((r for r in saved if r <= checkpoint_round), default=None)
        checkpoint.write_atomic(self._path(rnd), (state.arrays, state.scalars))
        for r, path in saved.items():
            if r not in (rnd, as_of_checkpoint):
                path.unlink()

    def restore(self, checkpoint_round: int) -> Message | None:
        """The state as of the end of ``checkpoint_round``, or None if none was kept."""
        kept = [r for r in self._saved() if r <= checkpoint_round]
        if not kept:
            return None
        arrays, scalars = checkpoint.read(
            self._path(max(kept)), "the run cannot resume with it: start it again without resume"
        )
        return Message("state", arrays, scalars)

    def _path(self, rnd: int) -> Path:
        return self.folder / f"state-{rnd}.pt"

    def _saved(self) -> dict[int, Path]:
        """The kept states by round, from the file names alone."""
        if not self.folder.is_dir():
            return {}
        return {int(p.stem.removeprefix("state-")): p for p in self.folder.glob("state-*.pt")}
