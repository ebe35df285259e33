"""The executable cache key hashes the modules that shape executables, and only those.

Each test edits a private copy of the package's modules (never the package itself) and computes
the key of one fixed executable over that copy: editing the server, the tokenizer, the scheduler
or the public front must keep the key (every cached entry stays usable); editing a model, a
kernel, the graph core, a runner or the sampler must change it, also after a model module moved
into a folder of its own.
"""

import shutil
from pathlib import Path

import pytest

from tokenspeed_jax.graph import cache as cache_module
from tokenspeed_jax.graph.cache import executable_key, function_identity

PACKAGE = Path(cache_module.__file__).resolve().parents[1]
# Patterns (under the package root) rather than a file list, so modules that move keep their side.
HOST_SIDE = ["server/**/*.py", "tokenizer.py", "detokenizer.py", "llm.py", "outputs.py",
             "cache.py", "**/scheduler.py", "**/block_manager.py", "**/request.py"]
DEVICE_SIDE = ["models/**/*.py", "kernels/**/*.py", "graph/**/*.py", "engine/**/*runner*.py",
               "engine/**/sampl*.py", "parallel.py"]


def matching(root: Path, patterns: list[str]) -> list[Path]:
    """Every module under ``root`` that one of ``patterns`` matches; each pattern matches one."""
    found = {pattern: sorted(root.glob(pattern)) for pattern in patterns}
    assert all(found.values()), [pattern for pattern, paths in found.items() if not paths]
    return sorted({path for paths in found.values() for path in paths})


@pytest.fixture
def key_of(monkeypatch):
    """The digest of one fixed executable's key with the package at a given root."""
    def key(root: Path) -> str:
        monkeypatch.setattr(cache_module, "_PACKAGE_ROOT", root)
        cache_module.package_source_hash.cache_clear()
        cache_module.environment.cache_clear()
        return executable_key(stage_name="double", identity="stage", trees=[], args=[],
                              donate=[]).digest
    yield key
    monkeypatch.undo()
    cache_module.package_source_hash.cache_clear()
    cache_module.environment.cache_clear()


@pytest.fixture
def package_copy(tmp_path) -> Path:
    root = tmp_path / "tokenspeed_jax"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# edited\n")


def test_editing_a_host_side_module_keeps_the_key(key_of, package_copy):
    before = key_of(package_copy)
    for path in matching(package_copy, HOST_SIDE):
        edit(path)
        assert key_of(package_copy) == before, path


def test_editing_a_module_that_shapes_executables_changes_the_key(key_of, package_copy):
    seen = {key_of(package_copy)}
    for path in matching(package_copy, DEVICE_SIDE):
        edit(path)
        key = key_of(package_copy)
        assert key not in seen, path
        seen.add(key)


def test_a_model_module_moved_into_a_folder_stays_covered(key_of, package_copy):
    before = key_of(package_copy)
    module = next(path for path in sorted((package_copy / "models").rglob("*.py"))
                  if path.name != "__init__.py")
    folder = package_copy / "models" / "moved_family"
    folder.mkdir()
    moved_to = module.rename(folder / module.name)
    (folder / "__init__.py").write_text('"""A family folder."""\n')
    moved = key_of(package_copy)
    assert moved != before
    edit(moved_to)
    assert key_of(package_copy) != moved


def test_a_stage_function_in_an_unhashed_module_is_keyed_by_its_own_source():
    """A function defined in a module the package hash skips (here one of ``llm.py``'s) carries
    its file's own digest, so editing that file still changes the key of any stage it is."""
    from tokenspeed_jax import llm

    assert function_identity(cache_module.source_hash, None).splitlines()[1] == "package"
    own = function_identity(llm._as_prompt_list, None).splitlines()[1]
    assert own == cache_module._file_digest(Path(llm.__file__).resolve())
