"""The deployment config: models, layering, error messages, dump and reference."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from cadenza.config import (
    CacheConfig,
    CadenzaConfig,
    ConfigError,
    SchedulerConfig,
    config_reference,
    dump_config,
    load_config,
    parse_memory_size,
    preset_names,
)
from cadenza.config.schema import section_model

NO_ENV: dict[str, str] = {}


def make_yaml(tmp_path: Path, text: str, name: str = "my.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_error(*args, **kwargs) -> str:
    kwargs.setdefault("env", NO_ENV)
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


# Defaults and presets


def test_defaults_are_valid():
    config = CadenzaConfig()
    assert config.model.path is None and config.model.dtype == "auto"
    assert config.cache.block_size == 16 and config.cache.memory_budget_bytes is None
    assert config.sampling.logits_processors[-1] == "top_k_top_p"
    assert config.plugins == []
    assert load_config(env=NO_ENV) == config


def test_default_preset_by_name_and_by_path():
    by_name = load_config("default", env=NO_ENV)
    assert by_name.model.dtype == "bfloat16" and by_name.model.device == "cpu"
    assert by_name.cache.memory_budget_bytes == 2**30
    assert by_name.attention_backend == "torch_sdpa"
    preset_file = Path(__file__).parents[1] / "config" / "presets" / "default.yaml"
    assert load_config(preset_file, env=NO_ENV) == by_name
    assert load_config(str(preset_file), env=NO_ENV) == by_name


def test_every_preset_loads():
    assert "default" in preset_names()
    for name in preset_names():
        load_config(name, env=NO_ENV)


def test_config_env_names_the_file(tmp_path):
    path = make_yaml(tmp_path, "server: {port: 1234}")
    assert load_config(env={"CADENZA_CONFIG": str(path)}).server.port == 1234
    # An explicit path wins over CADENZA_CONFIG.
    assert load_config("default", env={"CADENZA_CONFIG": str(path)}).server.port == 8000


# Precedence: defaults < file < env < overrides


def test_each_layer_beats_the_one_below(tmp_path):
    path = make_yaml(tmp_path, "server: {port: 1111, host: 0.0.0.0}\nmodel: {seed: 3}")
    assert load_config(path, env=NO_ENV).server.port == 1111
    env = {"CADENZA_SERVER__PORT": "2222"}
    config = load_config(path, env=env)
    assert (config.server.port, config.server.host, config.model.seed) == (2222, "0.0.0.0", 3)
    config = load_config(path, {"server.port": 3333}, env=env)
    assert (config.server.port, config.server.host) == (3333, "0.0.0.0")


def test_dotted_overrides():
    config = load_config(
        None,
        {"model.dtype": "float32", "server.port": 9000, "attention_backend": "eager",
         "sampling.defaults.temperature": 0.0, "cache": {"num_blocks": 8}},
        env=NO_ENV,
    )  # fmt: skip
    assert config.model.dtype == "float32" and config.server.port == 9000
    assert config.attention_backend == "eager" and config.sampling.defaults.temperature == 0.0
    assert config.cache.num_blocks == 8 and config.cache.block_size == 16


def test_none_override_is_not_given(tmp_path):
    path = make_yaml(tmp_path, "server: {port: 1111}")
    config = load_config(path, {"server.port": None, "model.dtype": None}, env=NO_ENV)
    assert config.server.port == 1111 and config.model.dtype == "auto"


def test_higher_layer_size_replaces_the_other_size():
    # The preset sets memory_budget; num_blocks from a flag must win, not clash.
    config = load_config("default", {"cache.num_blocks": 100}, env=NO_ENV)
    assert config.cache.num_blocks == 100 and config.cache.memory_budget is None


# Environment variables


def test_env_values_are_yaml():
    env = {
        "CADENZA_SERVER__PORT": "9000",
        "CADENZA_CACHE__ENABLE_PREFIX_CACHING": "false",
        "CADENZA_PLUGINS_ARE_NOT_THIS": "x",  # not reserved: an unknown key
    }
    assert "plugins_are_not_this" in load_error(env=env)
    del env["CADENZA_PLUGINS_ARE_NOT_THIS"]
    env["CADENZA_PLUGINS"] = "ignored"
    env["CADENZA_SAMPLING__LOGITS_PROCESSORS"] = "[temperature, top_k_top_p]"
    env["CADENZA_ATTENTION_BACKEND"] = "eager"
    env["CADENZA_MODEL__DTYPE"] = "float32"
    config = load_config(env=env)
    assert config.server.port == 9000 and config.cache.enable_prefix_caching is False
    assert config.sampling.logits_processors == ["temperature", "top_k_top_p"]
    assert config.attention_backend == "eager" and config.model.dtype == "float32"
    assert config.plugins == []


def test_env_text_fields_keep_the_raw_string():
    config = load_config(env={"CADENZA_SERVER__API_KEY": "0123", "CADENZA_MODEL__PATH": "null"})
    assert config.server.api_key == "0123" and config.model.path is None


def test_reserved_env_vars_are_not_config():
    env = {"CADENZA_PLUGINS": "a,b", "CADENZA_CONFIG": "", "HOME": "/root"}
    assert load_config(env=env) == CadenzaConfig()


def test_unknown_env_var_names_the_variable():
    message = load_error(env={"CADENZA_SERVER__PROT": "1"})
    assert message == (
        "environment variable CADENZA_SERVER__PROT: server.prot: unknown key (did you mean 'port'?)"
    )
    message = load_error(env={"CADENZA_SERVER_PORT": "1"})
    assert "CADENZA_SERVER_PORT" in message and "did you mean CADENZA_SERVER__PORT?" in message


def test_bad_env_value_names_the_variable():
    message = load_error(env={"CADENZA_MODEL__DTYPE": "fp8"})
    assert message.startswith(
        "environment variable CADENZA_MODEL__DTYPE: model.dtype: Input should be 'auto'"
    )
    assert "(got 'fp8')" in message


# Errors from files


def test_unknown_yaml_key_names_file_key_and_suggestion(tmp_path):
    path = make_yaml(tmp_path, "model:\n  dtyp: float32\n")
    assert load_error(path) == f"{path}: model.dtyp: unknown key (did you mean 'dtype'?)"
    path = make_yaml(tmp_path, "servr: {}\nzzz: 1\n")
    assert load_error(path).splitlines() == [
        f"{path}: servr: unknown key (did you mean 'server'?)",
        f"{path}: zzz: unknown key (expected one of: model, cache, scheduler, attention_backend, "
        "sampling, server, sessions, parallel, speculative, logging, embeddings, models, plugins, plugin_options)",
    ]


def test_typo_in_a_nested_key(tmp_path):
    path = make_yaml(tmp_path, "sampling:\n  defaults:\n    temprature: 0.5\n")
    message = load_error(path)
    assert message == (
        f"{path}: sampling.defaults.temprature: unknown key (did you mean 'temperature'?)"
    )


def test_bad_value_names_file_and_key(tmp_path):
    path = make_yaml(tmp_path, "scheduler:\n  max_num_seqs: -1\n")
    assert load_error(path) == (
        f"{path}: scheduler.max_num_seqs: Input should be greater than 0 (got -1)"
    )


def test_all_errors_listed_each_from_its_source(tmp_path):
    path = make_yaml(tmp_path, "scheduler: {max_num_seqs: 0}\nmodel: {dtype: fp32}\n")
    message = load_error(path, {"server.port": 70000}, env={"CADENZA_CACHE__BLOCK_SIZE": "3"})
    lines = message.splitlines()
    assert len(lines) == 4
    assert f"{path}: model.dtype: " in message and f"{path}: scheduler.max_num_seqs: " in message
    assert "environment variable CADENZA_CACHE__BLOCK_SIZE: cache.block_size: " in message
    assert "power of two" in message
    assert "override server.port: server.port: Input should be less than or equal to 65535" in (
        message
    )


def test_error_goes_to_the_highest_layer_that_set_the_key(tmp_path):
    path = make_yaml(tmp_path, "server: {port: -5}")
    message = load_error(path, env={"CADENZA_SERVER__PORT": "-6"})
    assert message.startswith("environment variable CADENZA_SERVER__PORT: server.port:")
    # A section-level error goes to whichever layer touched the section last.
    message = load_error(path, {"scheduler.max_num_batched_tokens": 100, "scheduler.chunk_size": 512, "server.port": 1})
    assert message.startswith("override scheduler.max_num_batched_tokens: scheduler: chunk_size")


def test_unknown_override_key():
    assert load_error(None, {"model.dtyp": "x"}) == (
        "override model.dtyp: model.dtyp: unknown key (did you mean 'dtype'?)"
    )
    assert "has no sub-keys" in load_error(None, {"server.port.number": 1})


def test_yaml_syntax_error_gives_line_and_column(tmp_path):
    path = make_yaml(tmp_path, "model:\n  dtype: [float32\nserver: {}\n")
    message = load_error(path)
    assert message.startswith(f"{path}: YAML syntax error at line ")
    assert "column" in message


def test_top_level_must_be_a_mapping(tmp_path):
    path = make_yaml(tmp_path, "- model\n- cache\n")
    assert "top level must be a mapping" in load_error(path)
    assert load_config(make_yaml(tmp_path, "# only comments\n", "empty.yaml"), env=NO_ENV) == (
        CadenzaConfig()
    )


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert load_error(missing) == f"config file not found: {missing}"
    assert "nor a preset: default" in load_error("no-such-preset")
    message = load_error(env={"CADENZA_CONFIG": str(missing)})
    assert message.startswith("environment variable CADENZA_CONFIG: config file not found")


def test_empty_section_reads_as_defaults(tmp_path):
    path = make_yaml(tmp_path, "model:\n  # dtype: float32\nserver:\n")
    assert load_config(path, env=NO_ENV) == CadenzaConfig()


# Model-level rules


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 536870912), ("1.5GB", 1500000000), ("2GiB", 2 * 2**30), ("1024", 1024),
     ("64 kib", 65536), (4096, 4096)],
)  # fmt: skip
def test_memory_budget_parsing(text, size):
    assert parse_memory_size(text) == size
    assert CacheConfig(memory_budget=text).memory_budget_bytes == size


@pytest.mark.parametrize("bad", ["bogus", "12 parsecs", "0GiB", -1, True, [1]])
def test_bad_memory_budget_is_rejected(bad):
    with pytest.raises(ValidationError, match="memory_budget"):
        CacheConfig(memory_budget=bad)


def test_bad_memory_budget_names_the_field(tmp_path):
    path = make_yaml(tmp_path, "cache: {memory_budget: bogus}")
    assert load_error(path).startswith(f"{path}: cache.memory_budget: not a memory size")


def test_num_blocks_and_memory_budget_are_exclusive(tmp_path):
    with pytest.raises(ValidationError, match="not both"):
        CacheConfig(num_blocks=10, memory_budget="1GiB")
    path = make_yaml(tmp_path, "cache: {num_blocks: 10, memory_budget: 1GiB}")
    assert load_error(path).startswith(f"{path}: cache: set num_blocks (10) or memory_budget")


def test_chunk_size_fits_a_batch():
    with pytest.raises(ValidationError, match="chunk_size"):
        SchedulerConfig(chunk_size=4096, max_num_batched_tokens=2048)
    SchedulerConfig(chunk_size=2048, max_num_batched_tokens=2048)


@pytest.mark.parametrize(
    ("key", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.1),
     ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3)],
)  # fmt: skip
def test_sampling_defaults_ranges(key, value):
    message = load_error(None, {f"sampling.defaults.{key}": value})
    assert message.startswith(f"override sampling.defaults.{key}: sampling.defaults.{key}: ")


def test_small_rules():
    assert load_config(None, {"server.port": 0}, env=NO_ENV).server.port == 0
    assert load_config(None, {"logging.level": "WARNING"}, env=NO_ENV).logging.level == "warning"
    for key, value in [("cache.block_size", 512), ("model.max_model_len", 0), ("server.port", -1)]:
        load_error(None, {key: value})


# Dump and reference


def test_dump_round_trips(tmp_path):
    config = load_config("default", {"server.port": 9001, "plugins": ["my_plugin"]}, env=NO_ENV)
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(config))
    assert load_config(path, env=NO_ENV) == config


def all_key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name in model.model_fields:
        sub = section_model(model, name)
        paths += all_key_paths(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]
    return paths


def test_reference_mentions_every_key():
    reference = config_reference()
    paths = all_key_paths(CadenzaConfig)
    assert len(paths) > 30
    missing = [path for path in paths if f"`{path}`" not in reference]
    assert not missing


def test_every_field_has_a_description():
    def walk(model: type[BaseModel]) -> list[str]:
        bare = [f"{model.__name__}.{n}" for n, f in model.model_fields.items() if not f.description]
        for name in model.model_fields:
            sub = section_model(model, name)
            bare += walk(sub) if sub else []
        return bare

    assert walk(CadenzaConfig) == []


def test_the_settings_vllm_users_reach_for_first_are_flags(capsys):
    import yaml

    from cadenza import cli

    argv = ["config", "show", "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
            "--kv-cache-memory", "256MiB", "--kv-cache-dtype", "float16", "--load-format", "dummy",
            "--device", "cpu", "--cuda-graphs", "off"]
    assert cli.main(argv) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["max_model_len"] == 1024 and shown["model"]["load_format"] == "dummy"
    assert shown["scheduler"]["max_num_seqs"] == 8 and shown["scheduler"]["max_num_batched_tokens"] == 512
    assert shown["cache"]["memory_budget"] == "256MiB" and shown["cache"]["dtype"] == "float16"
    assert shown["model"]["device"] == "cpu" and shown["model"]["cuda_graphs"] == "off"
    assert cli.main(["config", "show", "--kv-cache-memory", "lots"]) == 2
    assert "cache.memory_budget" in capsys.readouterr().err


def test_the_common_flags_come_from_the_schema_and_show_their_yaml_key(capsys):
    from cadenza import cli
    from cadenza.bench.common.setup import ENGINE_FLAGS
    from cadenza.config.flags import BY_FLAG, CONFIG_FLAGS, schema_field

    assert {"--max-model-len", "--max-num-seqs", "--kv-cache-memory", "--block-size"} <= set(BY_FLAG) >= set(ENGINE_FLAGS)
    parser = cli.build_parser()
    for command in (["serve"], ["bench", "latency"], ["bench", "throughput"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        wanted = CONFIG_FLAGS if command == ["serve"] else [BY_FLAG[f] for f in ENGINE_FLAGS]
        for flag in wanted:
            assert schema_field(flag.path).description  # a key that exists, described
            assert flag.flag in shown and f"[YAML: {flag.path}]" in shown, (command, flag)
    args = parser.parse_args(["serve", "--block-size", "32", "--max-model-len", "2048", "--kv-cache-dtype", "int8"])
    config = load_config(None, overrides=cli._overrides(args), env=NO_ENV)
    assert (config.cache.block_size, config.model.max_model_len, config.cache.dtype) == (32, 2048, "int8")
    args = parser.parse_args(["serve", "--data-parallel-size", "3", "--launcher", "ray", "--ray-placement", "pack",
                              "--prefill-replicas", "1", "--decode-replicas", "2", "--speculative-method", "ngram",
                              "--num-speculative-tokens", "4"])  # fmt: skip
    config = load_config(None, overrides=cli._overrides(args), env=NO_ENV)
    parallel = config.parallel
    assert (parallel.launcher, parallel.ray_placement, parallel.disaggregation.prefill, parallel.disaggregation.decode) == ("ray", "pack", 1, 2)
    assert (config.speculative.method, config.speculative.num_tokens) == ("ngram", 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--ray-placement", "everywhere"])  # the key's literal values are the choices
    with pytest.raises(KeyError, match="no.such"):
        schema_field("cache.no.such")


def test_the_token_budget_left_unset_follows_the_device():
    from cadenza.config.schema import SchedulerConfig

    unset = SchedulerConfig()
    assert (unset.for_device("cpu").max_num_batched_tokens, unset.for_device("cpu").chunk_size) == (2048, 512)
    assert (unset.for_device("cuda").max_num_batched_tokens, unset.for_device("cuda").chunk_size) == (8192, 2048)
    small = SchedulerConfig(max_num_batched_tokens=256).for_device("cuda")
    assert (small.max_num_batched_tokens, small.chunk_size) == (256, 256)  # the chunk within the budget set
    wide = SchedulerConfig(chunk_size=4096).for_device("cpu")
    assert (wide.max_num_batched_tokens, wide.chunk_size) == (4096, 4096)  # the budget holds the chunk set
    assert SchedulerConfig(max_num_batched_tokens=64, chunk_size=16).for_device("cuda").chunk_size == 16
