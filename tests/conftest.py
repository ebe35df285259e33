"""Test-suite hygiene shared by every module.

* The executable cache is on by default and lives under ``$XDG_CACHE_HOME``, its MAC key under
  ``$XDG_CONFIG_HOME``: the suite points both at fresh temporary directories, so tests never read
  entries a developer's runs left behind and never write to the real cache or use the real key.
  The first process to load this file makes them (the xdist controller under ``make test``) and
  every process it starts inherits them (its workers, subprocesses), so the whole session shares
  one cache: what one worker compiled the other loads (writes and the key's creation are atomic,
  ``graph/cache.py``, ``graph/trust.py``).
* Without a GPU plugin, XLA compiles for the CPU with its backend (LLVM) optimisation off
  (``CPU_XLA_FLAGS``, added to ``$XLA_FLAGS`` for this process and every process it starts):
  compiling tiny models is most of the suite's time on the CPU and running them little, and the
  tests check results against their references to the same tolerances either way. A machine
  with a GPU plugin (``pytest -m gpu``) compiles as the engine does.
* Compile guards are process-wide, so none may outlive its test module.
* Collection puts the slowest modules first (``SLOWEST_FIRST``), the rest in their usual order:
  ``make test`` runs modules whole on two workers, handed out in collection order, so the long
  ones start early and both workers finish together.
"""

import os
import pkgutil
import tempfile

import pytest

SESSION_DIRS = "TOKENSPEED_JAX_TEST_DIRS"  # the session's two directories, made by its first process
if SESSION_DIRS not in os.environ:
    os.environ[SESSION_DIRS] = os.pathsep.join((
        tempfile.mkdtemp(prefix="tokenspeed-jax-tests-"),
        tempfile.mkdtemp(prefix="tokenspeed-jax-tests-config-")))
os.environ["XDG_CACHE_HOME"], os.environ["XDG_CONFIG_HOME"] = os.environ[SESSION_DIRS].split(
    os.pathsep)

CPU_XLA_FLAGS = "--xla_backend_optimization_level=0"
if (not any(module.name.startswith("jax_cuda") for module in pkgutil.iter_modules())
        and CPU_XLA_FLAGS not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_XLA_FLAGS}".strip()

from tokenspeed_jax.graph.guard import disarm_all

# Modules taking half a minute or more on the 2-core CPU, slowest first (`--durations` shows
# new ones).
SLOWEST_FIRST = (
    "test_llm.py", "test_kimi_runner.py", "test_kda.py", "test_compile_cache.py",
    "test_model_runner.py", "test_server_smollm2.py", "test_dummy_weights.py",
    "test_expert_rows.py", "test_tensor_parallel_kimi.py", "test_kimi_engine.py",
    "test_refactor_pins.py", "test_deepseek_v3.py", "test_kimi_linear.py", "test_tensor_parallel.py",
)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixtures, keeping it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within


@pytest.fixture(autouse=True, scope="module")
def _disarm_compile_guards():
    yield
    disarm_all()
