"""`model.load_format: dummy`: random weights of a real shape, the same ones transformers can be given."""

from __future__ import annotations

import json

import pytest
import torch

from cadenza.models.dummy import dummy_tokenizer, fill_module, num_parameters, read_dummy_arch, shipped_shapes
from cadenza.models.errors import ModelLoadError
from cadenza.models.loading import load_model
from tests.model_forward import prefill_logits
from tests.tiny_models import _COMMON, ARCHITECTURES

# Parameter counts the model cards give (tied embeddings counted once).
SHIPPED = {"smollm2-135m": 134.5e6, "qwen3-0.6b": 596e6, "llama-3.2-1b": 1.236e9, "llama-3.2-3b": 3.213e9, "llama-3.1-8b": 8.03e9,
           "qwen3-30b-a3b": 30.5e9, "gpt-oss-20b": 20.9e9, "gemma-3-1b": 1.0e9, "granite-3.3-2b": 2.53e9,
           "smollm3-3b": 3.08e9, "phi-4-mini": 3.84e9}


def write_config(directory, arch: str):
    import transformers

    config_cls_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_cls_name)(**{**_COMMON, **extra})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return config


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "smollm_tied", "llama2_bias"])
def test_dummy_weights_are_what_transformers_computes_with_the_same_seed(tmp_path, arch):
    import transformers

    config = write_config(tmp_path / arch, arch)
    loaded = load_model(tmp_path / arch, dtype=torch.float32, load_format="dummy", seed=7)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fill_module(reference, loaded.arch, seed=7)
    tokens = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].float()
    got = prefill_logits(loaded, tokens)
    assert got.abs().max() > 0  # random weights, not zeros
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    other = load_model(tmp_path / arch, dtype=torch.float32, load_format="dummy", seed=8)
    assert not torch.equal(prefill_logits(other, tokens), got)  # the seed is the weights


@pytest.mark.parametrize("shape", sorted(SHIPPED))
def test_shipped_shapes_have_their_model_cards_parameter_counts(shape):
    assert shape in shipped_shapes()
    arch, source = read_dummy_arch(shape)
    assert source.endswith(f"{shape}.json")
    assert num_parameters(arch) == pytest.approx(SHIPPED[shape], rel=0.01)


def test_a_shipped_shape_loads_by_name_with_a_stand_in_tokenizer():
    arch, _ = read_dummy_arch("smollm2-135m")
    tokenizer = dummy_tokenizer(arch)
    ids = tokenizer.encode("hi there")
    assert ids == list(b"hi there")  # one id a byte
    assert tokenizer.decode(ids) == "hi there"
    assert tokenizer.eos_token_ids == (arch.eos_token_ids[0],)


@pytest.mark.parametrize("path", [None, "no-such-shape", "some/dir/that/is/not/there"])
def test_a_dummy_path_that_names_nothing_is_a_clear_error(path):
    with pytest.raises(ModelLoadError, match="shipped shape"):
        load_model(path, load_format="dummy")


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="load_format"):
        load_model(None, load_format="pt")
