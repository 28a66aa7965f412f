"""What the fuzz tests share: the fuzzed servers' settings, hypothesis settings, strategies for
sampling values that mix valid and invalid ones, and per field a table of values to be refused."""

from __future__ import annotations

import math

from hypothesis import HealthCheck
from hypothesis import strategies as st

from cadenza.sampling_params import BOUNDS, SEED_MAX, SEED_MIN, Bound

# Every fuzz test: no deadline (a server answers), the same cases every run, nothing kept between
# runs, and no health check (slow data generation is not a failure here).
FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))

# The fuzzed servers: a short context and tiny default max_tokens keep every generating case cheap,
# whatever max_tokens or n it asks for; one compute thread leaves the other core to the fuzzer;
# PyTorch's kernels rather than cadenza's spare a compile (half a minute) after their sources change.
FUZZ_SERVER_ARGS = ("--num-threads", "1")
FUZZ_ENV = {
    "CADENZA_MODEL__MAX_MODEL_LEN": "48",
    "CADENZA_SAMPLING__DEFAULTS__MAX_TOKENS": "2",
    "CADENZA_MODEL__CPU_KERNELS": '"off"',  # quoted: YAML reads a bare off as false
}
VOCAB_SIZE = 320  # tests/tiny_models.py

NASTY_NUMBERS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 2**63, -(2**63) - 1, 2**64, 10**30]),
    st.floats(),
    st.integers(),
)
WRONG_TYPES = st.one_of(
    st.booleans(),
    st.text(max_size=6),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
)


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """About four values in five from `valid`, so that a request with a few such fields still
    often gets through to generation."""
    # sampled_from picks evenly (st.integers favours its bounds) and shrinks towards the valid side.
    return st.sampled_from([valid, valid, valid, valid, invalid]).flatmap(lambda chosen: chosen)


def _number(valid: st.SearchStrategy) -> st.SearchStrategy:
    return mostly(st.one_of(valid, st.none()), st.one_of(NASTY_NUMBERS, WRONG_TYPES))


TOKEN_IDS = st.integers(0, VOCAB_SIZE - 1)
BAD_TOKEN_IDS = st.integers(-3, -1) | st.integers(VOCAB_SIZE, VOCAB_SIZE + 3) | st.just(2**70)
STOP = st.text(min_size=1, max_size=4)
PLUGINS = st.sampled_from(["min_p", "temperature", "nope", ""])
EXTRA = st.dictionaries(PLUGINS, st.dictionaries(st.text(max_size=3), st.integers()), max_size=2)

# SamplingOverrides' fields: mostly valid values (max_tokens kept tiny), else NaN, infinities, huge
# numbers, wrong types, empty strings, token ids outside the vocabulary, plugins that do not run.
SAMPLING = {
    # 2**70 is valid: it generates up to the context's end (a few tokens on the fuzz servers)
    "max_tokens": mostly(st.integers(1, 4), st.sampled_from([0, -1, 1.5, 2**70, "2", math.nan]) | WRONG_TYPES),
    "min_tokens": mostly(st.integers(0, 1), st.sampled_from([-1, 10**6, 1.5]) | WRONG_TYPES),
    "temperature": _number(st.floats(0, 2)),
    "top_p": _number(st.floats(0, 1, exclude_min=True)),
    "top_k": _number(st.integers(-1, VOCAB_SIZE + 5)),
    "min_p": _number(st.floats(0, 1)),
    "repetition_penalty": _number(st.floats(0.5, 2)),
    "presence_penalty": _number(st.floats(-2, 2)),
    "frequency_penalty": _number(st.floats(-2, 2)),
    "seed": _number(st.integers(SEED_MIN, SEED_MAX)),
    "stop": mostly(STOP | st.lists(STOP, max_size=3), st.sampled_from(["", [""], [1], 5])),
    "stop_token_ids": mostly(
        st.lists(TOKEN_IDS, max_size=3),
        st.lists(BAD_TOKEN_IDS | st.text(max_size=2), min_size=1, max_size=2) | WRONG_TYPES,
    ),
    "logit_bias": mostly(
        st.dictionaries(TOKEN_IDS.map(str), st.floats(-100, 100), max_size=3),
        st.dictionaries(
            BAD_TOKEN_IDS.map(str) | st.text(max_size=4),
            st.floats(-100, 100) | NASTY_NUMBERS | st.text(max_size=3),
            min_size=1,
            max_size=2,
        )
        | WRONG_TYPES,
    ),
    "ignore_eos": mostly(st.booleans(), WRONG_TYPES),
    "include_stop_str_in_output": mostly(st.booleans(), WRONG_TYPES),
    "skip_special_tokens": mostly(st.booleans(), WRONG_TYPES),
    "logprobs": mostly(st.integers(0, 20), st.sampled_from([-1, 21, 1.5]) | WRONG_TYPES),
    "prompt_logprobs": mostly(st.integers(0, 20), st.sampled_from([-1, 21, 1.5]) | WRONG_TYPES),
    "extra": mostly(st.just({}), EXTRA | WRONG_TYPES),
}


