"""Where a run computes: ``device`` (auto | cpu | cuda | cuda:N), ``precision`` and
``deterministic``.

The boundary is the client task and the evaluation: the data sets live on the device (moved
once), so do the shared model object and a client's message and state while it trains; what a
client sends back, and everything the server keeps, is on the CPU as before. Server code
therefore never meets a device tensor, and on ``cpu`` every move is a no-op, so CPU results
are bit-identical to a run without these settings.
"""

from __future__ import annotations

import os
import re
from contextlib import AbstractContextManager, nullcontext

import torch

from feddomain.federation.messages import Message

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
# cuBLAS needs a fixed workspace to be deterministic (CUDA >= 10.2); it must be set before the
# first cuBLAS call of the process
CUBLAS_WORKSPACE = ":4096:8"


def check_device(spec: str, precision: str) -> None:
    """Raise ValueError naming the value when ``spec`` cannot run here: a malformed name,
    ``cuda`` without CUDA, ``cuda:N`` past the devices present, ``bf16`` without CUDA."""
    if not DEVICE_PATTERN.fullmatch(spec):
        raise ValueError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {spec!r}: no CUDA device is available to this process "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                "use device: auto or cpu"
            )
        index = int(spec.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"numbered from 0"
            )
    if precision == "bf16" and resolve_device(spec).type != "cuda":
        raise ValueError(f"precision 'bf16' needs a CUDA device; device {spec!r} runs on the CPU")


def resolve_device(spec: str) -> torch.device:
    """``auto``: the current CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def describe(spec: str) -> str:
    """The device a run used and, for ``auto``, why (for the run's provenance)."""
    device = resolve_device(spec)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{device} ({name})" + (" chosen by auto" if spec == "auto" else "")
    return "cpu (auto: no CUDA device available)" if spec == "auto" else "cpu"


def apply_determinism(deterministic: bool) -> None:
    """``deterministic: true``: deterministic algorithms only (an op without one raises),
    cuDNN without autotuning, cuBLAS with a fixed workspace. Set both ways, so a sweep worker
    that ran a deterministic run does not carry the setting into the next."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        # only on a change: setting it imports torch's compiler config (SymPy), seconds of
        # start-up for a run that keeps the default
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """bf16 mixed precision (matmuls and convolutions in bfloat16, weights and optimiser state
    in float32); fp32 runs as is."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def move(msg: Message, device: torch.device) -> Message:
    """``msg``'s arrays on ``device``, in place (a tensor already there is kept as is)."""
    msg.arrays = {k: v.to(device) for k, v in msg.arrays.items()}
    return msg
