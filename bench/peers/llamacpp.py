"""The GGUF files llama.cpp runs as a peer: the model's own file, and re-writes of it at other precisions.

llama.cpp runs a GGUF at the file's own precision (Q4_1 for the embedded model): that is the
comparison its users make. `peer_files` names the files for the precisions asked for: `file` is the
file as shipped; `Q8_0` and `BF16` are the same weights, de-quantized and re-written as every matrix
in that type (the gguf package's writer, norms kept in F32 as llama.cpp's converter does), cached
outside the repository. The binaries that run them: `llamacpp_binaries` (latency) and
`llamacpp_server` (throughput), built by `llamacpp_build`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# general.file_type (llama.cpp's LlamaFileType) of a file whose matrices are all of one type.
_FILE_TYPES = {"BF16": 32, "Q8_0": 7}


PEER_PRECISIONS = ("file", "Q8_0", "BF16")


def why_llamacpp_cannot_run(source: Path) -> str | None:
    """Why llama.cpp cannot be a peer for the model at `source` here (a skip reason), or None."""
    from cadenza.bench.peers.llamacpp_build import why_binaries_missing

    if source.suffix != ".gguf":
        return "needs a .gguf model"
    return why_binaries_missing()


def file_precision(source: Path) -> str:
    """The type most of the file's matrix bytes are stored in (e.g. "Q4_1"; a gpt-oss MXFP4_MOE
    file is "MXFP4", though most of its matrices by count are Q8_0 attention)."""
    import collections

    import gguf

    kinds: collections.Counter[str] = collections.Counter()
    for tensor in gguf.GGUFReader(str(source)).tensors:
        if len(tensor.shape) > 1:
            kinds[tensor.tensor_type.name] += int(tensor.n_bytes)
    return kinds.most_common(1)[0][0]


def peer_files(source: Path, precisions: list[str], cache_dir: Path) -> list[tuple[str, Path]]:
    """(precision, file) for each of `precisions` ("file" is `source` itself), de-duplicated."""
    files: dict[str, Path] = {}
    for precision in precisions:
        if precision == "file":
            files.setdefault(file_precision(source), source)
        elif precision not in files:
            files[precision] = gguf_as(source, precision, cache_dir)
    return list(files.items())


def write_gguf_as(source: Path, target: Path, kind: str) -> Path:
    """Copy `source` to `target` with every matrix re-written as `kind` (BF16 or Q8_0) from its
    de-quantized values; norms and biases stay F32, as llama.cpp's converter keeps them."""
    import gguf

    if kind not in _FILE_TYPES:
        raise ValueError(f"can write a GGUF as {', '.join(_FILE_TYPES)}, not {kind!r}")
    quant_type = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for name, f in reader.fields.items():
        if name == "general.architecture" or name.startswith("GGUF."):
            continue
        value_type = f.types[0]
        sub_type = f.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = _FILE_TYPES[kind] if name == "general.file_type" else f.contents()
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values)
        else:
            packed = gguf.quants.quantize(values, quant_type)
            writer.add_tensor(tensor.name, packed, raw_shape=packed.shape, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def gguf_as(source: Path, kind: str, cache_dir: Path) -> Path:
    """`source` with every matrix as `kind`, written once into `cache_dir`; used as it is when it
    already is all `kind`."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if kinds == {gguf.GGMLQuantizationType[kind]}:
        return source
    target = cache_dir / f"{source.stem}.{kind.lower()}.gguf"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        write_gguf_as(source, partial, kind)
        partial.rename(target)
    return target
