"""Install the example plugin packages (examples/plugins/*) into the running venv, once.

Each is pip-installed editable, exactly as a plugin author would (`pip install -e`), so its entry
point in the `cadenza` group is real package metadata. Idempotent and safe to race: a file lock
serializes sessions, and a package already installed editable from this checkout is left alone
(editable, so it always runs the current source). A fresh install's import hook is a `.pth` file,
which Python only reads at start-up: it is activated here for the running interpreter.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "plugins"
PACKAGES = {  # distribution -> module
    "cadenza-banned-words": "cadenza_banned_words",
    "cadenza-pinned-prefix": "cadenza_pinned_prefix",
    "cadenza-summarize-context": "cadenza_summarize_context",
    "cadenza-folder-retrieval": "cadenza_folder_retrieval",
}


@contextmanager
def _lock():
    with open(Path(sys.prefix) / ".cadenza-example-plugins.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _installed_from(dist_name: str, source: Path) -> bool:
    try:
        direct_url = importlib.metadata.distribution(dist_name).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    info = json.loads(direct_url or "{}")
    return info.get("url") == source.as_uri() and info.get("dir_info", {}).get("editable", False)


def _activate(dist_name: str, module: str) -> None:
    """Do for the running interpreter what `site` does at start-up with the package's .pth."""
    if importlib.util.find_spec(module) is not None:
        return
    dist = importlib.metadata.distribution(dist_name)
    for file in dist.files or ():
        if file.suffix != ".pth":
            continue
        for line in Path(dist.locate_file(file)).read_text().splitlines():
            if line.startswith(("import ", "import\t")):
                exec(line, {})  # noqa: S102 - the line pip itself just wrote
            elif line.strip() and not line.startswith("#") and line.strip() not in sys.path:
                sys.path.append(line.strip())
    importlib.invalidate_caches()


def install_example_plugins() -> dict[str, str]:
    """Install every example package (once per venv); returns distribution -> module."""
    with _lock():
        for dist_name, module in PACKAGES.items():
            source = EXAMPLES / dist_name
            if not _installed_from(dist_name, source):
                # Offline with the venv's own setuptools; a venv without one (Python 3.12+ venvs
                # have none) lets pip fetch it into an isolated build environment instead.
                isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
                result = subprocess.run(
                    [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation, "-e", str(source)],
                    capture_output=True,
                    text=True,
                )
                if result.returncode:
                    raise RuntimeError(f"pip install -e {source} failed:\n{result.stdout}\n{result.stderr}")
                importlib.invalidate_caches()
            _activate(dist_name, module)
            importlib.import_module(module)
    return dict(PACKAGES)
