"""feddomain's ``Message`` <-> Flower's ``RecordDict``: arrays travel as an ``ArrayRecord``
(packed: one flat array per dtype, their layout in a ``ConfigRecord``),
scalars as a ``ConfigRecord``, and the runner's envelope (task, round, client, split, config) as a
second ``ConfigRecord``. Per-client state is kept in a node's ``Context.state`` as one ``Array``
per tensor (it moves between node and ClientApp in one protobuf, not as separate objects).

Tensors are converted through NumPy without loss (dtype and shape kept), and both records keep
insertion order on the wire, so a reply's arrays flatten in the same order as in the simulator.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from feddomain.errors import FeddomainError
from feddomain.evaluation.metrics import EvalResult, Reliability
from feddomain.federation.messages import Message, Scalar

ARRAYS, LAYOUT, SCALARS, ENVELOPE = "arrays", "layout", "scalars", "feddomain"


def arrays_to_record(arrays: dict[str, torch.Tensor]) -> ArrayRecord:
    """One Flower ``Array`` per tensor: for state a node keeps in its ``Context``."""
    record = ArrayRecord()
    for name, tensor in arrays.items():
        record[name] = Array.from_numpy_ndarray(_numpy(name, tensor))
    return record


def record_to_arrays(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {name: _writable(array.numpy()) for name, array in record.items()}


def pack_arrays(arrays: dict[str, torch.Tensor]) -> tuple[ArrayRecord, ConfigRecord]:
    """The tensors of a message as one flat ``Array`` per dtype, plus their names, dtypes and
    shapes in order. Every ``Array`` is a separate object that each hop of Flower's transport
    (ServerApp -> SuperLink -> SuperNode -> ClientApp, and back) requests on its own, a few
    milliseconds each on loopback; a model of 14 tensors sent whole is 2 objects a hop instead
    of 28."""
    groups: dict[str, list[np.ndarray]] = {}
    names, dtypes, shapes = [], [], []
    for name, tensor in arrays.items():
        values = _numpy(name, tensor)
        groups.setdefault(values.dtype.str, []).append(values.reshape(-1))
        names.append(name)
        dtypes.append(values.dtype.str)
        shapes.append(json.dumps(values.shape))
    record = ArrayRecord()
    for dtype, parts in groups.items():
        record[dtype] = Array.from_numpy_ndarray(np.concatenate(parts))
    return record, ConfigRecord({"names": names, "dtypes": dtypes, "shapes": shapes})


def unpack_arrays(record: ArrayRecord, layout: ConfigRecord) -> dict[str, torch.Tensor]:
    """Inverse of ``pack_arrays``: views into one writable buffer per dtype, in the sent order."""
    flat = {dtype: _writable(array.numpy()) for dtype, array in record.items()}
    offsets = dict.fromkeys(flat, 0)
    out = {}
    for name, dtype, shape_text in zip(
        layout["names"], layout["dtypes"], layout["shapes"], strict=True
    ):
        shape = tuple(json.loads(shape_text))
        size = math.prod(shape)
        start = offsets[dtype]
        out[name] = flat[dtype][start : start + size].view(shape)
        offsets[dtype] = start + size
    return out


def _numpy(name: str, tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        raise FeddomainError(f"array {name!r}: bfloat16 cannot be sent; use float32")
    return tensor.detach().cpu().contiguous().numpy()


def _writable(values: np.ndarray) -> torch.Tensor:
    """Decoded buffers are read-only; torch needs memory it may write to."""
    return torch.from_numpy(values if values.flags.writeable else values.copy())


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
    arrays, layout = pack_arrays(msg.arrays)
    return RecordDict(
        {
            ARRAYS: arrays,
            LAYOUT: layout,
            SCALARS: scalars_to_record(msg.scalars),
            ENVELOPE: ConfigRecord({"task": msg.task, **envelope}),
        }
    )


def from_content(content: RecordDict) -> tuple[Message, dict[str, Any]]:
    """Inverse of ``to_content``: the message and its envelope."""
    envelope = dict(content.config_records[ENVELOPE])
    arrays = unpack_arrays(content.array_records[ARRAYS], content.config_records[LAYOUT])
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
