"""Tokenizer (HF dir and GGUF), chat templates and incremental detokenisation.

The SmolLM2 expectations come from tests/golden/smollm2_tokenizer.json, written by
scripts/golden_tokenizer.py with HF transformers' own GGUF tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers

from tokenspeed_jax.detokenizer import IncrementalDetokenizer, check_stop_strings
from tokenspeed_jax.models.gguf_file import GGUFFile
from tokenspeed_jax.models.loader import default_model_path
from tokenspeed_jax.tokenizer import Tokenizer, byte_level_bpe

GOLDEN = json.loads(
    (Path(__file__).parent / "golden" / "smollm2_tokenizer.json").read_text(encoding="utf-8")
)
GOLDEN_TEXTS = [case["text"] for case in GOLDEN["cases"]]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(default_model_path()))


# ------------------------------------------------------------------------------ GGUF metadata


def write_gguf(path: Path, fields: dict) -> GGUFFile:
    """A metadata-only GGUF file with ``fields`` (str, bool, int as uint32, lists as arrays)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return GGUFFile(path)


def test_gguf_file_field_reads_scalars_strings_and_arrays(tmp_path: Path) -> None:
    parsed = write_gguf(
        tmp_path / "fields.gguf",
        {
            "t.name": "héllo wörld",
            "t.flag": True,
            "t.count": 49152,
            "t.words": ["a", "Ġb", "<|im_end|>", "日本"],
            "t.numbers": [3, 1, 4, 1, 5],
        },
    )
    assert parsed.field("t.name") == "héllo wörld"
    assert parsed.field("t.flag") is True
    assert parsed.field("t.count") == 49152
    assert parsed.field("t.words") == ["a", "Ġb", "<|im_end|>", "日本"]
    assert parsed.field("t.numbers") == [3, 1, 4, 1, 5]
    assert parsed.field("general.architecture") == "llama"
    assert parsed.field("t.absent", None) is None
    with pytest.raises(ValueError, match="fields.gguf: GGUF metadata key 't.absent' is missing"):
        parsed.field("t.absent")


BYTES = tokenizers.pre_tokenizers.ByteLevel.alphabet()


def tiny_gpt2_fields(**overrides) -> dict:
    """A byte-level vocabulary: the 256 byte symbols, four merges, a control and a user token."""
    tokens = ["<|end|>", "<think>"] + sorted(BYTES) + ["he", "ll", "hell", "hello", "Ġw"]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 4] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
        "{% endfor %}",
    }
    fields.update(overrides)
    return fields


