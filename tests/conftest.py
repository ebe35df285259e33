"""Test-suite hygiene shared by every module.

* The executable cache is on by default and lives under ``$XDG_CACHE_HOME``: the suite points it
  at a fresh temporary directory, so tests never read entries a developer's runs left behind and
  never write to the real cache (subprocesses inherit the variable).
* Compile guards are process-wide, so none may outlive its test module.
"""

import os
import tempfile

import pytest

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="tokenspeed-jax-tests-")

from tokenspeed_jax.graph.guard import disarm_all


@pytest.fixture(autouse=True, scope="module")
def _disarm_compile_guards():
    yield
    disarm_all()
