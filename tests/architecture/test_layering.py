"""The layers docs/architecture.md draws, held by reading the sources' imports (fast: no module is executed).

Imports run downward only: drivers (the modules at the top of server/) -> server.mqtt and server.outputs ->
server.engine -> server.data and server.algorithms -> fedcore; device_runtime (what boards run) imports nothing
of the server, the exporter, the core, torch or onnx; and no two server modules import each other, however
indirectly."""
from __future__ import annotations

import pytest

from tests.support.source_imports import REPO_ROOT, package_imports

SERVER = package_imports("server")
DRIVERS = tuple(sorted(f"server.{path.stem}" for path in (REPO_ROOT / "server").glob("*.py")
                       if path.stem != "__init__"))
LAYERS = {
    "server.engine": ("server.mqtt", "server.outputs", *DRIVERS),
    "server.data": ("server.engine", "server.mqtt", "server.outputs", *DRIVERS),
    "server.algorithms": ("server.engine", "server.mqtt", "server.outputs", *DRIVERS),
    "server.mqtt": DRIVERS,
    "server.outputs": DRIVERS,
}
"""Each layer -> what sits above it (none of which it may import)."""
DEVICE_FORBIDDEN = ("server", "export", "fedcore", "torch", "onnx")


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_drivers_are_found():
    assert {"server.broker_loop", "server.simulate", "server.cli"} <= set(DRIVERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_nothing_above_it(layer: str):
    upward = {module: sorted(m for m in imports if any(within(m, above) for above in LAYERS[layer]))
              for module, imports in SERVER.items() if within(module, layer)}
    assert {module: found for module, found in upward.items() if found} == {}


def test_the_device_runtime_imports_nothing_of_the_server_the_exporter_the_core_torch_or_onnx():
    found = {module: sorted(m for m in imports if any(within(m, name) for name in DEVICE_FORBIDDEN))
             for module, imports in package_imports("device_runtime").items()}
    assert {module: names for module, names in found.items() if names} == {}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_circle_and_nothing_else():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_server_modules_import_each_other_in_a_circle():
    modules = set(SERVER)
    graph = {module: {m for m in imports if m in modules and m != module and not within(module, m)}
             for module, imports in SERVER.items()}
    assert cycles(graph) == []