def sampling(fields=tuple(SAMPLING), max_size: int = 4, table: dict = SAMPLING) -> st.SearchStrategy[dict]:
    """A few sampling fields, each with a value from its mixed strategy in `table`."""
    names = st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=max_size)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({name: table[name] for name in chosen}))


# Values each sampling field must refuse, whatever else the request says. (Strings of digits and
# 0/1 for booleans are left out: pydantic's lax mode reads "3" as 3 and 1 as true, by design.)
NOT_NUMBERS = [math.nan, math.inf, -math.inf, "x", [1], {"a": 1}]
INVALID_SAMPLING = {
    "max_tokens": [0, -1, 1.5, *NOT_NUMBERS],
    "min_tokens": [-1, -(10**30), 1.5, *NOT_NUMBERS],
    "temperature": [-0.1, -1e308, *NOT_NUMBERS],
    "top_p": [0, -0.5, 1.01, 1e308, *NOT_NUMBERS],
    "top_k": [-2, -(10**30), 1.5, *NOT_NUMBERS],
    "min_p": [-0.01, 1.01, *NOT_NUMBERS],
    "repetition_penalty": [0, -1, *NOT_NUMBERS],
    "presence_penalty": [2.01, -2.01, 1e308, *NOT_NUMBERS],
    "frequency_penalty": [2.01, -2.01, -1e308, *NOT_NUMBERS],
    "seed": [SEED_MIN - 1, SEED_MAX + 1, 10**40, 1.5, *NOT_NUMBERS],
    "stop": [5, [1], [""], "", {"a": 1}, [None], True],
    "stop_token_ids": [[-1], "x", [1.5], [None], 5, {"a": 1}],
    "logit_bias": [
        {"abc": 1}, {"-1": 1}, {"": 1}, {"5": 101}, {"5": -100.5}, {"5": math.nan}, {"5": math.inf},
        {"5": "x"}, [], "x", 3,
    ],  # fmt: skip
    "ignore_eos": ["x", [], {}, 2, 0.5],
    "include_stop_str_in_output": ["x", [], 2],
    "skip_special_tokens": ["x", {}, -1],
    "logprobs": [-1, 21, 1.5, *NOT_NUMBERS],
    "prompt_logprobs": [-1, 21, 1.5, *NOT_NUMBERS],
    "extra": [[], "x", 3],
}
# Values the request models accept but the engine's ingress refuses: token ids beyond the
# vocabulary, parameters for plugins that do not run.
REFUSED_BY_ENGINE = {
    "stop_token_ids": [[VOCAB_SIZE], [2**70]],
    "logit_bias": [{str(VOCAB_SIZE): 1}, {str(2**70): 1}],
    "extra": [{"nope": {}}, {"": None}],
}


def outside(bound: Bound) -> st.SearchStrategy:
    """Numbers outside `bound` (sampling_params.BOUNDS: the one definition of every range)."""
    below, above = [], []
    if bound.low is not None:
        if bound.integer:
            below.append(st.integers(max_value=math.ceil(bound.low) - (0 if bound.low_open else 1)))
        else:
            below.append(st.floats(max_value=bound.low, exclude_max=not bound.low_open))
    if bound.high is not None:
        if bound.integer:
            above.append(st.integers(min_value=int(bound.high) + 1))
        else:
            above.append(st.floats(min_value=bound.high, exclude_min=True))
    return st.one_of(*below, *above)


def out_of_bounds(fields=None, rename: dict[str, str] | None = None) -> st.SearchStrategy[tuple[str, object]]:
    """(field, value) with the value outside the field's bound; `rename` gives a protocol's names."""
    wrapped = {"logit_bias": lambda v: {"5": v}, "stop_token_ids": lambda v: [v]}  # bounds of each item
    pairs = [
        st.tuples(st.just((rename or {}).get(name, name)), outside(bound).map(wrapped.get(name, lambda v: v)))
        for name, bound in BOUNDS.items()
        if fields is None or name in fields
    ]
    return st.one_of(*pairs)
