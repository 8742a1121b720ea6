"""The privacy contract: what a method's clients may send, checked on every reply, and the ledger
of what crossed each way.

A method declares on its client part (``ClientAlgorithm.uploads``) what a reply may hold: model
arrays by name pattern (each must have the model's own shape), named statistics with their
shapes, and scalar names. The runner checks every client reply against that declaration before
anything reads it — in the simulator and in the Flower ServerApp alike, since both go through
``Simulation._run_client`` — and stops the run with ``PrivacyViolation`` naming the method, the
client and the array. A statistic can never carry one row per training sample: its shape is
fixed by the declaration, and a free (``None``) leading dimension equal to the client's sample
count is refused as per-sample data.

Bytes are counted per link (``client-server``; with stations ``client-station`` and
``station-server``), by direction and kind: an array named like one of the model's arrays, with
its shape, is ``model``; any other array is ``statistics``; scalars are ``scalars`` (8 bytes per
number or boolean, UTF-8 length for strings, summed over lists: what a compact binary encoding
sends).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from feddomain.errors import FeddomainError
from feddomain.federation.messages import Message, Scalar
from feddomain.federation.topology import PILOT_CID

MODEL, STATISTICS, SCALARS = "model", "statistics", "scalars"
KINDS = (MODEL, STATISTICS, SCALARS)

Shape = tuple[int | None, ...]  # None: a dimension of any size


class PrivacyViolation(FeddomainError):
    """A client sent something its method does not declare."""


@dataclass(frozen=True)
class Uploads:
    """What a client may put in a reply. ``model``: glob patterns over the model's array names
    (``"*"`` for all, ``()`` for none: Local-only sends no weights); ``withheld``: patterns of
    model arrays never sent even where ``model`` matches them (FedFD's server-computed global
    statistics); ``statistics``: name -> shape; ``scalars``: names."""

    model: tuple[str, ...] = ()
    statistics: Mapping[str, Shape] = field(default_factory=dict)
    scalars: tuple[str, ...] = ("num_examples",)
    withheld: tuple[str, ...] = ()

    def sends_model_array(self, name: str) -> bool:
        """Whether a reply may carry the model array ``name``."""
        return _matches(name, self.model) and not _matches(name, self.withheld)


def scalar_nbytes(value: Scalar) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(scalar_nbytes(v) for v in value)
    return 8


class UploadCheck:
    """One method's declaration held against the model it trains."""

    def __init__(self, method: str, uploads: Uploads, model: Mapping[str, torch.Size]) -> None:
        self.method = method
        self.uploads = uploads
        self.model_shapes = {k: tuple(v) for k, v in model.items()}
        # the model arrays a reply may carry, matched against the patterns once per run
        self.sendable = {k for k in self.model_shapes if uploads.sends_model_array(k)}

    def is_model_array(self, name: str, tensor: torch.Tensor) -> bool:
        return self.model_shapes.get(name) == tuple(tensor.shape)

    def check(self, cid: int, reply: Message, n_samples: int) -> None:
        """Raise ``PrivacyViolation`` for the first undeclared array or scalar of ``reply``."""
        for name, tensor in reply.arrays.items():
            problem = self._array_problem(name, tuple(tensor.shape), n_samples)
            if problem:
                hint = (
                    f" (declare it in {self.method}'s ClientAlgorithm.uploads if it is meant "
                    "to be sent)"
                    if "not declared" in problem
                    else ""
                )
                raise PrivacyViolation(
                    f"{self.method}: {_sender(cid)} sent array '{name}' {list(tensor.shape)} "
                    f"({reply.task} task), which {problem}; the run is stopped so that nothing "
                    f"undeclared leaves a client{hint}"
                )
        undeclared = sorted(set(reply.scalars) - set(self.uploads.scalars))
        if undeclared:
            raise PrivacyViolation(
                f"{self.method}: {_sender(cid)} sent undeclared scalar(s) {undeclared} "
                f"({reply.task} task; declared: {list(self.uploads.scalars)})"
            )

    def _array_problem(self, name: str, shape: tuple[int, ...], n_samples: int) -> str | None:
        if name in self.sendable:
            want = self.model_shapes[name]
            return None if shape == want else f"differs from the model's shape {list(want)}"
        declared = self.uploads.statistics.get(name)
        per_sample = n_samples > 1 and len(shape) > 0 and shape[0] == n_samples
        if declared is None:
            if name in self.model_shapes:
                return "is a model array this method does not declare as sent"
            detail = " and has one row per training sample" if per_sample else ""
            return f"is not declared{detail}"
        if per_sample and (len(declared) == 0 or declared[0] is None or declared[0] != shape[0]):
            return f"has a per-sample leading dimension ({n_samples} training samples)"
        if len(declared) != len(shape) or any(
            d is not None and d != s for d, s in zip(declared, shape, strict=False)
        ):
            return f"differs from its declared shape {list(declared)}"
        return None

    def kind(self, name: str, tensor: torch.Tensor) -> str:
        return MODEL if self.is_model_array(name, tensor) else STATISTICS

    def message_bytes(self, msg: Message) -> dict[str, int]:
        """Bytes of ``msg`` by kind."""
        out = dict.fromkeys(KINDS, 0)
        for name, t in msg.arrays.items():
            out[self.kind(name, t)] += t.numel() * t.element_size()
        out[SCALARS] = sum(scalar_nbytes(v) for v in msg.scalars.values())
        return out


