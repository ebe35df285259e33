"""Write tests/golden/smollm2_tokenizer.json: token ids from HF transformers' GGUF tokenizer.

Run by hand in an environment with torch + transformers + gguf (never by the tests):

    python scripts/golden_tokenizer.py --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf

The file holds, for a fixed list of strings, the ids transformers produces without special tokens,
and one chat rendering (system + user message, generation prompt) as text and ids, so that the
tests check ``tokenspeed_jax.tokenizer`` against an independent implementation.
"""

from __future__ import annotations

import argparse
import json
import os

GOLDEN_TEXTS = (
    "What is the capital of France?",
    "Hello, world!",
    "naïve café — déjà vu, Straße, Ελληνικά, русский, 日本語の文章、中文。",
    "emoji: 👋🏽 🤖🚀 👨‍👩‍👧‍👦 ❤️",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "tabs\tand   spaces    and\n\n\nnewlines \n  \t end  ",
    "I have 2024 apples and 3.14159 pies; call 555-0123.",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "   leading and trailing   ",
    "can't won't it's we'll they've I'd you're",
)
GOLDEN_MESSAGES = (
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
)


def make_golden(gguf_path: str, out_path: str) -> dict:
    """Tokenize the golden texts and messages with transformers; write them to ``out_path``."""
    import transformers
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    chat_text = tokenizer.apply_chat_template(
        list(GOLDEN_MESSAGES), tokenize=False, add_generation_prompt=True
    )
    golden = {
        "source": f"transformers {transformers.__version__} AutoTokenizer(gguf_file={name!r})",
        "cases": [
            {"text": text, "ids": tokenizer.encode(text, add_special_tokens=False)}
            for text in GOLDEN_TEXTS
        ],
        "chat": {
            "messages": list(GOLDEN_MESSAGES),
            "text": chat_text,
            "ids": tokenizer.encode(chat_text, add_special_tokens=False),
        },
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=1)
    return golden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    default_out = os.path.join(
        os.path.dirname(__file__), "..", "tests", "golden", "smollm2_tokenizer.json"
    )
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    golden = make_golden(args.gguf, args.out)
    print(f"wrote {len(golden['cases'])} cases and one chat rendering to {args.out}")


if __name__ == "__main__":
    main()
