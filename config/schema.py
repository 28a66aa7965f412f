"""The deployment config: one pydantic model per thing it configures, rooted at `CadenzaConfig`.

Every field carries a description because `config_reference()` renders the YAML reference from the
JSON schema. Every model forbids unknown keys so a typo fails loudly instead of being ignored.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cadenza.sampling_params import (
    FrequencyPenalty,
    MaxTokens,
    MinP,
    PresencePenalty,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
)

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory_size(value: str | int) -> int:
    """Bytes in `value`: an int, or a string such as "512MiB", "2GiB", "1.5GB" or "1024".

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000.
    Raises ValueError for anything else, and for sizes that are not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("must be a byte count or a size string such as '512MiB' or '2GiB'")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            units = ", ".join(u for u in _UNITS if u not in ("", "b"))
            raise ValueError(f"not a memory size; use a number with a unit ({units}), e.g. '2GiB'")
        size = int(Decimal(match.group(1)) * _UNITS[unit])  # Decimal, so "1.5GB" is exact
    if size <= 0:
        raise ValueError("must be a positive number of bytes")
    return size


def checked_size(value: object) -> object:
    """A size field's value as given (None, bytes or a size string), once `parse_memory_size`
    accepts it: it raises with the reason, and the original spelling is kept."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # YAML reads 1e9 as a float
    if value is not None:
        parse_memory_size(value)
    return value


MAX_CPUS = 1024  # glibc's CPU_SETSIZE: the most CPUs one affinity mask names


def parse_cpu_list(text: str) -> list[int]:
    """CPU numbers from Linux's list syntax ("0-3,8,10-11"), in the order written, each once."""
    cpus: dict[int, None] = {}  # insertion-ordered, each once
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (write it as 0-3,8)")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"not a CPU list: {text!r} ({part.strip()} runs backwards)")
        if high >= MAX_CPUS:
            raise ValueError(f"not a CPU list: {text!r} (CPU numbers stop at {MAX_CPUS - 1})")
        cpus.update(dict.fromkeys(range(low, high + 1)))
    return list(cpus)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    """Which model to serve, and where and how its weights live."""

    path: str | None = Field(
        None,
        description="Hugging Face model directory or .gguf file. null serves the embedded default "
        "model, SmolLM2-135M-Instruct.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype. auto means bfloat16 on CPU and on CUDA."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs. auto picks cuda when available, else cpu."
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Longest sequence (prompt + output) in tokens. null uses the "
        "model's own context length.",
    )
    num_threads: int | None = Field(
        None, gt=0, description="Threads of torch's CPU ops and cadenza's CPU kernels (one OpenMP "
        "team). null: torch's default, one per core this process may run on (taskset and "
        "OMP_NUM_THREADS narrow it), shared out among tensor-parallel ranks. Set it to keep cadenza "
        "to fewer cores than the machine has, beside other busy processes: see docs/cpu-threads.md.",
    )
    thread_policy: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: the team keeps num_threads (or its default) threads. adaptive: "
        "every half second the compute thread measures how many cores other processes keep busy and "
        "runs its steps on the cores they leave (at least 1 thread), for a machine shared with busy "
        "neighbours; one engine on the CPU only. See docs/cpu-threads.md.",
    )
    thread_binding: str = Field(
        "auto", description="Where the team's threads run. auto: one thread a core, pinned, when this "
        "engine's team covers exactly the cores it may run on (one engine, thread_policy fixed, no OpenMP "
        "binding variable set); none: wherever the OS puts them; a CPU list such as 0-3 or 0,2,4,6: thread i on the "
        "i-th CPU. Pinned, a team beside a busy neighbour never ends up sharing one core with itself. "
        "See docs/cpu-threads.md.",
    )

    @field_validator("thread_binding")
    @classmethod
    def _cpu_list(cls, value: str) -> str:
        if value not in ("auto", "none"):
            parse_cpu_list(value)  # raises, naming the problem
        return value

    seed: int = Field(0, ge=0, description="Seed for torch's global random generator.")
    cpu_kernels: Literal["auto", "on", "off"] = Field(
        "auto", description="cadenza's compiled CPU kernels (x86-64 with AVX2/FMA; built on first "
        "use, about 30 s, then cached): bf16 matrix-vector products, norms, rotary and paged decode "
        "attention. auto uses them where they build and falls back to PyTorch ops otherwise; on "
        "fails start-up if they cannot be built; off always uses PyTorch ops.",
    )
    quantization: Literal["auto", "none", "int8"] = Field(
        "auto", description="How quantized weights run. auto keeps a GGUF's blocks of every type "
        "cadenza has CPU kernels for (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4) as "
        "stored and multiplies them natively (activations rounded to int8 per 32 values, per 256 for the "
        "K-quants and IQ4_XS, as llama.cpp does; steps of 64 rows or more de-quantize one weight at a time into a scratch GEMM), where "
        "the CPU kernels run and model.dtype is 16-bit: about 4x the batch-1 decode speed and a third "
        "of the weight memory of none, at slightly different logits (perplexity within 0.2%). none "
        "de-quantizes every weight to model.dtype on load, as do float32 dtype, cpu_kernels off or no "
        "kernels under auto. int8 also quantizes a Hugging Face checkpoint's linears and embedding to "
        "int8 per 32 weights (Q8_0 blocks) on load, weight-only, and runs them on the same kernels.",
    )
    moe_experts_on: Literal["device", "cpu"] = Field(
        "device", description="Where a mixture of experts' experts live and run. device: with the rest "
        "of the model. cpu (llama.cpp's --cpu-moe), on a GPU: in host memory, run on the CPU (a GGUF's "
        "quantized experts as their blocks on the CPU kernels), while attention, the router and the "
        "rest run on the GPU; each layer sends its activations to the host and the experts' output "
        "back. For a model whose experts do not fit the GPU. On the CPU, the same as device.",
    )


    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="How weights are read. auto: from model.path (an HF directory or a .gguf "
        "file). dummy (vLLM's name): random weights of the shape that model.path's config.json gives "
        "(a file, a directory holding one, or a shipped shape such as 'llama-3.2-1b'), seeded by "
        "model.seed, for benchmarks of real shapes with nothing to download; prompts are token ids.",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="Decode steps replayed as CUDA graphs, one per batch-size bucket (1, 2, 4, "
        "8, then steps of 8 up to scheduler.max_num_seqs), over static input buffers; prefill stays "
        "eager. auto captures on CUDA where the attention backend supports capture (single device). "
        "on pads decodes to their bucket over the static buffers on any device (captured on CUDA, "
        "run eagerly on the CPU, as the tests run the GPU's path) and fails start-up where the "
        "attention backend cannot; off runs every step unpadded and eagerly.",
    )

    @field_validator("cpu_kernels", "cuda_graphs", mode="before")
    @classmethod
    def _yaml_switch(cls, value: object) -> object:
        # YAML (and so an env var) reads a bare on/off as a boolean.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class CacheConfig(_Section):
    """The paged KV cache: block geometry, how many blocks, and what to evict."""

    block_size: int = Field(
        16, ge=1, le=256, description="Tokens per KV cache block; a power of two from 1 to 256."
    )
    num_blocks: int | None = Field(
        None, gt=0, description="Number of KV cache blocks. Set this or memory_budget, not both. "
        "With neither, the cache holds scheduler.max_num_seqs sequences of 256 tokens (of "
        "max_model_len where shorter) and at least one of max_model_len, within a quarter of the "
        "memory available at start-up (MemAvailable; free GPU memory on CUDA); the start-up log "
        "line 'KV cache sized' gives the bytes, blocks and tokens taken, and why. A CPU cache "
        "becomes resident only as its blocks are first written.",
    )
    memory_budget: str | int | None = Field(
        None, description="Memory for the KV cache: bytes, or a size such as '512MiB', '2GiB', "
        "'1.5GB'. Set this or num_blocks, not both.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = Field(
        "auto", description="What keys and values are stored as. 'auto': bfloat16 where attention "
        "computes in bfloat16, and also where block-quantized weights (a GGUF's, quantization: int8) "
        "round the activations to int8 (the CPU kernels read 16-bit rows at float32's speed); else "
        "the dtype attention computes in. 'float32' keeps full precision; float16 or bfloat16 halve "
        "float32's bytes (attention still computes in its own dtype); "
        "'int8': quantized per token and kv head (a float16 scale each), about half the bytes of "
        "bfloat16 and a quarter of float32, so the same memory_budget holds 2-4x the tokens.",
    )
    eviction_policy: str = Field(
        "lru", min_length=1, description="Name of the eviction policy plugin for cached blocks."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks across requests that share a prompt prefix."
    )
    host_size: str | int | None = Field(
        None, description="Host memory for prefix-cache blocks below the KV budget (a tier for GPU "
        "deployments): bytes, or a size such as '20GiB'. null: no host tier.",
    )
    disk_path: str | None = Field(
        None, description="Directory for the disk tier of the prefix cache: full blocks are written "
        "behind and read back for a later prompt with the same prefix, across restarts. null: off.",
    )
    disk_size: str | int = Field(
        "10GiB", description="Most bytes the disk tier keeps (bytes, or a size such as '20GiB'); "
        "the blocks disk_eviction_policy offers go first. Data-parallel replicas may share disk_path: "
        "each re-reads the directory every minute of writes and keeps the whole within this.",
    )
    host_eviction_policy: str = Field(
        "lru", min_length=1, description="Eviction policy plugin ordering the host tier's blocks, as "
        "eviction_policy orders the KV budget's (its own instance): lru, lfu, fifo or a plugin's name.",
    )
    disk_eviction_policy: str = Field(
        "lru", min_length=1, description="Eviction policy plugin ordering the disk tier's blocks: lru, "
        "lfu, fifo or a plugin's name. A block the policy never offers stays; a tier full of them "
        "skips new writes (e.g. pinned_prefix with kept_in: [disk] keeps a system prompt there).",
    )
    salt_per_api_key: bool = Field(
        False, description="Separate the tenants of a server with several API keys (server.api_keys): "
        "every request's cache salt is derived from the key that authenticated it (a keyed hash of its "
        "tenant name, or of the key where it names none), combined with any cache_salt it gives, so "
        "requests under different tenants never share prefix blocks, in the KV budget or the tiers.",
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value

    @field_validator("memory_budget", "host_size", "disk_size", mode="before")
    @classmethod
    def _parseable_budget(cls, value: object) -> object:
        return checked_size(value)

    @model_validator(mode="after")
    def _one_size(self) -> CacheConfig:
        if self.num_blocks is not None and self.memory_budget is not None:
            raise ValueError(
                f"set num_blocks ({self.num_blocks}) or memory_budget ({self.memory_budget!r}), "
                "not both"
            )
        return self

    @property
    def memory_budget_bytes(self) -> int | None:
        """`memory_budget` in bytes, or None when it is not set."""
        return None if self.memory_budget is None else parse_memory_size(self.memory_budget)

    @property
    def host_size_bytes(self) -> int | None:
        """`host_size` in bytes, or None when there is no host tier."""
        return None if self.host_size is None else parse_memory_size(self.host_size)

    @property
    def disk_size_bytes(self) -> int:
        """`disk_size` in bytes."""
        return parse_memory_size(self.disk_size)


# (max_num_batched_tokens, chunk_size) where the configuration leaves them unset, by the model's device.
DEVICE_TOKEN_BUDGETS = {"cpu": (2048, 512), "cuda": (8192, 2048)}


class SchedulerConfig(_Section):
    """How many sequences and tokens go into one step, and who waits."""

    max_num_seqs: int = Field(64, gt=0, description="Most sequences running in one batch.")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="Most tokens (prefill and decode together) in one step. Unset: by the "
        "model's device (DEVICE_TOKEN_BUDGETS: 2048 on the CPU, 8192 on CUDA, whose steps of a few "
        "thousand rows are where its matrix units run full).",
    )
    chunk_size: int | None = Field(
        None, gt=0, description="Prefill chunk size in tokens; at most max_num_batched_tokens. Unset: by "
        "the device (512 on the CPU, 2048 on CUDA), at most max_num_batched_tokens.",
    )
    max_waiting: int = Field(
        1024, gt=0, description="Most requests queued; beyond it new requests are rejected."
    )
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="Queue order: first come first served, or by request priority."
    )
    async_scheduling: bool = Field(
        True,
        description="Plan step N+1 while step N runs, so scheduling overlaps the forward pass. "
        "A request that stops on EOS then runs one discarded extra step.",
    )

    @model_validator(mode="after")
    def _chunk_fits(self) -> SchedulerConfig:
        if self.chunk_size is not None and self.max_num_batched_tokens is not None and self.chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        return self

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This section with the token budget and chunk size it leaves unset filled in for a model
        on `device_type` ("cpu", "cuda", ...; others take the CPU's)."""
        budget, chunk = DEVICE_TOKEN_BUDGETS.get(device_type, DEVICE_TOKEN_BUDGETS["cpu"])
        budget = self.max_num_batched_tokens or max(budget, self.chunk_size or 0)
        chunk = self.chunk_size or min(chunk, budget)
        return self.model_copy(update={"max_num_batched_tokens": budget, "chunk_size": chunk})


class SamplingDefaults(_Section):
    """Sampling parameters a request gets when it does not set them. The bounds are
    `cadenza.sampling_params`' own, the same ones every API checks."""

    max_tokens: MaxTokens | None = Field(
        256, description="Most tokens to generate. null: until EOS or max_model_len."
    )
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: PresencePenalty = 0.0
    frequency_penalty: FrequencyPenalty = 0.0


# The built-in processors in the order they should run (vLLM's): the grammar of structured outputs,
# bans and biases first, as they decide what may be emitted at all; penalties next, on the biased
# logits; then temperature, and the truncation filters last, on the tempered distribution a row
# actually samples from.
DEFAULT_LOGITS_PROCESSORS: tuple[str, ...] = (
    "structured_output", "min_tokens", "logit_bias", "penalties", "temperature", "min_p", "top_k_top_p",
)  # fmt: skip


class SamplingConfig(_Section):
    """Which sampler picks tokens, the logits processors before it, and per-request defaults."""

    sampler: str = Field("default", min_length=1, description="Name of the sampler plugin.")
    logits_processors: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LOGITS_PROCESSORS),
        description="Logits processor plugins, applied in this order.",
    )
    defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults, description="Defaults for per-request sampling params."
    )


