"""The model-family registry: each checkpoint ``model_type`` (or GGUF architecture) maps to one
family, anything else is an error naming it and the supported ones, and each family's
declaration resolves to the runner and the reference generator that serve it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tokenspeed_jax.models import registry
from tokenspeed_jax.models.deepseek_v3 import DeepseekV3Config
from tokenspeed_jax.models.kimi_linear import KimiLinearConfig
from tokenspeed_jax.models.llama import LlamaConfig
from tokenspeed_jax.models.loader import load_checkpoint

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize(("model_type", "family"), [
    ("llama", "llama"), ("qwen2", "llama"), ("qwen3", "llama"), ("kimi_linear", "kimi_linear"),
    ("deepseek_v3", "deepseek_v3"), ("kimi_k2", "deepseek_v3")])
def test_each_model_type_maps_to_its_family(model_type, family):
    assert registry.family_for(model_type).name == family


@pytest.mark.parametrize("model_type", ["gemma", None, 3])
def test_an_unknown_model_type_names_itself_and_the_supported_ones(model_type):
    with pytest.raises(ValueError, match=rf"model_type={model_type!r}.*llama, qwen2, qwen3, "
                                         r"kimi_linear"):
        registry.family_of_hf_config({"model_type": model_type})


def test_a_model_type_claimed_by_two_families_is_refused():
    llama = registry.family_for("llama")
    impostor = dataclasses.replace(registry.family_for("kimi_linear"), model_types=("qwen3",))
    with pytest.raises(ValueError, match="'qwen3' is claimed by both the llama and the "
                                         "kimi_linear family"):
        registry.by_model_type((llama, impostor))


def test_only_families_with_a_gguf_reader_take_gguf_files():
    assert registry.family_for_gguf("qwen2") is registry.family_for("qwen2")
    with pytest.raises(ValueError, match="GGUF architecture 'kimi_linear'; supported: llama, "
                                         "qwen2, qwen3$"):
        registry.family_for_gguf("kimi_linear")


@pytest.mark.parametrize(("name", "config_type"), [
    ("tiny_llama", LlamaConfig), ("tiny_qwen3", LlamaConfig), ("tiny_kimi", KimiLinearConfig),
    ("tiny_kimi_qlora", KimiLinearConfig), ("tiny_deepseek_v3", DeepseekV3Config),
    ("tiny_deepseek_v3_plain", DeepseekV3Config)])
def test_a_checkpoint_loads_through_the_family_its_config_names(name, config_type):
    raw = json.loads((GOLDEN / name / "config.json").read_text())
    family = registry.family_of_hf_config(raw)
    loaded = load_checkpoint(GOLDEN / name, dtype="float32")
    assert loaded.family is family and registry.family_of(loaded.config) is family
    assert isinstance(loaded.config, config_type) and isinstance(loaded.model, family.model_class)
    assert family.config_from_hf(loaded.config.to_hf()) == loaded.config


def test_families_name_the_forward_and_reference_that_serve_them():
    from tokenspeed_jax.hybrid_reference import HybridReferenceGenerator
    from tokenspeed_jax.models.kimi_linear.forward import LatentForward
    from tokenspeed_jax.models.llama.forward import LlamaForward
    from tokenspeed_jax.reference import ReferenceGenerator

    llama, kimi = registry.family_for("llama"), registry.family_for("kimi_linear")
    assert (llama.forward_class(), llama.reference_generator()) == (LlamaForward,
                                                                    ReferenceGenerator)
    assert (kimi.forward_class(), kimi.reference_generator()) == (LatentForward,
                                                                  HybridReferenceGenerator)
    assert kimi.has_recurrent_state and not llama.has_recurrent_state
    deepseek = registry.family_for("deepseek_v3")
    assert (deepseek.forward_class(), deepseek.reference_generator()) == (LatentForward,
                                                                          ReferenceGenerator)
    assert not deepseek.has_recurrent_state
