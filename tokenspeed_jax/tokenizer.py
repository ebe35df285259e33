"""Tokenizer: text <-> token ids and chat templates, for HF directories and GGUF files.

One class, ``Tokenizer``, wraps a ``tokenizers.Tokenizer`` plus the few facts the engine needs
beside it: the chat template, the BOS token and the set of end-of-sequence ids. Invariants:

* Whatever the source, the wrapped tokenizer carries its own added/special tokens and its own
  BOS post-processing, so ``encode(text, add_special_tokens=True)`` is all a caller needs, and
  ``save(dir)`` followed by ``from_hf_dir(dir)`` gives back a tokenizer with the same ids, the same
  template and the same ``eos_token_ids``.
* A GGUF tokenizer is rebuilt from the file's metadata alone (llama.cpp's key names); a tokenizer
  model or pre-tokenizer name this module does not know is an error naming it, never a guess.
* Chat templates render in a sandboxed jinja2 environment with HF's settings
  (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``).
* ``encode_chat`` keeps a message's content as text: special-token text typed in it
  (``<|im_start|>system``) is encoded as the characters it is, never as a control token, unless
  the caller allows it; the template's own special tokens stay control tokens.
* ``encode`` releases the GIL while the Rust tokenizer works, so a long prompt tokenized on a
  worker thread does not stall an event loop.
* ``max_token_chars`` bounds the characters one token covers, so ``len(text) / max_token_chars``
  is a lower bound on ``len(encode(text))`` that needs no tokenizing.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from tokenspeed_jax.models.gguf_file import GGUFFile

# Token type codes of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4

# The split rules of the byte-level pre-tokenizers, keyed by the name GGUF stores under
# `tokenizer.ggml.pre`. Each entry is applied in order (each regex splits the pieces the previous
# one produced, matches kept as their own pieces), then bytes are mapped to the BPE alphabet.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SINGLE_DIGIT_SPLIT = r"\p{N}"

GGUF_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2_SPLIT,),
    # StarCoder-lineage vocabularies (SmolLM, SmolLM2 among them) cut every digit on its own first.
    **{
        name: (_SINGLE_DIGIT_SPLIT, _GPT2_SPLIT)
        for name in ("smollm", "starcoder", "refact", "codeshell", "command-r")
    },
    **{
        name: (_LLAMA3_SPLIT,)
        for name in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx")
    },
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen")},
}
# llama.cpp tokenizes a word found whole in the vocabulary as that token for these vocabularies.
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"})

def _token_content(token: Any) -> str | None:
    """HF configs write a special token as a string or as a dict with "content"."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    raise TypeError(f"special token must be a string or a dict with 'content', got {token!r}")


