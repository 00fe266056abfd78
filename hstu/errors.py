"""The project's one user-facing error type."""


class HSTUError(ValueError):
    """Bad input or configuration; the message names the offending field and values."""
