"""Every module of the four packages imports, and no two modules import each other, even
through others.

What counts as an import (static: the import statements of every .py file, read with `ast`):
- module-level imports AND imports inside functions or methods: a lazy import only hides a
  cycle until the function runs (and the order in which functions run then decides whether
  the program works);
- not imports under `if TYPE_CHECKING:` (they never run);
- `from X import a` is an edge to the module `X.a` when that is a module, else to `X`;
  `import X.Y` is an edge to `X.Y`;
- an import is an edge to the module it names, not to that module's parent packages (whose
  `__init__` Python also runs: a package's own imports are the package module's edges, so
  `models/__init__.py` building a family on demand does not make every user of
  `models.layers` depend on every family);
- a module's imports of its own parent packages (`from . import sibling`, `from .. import
  errors` resolve to the sibling / `errors` module; `from . import name` of something defined
  in the package `__init__` is an edge to nothing) are not edges: that is how packages work.
  A package `__init__` importing its submodules is an edge;
- modules outside the four packages (mlx, llm, langchain_core, ...) are not followed.
The import names come from pyproject.toml's `package-dir` (kernels/ is
`qwen38_backend.kernels`, integrations/llm_qwen38 is `llm_qwen38`, ...).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Cycles (as the set of modules of one strongly connected component) that are known and
# being removed. Nothing else may be added here.
KNOWN_CYCLES: list[frozenset[str]] = []


# Import name -> directory, as pyproject.toml's `package-dir` maps them.
PACKAGE_DIRS = {
    "qwen38_backend": "qwen38_backend",
    "qwen38_backend.kernels": "kernels",
    "llm_qwen38": "integrations/llm_qwen38",
    "langchain_qwen38": "integrations/langchain_qwen38",
}


def module_files() -> dict[str, Path]:
    """Every module's import name -> its file (packages as their __init__.py)."""
    mods: dict[str, Path] = {}
    for pkg, directory in PACKAGE_DIRS.items():
        for f in sorted((ROOT / directory).rglob("*.py")):
            parts = [pkg, *f.relative_to(ROOT / directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            # a package mapped from elsewhere is read from its own directory (e.g. a
            # qwen38_backend/kernels link in a source tree: kernels/ is the real one)
            inner = [p for p in PACKAGE_DIRS if p.startswith(pkg + ".")]
            if any(name == p or name.startswith(p + ".") for p in inner):
                continue
            mods[name] = f
    return mods


MODULES = module_files()


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names (those of the four packages)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if MODULES[module].name != "__init__.py":
                base = base[:-1]  # a plain module's `.` is its package
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [
            f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names
        ]
    out = []
    for name in names:
        while name and name not in MODULES:  # `import X.Y.attr` style: the module part
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(sub) for sub in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports (directly, anywhere in the file)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        own = set(_ancestors(module))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skip:
                continue
            for target in _targets(module, node):
                if target != module and target not in own:
                    edges[module].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def _path(edges: dict[str, set[str]], comp: frozenset[str]) -> str:
    """One cycle through a component, for the failure message: a -> b -> ... -> a."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & comp):
                if w == start:
                    chain = [v]
                    while chain[-1] != start:
                        chain.append(prev[chain[-1]])
                    return " -> ".join([start, *reversed(chain[:-1]), start])
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(sorted(comp))


def test_the_packages_are_all_found() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name, directory in PACKAGE_DIRS.items():
        assert f'"{name}" = "{directory}"' in pyproject  # the installed layout
    for name in ("qwen38_backend", "qwen38_backend.kernels", "llm_qwen38", "langchain_qwen38"):
        assert name in MODULES
    assert {"qwen38_backend.models.qwen3_5", "qwen38_backend.kernels.gdn_decode"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    """The analysis itself: a function-level import and `from . import x` are edges."""
    edges = import_graph()
    # qwen38_backend.load() imports the loader inside the function
    assert "qwen38_backend.loader" in edges["qwen38_backend"]
    # `from . import demo` inside the loading package
    assert "qwen38_backend.loading.demo" in edges["qwen38_backend.loading.registry"]
    # a package __init__ importing its own submodules, lazily
    assert "qwen38_backend.models.qwen3_5" in edges["qwen38_backend.models"]
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(toy) == [frozenset("abc")]
    assert _path(toy, frozenset("abc")) == "a -> b -> c -> a"


def test_no_import_cycles() -> None:
    edges = import_graph()
    found = cycles(edges)
    unexpected = [c for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(_path(edges, c) for c in unexpected)
