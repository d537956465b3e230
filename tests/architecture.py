"""Structure checks of the ``neuron_compile`` package, read from its source with ``ast`` (nothing is imported).

Used by tests/test_architecture.py and runnable as a script (``python tests/architecture.py``) to print the
module graph's cycles, the private names imported across modules and the longest functions.

* Imports count wherever they are written: a function-level import that hides a cycle is still one.
* A private name is one with a leading underscore, imported from another module (``from a import _x``) or
  reached as an attribute of an imported module (``a._x``).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import networkx as nx

PACKAGE = "neuron_compile"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
MAX_FUNCTION_LINES = 80


@dataclasses.dataclass(frozen=True)
class PrivateImport:
    module: str
    line: int
    source: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} uses {self.source}.{self.name}"


@dataclasses.dataclass(frozen=True)
class LongFunction:
    module: str
    name: str
    line: int
    lines: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.name} ({self.lines} lines)"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(), str(path)) for path in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, known: dict) -> str | None:
    """The package module ``name`` refers to: itself, or its longest known prefix (``a.b.func`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(trees: dict[str, ast.Module] | None = None) -> nx.DiGraph:
    """Edge a -> b when module a imports package module b (at any level of its code), and a -> p for each package
    p whose ``__init__`` that import runs first. A module's own ancestors are not edges: they are initializing
    already when it runs."""
    trees = trees if trees is not None else modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(trees)
    for module, tree in trees.items():
        is_package = (ROOT.parent / module.replace(".", "/") / "__init__.py").exists()
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, is_package)
                targets = [f"{source}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, trees)
                if resolved:
                    for reached in [resolved, *_packages_initialized(resolved, trees)]:
                        if reached != module and not module.startswith(reached + "."):
                            graph.add_edge(module, reached)
    return graph


def _packages_initialized(module: str, known: dict) -> list[str]:
    """The packages whose ``__init__`` runs before ``module`` can be imported (its ancestors, root excluded)."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(2, len(parts)) if ".".join(parts[:end]) in known]


def import_cycles(graph: nx.DiGraph | None = None) -> list[list[str]]:
    """Each strongly connected group of more than one module, sorted."""
    graph = graph if graph is not None else import_graph()
    return sorted(sorted(group) for group in nx.strongly_connected_components(graph) if len(group) > 1)


def private_imports(trees: dict[str, ast.Module] | None = None) -> list[PrivateImport]:
    trees = trees if trees is not None else modules()
    found = []
    for module, tree in trees.items():
        is_package = (ROOT.parent / module.replace(".", "/") / "__init__.py").exists()
        aliases: dict[str, str] = {}  # local name -> package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, is_package)
                if not source.startswith(PACKAGE):
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in trees:
                        aliases[alias.asname or alias.name] = full
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(PrivateImport(module, node.lineno, source, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE) and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(PrivateImport(module, node.lineno, aliases[node.value.id], node.attr))
    return sorted(found, key=lambda item: (item.module, item.line))


def long_functions(limit: int = MAX_FUNCTION_LINES, trees: dict[str, ast.Module] | None = None) -> list[LongFunction]:
    """Functions (and methods) longer than ``limit`` lines, decorators and docstring included, longest first."""
    trees = trees if trees is not None else modules()
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
                length = node.end_lineno - start + 1
                if length > limit:
                    found.append(LongFunction(module, node.name, start, length))
    return sorted(found, key=lambda item: -item.lines)


def main() -> int:
    graph = import_graph()
    cycles, private, long = import_cycles(graph), private_imports(), long_functions()
    print(f"{graph.number_of_nodes()} modules, {graph.number_of_edges()} import edges")
    print(f"import cycles: {len(cycles)}")
    for group in cycles:
        print("  " + " <-> ".join(group))
    print(f"private names imported across modules: {len(private)}")
    for item in private:
        print(f"  {item}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(long)}")
    for item in long:
        print(f"  {item}")
    return 1 if cycles or private or long else 0


if __name__ == "__main__":
    sys.exit(main())
