"""The example plugin packages, pip-installed into the venv: discovery, the deployment YAML, and
generations on a tiny random model (fp32) with each plugin switched on and off per request."""

from __future__ import annotations

import asyncio
import importlib.metadata
import random
import threading

import anyio
import pytest
from example_plugins import EXAMPLES, install_example_plugins

from cadenza import LLM
from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.runtime.build import build_runtime
from cadenza.runtime.plugins import resolve_plugins
from cadenza.runtime.registries import ALLOWLIST_ENV, ENTRY_POINT_GROUP, load_registries
from cadenza.sampling_params import SamplingParams

DEPLOYMENT = EXAMPLES / "deployment.yaml"
PROCESSORS = ["banned_words", "min_tokens", "logit_bias", "penalties", "temperature", "min_p", "top_k_top_p"]


@pytest.fixture(scope="module", autouse=True)
def installed():
    return install_example_plugins()


def make_runtime(path, **overrides):
    settings = {"model.path": str(path), "model.dtype": "float32", "cache.block_size": 8, "cache.num_blocks": 256}
    settings.update(overrides)
    return build_runtime(load_config(None, overrides=settings, env={}))


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def banned(*words, **kw):
    return {"banned_words": {"words": list(words), **kw}}


async def collect(engine, prompt, params, **kw):
    text, tokens, last = [], [], None
    async for out in engine.generate(prompt, params, **kw):
        text.append(out.text)
        tokens.extend(out.token_ids)
        last = out
    return "".join(text), tokens, last


def when_requests_leave(pipeline, request_ids) -> threading.Event:
    """Set once the runner has told the pipeline that every one of `request_ids` left."""
    done, waiting, finish = threading.Event(), set(request_ids), pipeline.finish_requests

    def tracking(ids):
        finish(ids)
        waiting.difference_update(ids)
        if not waiting:
            done.set()

    pipeline.finish_requests = tracking
    return done


async def run_all(engine, jobs):
    """[(prompt, params)] -> [(text, tokens, last)], all submitted at once (one batch)."""
    results = [None] * len(jobs)

    async def one(i):
        results[i] = await collect(engine, *jobs[i], request_id=f"job{i}")

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(one, i)
    return results


# --- packaging and discovery --------------------------------------------------------------------


def test_each_example_is_a_package_with_an_entry_point(installed):
    group = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    for dist_name, module in installed.items():
        dist = importlib.metadata.distribution(dist_name)
        assert (EXAMPLES / dist_name / "pyproject.toml").is_file() and (EXAMPLES / dist_name / "README.md").is_file()
        (ep,) = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        assert ep.value == module and group[ep.name].value == module


def test_installed_plugins_register_through_their_entry_points():
    registries = load_registries()
    assert registries.logits_processors.source_of("banned_words") == "entry point banned_words"
    assert registries.eviction_policies.source_of("pinned_prefix") == "entry point pinned_prefix"


def test_allowlist_picks_which_installed_plugins_load():
    only_banned = load_registries(env={ALLOWLIST_ENV: "banned_words"})
    assert "banned_words" in only_banned.logits_processors
    assert "pinned_prefix" not in only_banned.eviction_policies
    none = load_registries(env={ALLOWLIST_ENV: ""})
    assert "banned_words" not in none.logits_processors


def test_deployment_yaml_uses_both_and_validates():
    config = load_config(DEPLOYMENT, env={})
    assert config.model.path is None
    assert config.cache.eviction_policy == "pinned_prefix"
    assert config.sampling.logits_processors[0] == "banned_words"
    plugins = resolve_plugins(config)  # names and plugin_options, without loading the model
    assert plugins.eviction_policy.name == "pinned_prefix"
    assert plugins.options["pinned_prefix"].pinned_blocks == 8
    assert plugins.options["banned_words"].words == []


def test_deployment_runs_on_a_tiny_model(model_path):
    config = load_config(DEPLOYMENT, overrides={"model.path": str(model_path), "model.dtype": "float32"}, env={})
    with LLM(config=config) as llm:
        assert type(llm.engine.cache_core.policy).name == "pinned_prefix"
        off, on = (o.outputs[0] for o in llm.generate([[5, 6, 7], [5, 6, 7]], [greedy(12), greedy(12, extra=banned("e"))]))
        assert off.finish_reason == on.finish_reason == "length"
        assert "e" not in on.text


