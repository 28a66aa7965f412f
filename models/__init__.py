"""Model architectures, checkpoint loaders and tokenizers."""

from cadenza.models.errors import ModelLoadError, UnsupportedModelError

__all__ = ["ModelLoadError", "UnsupportedModelError", "load_model"]


def __getattr__(name: str):
    if name == "load_model":
        from cadenza.models.loading import load_model

        return load_model
    raise AttributeError(name)