def _sender(cid: int) -> str:
    return "the pilot task" if cid == PILOT_CID else f"client {cid}"


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def non_finite_scalars(msg: Message) -> list[str]:
    """Names of numeric scalars (or lists of them) holding NaN or Inf."""
    bad = []
    for name, value in msg.scalars.items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            bad.append(name)
    return bad


@dataclass
class Ledger:
    """Bytes sent down (toward the clients) and up (toward the server) over one link, by kind,
    totals so far."""

    down: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    up: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, direction: str, counts: Mapping[str, int]) -> None:
        totals = self.down if direction == "down" else self.up
        for kind, n in counts.items():
            totals[kind] += n

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"down": dict(self.down), "up": dict(self.up)}

    def since(self, before: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
        """What was sent since ``before`` (a ``snapshot()``), by direction and kind."""
        now = self.snapshot()
        return {d: {k: now[d][k] - before[d][k] for k in KINDS} for d in now}

    def array_bytes(self, direction: str) -> int:
        totals = self.down if direction == "down" else self.up
        return totals[MODEL] + totals[STATISTICS]


CLIENT_SERVER, CLIENT_STATION, STATION_SERVER = "client-server", "client-station", "station-server"


class Links:
    """One ``Ledger`` per link of the topology: ``client-server`` in a flat federation;
    ``client-station`` and ``station-server`` with stations. ``clients`` is the ledger of the
    link clients talk on, ``server`` that of the link the server talks on (one link when flat)."""

    def __init__(self, hierarchical: bool) -> None:
        self.client_link = CLIENT_STATION if hierarchical else CLIENT_SERVER
        self.server_link = STATION_SERVER if hierarchical else CLIENT_SERVER
        self.ledgers = {name: Ledger() for name in (self.client_link, self.server_link)}

    @property
    def clients(self) -> Ledger:
        return self.ledgers[self.client_link]

    @property
    def server(self) -> Ledger:
        return self.ledgers[self.server_link]

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        return {name: ledger.snapshot() for name, ledger in self.ledgers.items()}

    def since(
        self, before: Mapping[str, Mapping[str, Mapping[str, int]]]
    ) -> dict[str, dict[str, dict[str, int]]]:
        """What crossed each link since ``before`` (a ``snapshot()``), by direction and kind."""
        return {name: ledger.since(before[name]) for name, ledger in self.ledgers.items()}

    def load(self, snapshot: Mapping[str, Mapping[str, Mapping[str, int]]]) -> None:
        """Continue from a checkpoint's ``snapshot()``."""
        self.ledgers = {name: Ledger(**snapshot[name]) for name in self.ledgers}
