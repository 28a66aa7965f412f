"""Per-request output streams: puts never block and coalesce, a slow reader is cut off, and the
final output carries the request's timings."""

import time

import anyio
import pytest

from cadenza.engine.streams import RequestStream
from cadenza.outputs import TextDelta, TokenLogprob

pytestmark = pytest.mark.anyio


def make_delta(text="", token_ids=(), finish_reason=None, logprobs=None, request_id="r", **kw):
    return TextDelta(request_id, text, tuple(token_ids), logprobs, finish_reason, **kw)


def logprob(token_id):
    return TokenLogprob(token_id, -0.1 * token_id, ((token_id, -0.1 * token_id),))


async def test_put_never_blocks_and_deltas_are_merged():
    stream = RequestStream("r", time.monotonic())
    for i in range(10_000):  # no reader at all: every put returns at once
        stream.put(make_delta(str(i % 10), (i,), logprobs=(logprob(i),), num_prompt_tokens=4, num_cached_tokens=2))
    stream.put(make_delta("!", (10_000,), "stop", (logprob(10_000),)))
    out = await stream.get()
    assert out.text == "0123456789" * 1000 + "!"
    assert out.token_ids == tuple(range(10_001))
    assert [lp.token_id for lp in out.logprobs] == list(range(10_001))
    assert (out.finish_reason, out.finished) == ("stop", True)
    assert (out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens) == (4, 10_001, 2)
    assert out.error is None and out.error_code is None


async def test_output_token_count_is_cumulative_across_gets():
    stream = RequestStream("r", time.monotonic())
    stream.put(make_delta("a", (1,), num_prompt_tokens=3))
    stream.put(make_delta("b", (2,)))
    first = await stream.get()
    assert (first.text, first.token_ids, first.num_output_tokens, first.num_prompt_tokens) == ("ab", (1, 2), 2, 3)
    assert first.logprobs is None and not first.finished and first.timings is None
    stream.put(make_delta("", ()))  # a delta with no new text (a held-back piece of a character)
    stream.put(make_delta("cd", (3, 4)))
    stream.put(make_delta("e", (5,), "length"))
    last = await stream.get()
    assert (last.text, last.token_ids, last.num_output_tokens, last.num_prompt_tokens) == ("cde", (3, 4, 5), 5, 3)
    assert last.finish_reason == "length"


async def test_puts_after_finish_are_ignored():
    stream = RequestStream("r", time.monotonic())
    stream.put(make_delta("a", (1,)))
    stream.put(make_delta("b", (2,), "abort"))
    assert stream.finished
    stream.put(make_delta("c", (3,)))
    stream.put(make_delta("", (), "error", error="late", error_code="engine_failed"))
    out = await stream.get()
    assert (out.text, out.token_ids, out.finish_reason, out.error, out.num_output_tokens) == ("ab", (1, 2), "abort", None, 2)
    stream.put(make_delta("d", (4,), "stop"))
    with anyio.move_on_after(0.05) as scope:  # nothing more will ever come
        await stream.get()
    assert scope.cancelled_caught


async def test_slow_reader_is_cut_off():
    stream = RequestStream("r", time.monotonic(), max_pending_tokens=4)
    for i in range(4):
        stream.put(make_delta("x", (i,)))
    assert not stream.finished, "exactly max_pending_tokens behind is still allowed"
    assert (await stream.get()).num_output_tokens == 4
    for i in range(4, 8):  # the limit counts tokens not yet read, not the request's total
        stream.put(make_delta("y", (i,)))
    assert not stream.finished
    stream.put(make_delta("z", (8,)))
    assert stream.finished
    stream.put(make_delta("w", (9,), "length"))
    out = await stream.get()
    assert (out.finish_reason, out.error_code) == ("error", "slow_reader")
    assert out.error and (out.text, out.token_ids) == ("yyyyz", (4, 5, 6, 7, 8))
    assert out.num_output_tokens == 9 and out.timings is not None


async def test_error_is_passed_through():
    stream = RequestStream("r", time.monotonic())
    stream.put(make_delta("", (), "error", error="out of blocks", error_code="sampler_error"))
    out = await stream.get()
    assert (out.finish_reason, out.error, out.error_code) == ("error", "out of blocks", "sampler_error")
    assert out.timings.ttft_seconds is None and out.timings.tpot_seconds is None and out.timings.e2e_seconds >= 0


async def test_timings_on_the_final_output():
    arrival = time.monotonic() - 10.0
    stream = RequestStream("r", arrival)
    stream.put(make_delta("a", (1,), queue_seconds=0.25))
    assert (await stream.get()).timings is None
    stream.put(make_delta("b", (2,)))
    stream.put(make_delta("c", (3, 4), "stop"))
    timings = (await stream.get()).timings
    assert timings.queue_seconds == 0.25
    assert 10.0 <= timings.ttft_seconds <= timings.e2e_seconds
    assert timings.e2e_seconds <= time.monotonic() - arrival
    assert timings.tpot_seconds == pytest.approx((timings.e2e_seconds - timings.ttft_seconds) / 3)


async def test_single_token_has_no_time_per_output_token():
    stream = RequestStream("r", time.monotonic())
    stream.put(make_delta("a", (1,), "length"))
    timings = (await stream.get()).timings
    assert timings.tpot_seconds is None and timings.queue_seconds is None
    assert timings.ttft_seconds == timings.e2e_seconds, "the first token is also the last"


async def test_get_waits_for_a_put():
    stream = RequestStream("r", time.monotonic())
    outputs = []
    waiting, received = anyio.Event(), anyio.Event()

    async def read():
        while True:
            waiting.set()
            outputs.append(await stream.get())
            received.set()
            if outputs[-1].finished:
                return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await waiting.wait()  # the reader is blocked in get(): nothing was put yet
            assert outputs == []
            stream.put(make_delta("a", (1,)))
            stream.put(make_delta("b", (2,)))  # before the reader runs again: merged with "a"
            await received.wait()
            received = anyio.Event()
            stream.put(make_delta("c", (3,), "stop"))
            await received.wait()
    assert [(o.text, o.token_ids, o.finish_reason) for o in outputs] == [("ab", (1, 2), None), ("c", (3,), "stop")]
