"""The incremental detokenizer: emitted text is always final (never a broken character, never a
stop string before it is detected), chunking cannot change it, and the actor finishes each request
exactly once. Runs on the real SmolLM2 tokenizer (from the embedded GGUF) and the tiny byte-level BPE."""

import random

import anyio
import gguf
import pytest
from tiny_models import build_tokenizer

from cadenza.actors.detokenizer import DetokenizerActor, IncrementalDetokenizer
from cadenza.actors.messages import (
    AbortRequest,
    NewTokens,
    RequestFailed,
    StepTokens,
    TrackRequest,
    UnexpectedMessageError,
)
from cadenza.metrics import EngineMetrics
from cadenza.models.default_model import default_model_path
from cadenza.models.gguf_tokenizer import tokenizer_from_gguf
from cadenza.models.tokenizer import Tokenizer
from cadenza.outputs import TextDelta, TokenLogprob
from cadenza.sampling_params import SamplingParams

HARD_TEXTS = [
    "family 👨\u200d👩\u200d👧\u200d👦, thumbs 👍🏽, rainbow 🏳️\u200d🌈, flags 🇯🇵🇫🇷🇺🇸 🙂",
    "日本語のテキスト、中文字符与标点。한국어 문장 你好世界",
    "مرحبا بالعالم — שלום עולם — नमस्ते",
    "e\u0301 n\u0303 a\u030a\u0323 Z\u0351\u0307\u0300 o\u0308\u0304 combining marks",
    "def f(x):\n\tif x:\n\t\treturn '\\t'\r\n    pass\n\n",
    "odd\u00a0spaces\u2003here\u200b and\u3000ideographic  \x0b\x0c \n\n\n   ",
    "<|im_start|>user\nhi 👋<|im_end|>\n<|im_start|>assistant\n你好<|im_end|>",
    "math ∑∫√∞ ≠ ≤ ≥ ∂x/∂y 𝔸𝕓𝒸 𝟘 and a lone \ufffd replacement",
    "The quick brown fox jumps over the lazy dog.",
]
SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def smollm2():
    loaded = tokenizer_from_gguf(gguf.GGUFReader(str(default_model_path())))
    return Tokenizer(backend=loaded.tokenizer, eos_token_ids=(loaded.eos_token_id,), bos_token_id=loaded.bos_token_id)


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer(backend=build_tokenizer().backend_tokenizer, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory):
    """A SentencePiece-style ("llama") vocabulary with byte fallback, through our GGUF loader."""
    pieces = ["▁", "a", "x", "▁a", "▁x", "你"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # unknown, control, byte, normal
    path = tmp_path_factory.mktemp("spm") / "byte_fallback.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = tokenizer_from_gguf(gguf.GGUFReader(path))
    return Tokenizer(backend=loaded.tokenizer, eos_token_ids=(2,))


@pytest.fixture(params=["smollm2", "tiny"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def make_detokenizer(tokenizer, request_id="r", **params):
    detok = IncrementalDetokenizer(tokenizer)
    detok.start(request_id, SamplingParams(**params))
    return detok


def random_chunks(ids, rng, largest=4):
    chunks, pos = [], 0
    while pos < len(ids):
        size = rng.randint(1, largest)
        chunks.append(tuple(ids[pos : pos + size]))
        pos += size
    return chunks


def feed(detok, chunks, request_id="r"):
    """(piece, hit_stop) per chunk; the last chunk finishes the request."""
    return [detok.add(request_id, chunk, i == len(chunks) - 1) for i, chunk in enumerate(chunks)]


def stop_reference(full, stops, include):
    """(final text, where the winning stop starts): read a character at a time, the stop string
    that is complete first wins; of two completing together, the one that starts first."""
    for end in range(1, len(full) + 1):
        done = [s for s in stops if full[:end].endswith(s)]
        if done:
            start = end - max(map(len, done))
            return full[: end if include else start], start
    return full, len(full)


def check_final_pieces(pieces, full):
    """Every prefix of the emitted pieces is a prefix of the final text: nothing emitted is ever
    taken back, so no replacement character is emitted that a later token would have completed."""
    out = ""
    for piece in pieces:
        out += piece
        assert full.startswith(out), (out, full)
        if "\ufffd" not in full:
            assert "\ufffd" not in piece
    assert out == full


# --- text without stop strings --------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_hard_texts_one_token_at_a_time_and_in_random_chunks(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    for text in HARD_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        for chunks in [[(i,) for i in ids]] + [random_chunks(ids, rng) for _ in range(3)]:
            results = feed(make_detokenizer(tokenizer, skip_special_tokens=skip_special_tokens), chunks)
            assert not any(hit for _, hit in results)
            check_final_pieces([piece for piece, _ in results], full)
    # The chat markers inline are special tokens, so the two settings decode differently.
    assert tokenizer.backend.token_to_id("<|im_start|>") in tokenizer.encode(HARD_TEXTS[6], add_special_tokens=False)


def test_complete_text_is_emitted_before_finishing(tokenizer):
    # Nothing is held back once the text ends in a whole character: the finishing flush adds nothing.
    for text in HARD_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = make_detokenizer(tokenizer)
        emitted = "".join(detok.add("r", (i,), False)[0] for i in ids)
        full = tokenizer.decode(ids)
        if not full.endswith("\ufffd"):
            assert emitted == full
            assert detok.add("r", (), True) == ("", False)


def test_character_split_across_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("好🇯🇵", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = make_detokenizer(tokenizer)
    assert [detok.add("r", (i,), False)[0] for i in ids[:cut]] == [""] * cut
    rest = "".join(detok.add("r", (i,), False)[0] for i in ids[cut:])
    assert "\ufffd" not in rest and rest == "好🇯🇵"


def test_truncated_character_is_flushed_as_replacement_at_finish(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = make_detokenizer(tokenizer)
    assert "".join(detok.add("r", (i,), False)[0] for i in ids[:cut]) == ""
    flushed, hit = detok.add("r", (), True)
    assert flushed == tokenizer.decode(ids[:cut]) and "\ufffd" in flushed and not hit


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_reconcile_with_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(99)
    vocab = tokenizer.vocab_size
    # Tokens that are a fragment of a character on their own: sequences of them end mid-character.
    fragments = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i], skip_special_tokens=False)]
    specials = [tokenizer.backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    ends_broken = 0
    for _ in range(300):
        ids = [
            rng.choice(fragments) if roll < 0.6 else rng.choice(specials) if roll < 0.7 else rng.randrange(vocab)
            for roll in (rng.random() for _ in range(rng.randint(1, 12)))
        ]
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        ends_broken += full.endswith("\ufffd")
        results = feed(make_detokenizer(tokenizer, skip_special_tokens=skip_special_tokens), random_chunks(ids, rng, 3))
        check_final_pieces([piece for piece, _ in results], full)
    assert ends_broken > 20, "the sequences must exercise a final flush of a broken character"


def test_byte_fallback_decoder_that_rewrites_emitted_text(byte_fallback):
    # The byte tokens of 你 and then a byte that starts no character: the byte-fallback decoder
    # turns the whole run into replacement characters, rewriting 你, which was final when emitted.
    # The DecodeStream raises from then on; the detokenizer keeps what it emitted and decodes on.
    ids = [byte_fallback.backend.token_to_id(t) for t in ("<0xE4>", "<0xBD>", "<0xA0>", "<0xE5>", "▁x", "▁a")]
    assert byte_fallback.decode(ids) == "\ufffd" * 4 + " x a"
    detok = make_detokenizer(byte_fallback)
    assert [detok.add("r", (i,), False) for i in ids] == [
        ("", False), ("", False), ("你", False), ("", False), ("\ufffd x", False), (" a", False)
    ]
    assert detok.add("r", (), True) == ("", False)


def test_byte_fallback_rewrite_at_finishing_still_flushes_held_bytes(byte_fallback):
    ids = [byte_fallback.backend.token_to_id(t) for t in ("<0x36>", "<0xE4>", "<0x67>")]
    assert byte_fallback.decode(ids) == "\ufffd" * 3, "the whole run, even the 6, is replaced"
    detok = make_detokenizer(byte_fallback)
    pieces = [detok.add("r", (i,), i == ids[-1])[0] for i in ids]
    assert pieces == ["6", "", "\ufffd\ufffd"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_fallback_random_ids(byte_fallback, skip_special_tokens):
    rng = random.Random(7)
    common = [byte_fallback.backend.token_to_id(t) for t in ("▁", "a", "▁x", "你", "<s>", "</s>", "<0xE4>", "<0xBD>", "<0xA0>")]
    rewritten = 0
    for _ in range(400):
        ids = [rng.choice(common) if rng.random() < 0.7 else rng.randrange(byte_fallback.vocab_size) for _ in range(rng.randint(1, 8))]
        texts = [byte_fallback.decode(ids[:n], skip_special_tokens=skip_special_tokens) for n in range(len(ids) + 1)]
        # Raises nothing, whatever the ids.
        results = feed(make_detokenizer(byte_fallback, skip_special_tokens=skip_special_tokens), random_chunks(ids, rng, 3))
        if all(after.startswith(before.rstrip("\ufffd")) for before, after in zip(texts, texts[1:])):
            check_final_pieces([piece for piece, _ in results], texts[-1])
        else:
            rewritten += 1  # a later token changed earlier text: what was emitted stays as it was
    assert rewritten > 20, "the sequences must exercise decoders that rewrite emitted text"


# --- stop strings ---------------------------------------------------------------------------------


def run_stops(tokenizer, ids, chunks, stops, include, skip_special_tokens=True):
    """Feed every chunk (those after a stop are tokens still in flight); check that nothing past
    the point where the winning stop starts is emitted before it is detected."""
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    expected, stop_start = stop_reference(full, stops, include)
    detok = make_detokenizer(tokenizer, stop=stops, include_stop_str_in_output=include, skip_special_tokens=skip_special_tokens)
    out, hits = "", 0
    for piece, hit in feed(detok, chunks):
        if hits:
            assert (piece, hit) == ("", False), "nothing after the stop string, and it is reported once"
        out += piece
        hits += hit
        if not hits:
            assert full[:stop_start].startswith(out), f"leaked past {stop_start}: {out!r} of {full!r}, stops {stops}"
    assert out == expected, (stops, include, full)
    assert hits == (stop_start < len(full)), "a stop string is reported exactly once, when there is one"
    return out, hits


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_text_exactly(tokenizer, include):
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    for stop in ["fox", " brown fox j", "The", "dog.", "o", "k b"]:
        for chunks in ([(i,) for i in ids], [tuple(ids)]):
            out, hits = run_stops(tokenizer, ids, chunks, [stop], include)
            index = SENTENCE.index(stop)
            assert hits == 1 and out == SENTENCE[: index + len(stop) if include else index]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_never_leaks(tiny, include):
    ids = tiny.encode(SENTENCE, add_special_tokens=False)  # The | quick | brown | fox | ...
    detok = make_detokenizer(tiny, stop=["quick brown fox"], include_stop_str_in_output=include)
    pieces = [detok.add("r", (i,), False) for i in ids[:4]]
    last = " quick brown fox"[1:] if include else ""
    assert pieces == [("The", False), (" ", False), ("", False), (last, True)]
    assert [detok.add("r", (i,), False) for i in ids[4:]] == [("", False)] * len(ids[4:])
    assert detok.add("r", (), True) == ("", False)


def test_partial_match_that_is_no_stop_is_released_by_the_next_token(tiny):
    ids = tiny.encode(SENTENCE, add_special_tokens=False)  # The | quick | brown | fox | ...
    detok = make_detokenizer(tiny, stop=["brown fix"])
    emitted = [detok.add("r", (i,), False)[0] for i in ids[:4]]
    assert emitted[:3] == ["The", " quick", " "], "'brown' may begin the stop: held back"
    assert emitted[3] == "brown fox", "' fox' shows it does not: released before finishing"


@pytest.mark.parametrize("reason_token", ["last", "empty"])
def test_hold_back_is_flushed_at_finishing(tiny, reason_token):
    ids = tiny.encode("The lazy dog", add_special_tokens=False)
    detok = make_detokenizer(tiny, stop=["dog!", "xyz"])
    emitted = "".join(detok.add("r", (i,), False)[0] for i in (ids if reason_token == "empty" else ids[:-1]))
    assert emitted in ("The lazy ", "The lazy")
    flushed, hit = detok.add("r", () if reason_token == "empty" else (ids[-1],), True)
    assert emitted + flushed == "The lazy dog" and not hit


def test_earliest_stop_wins_whatever_the_chunking(tiny):
    ids = tiny.encode(SENTENCE, add_special_tokens=False)
    cases = [
        (["lazy", "quick"], "The "),  # earliest in the text, not first in the list
        (["quick brown", "ick"], "The qu"),  # "ick" is complete first, though it starts later
        (["ick", "quick"], "The "),  # both complete together: the one that starts first
    ]
    rng = random.Random(5)
    for stops, expected in cases:
        for chunks in [[(i,) for i in ids], [tuple(ids)]] + [random_chunks(ids, rng) for _ in range(4)]:
            out, hits = run_stops(tiny, ids, chunks, stops, include=False)
            assert (out, hits) == (expected, 1), (stops, chunks)


def test_special_token_as_stop_string(smollm2):
    ids = smollm2.encode("<|im_start|>assistant\nhi there<|im_end|>\nmore", add_special_tokens=False)
    chunks = [(i,) for i in ids]
    assert run_stops(smollm2, ids, chunks, ["<|im_end|>"], False, skip_special_tokens=False) == ("<|im_start|>assistant\nhi there", 1)
    # Skipped special tokens make no text, so they cannot make a stop string either.
    assert run_stops(smollm2, ids, chunks, ["<|im_end|>"], False) == ("assistant\nhi there\nmore", 0)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_stop_strings_on_hard_texts(tokenizer, skip_special_tokens):
    rng = random.Random(2024)
    for text in HARD_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        for _ in range(30):
            stops = []
            for _ in range(rng.randint(1, 3)):
                start = rng.randrange(len(full))
                piece = full[start : start + rng.randint(1, 8)]
                stops.append(piece + "\x07" if rng.random() < 0.4 else piece)  # "\x07": a near miss
            chunks = random_chunks(ids, rng) if rng.random() < 0.7 else [(i,) for i in ids]
            run_stops(tokenizer, ids, chunks, stops, rng.random() < 0.5, skip_special_tokens)


# --- the actor ------------------------------------------------------------------------------------


async def run_actor(tokenizer, messages, scheduler_capacity=8):
    """Drive a DetokenizerActor over real channels; (deltas delivered, messages to the scheduler)."""
    inbox_tx, inbox_rx = anyio.create_memory_object_stream(8)
    scheduler_tx, scheduler_rx = anyio.create_memory_object_stream(scheduler_capacity)
    deltas: list[TextDelta] = []
    actor = DetokenizerActor(inbox_rx, IncrementalDetokenizer(tokenizer), deltas.append, scheduler_tx, EngineMetrics())
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            async with inbox_tx:
                for message in messages:
                    await inbox_tx.send(message)
    scheduler_tx.close()
    async with scheduler_rx:
        sent = [message async for message in scheduler_rx]
    assert actor.state == "stopped"
    return deltas, sent


def token_messages(request_id, ids, finish_reason="length", **first):
    messages = [NewTokens(request_id, (i,), (TokenLogprob(i, -0.5),)) for i in ids]
    messages[0] = NewTokens(request_id, (ids[0],), (TokenLogprob(ids[0], -0.5),), **first)
    messages[-1] = NewTokens(request_id, (ids[-1],), (TokenLogprob(ids[-1], -0.5),), finish_reason)
    return messages


@pytest.mark.anyio
async def test_actor_delivers_text_deltas(tiny):
    ids = tiny.encode("héllo wörld 你好 🙂", add_special_tokens=False)
    first = dict(num_prompt_tokens=7, num_cached_tokens=3, queue_seconds=0.25)
    deltas, sent = await run_actor(
        tiny, [TrackRequest("a", SamplingParams(), (5, 6, 7))] + token_messages("a", ids, **first)
    )
    assert sent == []
    assert "".join(d.text for d in deltas) == tiny.decode(ids)
    assert [d.token_ids for d in deltas] == [(i,) for i in ids]
    assert [d.logprobs[0].token_id for d in deltas] == ids
    assert [d.finish_reason for d in deltas] == [None] * (len(ids) - 1) + ["length"]
    assert (deltas[0].num_prompt_tokens, deltas[0].num_cached_tokens, deltas[0].queue_seconds) == (7, 3, 0.25)
    assert all("\ufffd" not in d.text for d in deltas)


@pytest.mark.anyio
async def test_a_steps_tokens_in_one_message_reach_each_request_in_order(tiny):
    """The scheduler sends a step's tokens as one StepTokens: each request's deltas as if its
    NewTokens had come one by one, interleaved steps included, and a stop string still aborts."""
    a = tiny.encode("héllo wörld 你好", add_special_tokens=False)
    b = tiny.encode(SENTENCE, add_special_tokens=False)[:6]
    steps = [StepTokens(tuple(m for m in (ma, mb) if m is not None))
             for ma, mb in zip(token_messages("a", a) + [None] * len(b), token_messages("b", b, "stop"))]
    steps += [StepTokens(tuple(token_messages("a", a)[len(b):]))] if len(a) > len(b) else []
    deltas, sent = await run_actor(tiny, [TrackRequest("a", SamplingParams(), ()), TrackRequest("b", SamplingParams(stop=["quick"]), ())] + steps)
    text = {rid: "".join(d.text for d in deltas if d.request_id == rid) for rid in "ab"}
    assert text["a"] == tiny.decode(a) and text["b"] == "The "
    assert [d.finish_reason for d in deltas if d.request_id == "b" and d.finish_reason] == ["stop"]
    assert AbortRequest("b", "stop") in sent


@pytest.mark.anyio
async def test_actor_stop_string_aborts_in_scheduler_and_finishes_once(tiny):
    ids = tiny.encode(SENTENCE, add_special_tokens=False)
    messages = [TrackRequest("a", SamplingParams(stop=["brown"]), ())]
    messages += [NewTokens("a", (i,)) for i in ids]  # tokens after the stop were already in flight
    messages += [NewTokens("a", (), finish_reason="stop")]  # the scheduler's answer to the abort
    deltas, sent = await run_actor(tiny, messages)
    assert sent == [AbortRequest("a", "stop")]
    assert "".join(d.text for d in deltas) == "The quick "
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["stop"] and deltas[-1].finish_reason == "stop"


@pytest.mark.anyio
async def test_actor_stop_on_the_last_tokens_needs_no_abort(tiny):
    ids = tiny.encode(SENTENCE, add_special_tokens=False)
    messages = [TrackRequest("a", SamplingParams(stop=["dog"], include_stop_str_in_output=True), ())]
    messages += [NewTokens("a", (i,)) for i in ids[:-2]]
    messages += [NewTokens("a", tuple(ids[-2:]), finish_reason="length")]  # ... | dog | . and the end
    deltas, sent = await run_actor(tiny, messages)
    assert sent == []
    assert "".join(d.text for d in deltas) == SENTENCE[: SENTENCE.index("dog") + 3]
    assert deltas[-1].finish_reason == "stop" and sum(d.finish_reason is not None for d in deltas) == 1


@pytest.mark.anyio
async def test_actor_ignores_unknown_and_finished_requests(tiny):
    ids = tiny.encode("hello", add_special_tokens=False)
    messages = [
        NewTokens("ghost", (ids[0],)),
        TrackRequest("a", SamplingParams(), ()),
        *token_messages("a", ids, finish_reason="length"),
        NewTokens("a", (ids[0],)),
        NewTokens("a", (), finish_reason="abort"),
    ]
    deltas, _ = await run_actor(tiny, messages)
    assert {d.request_id for d in deltas} == {"a"}
    assert "".join(d.text for d in deltas) == "hello"
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]


@pytest.mark.anyio
async def test_actor_request_failed(tiny):
    ids = tiny.encode("hello", add_special_tokens=False)
    messages = [
        RequestFailed("rejected", "queue is full", "queue_full"),  # failed before it was ever tracked
        TrackRequest("a", SamplingParams(), ()),
        NewTokens("a", (ids[0],)),
        RequestFailed("a", "ingress failed: boom"),
        NewTokens("a", (ids[1],), finish_reason="length"),
        TrackRequest("b", SamplingParams(), ()),
        NewTokens("b", (), finish_reason="error", error="out of blocks"),
    ]
    deltas, _ = await run_actor(tiny, messages)
    finished = {d.request_id: d for d in deltas if d.finish_reason}
    assert len(finished) == sum(d.finish_reason is not None for d in deltas) == 3
    assert (finished["rejected"].finish_reason, finished["rejected"].error, finished["rejected"].error_code) == (
        "error", "queue is full", "queue_full"
    )
    assert (finished["a"].finish_reason, finished["a"].error, finished["a"].error_code) == (
        "error", "ingress failed: boom", "internal_error"
    )
    assert (finished["b"].finish_reason, finished["b"].error) == ("error", "out of blocks")
    assert [d.request_id for d in deltas] == ["rejected", "a", "a", "b"]


@pytest.mark.anyio
async def test_actor_rejects_unexpected_message(tiny):
    _, inbox_rx = anyio.create_memory_object_stream(1)
    scheduler_tx, _ = anyio.create_memory_object_stream(1)
    actor = DetokenizerActor(inbox_rx, IncrementalDetokenizer(tiny), lambda delta: None, scheduler_tx, EngineMetrics())
    with pytest.raises(UnexpectedMessageError, match="detokenizer cannot handle AbortRequest"):
        await actor.handle(AbortRequest("a"))


@pytest.mark.anyio
async def test_actor_survives_a_decoder_that_rewrites_emitted_text(byte_fallback):
    ids = [byte_fallback.backend.token_to_id(t) for t in ("<0xE4>", "<0xBD>", "<0xA0>", "<0xE5>", "▁x", "▁a")]
    messages = [TrackRequest("a", SamplingParams(), ()), *token_messages("a", ids), TrackRequest("b", SamplingParams(), ())]
    messages += token_messages("b", ids[:3])
    deltas, _ = await run_actor(byte_fallback, messages)  # the actor stops cleanly: it did not fail
    assert "".join(d.text for d in deltas if d.request_id == "a") == "你\ufffd x a"
    assert "".join(d.text for d in deltas if d.request_id == "b") == "你"
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length", "length"]
