"""Errors raised while locating, reading and building models."""


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the path and the problem."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but uses an architecture, feature or quantization we do not run."""
