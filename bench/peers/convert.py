"""llama.cpp's own `convert_hf_to_gguf.py`, run on a Hugging Face directory: the GGUF a user of
llama.cpp would make of that checkpoint, from the source the bench builds llama.cpp from.

The script names each tokenizer's pre-tokenizer by a hash of how it splits a probe text, and
refuses one it does not know. A checkpoint with its own small tokenizer (the tests' tiny models)
can name the pre-tokenizer to record instead (`pre_tokenizer`): only llama.cpp's own tokenizer
reads it, and both engines are then given token ids.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cadenza.bench.peers.llamacpp_build import source_dir

# Runs the script as its `__main__`, with `get_vocab_base_pre` falling back to the named
# pre-tokenizer where the script would refuse the tokenizer.
_BOOTSTRAP = """
import runpy, sys
source, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if not pre:
            raise
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [source + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ConversionError(RuntimeError):
    """`convert_hf_to_gguf.py` refused the checkpoint; the message is the end of its output."""


def convert_hf_to_gguf(hf_dir: Path, out: Path, outtype: str = "f32", pre_tokenizer: str | None = None,
                       timeout: float = 600) -> Path:
    """Write `hf_dir` as the GGUF `out` (`outtype`: f32, f16, bf16, q8_0...) with llama.cpp's
    converter; returns `out`. Raises `ConversionError` with the script's last lines on failure."""
    source = source_dir()
    command = [sys.executable, "-c", _BOOTSTRAP, str(source), pre_tokenizer or "", str(hf_dir),
               "--outfile", str(out), "--outtype", outtype]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise ConversionError(f"convert_hf_to_gguf.py failed on {hf_dir} ({done.returncode}):\n{tail}")
    return out