class APIKeyConfig(_Section):
    """One API key the server accepts, and the tenant it belongs to. A bare string is a key alone."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # an error never shows the key

    key: str = Field(..., min_length=1, repr=False, description="A bearer token clients send.")
    tenant: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$",
        description="Who the key belongs to, named in the access log (never the key) and, under "
        "cache.salt_per_api_key, the cache it shares: keys of one tenant share one, and a tenant keeps "
        "its cache when its key is replaced. null: the key is a tenant of its own.",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_key(cls, value: object) -> object:
        return {"key": value} if isinstance(value, str) else value


class ServerConfig(_Section):
    """The network server: where it listens and how much it accepts."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # an error never shows a key

    host: str = Field("127.0.0.1", description="Interface to bind; 0.0.0.0 for all.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free port.")
    max_connections: int = Field(256, gt=0, description="Most concurrent client connections.")
    max_requests_per_connection: int = Field(
        16, gt=0, description="Most requests in flight on one connection."
    )
    max_prompt_tokens: int | None = Field(
        None, gt=0, description="Reject longer prompts. null: limited by max_model_len only."
    )
    api_key: str | None = Field(
        None, min_length=1, description="Bearer token clients must send. null: no auth (unless "
        "api_keys lists some).",
    )
    api_keys: list[APIKeyConfig] = Field(
        default_factory=list, description="More bearer tokens, for a server with several tenants: each "
        "{key: ..., tenant: ...} or a bare key; any of them (or api_key) authenticates. With "
        "cache.salt_per_api_key each tenant's requests share cached prefixes only among themselves.",
    )
    max_pending_tokens: int = Field(
        4096, gt=0, description="Tokens a request may have waiting for a slow client before it "
        "is aborted with a slow_reader error (other requests are never held up).",
    )
    socket_send_buffer: int | None = Field(
        262144, ge=4096, description="Kernel send buffer per connection in bytes (SO_SNDBUF), so "
        "what a slow client has not read yet is bounded. null: the OS autotunes (up to megabytes).",
    )
    shutdown_grace: float = Field(
        10.0, ge=0, description="Seconds running requests get to finish on SIGINT/SIGTERM before "
        "they are aborted.",
    )
    tool_parser: str = Field(
        "auto", min_length=1, description="The format the model writes tool calls in, parsed into "
        "`tool_calls` and used to force a call (tool_choice required or named): a registered tool parser "
        "(built-ins: hermes, llama3_json, mistral, qwen3_coder, harmony; plugins add more) or auto (chosen by "
        "the chat template's text, hermes when it says nothing).",
    )
    keep_alive: float = Field(
        300.0, description="Seconds a model listed under `models` stays loaded with no request before it "
        "is unloaded (Ollama's keep_alive; a request may set its own). -1: never. The first model listed "
        "(and the `model` section's, when `models` is empty) stays loaded always.",
    )
    max_loaded_models: int | None = Field(
        None, gt=0, description="The most models of `models` loaded at once; loading one more unloads the "
        "least recently used idle one first. null: no limit but models_memory_budget.",
    )
    models_memory_budget: str | int | None = Field(
        None, description="Memory the loaded models of `models` may take together (their weights files and "
        "KV caches): bytes or a size such as '20GiB'. Loading one more unloads the least recently used idle "
        "ones first. null: no limit but max_loaded_models.",
    )
    model_load_timeout: float = Field(
        300.0, gt=0, description="Seconds a request for a model that is loading (or waiting for room) "
        "waits before it gets a 503.",
    )
    max_concurrent_loads: int = Field(
        1, gt=0, description="How many models of `models` may load at once (loading reads whole weights "
        "files: two at once mostly share the disk).",
    )
    protocols: list[str] | None = Field(
        None, min_length=1, description="The wire protocols served, by name: built-ins openai (chat, "
        "completions, embeddings, tokenize), responses, realtime, sessions (cadenza's WebSocket), anthropic "
        "(Messages API), ollama; plugins add more. null: every registered protocol.",
    )
    reasoning_parser: str = Field(
        "auto", min_length=1, description="How chat answers split the model's reasoning "
        "(`reasoning_content`, streamed as deltas too) from its answer (`content`): a registered reasoning "
        "parser (built-ins: qwen3, deepseek_r1, think, gpt_oss (also harmony); plugins add more), auto "
        "(chosen by the chat template's text: one that writes <think> gets qwen3, gpt-oss's <|channel|> "
        "gpt_oss) or none (everything is content).",
    )

    @field_validator("models_memory_budget", mode="before")
    @classmethod
    def _parseable_models_budget(cls, value: object) -> object:
        return checked_size(value)

    @model_validator(mode="after")
    def _keys_once(self) -> ServerConfig:
        # Checked here, not on the list: an error then quotes no key (a list's errors show the list).
        where: dict[str, str] = {} if self.api_key is None else {self.api_key: "api_key"}
        for i, entry in enumerate(self.api_keys):
            if entry.key in where:
                raise ValueError(f"api_keys[{i}] repeats the key of {where[entry.key]}: each key is listed once")
            where[entry.key] = f"api_keys[{i}]"
        return self

    @property
    def all_api_keys(self) -> list[APIKeyConfig]:
        """Every key the server accepts: `api_key` (no tenant name) first, then `api_keys`."""
        single = [] if self.api_key is None else [APIKeyConfig(key=self.api_key)]
        return single + list(self.api_keys)

    @property
    def models_memory_budget_bytes(self) -> int | None:
        return None if self.models_memory_budget is None else parse_memory_size(self.models_memory_budget)