def test_from_gguf_builds_byte_level_bpe_with_control_and_user_tokens(tmp_path: Path) -> None:
    fields = tiny_gpt2_fields(
        **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.eot_token_id": 1}
    )
    tokens = fields["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "tiny.gguf", fields))
    ids = tok.encode("hello world<think><|end|>", add_special_tokens=True)
    expected = ["<|end|>", "hello", "Ġw", "o", "r", "l", "d", "<think>", "<|end|>"]
    assert ids == [tokens.index(t) for t in expected]
    assert tok.decode(ids) == "hello world<think>"  # only the control token is special
    assert tok.eos_token_ids == (0, 1) and tok.bos_token_id == 0
    assert tok.vocab_size == len(tokens)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|end|>x"


def test_from_gguf_rejects_unsupported_tokenizers(tmp_path: Path) -> None:
    llama = write_gguf(tmp_path / "a.gguf", tiny_gpt2_fields(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(NotImplementedError, match="'llama'"):
        Tokenizer.from_gguf(llama)
    unknown = write_gguf(tmp_path / "b.gguf", tiny_gpt2_fields(**{"tokenizer.ggml.pre": "nope"}))
    with pytest.raises(ValueError, match="unknown pre-tokenizer 'nope'"):
        Tokenizer.from_gguf(unknown)


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt-2", ["abc", "Ġ12345", "!!"]),
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "!!"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "!!"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45", "!!"]),
    ],
)
def test_pre_tokenizer_splits_digits_as_each_vocabulary_expects(pre: str, pieces: list) -> None:
    backend = byte_level_bpe(sorted(BYTES), [], pre=pre)
    assert [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("abc 12345!!")] == pieces


# ------------------------------------------------------------------------------ SmolLM2


def test_smollm2_encodes_like_transformers(smollm2: Tokenizer) -> None:
    for case in GOLDEN["cases"]:
        assert smollm2.encode(case["text"]) == case["ids"], case["text"]
    assert smollm2.encode("What is the capital of France?") == GOLDEN["cases"][0]["ids"]


def test_smollm2_chat_template_matches_transformers(smollm2: Tokenizer) -> None:
    chat = GOLDEN["chat"]
    text = smollm2.apply_chat_template(chat["messages"], add_generation_prompt=True)
    assert text == chat["text"]
    assert smollm2.encode(text) == chat["ids"]


def test_smollm2_decode_round_trips(smollm2: Tokenizer) -> None:
    for text in GOLDEN_TEXTS:
        assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_skippable(smollm2: Tokenizer) -> None:
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    ids = smollm2.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2.decode(ids) == "assistant\nhi"
    assert smollm2.eos_token_ids == (2,) and smollm2.bos_token_id == 1
    assert smollm2.vocab_size == 49152


def test_template_without_messages_gives_the_generation_prompt(smollm2: Tokenizer) -> None:
    assert smollm2.apply_chat_template([]) == "<|im_start|>assistant\n"
    assert smollm2.apply_chat_template([], add_generation_prompt=False) == ""


def test_missing_template_and_template_errors_are_clear(smollm2: Tokenizer) -> None:
    plain = Tokenizer(smollm2.backend, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    strict = Tokenizer(smollm2.backend, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(Exception, match="no system role"):
        strict.apply_chat_template([])


def test_save_and_from_hf_dir_round_trip(smollm2: Tokenizer, tmp_path: Path) -> None:
    smollm2.save(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in GOLDEN_TEXTS:
        assert loaded.encode(text) == smollm2.encode(text)
    assert loaded.chat_template == smollm2.chat_template
    assert loaded.eos_token_ids == smollm2.eos_token_ids
    assert loaded.bos_token_id == smollm2.bos_token_id
    assert loaded.vocab_size == smollm2.vocab_size


def test_from_hf_dir_reads_hf_config_shapes(smollm2: Tokenizer, tmp_path: Path) -> None:
    smollm2.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>", "lstrip": False},
        "eos_token": {"content": "<|endoftext|>"},
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (0, 2)
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_hf_dir(tmp_path).eos_token_ids == (0, 7)


# ------------------------------------------------------------------------------ detokenizer


def stream(tok: Tokenizer, prompt: list[int], output: list[int], **kwargs) -> tuple[list, object]:
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas = []
    for token_id in output:
        deltas.append(detok.add(token_id))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return deltas, detok


def test_streamed_text_equals_one_shot_decode(smollm2: Tokenizer) -> None:
    prompt = smollm2.encode(GOLDEN["chat"]["text"])
    for text in GOLDEN_TEXTS:
        output = smollm2.encode(text)
        deltas, detok = stream(smollm2, prompt, output)
        assert "".join(deltas) == smollm2.decode(output) == detok.text
        assert not any("\ufffd" in delta for delta in deltas)


def test_emoji_split_over_byte_tokens_is_emitted_whole(smollm2: Tokenizer) -> None:
    output = smollm2.encode("ok 🤖!")
    partial = [smollm2.decode(output[: i + 1]) for i in range(len(output))]
    assert sum(text.endswith("\ufffd") for text in partial) >= 1  # the emoji spans byte tokens
    deltas, _ = stream(smollm2, [1], output)
    assert " 🤖" in deltas  # held until its last byte arrived, then emitted at once
    assert "".join(deltas) == "ok 🤖!"


def test_finish_releases_an_incomplete_character(smollm2: Tokenizer) -> None:
    output = smollm2.encode("🤖")[:-1]
    deltas, _ = stream(smollm2, [1], output)
    assert deltas[:-1] == [""] * len(output)
    assert deltas[-1] == smollm2.decode(output) and deltas[-1].endswith("\ufffd")


def test_stop_string_spanning_two_tokens(smollm2: Tokenizer) -> None:
    output = smollm2.encode("The capital is Paris. Done")
    pieces = [smollm2.decode([i]) for i in output]
    assert " is" in pieces and " Paris" in pieces  # "is Pa" starts in one token, ends in the next
    deltas, detok = stream(smollm2, [1], output, stop=["xyz", "is Pa"])
    assert "".join(deltas) == "The capital " == detok.text
    assert detok.stop_reason == "is Pa"
    with pytest.raises(RuntimeError):
        detok.add(output[-1])


def test_check_stop_strings_holds_back_possible_starts() -> None:
    assert check_stop_strings("Hello Wor", ["World!"], 0).emit == "Hello "
    held = check_stop_strings("Hello Wor", ["World!"], 0)
    assert (held.emitted, held.stopped) == (6, False)
    assert check_stop_strings("Hello Wor", ["World!"], 6, final=True).emit == "Wor"
    stopped = check_stop_strings("Hello World!!", ["World!", "lo"], 0)
    assert (stopped.emit, stopped.stop, stopped.emitted) == ("Hel", "lo", 3)
    assert check_stop_strings("abcab", ["abd", "b"], 2).stop == "b"
    with pytest.raises(ValueError, match="emitted=9"):
        check_stop_strings("abc", ["x"], 9)
