"""llama.cpp as a peer, through `llama-cpp-python` when it is installed (imported lazily, never required).

The embedded model is Q4_1; llama.cpp would run it quantized, so `write_bf16_gguf` writes the same
de-quantized weights as a BF16 GGUF (the gguf package's writer), norms kept in F32 as llama.cpp
does. `LlamaCppEngine` runs one sequence through llama-cpp-python's `Llama` (the latency probes);
`llamacpp_batched.LlamaCppBatchedEngine` runs many at once (the throughput workload).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


_BF16_FILE_TYPE = 32  # LlamaFileType.MOSTLY_BF16


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def why_llamacpp_cannot_run(source: Path) -> str | None:
    """Why llama.cpp cannot be a peer for the model at `source` here (a skip reason), or None."""
    if not llama_cpp_available():
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    if source.suffix != ".gguf":
        return "needs a .gguf model"
    return None


def write_bf16_gguf(source: Path, target: Path) -> Path:
    """Copy `source` (any supported quantization) to `target` with every matrix in BF16."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for name, f in reader.fields.items():
        if name == "general.architecture" or name.startswith("GGUF."):
            continue
        value_type = f.types[0]
        sub_type = f.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = _BF16_FILE_TYPE if name == "general.file_type" else f.contents()
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if values.ndim == 1:  # norms and biases stay F32, as llama.cpp's converter keeps them
            writer.add_tensor(tensor.name, values)
        else:
            bf16 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
            writer.add_tensor(tensor.name, bf16, raw_shape=bf16.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def bf16_gguf_for(source: Path, cache_dir: Path) -> Path:
    """A BF16 copy of a quantized GGUF, written once into `cache_dir`; a BF16 file is used as it is."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if kinds == {gguf.GGMLQuantizationType.BF16}:
        return source
    target = cache_dir / f"{source.stem}.bf16.gguf"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        write_bf16_gguf(source, partial)
        partial.rename(target)
    return target


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, gguf_path: Path, *, num_threads: int | None, max_len: int, seed: int = 0) -> None:
        from llama_cpp import Llama

        import os

        threads = num_threads or os.cpu_count() or 1
        self.path = gguf_path
        self.llm = Llama(
            model_path=str(gguf_path), n_ctx=max_len, n_batch=512, n_threads=threads,
            n_threads_batch=threads, seed=seed, verbose=False,
        )

    def time_prefill(self, prompt: list[int]) -> float:
        """Seconds to evaluate `prompt` from an empty context (no sampling)."""
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - started

    def time_decode(self, prompt: list[int], num_tokens: int, temperature: float) -> float:
        """Seconds per token after the first, batch 1."""
        self.llm.reset()
        self.llm.eval(prompt)
        produced, started = 0, None
        for _ in self.llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=False):
            produced += 1
            if produced == 1:
                started = time.perf_counter()
            if produced == num_tokens + 1:
                break
        return (time.perf_counter() - started) / num_tokens
