"""Bad input at load time: each a clear error that names the problem."""

import json

import pytest

from cadenza import LLM
from cadenza.attention_backends.base import BackendUnavailableError
from cadenza.config import ConfigError
from cadenza.models.errors import ModelLoadError, UnsupportedModelError
from cadenza.plugins.errors import UnknownNameError


def copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(tmp_path)


def test_corrupt_safetensors(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir("llama3"), tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors.*corrupt"):
        LLM(model, dtype="float32")


def test_pickle_only_checkpoint_is_refused(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir("llama3"), tmp_path / "m")
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are never loaded"):
        LLM(model)


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir("llama3"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt_neox.*supported: llama"):
        LLM(model)


def test_unsupported_rope_type(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir("llama3"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "dynamic"  # NTK-aware dynamic scaling: not computed
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic'"):
        LLM(model)


def test_missing_tensor(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_model(tiny_model_dir("llama3"), tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensors for layers.1.mlp.gate_up_proj"):
        LLM(model, dtype="float32")


def test_yaml_typo_names_file_and_key(tiny_model_dir, tmp_path):
    config = tmp_path / "deploy.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir('llama3')}\ncache:\n  blok_size: 8\n")
    with pytest.raises(ConfigError, match=r"deploy.yaml: cache.blok_size: unknown key.*block_size"):
        LLM(config=config)


def test_unknown_backend_lists_known(tiny_model_dir):
    with pytest.raises(UnknownNameError, match="unknown attention backend 'flash'.*eager.*torch_sdpa"):
        LLM(tiny_model_dir("llama3"), attention_backend="flash")


def test_xformers_without_cuda_is_clear(tiny_model_dir):
    with pytest.raises(BackendUnavailableError, match="xformers.*CUDA"):
        LLM(tiny_model_dir("llama3"), attention_backend="xformers")


def test_unknown_eviction_policy(tiny_model_dir):
    with pytest.raises(UnknownNameError, match="eviction policy 'mru'.*fifo, lfu, lru"):
        LLM(tiny_model_dir("llama3"), eviction_policy="mru")
