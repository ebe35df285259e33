"""Kimi Linear (KDA + MLA + MoE): the model (``model``), its KDA layers (``layers``), its
tensor-parallel rules (``sharding``) and its declaration (``family.FAMILY``).

Importing the package gives the model's public names; the registry imports the declaration.
"""

from tokenspeed_jax.models.kimi_linear.model import (
    KDA,
    MLA,
    MODEL_TYPE,
    KimiCache,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    KimiWeight,
    kimi_weight_map,
)

__all__ = ["KDA", "MLA", "MODEL_TYPE", "KimiCache", "KimiLinearConfig", "KimiLinearForCausalLM",
           "KimiWeight", "kimi_weight_map"]
