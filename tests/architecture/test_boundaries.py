"""The package boundaries docs/architecture.md draws, held by reading the sources' imports and attribute uses.

The drivers talk only to the engine; the engine and the run assembly name no algorithm (each algorithm is whole
in its file under server/algorithms/); fedcore/ and export/ import nothing of server/ (no package loop).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from server.engine.run_config import ALGORITHMS
from tests.support.source_imports import imported_modules

REPO = Path(__file__).resolve().parents[2]
DRIVERS = ("server/simulate.py", "server/broker_loop.py")
ENGINE_AND_ASSEMBLY = ("server/engine/round_engine.py", "server/run_setup.py")


def tree(path: str) -> ast.Module:
    return ast.parse((REPO / path).read_text(), path)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_driver_reaches_nothing_behind_the_engine(driver: str):
    """No ``.coordinator``, no private engine attribute, no import of the coordinator."""
    reached = {node.attr for node in ast.walk(tree(driver)) if isinstance(node, ast.Attribute)}
    assert "coordinator" not in reached
    assert "server.engine.coordinator" not in imported_modules(REPO / driver)
    engine_private = [node.attr for node in ast.walk(tree(driver)) if isinstance(node, ast.Attribute)
                      and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"
                      and node.attr.startswith("_")]
    assert engine_private == []


@pytest.mark.parametrize("path", ENGINE_AND_ASSEMBLY)
def test_the_engine_and_the_run_assembly_name_no_algorithm(path: str):
    strings = [node.value for node in ast.walk(tree(path)) if isinstance(node, ast.Constant)
               and isinstance(node.value, str)]
    named = [s for s in strings if s in ALGORITHMS]
    assert named == []


@pytest.mark.parametrize("package", ["fedcore", "export"])
def test_the_core_and_the_exporter_import_nothing_of_the_server(package: str):
    offending = {str(path.relative_to(REPO)): sorted(m for m in imported_modules(path) if m.split(".")[0] == "server")
                 for path in (REPO / package).glob("*.py")}
    assert {path: modules for path, modules in offending.items() if modules} == {}
