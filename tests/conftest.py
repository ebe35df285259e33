"""Test-suite hygiene shared by every module.

* The executable cache is on by default and lives under ``$XDG_CACHE_HOME``, its MAC key under
  ``$XDG_CONFIG_HOME``: the suite points both at fresh temporary directories, so tests never read
  entries a developer's runs left behind and never write to the real cache or use the real key
  (subprocesses inherit the variables).
* Compile guards are process-wide, so none may outlive its test module.
"""

import os
import tempfile

import pytest

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="tokenspeed-jax-tests-")
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="tokenspeed-jax-tests-config-")

from tokenspeed_jax.graph.guard import disarm_all


@pytest.fixture(autouse=True, scope="module")
def _disarm_compile_guards():
    yield
    disarm_all()
