"""A cadenza context provider: retrieval over a local folder of text files, by BM25 (terms), by
the served model's own embeddings (dense), or by both, fused by reciprocal rank (hybrid)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import anyio
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cadenza.plugins.hookspecs import hookimpl
from cadenza.policies.context import ContextProvider, Embed, Message, ProviderRequest

HEADER = "Passages from the knowledge base that may help with the next question:"
FUSION_DEPTH = 100  # each ranking's best this many enter a hybrid fusion; deeper ranks add under 1/(k + 100)


class FolderRetrievalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    folder: str = Field(description="The folder of documents (searched recursively).")
    patterns: list[str] = Field(["*.txt", "*.md"], min_length=1, description="File name patterns to index.")
    top_k: int = Field(2, ge=1, le=20, description="The most passages added to a turn.")
    passage_chars: int = Field(800, ge=100, le=20000, description="Paragraphs are merged into passages up to this size.")
    method: Literal["bm25", "dense", "hybrid"] = Field(
        "bm25", description="bm25: passages that share terms with the query (bm25s), indexed at start-up; dense: "
        "the passages nearest the query by cosine similarity of the served model's embeddings; hybrid: both "
        "rankings fused by reciprocal rank.",
    )
    min_similarity: float | None = Field(
        None, ge=-1, le=1, description="dense, hybrid: passages whose cosine similarity to the query is below this "
        "are left out of the dense ranking; null: the nearest top_k always are added.",
    )
    rrf_k: int = Field(60, ge=1, description="hybrid: a passage scores the sum over both rankings of 1 / (rrf_k + rank).")
    embed_batch: int = Field(32, ge=1, le=1024, description="dense, hybrid: passages sent to the engine at once.")

    @field_validator("folder")
    @classmethod
    def _is_folder(cls, value: str) -> str:
        if not Path(value).is_dir():
            raise ValueError(f"{value!r} is not a folder")
        return value


@dataclass(frozen=True)
class Corpus:
    """The passages searched now, as (file, text), with their unit vectors (dense, hybrid) and
    BM25 index (bm25, hybrid); replaced whole when the folder changes, so a search reads one."""

    passages: list[tuple[str, str]]
    vectors: np.ndarray | None = None  # [len(passages), hidden]
    index: object | None = None  # a bm25s.BM25; None when there are no passages

    def by_terms(self, query: str, k: int) -> list[int]:
        """Passage numbers by BM25 score for `query`, best first, at most `k`; none that share no term."""
        import bm25s

        if self.index is None or not query.strip():
            return []
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        found, scores = self.index.retrieve(tokens, k=min(k, len(self.passages)), show_progress=False)
        return [int(i) for i, score in zip(found[0], scores[0]) if score > 0]


class FolderRetrieval(ContextProvider):
    name = "folder_retrieval"
    options_model = FolderRetrievalOptions

    def __init__(self, options: FolderRetrievalOptions) -> None:
        super().__init__(options)
        self.corpus = Corpus([])
        self.vectors = PassageVectors(Path(options.folder), options.patterns, options.passage_chars, options.embed_batch)
        self._refreshing = anyio.Lock()
        if options.method == "bm25":
            passages = list(_passages(Path(options.folder), options.patterns, options.passage_chars))
            self.corpus = Corpus(passages, index=_bm25_index([text for _, text in passages]))
        # dense and hybrid index on their first turn: embedding needs the engine, which a turn brings.

    def search(self, query: str) -> list[tuple[str, str]]:
        """The best passages for `query` by BM25 as (file, text), best first; none that share no term."""
        corpus = self.corpus
        return [corpus.passages[i] for i in corpus.by_terms(query, self.options.top_k)]

    async def retrieve(self, query: str, embed: Embed | None) -> list[tuple[str, str]]:
        """The best passages for `query` by the configured method as (file, text), best first."""
        if not query.strip():
            return []
        if self.options.method == "bm25":
            return await anyio.to_thread.run_sync(self.search, query)  # scoring is numpy work
        if embed is None:
            raise RuntimeError(f"method {self.options.method!r} needs the served model's embeddings "
                               "(ProviderRequest.embed), which this server does not give its context providers")  # fmt: skip
        # Indexing is shielded: a turn that runs out of time still leaves the folder embedded for the next.
        with anyio.CancelScope(shield=True):
            async with self._refreshing:
                if await self.vectors.refresh(embed) or self.corpus.vectors is None:
                    self.corpus = await anyio.to_thread.run_sync(self._build_corpus)
        corpus = self.corpus
        if not corpus.passages:
            return []
        (query_vector,) = await embed([query])
        ranked = dense_ranking(corpus.vectors, query_vector, self.options.min_similarity)
        if self.options.method == "hybrid":
            ranked = reciprocal_rank_fusion([corpus.by_terms(query, FUSION_DEPTH), ranked[:FUSION_DEPTH]], self.options.rrf_k)
        return [corpus.passages[i] for i in ranked[: self.options.top_k]]

    async def provide(self, request: ProviderRequest) -> list[Message]:
        hits = await self.retrieve(request.query, request.embed)
        if not hits:
            return []
        body = "\n\n".join(f"[{name}]\n{text}" for name, text in hits)
        return [{"role": "system", "content": f"{HEADER}\n\n{body}"}]

    def _build_corpus(self) -> Corpus:
        passages, vectors = self.vectors.passages()
        index = _bm25_index([text for _, text in passages]) if self.options.method == "hybrid" else None
        return Corpus(passages, vectors, index)


@dataclass(frozen=True)
class FileVectors:
    stamp: tuple[int, int]  # (mtime_ns, size) when the file was read
    passages: list[str]
    vectors: np.ndarray  # [len(passages), hidden], unit rows


class PassageVectors:
    """The folder's passages and their embeddings, cached by file path with its (mtime, size):
    `refresh` re-reads and re-embeds only the files that are new or changed, and forgets deleted ones."""

    def __init__(self, folder: Path, patterns: list[str], passage_chars: int, batch: int) -> None:
        self.folder, self.patterns, self.passage_chars, self.batch = folder, patterns, passage_chars, batch
        self.files: dict[Path, FileVectors] = {}

    async def refresh(self, embed: Embed) -> bool:
        """Bring the cache up to date with the folder; whether anything changed."""
        stamps = await anyio.to_thread.run_sync(self._stamps)
        gone = [path for path in self.files if path not in stamps]
        for path in gone:
            del self.files[path]
        stale = [path for path, stamp in stamps.items() if path not in self.files or self.files[path].stamp != stamp]
        if stale:
            # Stamps taken before reading: a file that changes meanwhile is stale again next time.
            texts = await anyio.to_thread.run_sync(lambda: {path: self._read(path) for path in stale})
            await self._embed(texts, stamps, embed)
        return bool(gone or stale)

    def passages(self) -> tuple[list[tuple[str, str]], np.ndarray]:
        """Every cached passage as (file, text), files in path order, and their vectors, row for row."""
        files = [(path, self.files[path]) for path in sorted(self.files) if self.files[path].passages]
        passages = [(path.name, text) for path, entry in files for text in entry.passages]
        vectors = np.concatenate([entry.vectors for _, entry in files]) if files else np.zeros((0, 0), np.float32)
        return passages, vectors

    async def _embed(self, texts: dict[Path, list[str]], stamps: dict[Path, tuple[int, int]], embed: Embed) -> None:
        """Embed `texts` in batches of `batch` passages; a file is cached once all of its are done."""
        pending = [(path, text) for path, passages in texts.items() for text in passages]
        done: dict[Path, list] = {path: [] for path in texts}
        for path, passages in texts.items():
            if not passages:
                self.files[path] = FileVectors(stamps[path], [], np.zeros((0, 0), np.float32))
        for start in range(0, len(pending), self.batch):
            chunk = pending[start : start + self.batch]
            for (path, _), vector in zip(chunk, await embed([text for _, text in chunk]), strict=True):
                done[path].append(vector)
                if len(done[path]) == len(texts[path]):
                    self.files[path] = FileVectors(stamps[path], texts[path], _unit_rows(done[path]))

    def _stamps(self) -> dict[Path, tuple[int, int]]:
        stamps = {}
        for path in _files(self.folder, self.patterns):
            try:
                stat = path.stat()
            except FileNotFoundError:  # deleted since it was listed
                continue
            stamps[path] = (stat.st_mtime_ns, stat.st_size)
        return stamps

    def _read(self, path: Path) -> list[str]:
        try:
            return list(_split(path, self.passage_chars))
        except FileNotFoundError:  # deleted since its stamp: no passages now, forgotten next refresh
            return []


def dense_ranking(vectors: np.ndarray, query: Sequence[float], min_similarity: float | None = None) -> list[int]:
    """Rows of `vectors` (unit rows) by cosine similarity to `query`, nearest first; those under
    `min_similarity` left out."""
    similarity = vectors @ _unit_rows([query])[0]
    order = np.argsort(-similarity, kind="stable")
    return [int(i) for i in order if min_similarity is None or similarity[i] >= min_similarity]


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = 60) -> list[int]:
    """The items of `rankings` (each best first) by their summed 1 / (k + rank), rank counted from
    1, best first; ties keep the order in which items first appear (earlier rankings first)."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores, key=lambda item: -scores[item])  # sorted is stable: ties keep first appearance


def _unit_rows(rows: Sequence[Sequence[float]]) -> np.ndarray:
    # Normalized here too: a deployment may set `embeddings.normalize: false`, and cosine needs unit rows.
    matrix = np.asarray(rows, dtype=np.float32)
    return matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)


def _bm25_index(texts: list[str]):
    import bm25s  # imported here: registering the plugin must stay cheap

    if not texts:
        return None
    index = bm25s.BM25()
    index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    return index


def _files(folder: Path, patterns: list[str]) -> list[Path]:
    return sorted({p for pattern in patterns for p in folder.rglob(pattern) if p.is_file()})


def _split(path: Path, size: int):
    """A file's passages: its paragraphs (split at blank lines), merged up to `size` characters."""
    chunk = ""
    for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        paragraph = paragraph.strip()
        if chunk and len(chunk) + len(paragraph) > size:
            yield chunk
            chunk = ""
        chunk = f"{chunk}\n\n{paragraph}".strip() if paragraph else chunk
    if chunk:
        yield chunk


def _passages(folder: Path, patterns: list[str], size: int):
    for path in _files(folder, patterns):
        for text in _split(path, size):
            yield path.name, text


@hookimpl
def register_context_providers(register):
    register(FolderRetrieval.name, FolderRetrieval)
