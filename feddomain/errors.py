"""Exceptions whose messages are meant for the user: they name the file, key or value at fault."""


class FeddomainError(Exception):
    """Base class: the CLI prints these as one clear message, without a traceback."""


class DataError(FeddomainError):
    """A data root, domain folder, image or cache file is missing, malformed or inconsistent."""


class ConfigError(FeddomainError):
    """A configuration key or value is invalid."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) during a command; the message says what was kept and how to go on.
    The CLI prints it without a traceback and exits with status 130."""
