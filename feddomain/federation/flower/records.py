"""feddomain's ``Message`` <-> Flower's ``RecordDict``: arrays travel as an ``ArrayRecord``,
scalars as a ``ConfigRecord``, and the runner's envelope (task, round, client, split, config) as a
second ``ConfigRecord``. Per-client state is kept in a node's ``Context.state`` the same way.

Tensors are converted through NumPy without loss (dtype and shape kept), and both records keep
insertion order on the wire, so a reply's arrays flatten in the same order as in the simulator.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from feddomain.errors import FeddomainError
from feddomain.evaluation.metrics import EvalResult, Reliability
from feddomain.federation.messages import Message, Scalar

ARRAYS, SCALARS, ENVELOPE = "arrays", "scalars", "feddomain"


def arrays_to_record(arrays: dict[str, torch.Tensor]) -> ArrayRecord:
    record = ArrayRecord()
    for name, tensor in arrays.items():
        if tensor.dtype == torch.bfloat16:
            raise FeddomainError(f"array {name!r}: bfloat16 cannot be sent; use float32")
        record[name] = Array.from_numpy_ndarray(tensor.detach().cpu().contiguous().numpy())
    return record


def record_to_arrays(record: ArrayRecord) -> dict[str, torch.Tensor]:
    out = {}
    for name, array in record.items():
        values = array.numpy()
        # decoded buffers are read-only; torch needs memory it may write to
        out[name] = torch.from_numpy(values if values.flags.writeable else values.copy())
    return out


def scalars_to_record(scalars: dict[str, Scalar]) -> ConfigRecord:
    return ConfigRecord({k: _plain(k, v) for k, v in scalars.items()})


def _plain(key: str, value: Any) -> Any:
    """NumPy scalars (e.g. a loss computed with NumPy) become Python ones; others must already
    be what a ``ConfigRecord`` holds."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [v.item() if isinstance(v, np.generic) else v for v in value]
    if value is None:
        raise FeddomainError(f"scalar {key!r} is None; messages carry only values")
    return value


def to_content(msg: Message, **envelope: Any) -> RecordDict:
    """A feddomain message plus the runner's envelope, as Flower message content."""
    return RecordDict(
        {
            ARRAYS: arrays_to_record(msg.arrays),
            SCALARS: scalars_to_record(msg.scalars),
            ENVELOPE: ConfigRecord({"task": msg.task, **envelope}),
        }
    )


def from_content(content: RecordDict) -> tuple[Message, dict[str, Any]]:
    """Inverse of ``to_content``: the message and its envelope."""
    envelope = dict(content.config_records[ENVELOPE])
    arrays = record_to_arrays(content.array_records[ARRAYS])
    scalars = dict(content.config_records[SCALARS])
    return Message(str(envelope.pop("task")), arrays, scalars), envelope


# ---------------------------------------------------------------------- node state
def has_state(state: RecordDict, key: str) -> bool:
    """Whether this Flower run has stored the client's state on the node (after its first task)."""
    return f"{key}.arrays" in state


def load_state(state: RecordDict, key: str) -> Message:
    """A client's persistent state from a node's ``Context.state`` (empty on first use)."""
    if not has_state(state, key):
        return Message("state")
    return Message(
        "state",
        record_to_arrays(state.array_records[f"{key}.arrays"]),
        dict(state.config_records[f"{key}.scalars"]),
    )


def store_state(state: RecordDict, key: str, msg: Message) -> None:
    state[f"{key}.arrays"] = arrays_to_record(msg.arrays)
    state[f"{key}.scalars"] = scalars_to_record(msg.scalars)


# ------------------------------------------------------------------ eval results
def result_to_json(result: EvalResult | None) -> str:
    return json.dumps(None if result is None else result.to_dict())


def result_from_json(text: str) -> EvalResult | None:
    raw = json.loads(text)
    if raw is None:
        return None
    return EvalResult(**{**raw, "reliability": Reliability(**raw["reliability"])})


def results_to_json(results: dict[str, EvalResult]) -> str:
    return json.dumps({name: r.to_dict() for name, r in results.items()})


def results_from_json(text: str) -> dict[str, EvalResult]:
    return {
        name: EvalResult(**{**raw, "reliability": Reliability(**raw["reliability"])})
        for name, raw in json.loads(text).items()
    }
