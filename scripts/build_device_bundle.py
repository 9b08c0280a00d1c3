"""Build the flashable device bundle: DIR/fedara-device-<version>.tar.gz.

    .venv/bin/python scripts/build_device_bundle.py --out dist

The tarball holds one folder, ``fedara-device-<version>/``, with
- the ``device_runtime`` wheel (pure Python, py3-none-any), built from a minimal project generated in a temporary
  folder that names only that package (version from pyproject.toml);
- ``requirements-device.txt``: numpy, paho-mqtt and cryptography (with cffi, pycparser) pinned to the versions installed here and
  stock onnxruntime pinned to the release tested with them (STOCK_ONNXRUNTIME), all installed with --no-deps from the package
  index (never torch or onnx); every pin has wheels for aarch64 and x86_64 (CPython 3.11+);
- ``fedara-device.env`` (settings template), ``fedara-device.service`` (systemd unit), ``install.sh`` and
  ``DEVICE.md`` (the board owner's guide), from scripts/device_bundle/.
It refuses to bundle a device_runtime that imports anything beyond the stdlib, numpy, paho, cryptography and
onnxruntime.
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "device_runtime"
DISTRIBUTION = "fedara-device"
WHEEL_PREFIX = "fedara_device"
ALLOWED_IMPORTS = frozenset({"numpy", "paho", "onnxruntime", "cryptography", PACKAGE})
PINNED = ("numpy", "paho-mqtt", "cryptography", "cffi", "pycparser")  # as installed here (secure aggregation: cryptography)
# The stock build the bundle and arm64 tests run (tests/scripts/test_device_bundle.py, test_arm64.py). Measured under
# qemu-user 7.2 (Debian bookworm's arm64 emulation): the aarch64 wheels of 1.19.2, 1.22.0, 1.24.4 and 1.27.0
# import, those of 1.30.0 and 1.32.0 segfault on import; 1.27.0 is the newest verified there.
STOCK_ONNXRUNTIME = "1.27.0"
WHEEL_REQUIREMENTS = ("numpy>=1.24", "paho-mqtt>=2,<3", "cryptography>=42")  # onnxruntime comes from requirements-device.txt
TEMPLATES = ROOT / "scripts" / "device_bundle"
TEMPLATE_FILES = ("install.sh", "fedara-device.service", "fedara-device.env", "DEVICE.md")
REQUIREMENTS_NAME = "requirements-device.txt"
EXECUTABLE_MODE, FILE_MODE, DIRECTORY_MODE = 0o755, 0o644, 0o755


class BundleError(RuntimeError):
    """The bundle cannot be built: a device module imports a forbidden package, a pin is missing, pip failed."""


def project_version(pyproject: Path) -> str:
    """``project.version`` of a pyproject.toml."""
    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    try:
        return str(data["project"]["version"])
    except KeyError:
        raise BundleError(f"{pyproject} has no project.version") from None


def module_imports(source: str) -> set[str]:
    """Top-level names of the absolute imports in a module's source."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def foreign_imports(package_dir: Path) -> dict[str, list[str]]:
    """For each module of the package that imports something outside the stdlib and ALLOWED_IMPORTS: those names."""
    allowed = ALLOWED_IMPORTS | set(sys.stdlib_module_names) | {"__future__"}
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        foreign = sorted(module_imports(path.read_text()) - allowed)
        if foreign:
            found[str(path.relative_to(package_dir.parent))] = foreign
    return found


def pinned_requirements(versions: dict[str, str]) -> str:
    """requirements-device.txt: one ``name==version`` per package, with how to install them."""
    lines = ["# The device's pinned requirements, the versions tested together. Install each with --no-deps:",
             "#   pip install --no-deps -r requirements-device.txt",
             "# Stock onnxruntime (aarch64 and x86_64 wheels); its C bindings need only numpy.",
             *(f"{name}=={versions[name]}" for name in PINNED), f"onnxruntime=={STOCK_ONNXRUNTIME}"]
    return "\n".join(lines) + "\n"


def installed_versions(names: tuple[str, ...]) -> dict[str, str]:
    """The versions of ``names`` installed in this environment (BundleError naming any that is missing)."""
    versions, missing = {}, []
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise BundleError(f"cannot pin {missing}: not installed in {sys.prefix}")
    return versions


def device_pyproject(version: str) -> str:
    """A pyproject.toml that builds only the device_runtime package (and its *.json data)."""
    dependencies = ", ".join(f'"{r}"' for r in WHEEL_REQUIREMENTS)
    return f"""[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{DISTRIBUTION}"
version = "{version}"
description = "FedARA device runtime: onnxruntime local rounds over MQTT (onnxruntime from requirements-device.txt)"
requires-python = ">=3.10"
dependencies = [{dependencies}]

[tool.setuptools]
packages = ["{PACKAGE}"]

[tool.setuptools.package-data]
{PACKAGE} = ["*.json"]
"""


def build_wheel(version: str, work: Path) -> Path:
    """Copy device_runtime into a minimal project under ``work`` and build its wheel there."""
    project = work / "project"
    shutil.copytree(ROOT / PACKAGE, project / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (project / "pyproject.toml").write_text(device_pyproject(version))
    dist = work / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(dist), str(project)], capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleError(f"building the {DISTRIBUTION} wheel failed:\n{done.stdout}{done.stderr}")
    wheels = list(dist.glob(f"{WHEEL_PREFIX}-{version}-py3-none-any.whl"))
    if len(wheels) != 1:
        raise BundleError(f"expected one {WHEEL_PREFIX}-{version}-py3-none-any.whl in {dist}, got {sorted(dist.iterdir())}")
    return wheels[0]


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Root-owned entries; install.sh and folders executable, everything else read-only."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    executable = info.isdir() or info.name.endswith(".sh")
    info.mode = EXECUTABLE_MODE if executable else FILE_MODE
    return info


def build_bundle(out_dir: Path) -> Path:
    """Build ``out_dir/fedara-device-<version>.tar.gz`` and return its path."""
    foreign = foreign_imports(ROOT / PACKAGE)
    if foreign:
        raise BundleError(f"device modules import packages a device does not have: {foreign}")
    version = project_version(ROOT / "pyproject.toml")
    name = f"{DISTRIBUTION}-{version}"
    requirements = pinned_requirements(installed_versions(PINNED))
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle = out_dir / f"{name}.tar.gz"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wheel = build_wheel(version, work)
        (work / REQUIREMENTS_NAME).write_text(requirements)
        members = {wheel.name: wheel, REQUIREMENTS_NAME: work / REQUIREMENTS_NAME,
                   **{f: TEMPLATES / f for f in TEMPLATE_FILES}}
        partial = bundle.with_name(bundle.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(work, arcname=name, recursive=False, filter=_normalized)
            for arcname, path in members.items():
                tar.add(path, arcname=f"{name}/{arcname}", filter=_normalized)
        partial.replace(bundle)
    return bundle


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder that receives fedara-device-<version>.tar.gz")
    args = p.parse_args(argv)
    try:
        bundle = build_bundle(args.out)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(bundle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
