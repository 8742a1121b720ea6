"""Central: one model trained on the pooled source training data (the usual upper reference).

It is FedAvg run by the engine over a single client holding every client's training data (and,
for id accuracy, the union of their validation splits): one round is one pass of E epochs.
"""

from feddomain.algorithms.base import MethodSpec
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import register

register(
    MethodSpec(
        "central",
        FedAvgServer,
        FedAvgClient,
        FedAvgHparams,
        pooled=True,
        description="Central: one model trained on the pooled source data (upper reference)",
    )
)
