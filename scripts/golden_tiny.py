"""Tiny random-weight HF checkpoints and transformers' logits and greedy tokens for them.

Each checkpoint is a complete HF model directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a chat template) written by
``save_pretrained``; beside it, ``<name>.npz`` holds, for two prompts of different lengths:

- ``prompt_ids`` / ``prompt_ids_2``: int32 [T], starting with the BOS token;
- ``logits`` / ``logits_2``: float32 [T, V], one fp32 forward of the whole prompt, eager attention;
- ``greedy_ids`` / ``greedy_ids_2``: int32 [16], the tokens ``generate(do_sample=False,
  max_new_tokens=16)`` appends (never cut short by EOS: a seed whose greedy path hits EOS, repeats
  fewer than ``MIN_DISTINCT_GREEDY`` distinct tokens, or whose top-2 logits come closer than
  ``MIN_GREEDY_MARGIN`` anywhere on it, is rejected for the next one);
- ``greedy_logits`` / ``greedy_logits_2``: float32 [16, V], the logits each greedy token was
  picked from (``generate``'s ``output_logits``: step 0 is the prompt's last position, step i
  the forward of the i-th greedy token through transformers' own KV cache);
- ``greedy_margin`` / ``greedy_margin_2``: float32 [16], top-1 minus top-2 logit at each greedy step.

The goldens are computed from the model reloaded from its directory, so they pin the files as saved.
Positions run past the llama3 rope scaling's ``original_max_position_embeddings`` (32), and the
rope theta of 10000 with head_dim 16 puts frequencies in all three llama3 bands (kept, smoothed,
divided by the factor).
"""

import dataclasses
import json
import pathlib
import shutil
from collections.abc import Callable

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

VOCAB_SIZE = 320
NEW_TOKENS = 16
PROMPT_LENGTHS = (40, 60)
MIN_GREEDY_MARGIN = 1e-2
MIN_DISTINCT_GREEDY = 4
MAX_SEED_TRIES = 50
MAX_DIR_BYTES = 1 << 20
EMBED_STD = 0.1
LINEAR_STD = 0.12
NORM_JITTER = 0.1

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick,
polished the brass, and wrote the weather in a thick leather book: wind from the north-west,
sea state moderate, visibility twelve miles. Ships passed far out, their lamps like slow stars.

A compiler reads a program, builds a tree of its structure, and lowers that tree step by step
into instructions a machine can run. Each pass keeps the meaning of the program while making it
simpler, faster, or closer to the hardware. Good compilers explain their errors in plain words.

In the spring market, farmers sold radishes, early peas, honey in clay jars, and bread still warm
from the oven. Children counted coins at the fruit stall; 3 apples cost 1.20, 7 pears cost 2.45.
An old man played the accordion near the fountain while pigeons argued over crumbs.

Rivers carve valleys over thousands of years. Water carries sand and stones downstream, grinding
the bed deeper after every flood. Where the river slows, it drops its load and builds wide plains
of rich soil, which is why so many towns grew up along the banks of slow, muddy rivers.

