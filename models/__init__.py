"""Model architectures, checkpoint loaders and tokenizers.

May import: attention_backends/ (the contract a model calls), plugins/, kernels/, threads/,
config/ and the root's plain data. Besides architectures and loaders: tokenizers and `prompts.py`
(what a caller sends, as prompt token ids).
"""

from cadenza.models.errors import ModelLoadError, UnsupportedModelError

__all__ = ["ModelLoadError", "UnsupportedModelError", "load_model"]


def __getattr__(name: str):
    if name == "load_model":
        from cadenza.models.loading import load_model

        return load_model
    raise AttributeError(name)
