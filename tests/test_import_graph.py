"""The import graph of `src/modelship` keeps the layers docs/architecture.md draws.

Read from the source with `ast`: imports inside functions count (a lazy import is still a
dependency) and so do those under `if TYPE_CHECKING:` (a type a module names is one it
depends on), except where a test says otherwise. The rules:
- every module belongs to one unit of `LAYERS` and imports only its own layer or the
  layers below it; two top-level packages of one layer (pipeline and fleet, gateway and
  server) never import each other;
- no circle between units (packages), nor between modules;
- the gateway loads no torch (it is a light process in front of the replicas);
- the pure policy modules (`PURE`) do no I/O: nothing they load at run time, directly or
  through the modelship modules they import, is a network, async or filesystem module.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import modelship

ROOT = Path(modelship.__file__).parent

# Top first. A module's unit is the longest entry naming it or a package above it, so a new
# module inside a listed package needs no line here; a new top-level module does (the test
# below says so). A module may import its own layer and the layers below, never above.
LAYERS: tuple[tuple[str, ...], ...] = (
    # What a user runs. "modelship" is the package's own __init__ (the lazy `modelship.LLM`),
    # not everything under it.
    ("modelship", "modelship.__main__", "modelship.cli"),
    # The stages, the local fleet and the Kubernetes rendering: each reads pipeline.yaml.
    ("modelship.pipeline", "modelship.fleet", "modelship.deploy", "modelship.loadgen"),
    ("modelship.config",),
    # pipeline.yaml's sections that live in the package they configure, with what they
    # import there: modelship.config composes them, so they sit below it while the rest of
    # their package sits above (reading a config loads no stage, fleet or renderer).
    (
        "modelship.deploy.config",
        "modelship.deploy.names",
        "modelship.deploy.quantity",
        "modelship.fleet.config",
        "modelship.pipeline.optimize",  # the scheme registry that `optimize.variants` checks
        "modelship.pipeline.errors",
        "modelship.pipeline.calibration",
        "modelship.serve_options",  # what a replica is started with: `serve:` and the flags
    ),
    # The two HTTP fronts: the gateway and a replica's OpenAI server.
    ("modelship.gateway", "modelship.server"),
    ("modelship.engine",),
    ("modelship.model",),
    ("modelship.release",),
    ("modelship.autoscale",),
    ("modelship.storage",),
    # Leaf helpers shared by the fronts, the engine and the CLI.
    (
        "modelship.adapter_names",
        "modelship.body_limit",
        "modelship.errors",
        "modelship.flags",
        "modelship.http_limits",
        "modelship.httptools_limited",
        "modelship.lifetime",
        "modelship.liveness",
        "modelship.logs",
        "modelship.progress",
        "modelship.prompt_bounds",
        "modelship.replica_headers",
        "modelship.request_id",
        "modelship.responses_api",
        "modelship.tracing",
    ),
)

# Decisions without I/O, tested as pure functions: what they import at run time, directly
# or through other modelship modules, must not reach the network, an event loop or files.
PURE = (
    "modelship.gateway.routing",
    "modelship.gateway.tiers",
    "modelship.gateway.admission",
    "modelship.gateway.canary",  # the canary judge
    "modelship.autoscale.policy",
    "modelship.engine.scheduler",
    "modelship.engine.block_manager",
)
# Light processes: what they load at run time must not reach these.
HEAVY = {"modelship.gateway": {"torch", "transformers", "triton"}}
IO_MODULES = {
    "httpx", "starlette", "fastapi", "uvicorn", "asyncio", "socket", "ssl", "subprocess",
    "os", "pathlib", "shutil", "tempfile", "fcntl", "io", "open()",
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


def imported_names(path: Path, type_only: bool, modules=()) -> set[str]:
    """The absolute names `path` imports: `from package import submodule` gives the
    submodule when it is one of `modules`, else `package`; plus "open()" where it calls
    the builtin."""
    names: set[str] = set()
    nodes = ast.walk if type_only else runtime_nodes
    for node in nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in modules else node.module)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "open":
            names.add("open()")
    return names


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """module -> the modelship modules it imports; with `type_only`, those under
    `if TYPE_CHECKING:` too."""
    modules = module_names()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target in imported_names(path, type_only, modules):
            while target and target not in modules:  # `from module import function`
                target = target.rpartition(".")[0]
            if target and target != name and target != "modelship":
                graph[name].add(target)
    return graph


def unit(module: str) -> str | None:
    """The entry of `LAYERS` that `module` belongs to; None when none names it."""
    names = [
        entry
        for layer in LAYERS
        for entry in layer
        if module == entry or (entry != "modelship" and module.startswith(entry + "."))
    ]
    return max(names, key=len, default=None)


LAYER_OF = {entry: depth for depth, layer in enumerate(LAYERS) for entry in layer}


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


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(module for module in module_names() if unit(module) is None)
    assert not unplaced, f"add these to a layer of LAYERS: {unplaced}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target} (a layer above: {LAYERS[LAYER_OF[unit(target)]]})"
        for module, targets in graph.items()
        for target in targets
        if unit(module) and unit(target) and LAYER_OF[unit(target)] < LAYER_OF[unit(module)]
    )


def test_every_import_points_down_or_within_its_layer() -> None:
    upward = upward_imports(import_graph(type_only=True))
    assert not upward, "\n".join(upward)


def test_no_package_imports_itself_through_others() -> None:
    """Within a layer, units may import each other one way only."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in import_graph(type_only=True).items():
        for target in targets:
            if unit(module) != unit(target):
                graph[str(unit(module))].add(str(unit(target)))
    find_circle(graph)


