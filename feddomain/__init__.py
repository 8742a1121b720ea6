"""feddomain: federated domain generalization — faithful methods, fast CPU simulation, Flower."""

__version__ = "0.1.0"
