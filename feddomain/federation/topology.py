"""Who takes part when: the seeded client-sampling stream and derived per-task seeds.

Every random choice of the runner is a pure function of (seed, purpose, round, client). A resumed
run therefore needs no saved RNG state to draw exactly what the uninterrupted run drew, and every
method sees the same client-sampling stream for the same seed.
"""

from __future__ import annotations

import numpy as np
import torch

SAMPLING, CLIENT_TRAIN, SERVER, INIT, CLIENT_PRE_ROUND, PILOT_TASK, EVALUATION = range(7)
# data-layer draws: per-client validation split, few-shot picks, target pilot sets
VAL_SPLIT, FEW_SHOT, PILOT_SPLIT = 101, 102, 103
# The client id a pilot task runs under: no client's, so no client's data or state is in reach.
PILOT_CID = -1


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for one (purpose, round, client) task, independent across keys."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def generator(seed: int, *keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *keys))


def sampling_stream(n_clients: int, fraction: float, rounds: int, seed: int) -> list[list[int]]:
    """Participants of every round, drawn up front: ``max(int(fraction*N), 1)`` distinct clients,
    uniformly without replacement (FISC / FL-bench convention), sorted; all clients at 1.0."""
    k = max(int(fraction * n_clients), 1)
    if k >= n_clients:
        return [list(range(n_clients)) for _ in range(rounds)]
    rng = np.random.default_rng(derive_seed(seed, SAMPLING))
    return [sorted(rng.choice(n_clients, size=k, replace=False).tolist()) for _ in range(rounds)]
