"""OpenAI's HTTP API as a protocol: chat and text completions, embeddings, and vLLM's
tokenize/detokenize routes (the Responses and Realtime APIs are protocols of their own)."""

from __future__ import annotations

from fastapi import APIRouter

from cadenza.api import tokenizer
from cadenza.api.openai import completions, embeddings
from cadenza.api.protocols import Protocol


class OpenAIProtocol(Protocol):
    name = "openai"
    prefixes = ("/v1/",)

    def router(self) -> APIRouter:
        router = APIRouter()
        for part in (completions.router, embeddings.router, tokenizer.router):
            router.include_router(part)
        return router