class ServedModelConfig(_Section):
    """One model of a server that serves several (`models`): requests pick it by `model`."""

    name: str = Field(
        ..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        description="The name requests give as `model` (Ollama's clients may add ':latest').",
    )
    path: str | None = Field(
        None, description="The model: a GGUF file, a Hugging Face directory or a shipped name, as "
        "model.path. null: the embedded default model.",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted config keys set for this model only, over the rest of "
        "the deployment (e.g. {'model.dtype': 'float32', 'cache.memory_budget': '1GiB'}).",
    )
    keep_alive: float | None = Field(
        None, description="Seconds idle before it is unloaded; null: server.keep_alive; -1: never.",
    )
    pinned: bool = Field(False, description="Never unloaded (the first model listed always is).")

    @field_validator("overrides")
    @classmethod
    def _not_nested(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key.split(".")[0] in ("models", "server", "plugins", "plugin_options", "logging"):
                raise ValueError(f"{key!r}: the server's own settings are shared by every model")
        return value


class SessionsConfig(_Section):
    """Long-lived conversations (WebSocket sessions, the Responses and Realtime APIs): what a
    conversation does when it outgrows the model, and what is retrieved before each turn. A
    session may choose its own policy and providers (`session.update`); these are the defaults."""

    context_policy: str = Field(
        "error", min_length=1, description="What a conversation turn does when the history and "
        "the turn would not fit max_model_len minus the turn's max_tokens: 'error' fails the turn "
        "(prompt_too_long), 'drop_oldest' drops whole turns from the oldest (the system prompt is "
        "kept), or the name of a context policy plugin.",
    )
    context_providers: list[str] = Field(
        default_factory=list, description="Context provider plugins (retrieval, memory) that add "
        "messages to every conversation turn, in this order, before it is tokenized.",
    )
    provider_timeout: float = Field(
        5.0, gt=0, description="Seconds the context providers of one turn may take together; past "
        "it the turn fails with context_provider_timeout (the session carries on).",
    )
    max_conversations: int = Field(
        8, gt=0, description="Most conversations (forks included) one WebSocket session may hold.",
    )
    stored_responses: int = Field(
        1024, ge=0, description="Responses API: most finished responses kept in memory for "
        "previous_response_id, least recently used dropped first. 0 stores none.",
    )


class DisaggregationConfig(_Section):
    """Prefill/decode disaggregation: some data-parallel replicas only prefill prompts and hand
    their KV-cache blocks to the others, which decode. See docs/scale-out.md."""

    prefill: int = Field(
        0, ge=0, description="Replicas that compute prompts' KV caches and send their blocks on. 0 "
        "(with decode 0): off, every replica does both.",
    )
    decode: int = Field(
        0, ge=0, description="Replicas that receive a prompt's blocks (only those their prefix "
        "cache lacks), compute its last position and stream the answer. prefill + decode must equal "
        "data_parallel_size.",
    )
    connector: str = Field(
        "torch_distributed", min_length=1, description="KV connector plugin moving the blocks: "
        "torch_distributed (point-to-point in a process group of its own: gloo on the CPU, NCCL "
        "between GPUs), nixl (the `nixl` package), or a plugin's name.",
    )

    @model_validator(mode="before")
    @classmethod
    def _empty(cls, value: object) -> object:
        return {} if value is None else value  # a YAML section whose keys are all commented out

    @property
    def enabled(self) -> bool:
        return self.prefill + self.decode > 0


class ParallelConfig(_Section):
    """Scale-out: tensor parallelism (one model split over ranks) and data parallelism (engine
    replicas behind one server). See docs/scale-out.md."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks one model is split over (Megatron-style: attention heads, MLP "
        "columns and the vocabulary). 1: no split. `cadenza serve` spawns the ranks on this machine, "
        "or runs as one rank of a `torchrun` launch.",
    )
    data_parallel_size: int = Field(
        1, ge=1, description="Engine replicas (processes) behind one server port; a router sends "
        "each request to the replica whose prefix cache holds the longest part of its prompt, else "
        "to the least loaded one. Each replica may itself be tensor-parallel: data_parallel_size x "
        "tensor_parallel_size ranks must fit the CPU cores (or GPUs) of this machine or the Ray cluster.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend for tensor parallelism: auto is nccl on CUDA "
        "and gloo on the CPU.",
    )
    timeout_seconds: float = Field(
        60.0, gt=0, description="Longest a collective operation (a step's all-reduce, the wait for "
        "the next step) may take before the rank that waits gives up: a dead rank fails the engine "
        "within this, never hangs it.",
    )
    launcher: Literal["local", "ray"] = Field(
        "local", description="Where data-parallel replicas run: local starts them as processes on "
        "this machine; ray starts each under a Ray actor (the cadenza[ray] extra), on the cluster at "
        "RAY_ADDRESS, else the one this machine joined, else a local Ray instance cadenza starts and stops.",
    )
    max_restarts: int = Field(
        3, ge=0, description="launcher ray: how many times Ray restarts a replica that died after it "
        "served (its open requests end with engine_failed; the others serve meanwhile). 0: a dead "
        "replica stays dead and the engine turns unhealthy, as with local replicas. Under "
        "disaggregation replicas are not restarted (unset means 0; above 0 is refused).",
    )
    ray_placement: Literal["spread", "pack", "strict_spread"] = Field(
        "spread", description="launcher ray: how replicas spread over the cluster's nodes (a Ray "
        "placement group of one bundle a replica; a replica's ranks always share a node). spread: "
        "over as many nodes as can hold one, as Ray Serve spreads replicas; pack: as few nodes as "
        "possible; strict_spread: each on a node of its own, or start-up fails.",
    )
    router: Literal["prefix", "round_robin", "least_loaded"] = Field(
        "prefix", description="How data parallelism picks a replica: prefix (longest cached prompt "
        "prefix by block hashes, else least loaded), round_robin, or least_loaded.",
    )
    disaggregation: DisaggregationConfig = Field(
        default_factory=DisaggregationConfig, description="Prefill/decode disaggregation: how many "
        "replicas prefill and how many decode, and the KV connector between them.",
    )


class SpeculativeConfig(_Section):
    """Speculative decoding: a proposer guesses the next tokens of a decoding request and the model
    checks them all in one pass, keeping the longest prefix it would have produced itself (exact:
    greedy output is unchanged, sampled output keeps its distribution). See docs/speculative.md."""

    method: str = Field(
        "none", min_length=1, description="Proposer: none (off), ngram (prompt lookup), suffix (a "
        "suffix automaton over the request's tokens), draft (a smaller model, plugin_options.draft) "
        "or a proposer plugin's name. A request may switch it off or pick another built proposer "
        "(SamplingParams.speculative).",
    )
    num_tokens: int = Field(
        16, ge=1, le=16, description="Most tokens proposed for a request in one step. Lookups (ngram, "
        "suffix) are trimmed each step from how long their match is; other proposers' counts adapt per "
        "request from its recent acceptance, between 1 and this.",
    )
    max_batch_size: int = Field(
        4, ge=1, description="No speculation in a step that decodes more requests than this: a big "
        "batch is compute-bound, so verifying guesses costs what it saves.",
    )
    min_acceptance: float = Field(
        0.3, ge=0, le=1, description="A request whose recent share of accepted proposed tokens falls "
        "below this (or whose proposer keeps finding nothing) stops speculating for a while, then "
        "tries again.",
    )
    cooldown_steps: int = Field(
        16, ge=1, description="Decode steps a request waits before speculating again after it was "
        "switched off; doubles each time it is switched off again (at most 16x).",
    )
    token_cost: float | None = Field(
        None, ge=0, le=1, description="What one more token costs a step, relative to a one-token "
        "step: near 0 where steps are bound by reading the weights (a GPU at batch 1), near 1 where "
        "bound by compute (a small CPU). The number of tokens proposed is chosen from it and the "
        "request's acceptance. null: measured from the steps the engine runs.",
    )


class EmbeddingsConfig(_Section):
    """Embeddings (`/v1/embeddings`, `LLM.embed`): how the served decoder's last hidden states
    (after its final norm) become one vector per input."""

    pooling: Literal["last", "mean"] = Field(
        "last", description="last: the last input token's hidden state; mean: the mean over every input token's "
        "(those inputs are then computed whole, never taken from the prefix cache).",
    )
    normalize: bool = Field(True, description="Scale each vector to unit L2 norm (after truncation to `dimensions`).")


class LoggingConfig(_Section):
    """Log verbosity and rendering."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Lowest level logged; upper case accepted."
    )
    format: Literal["auto", "console", "json"] = Field(
        "auto", description="auto: console on a terminal, json otherwise."
    )

    @field_validator("level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


class CadenzaConfig(_Section):
    """A whole deployment. `CadenzaConfig()` is valid: every section has defaults."""

    # Its errors' text shows no input, which would hold the server's keys (`load_config`'s messages
    # quote the values at fault, never a key: config/errors.py).
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    model: ModelConfig = Field(default_factory=ModelConfig, description="The model.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="The paged KV cache.")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="Batching and queueing."
    )
    attention_backend: str = Field(
        "auto", min_length=1, description="Name of the attention backend plugin. auto: 'triton' (paged "
        "attention kernels, CUDA-graph capable) on CUDA, 'torch_sdpa' on the CPU.",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Token sampling."
    )
    server: ServerConfig = Field(default_factory=ServerConfig, description="The network server.")
    sessions: SessionsConfig = Field(
        default_factory=SessionsConfig, description="Long-lived conversations: context policies and providers."
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="Tensor and data parallelism (scale-out)."
    )
    speculative: SpeculativeConfig = Field(
        default_factory=SpeculativeConfig, description="Speculative decoding (several tokens a step)."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    embeddings: EmbeddingsConfig = Field(
        default_factory=EmbeddingsConfig, description="Embeddings: pooling of the last hidden states."
    )
    models: list[ServedModelConfig] = Field(
        default_factory=list, description="Several models on one server, each loaded on its first request "
        "and unloaded after keep_alive idle (or for room, least recently used first); requests route by "
        "`model`. The first is loaded at start-up and stays. Empty: the `model` section's one model.",
    )
    plugins: list[str] = Field(
        default_factory=list, description="Module names to load as plugins."
    )
    plugin_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Deployment settings for plugins, keyed by the registered name (e.g. "
        "pinned_prefix: {pinned_blocks: 4}); checked at start-up against the plugin's options model.",
    )

    @field_validator("model", "cache", "scheduler", "sampling", "server", "sessions", "parallel", "speculative", "logging", "embeddings", mode="before")
    @classmethod
    def _empty_section(cls, value: object) -> object:
        # A YAML section whose keys are all commented out reads as null: treat it as empty.
        return {} if value is None else value

    @model_validator(mode="after")
    def _salt_needs_keys(self) -> CadenzaConfig:
        if self.cache.salt_per_api_key and not self.server.all_api_keys:
            raise ValueError("cache.salt_per_api_key needs the keys it salts by: set server.api_keys (or server.api_key)")
        return self

    @field_validator("models")
    @classmethod
    def _unique_names(cls, value: list[ServedModelConfig]) -> list[ServedModelConfig]:
        names = [m.name for m in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"model names must be unique; given more than once: {', '.join(twice)}")
        return value


def section_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model behind field `name` of `model`, or None when that field is a plain value."""
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None