def test_no_module_imports_itself_through_others() -> None:
    find_circle(import_graph())


def test_no_engine_module_imports_itself_even_for_type_checkers() -> None:
    """A circle through `if TYPE_CHECKING:` imports is one a lazy import away from a real
    one (config -> cuda_graphs -> scheduler -> config was). Held for the engine only: the
    model's llama <-> fused_decoder type circle is one class and its fast path."""
    graph = {
        module: {target for target in targets if target.startswith("modelship.engine.")}
        for module, targets in import_graph(type_only=True).items()
        if module.startswith("modelship.engine.")
    }
    find_circle(graph)


def loaded_by(starts: list[str], graph: dict[str, set[str]]) -> set[str]:
    """`starts` and every modelship module they load at run time, transitively."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def outside_uses(module: str, modules: dict[str, Path]) -> set[str]:
    """The top-level names of what `module` imports at run time ("open()" included)."""
    return {name.split(".")[0] for name in imported_names(modules[module], False)}


def test_pure_policy_modules_do_no_io() -> None:
    modules = module_names()
    graph = import_graph()
    found = []
    for pure in PURE:
        for module in sorted(loaded_by([pure], graph)):
            if io := outside_uses(module, modules) & IO_MODULES:
                found.append(f"{pure} loads {module}, which uses {sorted(io)}")
    assert not found, "\n".join(found)


def test_light_processes_load_no_heavy_library() -> None:
    modules = module_names()
    graph = import_graph()
    found = []
    for package, heavy in HEAVY.items():
        starts = [m for m in modules if m == package or m.startswith(package + ".")]
        for module in sorted(loaded_by(starts, graph)):
            if used := outside_uses(module, modules) & heavy:
                found.append(f"{package} loads {module}, which uses {sorted(used)}")
    assert not found, "\n".join(found)


def test_packages_of_one_layer_stay_apart() -> None:
    """Top-level packages that share a layer are alternatives or neighbours, never one
    built on the other (what one needs from the other belongs in a layer below)."""
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}

    def package(module: str) -> str | None:
        name = module.split(".")[1] if module.count(".") else ""
        return name if name in packages else None

    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph(type_only=True).items()
        for target in targets
        if package(module) and package(target) and package(module) != package(target)
        and unit(module) and unit(target)
        and LAYER_OF[unit(module)] == LAYER_OF[unit(target)]
    )  # fmt: skip
    assert not crossing, "\n".join(crossing)


def test_the_graph_is_read_at_all() -> None:  # the checks above would pass on an empty graph
    graph = import_graph()
    assert "modelship.engine.llm_engine" in graph["modelship.engine.core"]  # a lazy import
    assert "modelship.model.loader" in graph["modelship.engine.worker"]
    assert upward_imports({"modelship.engine.core": {"modelship.gateway.routing"}})
    assert {unit(module) for module in PURE} <= LAYER_OF.keys()
