"""Filter-wise optimal-transport alignment (FOT, hfedatm.md §3.4).

Each group's filters of a station are matched to the reference station's by a one-to-one
assignment on the cost D(a, b) = ‖w̃_ref[a] − w̃[b]‖² between ℓ2-normalised flattened filters
(float64; POT's ``ot.dist``). ``sinkhorn`` (the paper's): POT's log-domain entropic OT with
uniform marginals a = b = 1, ε = 0.05, exactly 25 iterations, rounded to a permutation by a linear
assignment that maximises the plan's mass (``linear_sum_assignment(−Π)``); ``exact``: the linear
assignment on D itself. The plan is never applied softly.

Modes: ``graph`` (default) solves the groups in the spec's order, building each group's cost as
the sum over its member convs whose inputs are already aligned (their input axes permuted by
the solved upstream groups first), and applies every permutation on both sides (next layers,
BatchNorm, flatten→Linear columns, Grams): the aligned model computes the same function.
``literal`` (the paper's text / official code; an ablation) permutes each conv's output rows
and bias alone, each on its own raw cost, and touches nothing else — not function-preserving.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from feddomain.merging.permutation import Arrays, PermutationSpec, apply_permutations

SOLVERS = ("sinkhorn", "exact")
MODES = ("graph", "literal")


@dataclass(frozen=True)
class Solver:
    """How a cost matrix becomes a permutation."""

    kind: str = "sinkhorn"
    reg: float = 0.05
    iterations: int = 25

    def __call__(self, cost: np.ndarray) -> np.ndarray:
        """perm with perm[a] = the column matched to row a."""
        from scipy.optimize import linear_sum_assignment  # late, as POT: HFedATM runs only

        if self.kind == "exact":
            return linear_sum_assignment(cost)[1]
        plan = sinkhorn_plan(cost, self.reg, self.iterations)
        return linear_sum_assignment(-plan)[1]


def sinkhorn_plan(cost: np.ndarray, reg: float, iterations: int) -> np.ndarray:
    """POT's log-domain Sinkhorn with marginals 1_k, for exactly ``iterations`` iterations
    (stopThr 0: no early stop; the non-convergence warning is expected and silenced)."""
    import ot  # late: POT imports scikit-learn, seconds of start-up every other method skips

    ones = np.ones(cost.shape[0])
    return ot.sinkhorn(
        ones,
        ones,
        cost,
        reg,
        method="sinkhorn_log",
        numItermax=iterations,
        stopThr=0.0,
        warn=False,
    )


def filter_cost(reference: Tensor, other: Tensor) -> np.ndarray:
    """Squared Euclidean distances between the ℓ2-normalised flattened filters (rows of axis 0)
    of two conv weights, float64; an all-zero filter stays zero."""
    import ot

    a = F.normalize(reference.reshape(reference.shape[0], -1).double(), dim=1)
    b = F.normalize(other.reshape(other.shape[0], -1).double(), dim=1)
    return ot.dist(a.numpy(), b.numpy(), metric="sqeuclidean")


@dataclass
class Alignment:
    """One station aligned to the reference: its arrays and Grams, the permutation of each
    group (graph) or conv (literal), and per group (matched cost, identity cost, identity
    fraction) for the diagnostics (hfedatm.md §8 M1)."""

    arrays: Arrays
    grams: dict[str, Tensor]
    perms: dict[str, Tensor] = field(default_factory=dict)
    costs: dict[str, tuple[float, float, float]] = field(default_factory=dict)


def align(
    spec: PermutationSpec,
    reference: Mapping[str, Tensor],
    arrays: Mapping[str, Tensor],
    grams: Mapping[str, Tensor],
    solver: Solver,
    mode: str = "graph",
) -> Alignment:
    """``arrays`` (and their dense ``grams``) aligned to ``reference``."""
    if mode == "literal":
        return _align_literal(spec, reference, arrays, grams, solver)
    perms: dict[str, Tensor] = {}
    costs: dict[str, tuple[float, float, float]] = {}
    for group in spec.groups:
        cost = _group_cost(spec, group.filters, reference, arrays, perms)
        perm = solver(cost)
        perms[group.name] = torch.as_tensor(perm, dtype=torch.long)
        costs[group.name] = _cost_summary(cost, perm)
    aligned, aligned_grams = apply_permutations(spec, arrays, grams, perms)
    return Alignment(aligned, aligned_grams, perms, costs)


def _group_cost(
    spec: PermutationSpec,
    filters: tuple[str, ...],
    reference: Mapping[str, Tensor],
    arrays: Mapping[str, Tensor],
    solved: Mapping[str, Tensor],
) -> np.ndarray:
    """Σ of the member convs' costs over members whose input groups are all solved (or that
    read the image), each member's input axis permuted by those solutions first."""
    total = None
    for name in filters:
        consumer = spec.consumer_of(name)
        weight = arrays[name]
        if consumer is not None:
            if not all(g in solved for g in consumer.layout):
                continue
            weight = weight.index_select(1, spec.input_index(consumer, solved))
        cost = filter_cost(reference[name], weight)
        total = cost if total is None else total + cost
    if total is None:
        raise ValueError(f"permutation spec {spec.arch}: no member of {filters} can be solved yet")
    return total


def _cost_summary(cost: np.ndarray, perm: np.ndarray) -> tuple[float, float, float]:
    """(Σ_a D(a, π(a)), Σ_a D(a, a), fraction of a with π(a) = a)."""
    rows = np.arange(len(perm))
    return float(cost[rows, perm].sum()), float(np.trace(cost)), float(np.mean(perm == rows))


def _align_literal(
    spec: PermutationSpec,
    reference: Mapping[str, Tensor],
    arrays: Mapping[str, Tensor],
    grams: Mapping[str, Tensor],
    solver: Solver,
) -> Alignment:
    out = dict(arrays)
    perms: dict[str, Tensor] = {}
    costs: dict[str, tuple[float, float, float]] = {}
    for group in spec.groups:
        for weight in group.filters:
            cost = filter_cost(reference[weight], arrays[weight])
            perm = solver(cost)
            index = torch.as_tensor(perm, dtype=torch.long)
            bias = weight.removesuffix("weight") + "bias"
            for name in (weight, bias) if bias in group.biases else (weight,):
                out[name] = out[name].index_select(0, index)
            perms[weight] = index
            costs[weight] = _cost_summary(cost, perm)
    return Alignment(out, dict(grams), perms, costs)
