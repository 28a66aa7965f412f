import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import ARCHITECTURES, build_tiny_model  # noqa: E402

from cadenza.config.logging_setup import configure_logging  # noqa: E402

# Engine logs at warning and above only, to the interpreter's own stderr: a stream pytest
# captures for one test is closed after it, and a logger left pointing there breaks later tests.
configure_logging("warning", "console", stream=sys.__stderr__)


@pytest.fixture(autouse=True)
def _restore_logging():
    """Code under test (the CLI, the bench) may configure logging for itself; undo it after."""
    yield
    configure_logging("warning", "console", stream=sys.__stderr__)


@pytest.fixture
def anyio_backend():
    """The async tests (`pytest.mark.anyio`) run on asyncio, as the server does."""
    return "asyncio"


@pytest.fixture(scope="session")
def kernels():
    """cadenza's compiled CPU kernels, built as `model.cpu_kernels: auto` builds them; the test is
    skipped where they do not build (no AVX2, no compiler)."""
    from cadenza.kernels.cpu import loader as cpu

    built = cpu.configure("auto")
    if built is None:
        pytest.skip(f"cadenza's CPU kernels are unavailable here: {cpu.build_error()}")
    return built


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    """The tiny Llama-3 checkpoint most engine tests run on."""
    return tiny_model_dir("llama3")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """build(arch) -> directory of a tiny random HF checkpoint, built once per session."""
    built: dict[tuple[str, str | None], Path] = {}

    def build(arch: str, max_shard_size: str | None = None) -> Path:
        key = (arch, max_shard_size)
        if key not in built:
            name = arch if max_shard_size is None else f"{arch}-sharded"
            built[key] = build_tiny_model(tmp_path_factory.mktemp(name), arch, max_shard_size=max_shard_size)
        return built[key]

    return build


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param