def test_bad_plugin_options_name_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(DEPLOYMENT.read_text().replace("pinned_blocks: 8", "pinned_blocks: -1"))
    with pytest.raises(ValueError, match=r"plugin_options\.pinned_prefix\.pinned_blocks: .*greater than or equal to 0"):
        resolve_plugins(load_config(path, env={}))
    config = load_config(None, overrides={"plugin_options": {"pinned_prefx": {}}}, env={})
    with pytest.raises(ValueError, match=r"plugin_options\.pinned_prefx: no plugin registers 'pinned_prefx'.*pinned_prefix"):
        resolve_plugins(config)
    config = load_config(None, overrides={"plugin_options": {"lru": {"x": 1}}}, env={})
    with pytest.raises(ValueError, match=r"plugin_options\.lru: 'lru' takes no options"):
        resolve_plugins(config)


# --- banned words --------------------------------------------------------------------------------


def straddling_word(pieces, tokens) -> str:
    """A word spelled across a token boundary of `tokens`: the end of one token and the start of
    the next (ASCII, so it is a clean substring of the text)."""
    for j in range(len(tokens) - 1):
        a, b = pieces[tokens[j]], pieces[tokens[j + 1]]
        if a and b and (a + b).isascii() and (a[-2:] + b[:2]).strip():
            return (a[-2:] + b[:2]).decode()
    raise AssertionError(f"no ASCII token boundary in {tokens}")


def completing_token(pieces, tokens, word: str) -> int:
    """The index of the token that completes the first occurrence of `word`."""
    spelled = b"".join(pieces[t] for t in tokens)
    end = spelled.index(word.encode()) + len(word.encode())
    size = 0
    for k, token in enumerate(tokens):
        size += len(pieces[token])
        if size >= end:
            return k
    raise AssertionError("unreachable")


def brute_force_banned(pieces, output, words) -> set[int]:
    """Tokens after which some word occurs in the output's bytes, ending in that token."""
    text = b"".join(pieces[t] for t in output)
    return {
        t for t, piece in enumerate(pieces)
        if any((text + piece).find(w, max(0, len(text) - len(w) + 1)) != -1 for w in words)
    }  # fmt: skip


