"""Exceptions whose messages are meant for the user: they name the file, key or value at fault."""


class FeddomainError(Exception):
    """Base class: the CLI prints these as one clear message, without a traceback."""


class DataError(FeddomainError):
    """A data root, domain folder, image or cache file is missing, malformed or inconsistent."""


class ConfigError(FeddomainError):
    """A configuration key or value is invalid."""


DIVERGED_RECORD = "diverged.json"  # in a run directory: its model diverged before evaluating


class DivergedError(FeddomainError):
    """Training produced a model whose outputs are not finite: an outcome of the run's settings
    (a step too large), not a fault of the data or the code."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) during a command; the message says what was kept and how to go on.
    The CLI prints it without a traceback and exits with status 130."""