def _select_chat_template(template: Any) -> str | None:
    """HF allows a template string or a list of {"name", "template"}; we use "default"."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        if "default" not in named:
            raise ValueError(
                f"chat_template is a list without a 'default' entry; names: {list(named)}"
            )
        return named["default"]
    raise TypeError(
        f"chat_template must be a string or a list of named templates, got {template!r}"
    )


def _dedupe(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


def _raise_template_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its chat template, BOS and end-of-sequence ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._required_id(bos_token, "bos_token")
        eos_id = self._required_id(eos_token, "eos_token")
        self.eos_token_ids: tuple[int, ...] = _dedupe(
            ([eos_id] if eos_id is not None else []) + list(eos_token_ids)
        )
        vocab_size = self.vocab_size
        bad = [i for i in self.eos_token_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"eos token ids {bad} are outside the vocabulary of {vocab_size}")

    def _required_id(self, token: str | None, name: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{name}={token!r} is not in the vocabulary")
        return token_id

    # ----------------------------------------------------------------------------- loading

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and generation_config.json's eos ids."""
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}")
        backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        generation = _read_json(os.path.join(path, "generation_config.json"))
        template = _select_chat_template(config.get("chat_template"))
        template_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        eos_ids = generation.get("eos_token_id", [])
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file's metadata describes (byte-level BPE)."""
        field = gguf_file.field
        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer model {model!r} is not supported; only 'gpt2' (byte-level BPE) is"
            )
        tokens = field("tokenizer.ggml.tokens")
        token_types = field("tokenizer.ggml.token_type", [])
        pre = field("tokenizer.ggml.pre", "gpt-2")
        backend = byte_level_bpe(
            tokens,
            field("tokenizer.ggml.merges"),
            pre=pre,
            ignore_merges=pre in _IGNORE_MERGES_PRE,
        )
        _add_typed_tokens(backend, tokens, token_types)

        def token_at(key: str) -> str | None:
            token_id = field(key, None)
            if token_id is None:
                return None
            if not 0 <= token_id < len(tokens):
                raise ValueError(f"{key}={token_id} is outside the vocabulary of {len(tokens)}")
            return tokens[token_id]

        bos_token = token_at("tokenizer.ggml.bos_token_id")
        if field("tokenizer.ggml.add_bos_token", False):
            if bos_token is None:
                raise ValueError("GGUF sets add_bos_token but has no tokenizer.ggml.bos_token_id")
            backend.post_processor = _prepend_bos(bos_token, tokens.index(bos_token))
        end_ids = [
            field(key, None)
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        ]
        return cls(
            backend,
            chat_template=field("tokenizer.chat_template", None),
            bos_token=bos_token,
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            eos_token_ids=[i for i in end_ids if i is not None],
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json and the eos ids in generation_config.json.

        An existing generation_config.json keeps its other keys.
        """
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        config = {
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        _write_json(os.path.join(path, "tokenizer_config.json"), config)
        generation_file = os.path.join(path, "generation_config.json")
        generation = _read_json(generation_file)
        generation["eos_token_id"] = list(self.eos_token_ids)
        if self.bos_token_id is not None:
            generation["bos_token_id"] = self.bos_token_id
        _write_json(generation_file, generation)

    # ----------------------------------------------------------------------------- use

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their single ids."""
        # encode_batch releases the GIL while it runs; encode holds it throughout.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token text as ordinary characters."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def _special_text(self) -> re.Pattern[str] | None:
        """Matches any special token's text; None when there are none."""
        texts = sorted((t.content for t in self.backend.get_added_tokens_decoder().values()
                        if t.special), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token covers (the longest vocabulary entry: a
        byte-level entry spells one byte per character, which is at most one text character)."""
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, **context: Any) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template (module docstring);
        ``context`` reaches the template (``tools=[...]``).

        Each message's ``content`` (a string) is encoded as plain text unless
        ``special_tokens_in_content``. Raises ValueError when a template transforms a content
        holding special-token text in a way other than trimming whitespace, so the content
        cannot be found in the rendered text.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        **context)
        pattern = self._special_text
        if (special_tokens_in_content or pattern is None
                or not any(pattern.search(m.get("content") or "") for m in messages)):
            return self.encode(text)
        markers = [f"<content-{uuid.uuid4().hex}>" for _ in messages]
        marked = self.apply_chat_template(
            [{**m, "content": marker} for m, marker in zip(messages, markers)],
            add_generation_prompt=add_generation_prompt, **context)
        ids: list[int] = []
        position = 0
        for message, marker in zip(messages, markers):
            before, found, marked = marked.partition(marker)
            content = message.get("content") or ""
            if not found or not text.startswith(before, position):
                raise ValueError("the chat template does not render message content verbatim, "
                                 "so special-token text in it cannot be kept as plain text")
            position += len(before)
            shown = next((c for c in (content, content.strip(), content.lstrip(),
                                      content.rstrip()) if text.startswith(c, position)), None)
            if shown is None:
                raise ValueError("the chat template changes message content, so special-token "
                                 "text in it cannot be kept as plain text")
            ids += self.encode(before)
            ids += self._plain_backend.encode_batch([shown], add_special_tokens=False)[0].ids
            position += len(shown)
        if text[position:] != marked:
            raise ValueError("the chat template does not render message content verbatim, "
                             "so special-token text in it cannot be kept as plain text")
        return ids + self.encode(marked)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template; extra kwargs reach the template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], *, pre: str, ignore_merges: bool = False
) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer from a vocabulary spelled in GPT-2's byte alphabet.

    ``merges`` are "left right" strings, best first; ``pre`` names the pre-tokenizer split rules
    (a key of ``GGUF_PRE_TOKENIZER_SPLITS``).
    """
    if pre not in GGUF_PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"unknown pre-tokenizer {pre!r}; known: {sorted(GGUF_PRE_TOKENIZER_SPLITS)}"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"vocabulary of {len(tokens)} tokens has {len(vocab)} distinct ones")
    pairs = []
    for merge in merges:
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"merge {merge!r} is not two tokens separated by one space")
        pairs.append(tuple(pair))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges)
    )
    splits = [
        pre_tokenizers.Split(tokenizers.Regex(rule), behavior="isolated")
        for rule in GGUF_PRE_TOKENIZER_SPLITS[pre]
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_typed_tokens(
    backend: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int]
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens; both are
    matched whole in input text, as llama.cpp does."""
    special = [
        tokenizers.AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == GGUF_TOKEN_CONTROL
    ]
    user = [
        tokenizers.AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == GGUF_TOKEN_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _prepend_bos(bos_token: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{bos_token} $A",
        pair=f"{bos_token} $A {bos_token} $B",
        special_tokens=[(bos_token, bos_id)],
    )


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=2)
