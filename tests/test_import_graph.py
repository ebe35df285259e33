"""The package's import graph, read from the source with ``ast`` (nothing is imported).

An edge runs from a module to each package module it imports anywhere: at module level, inside a
function, or only for type checking (a circle through a type-checking import is still two modules
that each need the other). Two properties hold: the graph has no circles, and the modules the
executable cache key hashes (``shapes_executables``) import at module level only modules it hashes
too, so code that runs while a stage is traced cannot live in a module whose edits keep the key.
"""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath

from tokenspeed_jax.graph import cache as cache_module
from tokenspeed_jax.graph.cache import shapes_executables

PACKAGE = Path(cache_module.__file__).resolve().parents[1]
NAME = PACKAGE.name


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules an import statement names (``from a import b``: ``a.b`` when that is a
    module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    if node.level or not node.module or node.module.split(".")[0] != NAME:
        return []
    names = [f"{node.module}.{alias.name}" for alias in node.names]
    return [name if name in MODULES else node.module for name in names]


def imports(name: str, *, module_level_only: bool) -> set[str]:
    """The package modules ``name`` imports; with ``module_level_only``, only the imports that
    run when it is imported (not inside functions, not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(MODULES[name].read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.update(imported(child))
            elif module_level_only and (
                    isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))):
                continue
            visit(child)

    visit(tree)
    return found - {name}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as the modules along it (first repeated last), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (circle := walk(target)):
                return circle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (circle := walk(node)):
            return circle
    return None


def test_circle_finder_finds_a_circle_and_accepts_a_tree():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_circles():
    graph = {name: imports(name, module_level_only=False) for name in MODULES}
    assert sum(map(len, graph.values())) > len(MODULES)  # the reader sees the imports at all
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def hashed(name: str) -> bool:
    return shapes_executables(PurePosixPath(MODULES[name].relative_to(PACKAGE).as_posix()))


def test_modules_the_cache_key_hashes_import_only_hashed_modules():
    def inside(folder: str) -> list[str]:
        return [name for name in MODULES if name.startswith(f"{NAME}.{folder}.")]

    assert all(map(hashed, inside("models"))) and not any(map(hashed, inside("server")))
    leaks = sorted((name, target) for name in MODULES if hashed(name)
                   for target in imports(name, module_level_only=True) if not hashed(target))
    assert not leaks, leaks


def test_public_outputs_import_no_engine_internals():
    assert imports("tokenspeed_jax.outputs", module_level_only=False) == set()
