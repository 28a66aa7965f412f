"""Grammars for structured outputs on llguidance: from a `StructuredOutputs` spec to a matcher.

llguidance (the Rust engine behind Guidance, also used by vLLM and llama.cpp) does the grammar
work: JSON schema, regex, Lark and GBNF to a grammar, and per step the set of allowed tokens as a
bitmask. This module only translates cadenza's spec, builds the tokenizer llguidance needs from
cadenza's own vocabulary bytes (`samplers.vocab`, the bytes the detokenizer emits), and keeps a
cache of compiled grammars keyed by the spec, so a schema many requests share compiles once.

Compiling is the expensive part (up to about a second for a huge schema; a millisecond for most):
`GrammarCompiler.compile` is thread-safe and meant to run off the step path (the ingress calls it,
through `SamplingComponent.prepare_request`, in a worker thread before admission). A matcher for a
request is a `deep_copy` of the cached one: microseconds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Sequence

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from cadenza.sampling_params import StructuredOutputs

# A byte no UTF-8 text contains: llguidance's marker for special tokens, which never match text.
_SPECIAL_MARKER = b"\xff"


class GrammarError(ValueError):
    """A spec llguidance cannot compile; the message starts with the field at fault, e.g.
    `structured_outputs.json: Invalid type: foo`."""


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON envelope) for a spec. Raises `GrammarError` only for a
    grammar that is not even parseable as GBNF/Lark; the rest is found when it compiles."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json_schema if kind == "json" else {"type": "object"}
        if schema is True:
            schema = {}
        elif schema is False:
            raise GrammarError("structured_outputs.json: the schema `false` matches nothing")
        options = {"whitespace_flexible": not spec.disable_any_whitespace}
        if spec.disable_any_whitespace:
            options.update(item_separator=",", key_separator=":")
        return LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(spec.choice))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise GrammarError(f"structured_outputs.grammar: {exc}") from None


class _TokenizerWrapper:
    """What `LLTokenizer` reads from a Python tokenizer: each token's bytes (special tokens marked
    with 0xff, so no text ever matches them), EOS, and an encoder for llguidance's own use."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        from cadenza.samplers.vocab import token_bytes_lookup

        backend = getattr(tokenizer, "backend", tokenizer)
        added = backend.get_added_tokens_decoder()
        bytes_of = token_bytes_lookup(tokenizer)
        self.special_token_ids = [i for i, t in added.items() if t.special and i < vocab_size]
        special = set(self.special_token_ids)
        # Ids past the tokenizer's vocabulary (a model's padded rows) are b"": never allowed.
        self.tokens = [
            _SPECIAL_MARKER + added[i].content.encode() if i in special else bytes_of(i) for i in range(vocab_size)
        ]
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


def build_lltokenizer(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> LLTokenizer:
    """llguidance's tokenizer for cadenza's `Tokenizer`, as wide as the model's logits."""
    wrapper = _TokenizerWrapper(tokenizer, vocab_size, eos_token_ids)
    return LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarCompiler:
    """Compiled grammars by spec, shared by every request; thread-safe.

    `compile(spec)` returns the cached pristine matcher, compiling it on a miss; two threads asking
    for the same spec at once compile it once (the second waits on the first's future). Up to
    `capacity` grammars are kept, least recently used evicted first. `matcher(spec)` is a fresh
    per-request copy.
    """

    def __init__(self, tokenizer: LLTokenizer, capacity: int = 512) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[LLMatcher]] = OrderedDict()
        # Errors name the problem, not the parser's state and the grammar (which may be large).
        self.limits = LLParserLimits(verbose_errors=False)
        self.num_compiled = 0

    def compile(self, spec: StructuredOutputs) -> LLMatcher:
        """The spec's compiled matcher (do not advance it: copy it). Raises `GrammarError`."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = self._cache[key] = Future()
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(self._compile(spec))
            except BaseException as exc:
                with self._lock:  # a failure is not cached: the next request gets its own message
                    if self._cache.get(key) is future:
                        del self._cache[key]
                future.set_exception(exc)
        return future.result()

    def matcher(self, spec: StructuredOutputs) -> LLMatcher:
        """A fresh matcher for one request, at the start of the grammar."""
        return self.compile(spec).deep_copy()

    def is_cached(self, spec: StructuredOutputs) -> bool:
        with self._lock:
            future = self._cache.get(spec.key())
        return future is not None and future.done() and future.exception() is None

    def _compile(self, spec: StructuredOutputs) -> LLMatcher:
        field = f"structured_outputs.{spec.kind}"
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:  # llguidance: the schema is not a JSON object
            raise GrammarError(str(exc) if isinstance(exc, GrammarError) else f"{field}: {exc}") from None
        # The constructor drops the GIL while it builds the lexer and parser: steps keep running.
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(f"{field}: {_first_line(matcher.get_error())}")
        self.num_compiled += 1
        return matcher


def _first_line(message: str) -> str:
    """llguidance's message without its source excerpt and caret lines (the regex crate's own
    reason, `error: ...`, comes last)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    reason = next((line for line in reversed(lines) if line.startswith("error:")), None)
    return f"{lines[0]} {reason}" if reason and reason != lines[0] else lines[0]
