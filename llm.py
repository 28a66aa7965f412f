"""`LLM`: offline, synchronous generation for many prompts at once, shaped as vLLM's.

    from cadenza import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2 model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import anyio
import structlog
from anyio.from_thread import BlockingPortal

from cadenza.config import CadenzaConfig, load_config
from cadenza.config.flags import KEYWORDS
from cadenza.config.logging_setup import configure_logging
from cadenza.engine.async_engine import AsyncEngine
from cadenza.models.loading import release_free_memory
from cadenza.models.prompts import ChatPrompt, Prompt, PromptError, is_single_prompt, tokenize_prompt
from cadenza.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    RequestTimings,
    TokenLogprob,
)
from cadenza.pooling_params import PoolingParams
from cadenza.runtime.build import Runtime, build_runtime
from cadenza.sampling_params import SamplingParams, completion_seed


def config_overrides(model: str | Path | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """LLM keyword arguments as dotted config overrides (the short names of `config.flags.ALIASES`,
    or dotted keys); unknown names raise TypeError."""
    dotted: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in KEYWORDS:
            dotted[KEYWORDS[key]] = value
        elif "." in key:
            dotted[key] = value
        else:
            known = ", ".join(sorted(KEYWORDS))
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}; known: {known}, or a dotted config path")
    if model is not None:
        dotted["model.path"] = str(model)
    return dotted


class LLM:
    """Runs an `AsyncEngine` on a background event loop and waits for whole results."""

    def __init__(self, model: str | Path | None = None, *, config: CadenzaConfig | str | Path | None = None, **overrides: Any) -> None:
        dotted = config_overrides(model, overrides)
        if isinstance(config, CadenzaConfig):
            # A config object is already complete: keyword overrides apply on top, nothing else.
            self.config = load_config(None, overrides={**config.model_dump(mode="json"), **dotted}, env={})
        else:
            self.config = load_config(config, overrides=dotted)
        if not structlog.is_configured():  # an application's own logging setup wins
            configure_logging(self.config.logging.level, self.config.logging.format)
        self.runtime: Runtime = build_runtime(self.config)
        self.tokenizer = self.runtime.tokenizer
        self._token_texts: dict[int, str] = {}  # vLLM's `decoded_token` of each token met in logprobs
        self._portal, self._thread = _start_event_loop_thread()
        self._engine_cm = self._portal.wrap_async_context_manager(AsyncEngine.serve(self.runtime))
        self.engine: AsyncEngine = self._engine_cm.__enter__()
        release_free_memory()  # what building the sampling pipeline and starting the engine freed

    def close(self) -> None:
        """Stop the engine, then its event loop thread, then what the runtime started beside this
        process (tensor-parallel ranks)."""
        engine_cm, self._engine_cm = getattr(self, "_engine_cm", None), None
        if engine_cm is None or not self._thread.is_alive():
            return
        try:
            engine_cm.__exit__(None, None, None)
        finally:
            self._portal.call(self._portal.stop)
            self._thread.join(timeout=10)
            self.runtime.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self, _is_finalizing=sys.is_finalizing) -> None:  # bound early: at exit `sys` may be None here
        if _is_finalizing() or getattr(self, "_engine_cm", None) is None:
            return  # the loop thread is a daemon: nothing left to wait for
        # The collector may run this in any thread, even one the engine's loop is waiting on,
        # where a blocking close would deadlock: close from a thread of its own instead.
        threading.Thread(target=self._close_quietly, name="cadenza-close", daemon=True).start()

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in prompt order, its `n` completions in `outputs`
        (completion i of a seeded request samples with seed + i). A completion that fails alone
        has finish_reason "error" and its `error`; the others are unaffected."""
        batch = [prompts] if is_single_prompt(prompts) else list(prompts)
        return self._run(batch, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or a list of them, each
        rendered by the model's chat template with `tools` (OpenAI function tools) and
        `chat_template_kwargs` (Qwen3's `enable_thinking`, say), then generated as `generate`
        does. The text comes back as the model wrote it (tool calls and reasoning unparsed)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [ChatPrompt(list(c), list(tools) if tools else None, chat_template_kwargs) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, batch: list[Prompt], sampling_params, use_tqdm: bool | None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            per_prompt = [sampling_params] * len(batch)
        else:
            per_prompt = list(sampling_params)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts")
        prepared = [self._prepare(p) for p in batch]
        requests = [
            (prompt, one, index) for prompt, p in zip(prepared, per_prompt) for index, one in enumerate(_completions(p))
        ]
        if use_tqdm is None:
            use_tqdm = len(requests) > 1 and sys.stderr.isatty()
        completions = self._portal.call(self._run_all, requests, use_tqdm)
        outputs, start = [], 0
        for (text, ids), params in zip(prepared, per_prompt):
            mine, start = completions[start : start + params.n], start + params.n
            first = mine[0]
            outputs.append(RequestOutput(
                request_id=first.request_id,
                prompt=text,
                prompt_token_ids=ids,
                prompt_logprobs=first.prompt_logprobs,
                outputs=[c.completion for c in mine],
                finished=all(c.completion.finished() for c in mine),
                metrics=first.timings,
                num_cached_tokens=first.num_cached_tokens,
            ))  # fmt: skip
        return outputs

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """One vector per prompt, in order (`.embedding`; None with `error` for a request that
        failed alone). `pooling`: None takes the deployment's `embeddings` section."""
        batch = [prompts] if is_single_prompt(prompts) else list(prompts)
        pooling = pooling or self.engine.pooling_params()
        prepared = [self._prepare(p) for p in batch]
        return self._portal.call(self._embed_all, prepared, pooling)

    async def _embed_all(self, prepared: list[tuple[str | None, list[int]]], pooling: PoolingParams) -> list[EmbeddingOutput]:
        results: list[EmbeddingOutput | None] = [None] * len(prepared)

        async def run_one(i: int) -> None:
            ids = prepared[i][1]
            out = await self.engine.embed(ids, pooling)
            vector = list(out.embedding) if out.embedding is not None else None
            results[i] = EmbeddingOutput(out.request_id, vector, len(ids), out.error, out.error_code)

        async with anyio.create_task_group() as tg:
            for i in range(len(prepared)):
                tg.start_soon(run_one, i)
        return results  # type: ignore[return-value]

    def _prepare(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.runtime.loaded.arch.vocab_size)
        limit = self.runtime.max_model_len
        if len(ids) >= limit:
            raise PromptError(f"prompt has {len(ids)} tokens; max_model_len is {limit}")
        return text, ids

    async def _run_all(self, requests, use_tqdm: bool) -> list["_Completion"]:
        results: list[_Completion | None] = [None] * len(requests)
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="Generating", unit="req")

        async def run_one(i: int) -> None:
            results[i] = await self._collect(*requests[i])
            if progress is not None:
                progress.update(1)

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(run_one, i)
        finally:
            if progress is not None:
                progress.close()
        return results  # type: ignore[return-value]

    async def _collect(self, prepared: tuple[str | None, list[int]], params: SamplingParams, index: int) -> "_Completion":
        text, ids = prepared
        pieces: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        last = None
        async for out in self.engine.generate(ids, params):
            last = out
            pieces.append(out.text)
            tokens.extend(out.token_ids)
            if logprobs is not None and out.logprobs:
                logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
        assert last is not None and last.finished
        completion = CompletionOutput(
            index=index,
            text="".join(pieces),
            token_ids=tokens,
            cumulative_logprob=sum(lp.logprob for lp in logprobs) if logprobs is not None else None,
            logprobs=[self._position(lp) for lp in logprobs] if logprobs is not None else None,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            error=last.error,
            error_code=last.error_code,
        )
        prompt = [None if lp is None else self._position(lp) for lp in prompt_logprobs] if prompt_logprobs else None
        return _Completion(last.request_id, completion, prompt, last.timings, last.num_cached_tokens)

    def _position(self, entry: TokenLogprob) -> PositionLogprobs:
        """One position's `TokenLogprob` as vLLM's dict: the token itself first (its rank where it
        was computed, else its place among the top ones), then the top tokens ranked 1, 2, ..."""
        ranks = {token: rank for rank, (token, _) in enumerate(entry.top, start=1)}
        position = {entry.token_id: Logprob(entry.logprob, entry.rank or ranks.get(entry.token_id),
                                            self._token_text(entry.token_id))}
        for token, logprob in entry.top:
            position.setdefault(token, Logprob(logprob, ranks[token], self._token_text(token)))
        return position

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


@dataclass(frozen=True, slots=True)
class _Completion:
    """One completion as `_collect` gathers it, with what its prompt's `RequestOutput` takes from it."""

    request_id: str
    completion: CompletionOutput
    prompt_logprobs: list[PositionLogprobs | None] | None
    timings: RequestTimings | None
    num_cached_tokens: int


def _completions(params: SamplingParams) -> list[SamplingParams]:
    """A request for `n` completions as `n` requests for one. Completion i of a seeded request
    samples with seed + i (wrapping within the seed's range), as the OpenAI API's choices do, so
    completions differ yet repeat."""
    if params.n == 1:
        return [params]
    return [params.model_copy(update={"n": 1, "seed": completion_seed(params.seed, i)}) for i in range(params.n)]


def _start_event_loop_thread() -> tuple[BlockingPortal, threading.Thread]:
    """An event loop in a daemon thread, reachable through a portal.

    A daemon thread, unlike anyio's `start_blocking_portal` executor, cannot keep the interpreter
    from exiting when a caller never closes its `LLM`.
    """
    ready = threading.Event()
    holder: list[BlockingPortal] = []

    async def main() -> None:
        async with BlockingPortal() as portal:
            holder.append(portal)
            ready.set()
            await portal.sleep_until_stopped()

    thread = threading.Thread(target=anyio.run, args=(main,), name="cadenza-engine", daemon=True)
    thread.start()
    ready.wait()
    return holder[0], thread
