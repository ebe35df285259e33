"""The registry of model families: a checkpoint's ``model_type`` (config.json) or GGUF
architecture -> its ``Family``.

Invariants: every ``model_type`` belongs to exactly one family (checked when the registry is
built); a value no family accepts is a ValueError naming it and every supported one. This is the
only place that tells families apart by name: every other module asks the family it gets here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenspeed_jax.models.deepseek_v3.family import FAMILY as DEEPSEEK_V3
from tokenspeed_jax.models.family import Family
from tokenspeed_jax.models.kimi_linear.family import FAMILY as KIMI_LINEAR
from tokenspeed_jax.models.llama.family import FAMILY as LLAMA

FAMILIES: tuple[Family, ...] = (LLAMA, KIMI_LINEAR, DEEPSEEK_V3)


def by_model_type(families: tuple[Family, ...]) -> dict[str, Family]:
    table: dict[str, Family] = {}
    for family in families:
        for model_type in family.model_types:
            if model_type in table:
                raise ValueError(f"model_type={model_type!r} is claimed by both the "
                                 f"{table[model_type].name} and the {family.name} family")
            table[model_type] = family
    return table


_BY_MODEL_TYPE = by_model_type(FAMILIES)


def supported_model_types() -> tuple[str, ...]:
    return tuple(_BY_MODEL_TYPE)


def family_for(model_type: Any) -> Family:
    """The family that accepts ``model_type``; a ValueError naming it and the supported ones."""
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"unsupported model_type={model_type!r}; supported: "
                         f"{', '.join(supported_model_types())}")
    return family


def family_of(config: Any) -> Family:
    """The family of a built model config (any family's config carries ``model_type``)."""
    return family_for(getattr(config, "model_type", None))


def family_of_hf_config(config: Mapping[str, Any]) -> Family:
    """The family of a checkpoint's config.json dict."""
    return family_for(config.get("model_type"))


def family_for_gguf(architecture: str) -> Family:
    """The family that reads GGUF files of ``architecture`` (``general.architecture``)."""
    readers = {t: f for t, f in _BY_MODEL_TYPE.items() if f.gguf is not None}
    if architecture not in readers:
        raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: "
                         f"{', '.join(readers)}")
    return readers[architecture]
