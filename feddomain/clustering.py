"""FINCH (Sarfraz et al., CVPR 2019), from the authors' PyPI package ``finch-clust``, with the edge
cases FISC, CCST and FPL share.

FINCH links every row to its first (cosine) neighbour, takes connected components as clusters
and repeats on the cluster means; it returns one partition per level, finest first. The package
checks its own toy cases (tests/test_styles.py: three separated blobs, finest to coarsest, no
one-cluster last level, n <= 2). Rows are always compared exactly (no approximate nearest
neighbours: pynndescent is neither needed nor installed for the few hundred rows used here).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from threadpoolctl import threadpool_limits


def finch_partitions(rows: torch.Tensor | np.ndarray, *, early_exit: bool = True) -> np.ndarray:
    """FINCH partitions of ``rows`` [n, d] as labels [n, P], finest first, coarsest last.

    n <= 2 is one cluster (FINCH needs three points to separate any; fisc.md §3.8). ``early_exit``
    is the package's ``ensure_early_exit`` (FPL's code turns it off)."""
    data = np.ascontiguousarray(torch.as_tensor(rows).detach().cpu().double().numpy())
    n = data.shape[0]
    if n == 0:
        raise ValueError("FINCH needs at least one row; got none")
    if n <= 2:
        return np.zeros((n, 1), dtype=np.int64)
    # BLAS with the run's thread count (torch's): OpenBLAS's default of one thread per core
    # made each small distance matrix 100x slower on a loaded 2-core machine (docs/performance.md)
    with warnings.catch_warnings(), threadpool_limits(limits=torch.get_num_threads()):
        warnings.simplefilter("ignore")  # at import: pynndescent (not needed here) is missing
        from finch import FINCH  # late: scikit-learn's import costs seconds at every start

        partitions, _, _ = FINCH(
            data.astype(np.float32),
            distance="cosine",
            ensure_early_exit=early_exit,
            ann_threshold=n + 1,  # exact first neighbours, whatever n
            verbose=False,
        )
    return np.asarray(partitions, dtype=np.int64).reshape(n, -1)


def cluster_means(rows: torch.Tensor, labels: np.ndarray) -> torch.Tensor:
    """The mean row of each cluster [P, d], clusters in order of their label."""
    index = torch.as_tensor(labels, device=rows.device)
    _, inverse = torch.unique(index, return_inverse=True)
    groups = int(inverse.max()) + 1
    sums = torch.zeros(groups, rows.shape[1], dtype=rows.dtype, device=rows.device)
    sums.index_add_(0, inverse, rows)
    counts = torch.bincount(inverse, minlength=groups).to(rows.dtype)
    return sums / counts[:, None]
