"""What the project's source files import, read from their syntax trees (no module is executed): for the
architecture tests that hold the package boundaries and the layering."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path, root: Path = REPO_ROOT) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function; ``from a.b import c`` gives ``a.b.c`` when
    that is one of the project's modules, else ``a.b``."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.update(f"{node.module}.{alias.name}" if _is_module(f"{node.module}.{alias.name}", root)
                           else node.module for alias in node.names)
    return modules


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    """The dotted name of a source file under ``root`` (a package's ``__init__.py`` is the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(package: str, root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """Every module of ``package`` (recursively), by dotted name, with what it imports."""
    return {module_name(path, root): imported_modules(path, root) for path in sorted((root / package).rglob("*.py"))}
