"""Exceptions whose messages are meant for the user: they name the file, key or value at fault."""


class FeddomainError(Exception):
    """Base class: the CLI prints these as one clear message, without a traceback."""


class DataError(FeddomainError):
    """A data root, domain folder, image or cache file is missing, malformed or inconsistent."""


class ConfigError(FeddomainError):
    """A configuration key or value is invalid."""
