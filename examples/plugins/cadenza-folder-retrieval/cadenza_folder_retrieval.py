"""A cadenza context provider: BM25 retrieval over a local folder of text files."""

from __future__ import annotations

from pathlib import Path

import anyio
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cadenza.plugins.context import ContextProvider, Message, ProviderRequest
from cadenza.plugins.hookspecs import hookimpl

HEADER = "Passages from the knowledge base that may help with the next question:"


class FolderRetrievalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    folder: str = Field(description="The folder of documents (searched recursively).")
    patterns: list[str] = Field(["*.txt", "*.md"], min_length=1, description="File name patterns to index.")
    top_k: int = Field(2, ge=1, le=20, description="The most passages added to a turn.")
    passage_chars: int = Field(800, ge=100, le=20000, description="Paragraphs are merged into passages up to this size.")

    @field_validator("folder")
    @classmethod
    def _is_folder(cls, value: str) -> str:
        if not Path(value).is_dir():
            raise ValueError(f"{value!r} is not a folder")
        return value


class FolderRetrieval(ContextProvider):
    name = "folder_retrieval"
    options_model = FolderRetrievalOptions

    def __init__(self, options: FolderRetrievalOptions) -> None:
        import bm25s  # imported here: registering the plugin must stay cheap

        super().__init__(options)
        self.passages = list(_passages(Path(options.folder), options.patterns, options.passage_chars))
        self.index = None
        if self.passages:
            self.index = bm25s.BM25()
            self.index.index(bm25s.tokenize([text for _, text in self.passages], stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str) -> list[tuple[str, str]]:
        """The best passages for `query` as (file, text), best first; none that share no term."""
        import bm25s

        if self.index is None or not query.strip():
            return []
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        k = min(self.options.top_k, len(self.passages))
        found, scores = self.index.retrieve(tokens, k=k, show_progress=False)
        return [self.passages[i] for i, score in zip(found[0], scores[0]) if score > 0]

    async def provide(self, request: ProviderRequest) -> list[Message]:
        hits = await anyio.to_thread.run_sync(self.search, request.query)  # scoring is numpy work
        if not hits:
            return []
        body = "\n\n".join(f"[{name}]\n{text}" for name, text in hits)
        return [{"role": "system", "content": f"{HEADER}\n\n{body}"}]


def _passages(folder: Path, patterns: list[str], size: int):
    for path in sorted({p for pattern in patterns for p in folder.rglob(pattern) if p.is_file()}):
        chunk = ""
        for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            paragraph = paragraph.strip()
            if chunk and len(chunk) + len(paragraph) > size:
                yield path.name, chunk
                chunk = ""
            chunk = f"{chunk}\n\n{paragraph}".strip() if paragraph else chunk
        if chunk:
            yield path.name, chunk


@hookimpl
def register_context_providers(register):
    register(FolderRetrieval.name, FolderRetrieval)
