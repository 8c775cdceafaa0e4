"""Errors meant for people: the CLI prints `error: <message>` and exits 1, without a traceback."""


class PolystrataError(Exception):
    """Base of every error whose message is shown to the user as is."""


class GGUFError(PolystrataError):
    """A GGUF file is malformed, truncated, or uses something this build does not know."""


class UnsupportedError(PolystrataError):
    """A model, architecture, format or option that PolyStrata does not support."""


class ZooError(PolystrataError):
    """A model could not be fetched or verified."""