"Is the train late again?" she asked. "Twenty minutes," said the porter, checking his watch.
They waited on the cold platform, sharing tea from a flask, until the headlights appeared.
"""

PROMPTS = (
    (
        "The keeper wrote the weather in his book while the ships passed far out at sea, and the "
        "compiler lowered the tree into instructions."
    ),
    (
        "Farmers sold honey and bread in the spring market; the river carried sand downstream and "
        "built wide plains of soil where towns grew. The porter checked his watch on the platform "
        "while the headlights appeared through the cold evening air."
    ),
)


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """One tiny checkpoint: its directory name, a factory for its HF config, and whether its
    config.json spells rope the way pre-5.0 transformers did (``rope_theta`` at the top level,
    scaling in ``rope_scaling``), as most published Llama 3 checkpoints do."""

    name: str
    make_config: Callable[[dict], PretrainedConfig]
    legacy_rope_keys: bool = False


def _special_ids(tokenizer: Tokenizer) -> dict:
    return {
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "pad_token_id": tokenizer.token_to_id(PAD),
    }


def _llama_config(special_ids: dict) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
        **special_ids,
    )


def _qwen3_config(special_ids: dict) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        use_sliding_window=False,
        **special_ids,
    )


def _tied_config(special_ids: dict) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        **special_ids,
    )


TINY_MODELS = (
    TinyModel("tiny_llama", _llama_config, legacy_rope_keys=True),
    TinyModel("tiny_qwen3", _qwen3_config),
    TinyModel("tiny_tied", _tied_config),
)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of exactly VOCAB_SIZE tokens trained on CORPUS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise ValueError(f"trained vocab {tokenizer.get_vocab_size()} != {VOCAB_SIZE=}")
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, directory: pathlib.Path) -> PreTrainedTokenizerFast:
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )
    hf_tokenizer.save_pretrained(directory, save_jinja_files=False)
    return hf_tokenizer


def _write_legacy_rope_keys(directory: pathlib.Path) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are far from zero; norm gains scattered around 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + NORM_JITTER * noise)
            elif "embed_tokens" in name:
                param.copy_(EMBED_STD * noise)
            else:
                param.copy_(LINEAR_STD * noise)


def _prompt_ids(hf_tokenizer: PreTrainedTokenizerFast) -> list[np.ndarray]:
    prompts = []
    for text, length in zip(PROMPTS, PROMPT_LENGTHS, strict=True):
        ids = [hf_tokenizer.bos_token_id] + hf_tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < length:
            raise ValueError(f"prompt {text[:30]!r} has {len(ids)} tokens, fewer than {length=}")
        prompts.append(np.asarray(ids[:length], dtype=np.int32))
    return prompts


def _reference_outputs(model: torch.nn.Module, prompt: np.ndarray, eos_id: int) -> dict | None:
    """Logits of the whole prompt and the greedy continuation; None if the path is ambiguous."""
    input_ids = torch.from_numpy(prompt.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids).logits[0].float().numpy()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    greedy = out.sequences[0, len(prompt):].numpy().astype(np.int32)
    if len(greedy) != NEW_TOKENS or eos_id in greedy or len(set(greedy)) < MIN_DISTINCT_GREEDY:
        return None
    scores = torch.stack(out.scores)[:, 0].numpy()
    top2 = np.sort(scores, axis=-1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]).astype(np.float32)
    if margin.min() < MIN_GREEDY_MARGIN:
        return None
    greedy_logits = torch.stack(out.logits)[:, 0].numpy().astype(np.float32)
    return {"logits": logits.astype(np.float32), "greedy_ids": greedy,
            "greedy_logits": greedy_logits, "greedy_margin": margin}


def _dir_bytes(directory: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def write_model(spec: TinyModel, tokenizer: Tokenizer, golden_dir: pathlib.Path) -> None:
    """Save a checkpoint for the first seed whose greedy paths are clean, then its npz."""
    directory = golden_dir / spec.name
    config = spec.make_config(_special_ids(tokenizer))
    for seed in range(MAX_SEED_TRIES):
        if directory.exists():
            shutil.rmtree(directory)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, seed)
        model.generation_config.do_sample = False
        model.save_pretrained(directory, safe_serialization=True)
        if spec.legacy_rope_keys:
            _write_legacy_rope_keys(directory)
        hf_tokenizer = _save_tokenizer(tokenizer, directory)
        reloaded = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        if reloaded.config.rope_parameters != config.rope_parameters:
            raise ValueError(f"{directory} reloads rope as {reloaded.config.rope_parameters}")
        prompts = _prompt_ids(hf_tokenizer)
        results = [_reference_outputs(reloaded, p, config.eos_token_id) for p in prompts]
        if all(r is not None for r in results):
            break
    else:
        raise ValueError(f"no seed in range({MAX_SEED_TRIES}) gave clean greedy paths")
    arrays = {}
    for suffix, prompt, result in zip(("", "_2"), prompts, results, strict=True):
        arrays[f"prompt_ids{suffix}"] = prompt
        arrays.update({f"{key}{suffix}": value for key, value in result.items()})
    arrays["seed"] = np.int32(seed)
    np.savez(golden_dir / f"{spec.name}.npz", **arrays)
    check_model(spec.name, golden_dir)


def check_model(name: str, golden_dir: pathlib.Path) -> None:
    """Shapes, finiteness, size and a logits spread that is not near zero."""
    directory = golden_dir / name
    config = json.loads((directory / "config.json").read_text())
    vocab = config["vocab_size"]
    for required in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (directory / required).is_file():
            raise ValueError(f"{directory} lacks {required}")
    if "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text()):
        raise ValueError(f"{directory}/tokenizer_config.json has no chat_template")
    size = _dir_bytes(directory)
    if size > MAX_DIR_BYTES:
        raise ValueError(f"{directory} holds {size} bytes, over {MAX_DIR_BYTES=}")
    with np.load(golden_dir / f"{name}.npz") as data:
        for suffix, length in zip(("", "_2"), PROMPT_LENGTHS, strict=True):
            prompt, logits = data[f"prompt_ids{suffix}"], data[f"logits{suffix}"]
            greedy, greedy_logits = data[f"greedy_ids{suffix}"], data[f"greedy_logits{suffix}"]
            if prompt.shape != (length,) or prompt.dtype != np.int32:
                raise ValueError(f"{name} prompt_ids{suffix}: {prompt.shape} {prompt.dtype}")
            if logits.shape != (length, vocab) or logits.dtype != np.float32:
                raise ValueError(f"{name} logits{suffix}: {logits.shape} {logits.dtype}")
            if greedy.shape != (NEW_TOKENS,) or greedy.max() >= vocab:
                raise ValueError(f"{name} greedy_ids{suffix}: {greedy.shape} max {greedy.max()}")
            if greedy_logits.shape != (NEW_TOKENS, vocab) or not np.array_equal(
                    greedy_logits.argmax(-1), greedy):
                raise ValueError(f"{name} greedy_logits{suffix} do not pick greedy_ids{suffix}")
            if not np.isfinite(logits).all() or logits.std() < 0.3:
                raise ValueError(f"{name} logits{suffix} not finite or flat: std {logits.std()}")
            print(
                f"{name}{suffix}: prompt {prompt.shape} logits {logits.shape} "
                f"std {logits.std():.3f} greedy {greedy.tolist()} "
                f"min margin {data[f'greedy_margin{suffix}'].min():.4f}"
            )
        seed = int(data["seed"])
    files = sorted(p.name for p in directory.iterdir())
    print(f"{name}: seed {seed}, {size} bytes: {files}")


def write_all(golden_dir: pathlib.Path) -> None:
    tokenizer = train_tokenizer()
    for spec in TINY_MODELS:
        write_model(spec, tokenizer, golden_dir)
