"""The package's public names: what ``tokenspeed_jax`` exports, and that none of them shares its
name with a wire model of the server (two classes called ``Completion`` read as one)."""

import pydantic
import pytest

import tokenspeed_jax
from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.llm import LLM
from tokenspeed_jax.outputs import Completion
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.server import protocol


def test_every_public_name_is_the_class_it_names():
    assert {name: getattr(tokenspeed_jax, name) for name in tokenspeed_jax.__all__} == {
        "LLM": LLM, "Completion": Completion, "EngineConfig": EngineConfig,
        "SamplingParams": SamplingParams}
    with pytest.raises(AttributeError, match="Engine"):
        tokenspeed_jax.Engine  # noqa: B018


def test_no_wire_model_shares_a_public_name():
    wire = {name for name, value in vars(protocol).items()
            if isinstance(value, type) and issubclass(value, pydantic.BaseModel)}
    assert "TextCompletion" in wire and "ChatCompletion" in wire
    assert wire.isdisjoint(tokenspeed_jax.__all__)
