"""The import graph of `src/modelship`: no circle between modules, and no package imports
one above it (the layers docs/architecture.md draws). Read from the source with `ast`,
imports inside functions included (a lazy import is still a dependency), those only for
type checkers left out."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import modelship

ROOT = Path(modelship.__file__).parent

# package -> packages it must never import (directly or lazily)
FORBIDDEN = {
    "storage": {"model", "engine", "server", "gateway", "autoscale", "fleet", "pipeline",
                "deploy", "config", "cli"},
    "model": {"engine", "server", "gateway", "autoscale", "fleet", "pipeline", "deploy",
              "config", "cli"},
    "engine": {"server", "gateway", "autoscale", "fleet", "pipeline", "deploy", "config",
               "cli"},
    "server": {"gateway", "autoscale", "fleet", "pipeline", "deploy", "config", "cli"},
    "gateway": {"fleet", "server", "pipeline", "deploy", "cli", "engine", "model"},
    "autoscale": {"gateway", "fleet", "server", "pipeline", "deploy", "config", "cli",
                  "engine", "model"},
    "fleet": {"deploy", "cli"},
    "pipeline": {"gateway", "fleet", "deploy", "cli"},
    "deploy": {"gateway", "fleet", "server", "engine", "model", "pipeline", "cli"},
    "config": {"cli", "server"},
}  # fmt: skip


def module_names() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def runtime_nodes(tree: ast.AST):
    """Every node, except those under `if TYPE_CHECKING:` (never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if isinstance(test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """module -> the modules it imports; with `type_only`, those under `if TYPE_CHECKING:`
    too."""
    modules = module_names()
    graph: dict[str, set[str]] = defaultdict(set)
    nodes = ast.walk if type_only else runtime_nodes
    for name, path in modules.items():
        for node in nodes(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # `from package import submodule` -> the submodule
                    submodule = f"{node.module}.{alias.name}"
                    targets.append(submodule if submodule in modules else node.module)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target != "modelship":
                    graph[name].add(target)
    return graph


def package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def find_circle(graph: dict[str, set[str]]) -> None:
    """Raise AssertionError naming the first import circle in `graph`."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_no_module_imports_itself_through_others() -> None:
    find_circle(import_graph())


def test_no_engine_module_imports_itself_even_for_type_checkers() -> None:
    """A circle through `if TYPE_CHECKING:` imports is one a lazy import away from a real
    one (config -> cuda_graphs -> scheduler -> config was)."""
    graph = {
        module: {target for target in targets if package(target) == "engine"}
        for module, targets in import_graph(type_only=True).items()
        if package(module) == "engine"
    }
    find_circle(graph)


def test_no_package_imports_a_layer_above_it() -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if package(target) in FORBIDDEN.get(package(module), set())
    )
    assert not upward, "\n".join(upward)


def test_the_graph_is_read_at_all() -> None:  # the checks above would pass on an empty graph
    graph = import_graph()
    assert "modelship.engine.llm_engine" in graph["modelship.engine.core"]  # a lazy import
    assert "modelship.model.loader" in graph["modelship.engine.worker"]