@pytest.mark.parametrize("seed", range(20))
def test_banned_next_is_exactly_the_completing_tokens(seed):
    from cadenza_banned_words import BannedWords, VocabIndex

    rng = random.Random(seed)
    alphabet = [b"a", b"b", b"c", b" ", "\u00e9".encode(), b"\xc3", b"\xa9"]  # with a split character
    pieces = [b""] + list(dict.fromkeys(b"".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(60)))
    words = [b"".join(rng.choices(alphabet[:5], k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
    banned = BannedWords([w.decode(errors="ignore") or "a" for w in words], VocabIndex(pieces), ignore_case=False)
    encoded = [(w.decode(errors="ignore") or "a").encode() for w in words]
    for _ in range(20):
        output = [rng.randrange(len(pieces)) for _ in range(rng.randint(0, 6))]
        assert set(banned.banned_next(output).tolist()) == brute_force_banned(pieces, output, encoded)


@pytest.mark.anyio
async def test_banned_word_across_tokens_is_never_generated_and_off_is_untouched(model_path):
    runtime = make_runtime(model_path, **{"sampling.logits_processors": PROCESSORS})
    processor = runtime.runner.sampling_pipeline.processors[0]
    prompts = [[10 + i, 11, 12, 13] for i in range(4)]
    async with AsyncEngine.serve(runtime) as engine:
        reference = await run_all(engine, [(p, greedy(24)) for p in prompts])
        words = [straddling_word(processor._index(False).pieces, tokens) for _, tokens, _ in reference]
        assert all(w in text for w, (text, _, _) in zip(words, reference))
        # One batch: rows 0 and 2 ban their word, row 1 says false, row 3 leaves extra out.
        jobs = [
            (prompts[0], greedy(24, extra=banned(words[0]))),
            (prompts[1], greedy(24, extra={"banned_words": False})),
            (prompts[2], greedy(24, extra=banned(words[2].upper(), ignore_case=True))),
            (prompts[3], greedy(24)),
        ]
        left = when_requests_leave(runtime.runner.sampling_pipeline, ["job0", "job1", "job2"])
        results = await run_all(engine, jobs)
        assert await anyio.to_thread.run_sync(left.wait, 30)
        # Every request told the processor it left: no per-request state outlives its request.
        assert runtime.runner.sampling_pipeline.num_joined == 0 and not processor.request_params
    pieces = processor._index(False).pieces
    for i in (0, 2):
        text, tokens, last = results[i]
        assert words[i] not in text and last.finish_reason == "length" and len(tokens) == 24
        # Greedy: identical up to the token that would have completed the word, and not after.
        first_change = next(k for k, (x, y) in enumerate(zip(tokens, reference[i][1])) if x != y)
        assert first_change == completing_token(pieces, reference[i][1], words[i])
    for i in (1, 3):
        assert results[i][:2] == reference[i][:2]


@pytest.mark.anyio
async def test_sampled_rows_never_produce_a_banned_word(model_path):
    runtime = make_runtime(model_path, **{"sampling.logits_processors": PROCESSORS})
    pieces = runtime.runner.sampling_pipeline.processors[0]._index(False).pieces
    rng = random.Random(3)
    async with AsyncEngine.serve(runtime) as engine:
        free = await run_all(engine, [([rng.randrange(3, 300)], SamplingParams(max_tokens=40, seed=i, ignore_eos=True)) for i in range(8)])
        # The commonest two-character strings of free sampling: banning them must cost something.
        text = "".join(t for t, _, _ in free)
        pairs = sorted({text[k : k + 2] for k in range(len(text) - 1) if text[k : k + 2].isascii()}, key=text.count)[-3:]
        jobs = [([rng.randrange(3, 300)], SamplingParams(max_tokens=40, seed=i, ignore_eos=True, extra=banned(*pairs))) for i in range(8)]
        for text, tokens, last in await run_all(engine, jobs):
            spelled = b"".join(pieces[t] for t in tokens).decode(errors="replace")
            assert last.finish_reason == "length" and not any(p in spelled for p in pairs), (pairs, spelled)


@pytest.mark.anyio
async def test_bad_params_fail_only_that_request_naming_the_field(model_path):
    runtime = make_runtime(model_path, **{"sampling.logits_processors": PROCESSORS})
    async with AsyncEngine.serve(runtime) as engine:
        bad, unknown, wrong_type, good = await run_all(
            engine,
            [
                ([5, 6], greedy(4, extra={"banned_words": {"words": [""]}})),
                ([5, 6], greedy(4, extra={"no_repeat": {}})),
                ([5, 6], greedy(4, extra={"banned_words": ["x"]})),
                ([5, 6], greedy(4, extra=banned("zz"))),
            ],
        )
    assert bad[2].finish_reason == "error" and "extra.banned_words.words[0]: String should have at least 1 character" in bad[2].error
    assert unknown[2].finish_reason == "error" and "extra.no_repeat" in unknown[2].error and "banned_words" in unknown[2].error
    assert wrong_type[2].finish_reason == "error" and "extra.banned_words: expected an object" in wrong_type[2].error
    assert good[2].finish_reason == "length" and len(good[1]) == 4


def test_banned_words_through_the_llm_api(model_path):
    with LLM(model_path, dtype="float32", block_size=8, num_blocks=128, logits_processors=PROCESSORS) as llm:
        off = llm.generate([[7, 8, 9]], greedy(16))[0].outputs[0]
        word = next(off.text[k : k + 2] for k in range(len(off.text)) if off.text[k : k + 2].isalpha() and off.text[k : k + 2].isascii())
        on, again = (o.outputs[0] for o in llm.generate([[7, 8, 9], [7, 8, 9]], [greedy(16, extra=banned(word)), greedy(16)]))
        assert word in off.text and word not in on.text and again.token_ids == off.token_ids


# --- pinned prefix -------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["pinned_prefix", "lru"])
async def test_system_prompt_survives_a_burst_only_when_pinned(model_path, policy):
    """16 blocks of 8 tokens. The system prompt (2 blocks) is shared by two requests, then eight
    one-off requests cycle the cache; a third request with the prompt then hits it only if pinned."""
    runtime = make_runtime(
        model_path,
        **{"cache.num_blocks": 16, "cache.eviction_policy": policy, "plugin_options": {"pinned_prefix": {"pinned_blocks": 2}}},
    )
    rng = random.Random(5)
    system = [rng.randrange(3, 300) for _ in range(16)]
    async with AsyncEngine.serve(runtime) as engine:
        for i in range(2):
            await collect(engine, system + [20 + i, 21, 22], greedy(4))
        for _ in range(8):
            _, _, last = await collect(engine, [rng.randrange(3, 300) for _ in range(40)], greedy(8))
            assert last.finish_reason == "length"
        _, _, last = await collect(engine, system + [30, 31, 32], greedy(4))
        await engine.settle()
        engine.cache_core.check_invariants()
    assert last.num_cached_tokens == (16 if policy == "pinned_prefix" else 0)


def test_pinned_blocks_go_last_least_reused_first():
    from cadenza_pinned_prefix import PinnedPrefixOptions, PinnedPrefixPolicy

    policy = PinnedPrefixPolicy(PinnedPrefixOptions(pinned_blocks=1))
    for block, position in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        policy.on_cached(block, position)
    policy.on_acquire(0)  # block 0 (a shared system prompt) was reused
    for block in (0, 1, 2, 3):
        policy.on_release(block)
    assert policy.pinned == {0, 2} and len(policy) == 4
    assert [policy.pop_victim() for _ in range(4)] == [1, 3, 2, 0]
    assert len(policy) == 0 and policy.pinned == set()


def test_pinned_blocks_are_kept_in_the_tiers_kept_in_names(tmp_path):
    """In the KV budget pinned blocks go last; in the disk tier, with kept_in: [disk], never: a
    burst of other blocks leaves the system prompt's block on disk (across a restart too), and a
    tier full of pinned blocks skips new writes."""
    from cadenza_pinned_prefix import PinnedPrefixOptions, PinnedPrefixPolicy

    from cadenza.kv_tiers import DiskTier, model_identity
    from cadenza.kv_tiers.disk import HEADER

    options = PinnedPrefixOptions(pinned_blocks=1, kept_in=["disk"])

    def policy(tier):
        built = PinnedPrefixPolicy(options)
        built.tier = tier  # as cadenza sets it (`Runtime.make_eviction_policy`)
        return built

    for tier in (None, "host"):  # not named by kept_in: evicted last, never kept
        evicted_last = policy(tier)
        for block, position in [(0, 0), (1, 1)]:
            evicted_last.on_cached(block, position)
            evicted_last.on_release(block)
        assert len(evicted_last) == 2 and [evicted_last.pop_victim(), evicted_last.pop_victim()] == [1, 0]

    identity = model_identity("weights", dtype="float32", block_size=8, kv_dtype="float32")
    size = 2 * (HEADER.size + 100)
    disk = DiskTier(tmp_path, size, identity, policy("disk"))
    system = b"system prompt".ljust(16, b"\0")
    assert disk.put(system, b"s" * 100, 0)
    for i in range(6):  # a burst of other blocks: each pushes the one before out
        assert disk.put(i.to_bytes(16, "little"), bytes([i]) * 100, 1 + i)
    assert system in disk and len(disk) == 2 and disk.stats.evicted == 5
    restarted = DiskTier(tmp_path, size, identity, policy("disk"))  # the position is in the file
    assert restarted.put(b"another first".ljust(16, b"\0"), b"f" * 100, 0)  # the last unpinned block goes
    assert not restarted.put(b"one more".ljust(16, b"\0"), b"m" * 100, 3) and restarted.stats.writes_skipped == 1
    assert restarted.get(system) == b"s" * 100


# --- through the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_server(model_path):
    from server_process import running_server

    with running_server(model_path, "--config", str(DEPLOYMENT)) as server:
        yield server


def first_ascii_pair(text: str) -> str:
    return next(text[k : k + 2] for k in range(len(text)) if text[k : k + 2].isalpha() and text[k : k + 2].isascii())


def test_openai_api_passes_extra_body_to_the_plugin(plugin_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=plugin_server.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id

    def complete(**extra_body):
        out = client.completions.create(model=model, prompt=[7, 8, 9], max_tokens=16, temperature=0, extra_body={"ignore_eos": True, **extra_body})
        return out.choices[0].text

    off = complete()
    word = first_ascii_pair(off)
    assert word not in complete(extra={"banned_words": {"words": [word]}})
    assert complete(extra={"banned_words": False}) == off


@pytest.mark.anyio
async def test_websocket_generate_passes_sampling_extra_to_the_plugin(plugin_server):
    import json

    from websockets.asyncio.client import connect

    async with connect(plugin_server.ws_url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"

        async def generate(request_id, **sampling):
            message = {"type": "generate", "request_id": request_id, "token_ids": [7, 8, 9],
                       "sampling": {"temperature": 0, "max_tokens": 16, "ignore_eos": True, **sampling}}  # fmt: skip
            await ws.send(json.dumps(message))
            text = []
            while True:
                reply = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if reply.get("request_id") != request_id:
                    continue
                if reply["type"] == "delta":
                    text.append(reply["text"])
                elif reply["type"] in ("done", "error"):
                    return "".join(text), reply

        off, _ = await generate("off")
        word = first_ascii_pair(off)
        on, done = await generate("on", extra={"banned_words": {"words": [word]}})
        assert done["type"] == "done" and word not in on


def test_bad_plugin_params_are_a_400_naming_the_field(plugin_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=plugin_server.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", max_tokens=4, extra_body={"extra": {"banned_words": {"words": [""]}}})
    assert bad.value.status_code == 400
    assert bad.value.body["code"] == "invalid_extra" and "extra.banned_words.words" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model=model, prompt="hi", max_tokens=4, extra_body={"extra": {"no_such_plugin": {}}})
    assert "banned_words" in unknown.value.body["message"]  # the known names are listed
