"""The one-pass GGUF reader gives what gguf-py's `GGUFReader` gives: every field's value and every
tensor's type, shape and bytes, on the default model and on a file with every value kind."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from cadenza.models.default_model import default_model_path
from cadenza.models.errors import ModelLoadError
from cadenza.models.gguf_file import GGUFFile, GGUFFormatError
from cadenza.models.gguf_loader import open_gguf
from cadenza.models.gguf_tokenizer import read_field


def assert_same(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert set(ours.fields) == set(theirs.fields)
    for key in theirs.fields:
        if key == "k.nested":  # gguf-py's fields flatten it; read_field refuses it (below)
            continue
        want, got = read_field(theirs, key), read_field(ours, key)
        assert type(got) is type(want) and got == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_the_default_model_reads_as_gguf_py_reads_it():
    ours = assert_same(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def test_every_value_kind_and_tensor_type(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("k.u8", 200)
    writer.add_int8("k.i8", -5)
    writer.add_uint16("k.u16", 60000)
    writer.add_int16("k.i16", -300)
    writer.add_uint32("k.u32", 4_000_000_000)
    writer.add_int32("k.i32", -7)
    writer.add_float32("k.f32", 0.25)
    writer.add_uint64("k.u64", 2**40)
    writer.add_int64("k.i64", -(2**40))
    writer.add_float64("k.f64", 1e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "héllo 🙂")
    writer.add_array("k.ints", [1, 2, 3])
    writer.add_array("k.floats", [0.5, -1.5])
    writer.add_array("k.strs", ["a", "", "ü"])
    writer.add_array("k.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.BF16):
        values = rng.standard_normal((4, 256)).astype(np.float32)
        writer.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_same(path)
    assert ours.fields["k.str"] == "héllo 🙂"
    assert ours.fields["k.nested"] == [[1, 2], [3]]
    with pytest.raises(ValueError, match="nested array"):
        read_field(ours, "k.nested")


def test_a_file_that_is_not_gguf_is_a_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFFile(bad)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        open_gguf(bad)


def test_a_truncated_file_names_where_it_broke(tmp_path):
    data = default_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:5000])
    with pytest.raises(GGUFFormatError, match="malformed GGUF near byte"):
        GGUFFile(cut)
    cut.write_bytes(data[: len(data) // 2])  # the directory is whole, the tensors are not
    with pytest.raises(GGUFFormatError, match="runs past the end"):
        GGUFFile(cut)
