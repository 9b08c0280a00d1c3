"""Ray is an optional extra (``pip install .[ray]``, pulled by ``[dev]`` for the tests): neither the project's own
dependencies, nor the ``[device]`` extra, nor the device bundle's requirements and wheel install it."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement_names(extra: str) -> set[str]:
    """The distributions an extra installs, its own ``fedara-edge[...]`` extras followed."""
    names: set[str] = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        inner = re.fullmatch(r"fedara-edge\[(.+)\]", requirement)
        if inner:
            for other in inner.group(1).split(","):
                names |= requirement_names(other.strip())
        else:
            names.add(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower())
    return names


def test_ray_is_an_extra_that_the_dev_install_pulls_and_the_core_does_not():
    assert requirement_names("ray") == {"ray"} and "ray" in requirement_names("dev")
    assert not any(r.lower().startswith("ray") for r in PROJECT["dependencies"])


def test_the_device_extra_and_the_device_bundle_install_no_ray():
    assert "ray" not in requirement_names("device")
    bundle = load_script("build_device_bundle")
    assert "ray" not in bundle.pinned_requirements({name: "1" for name in bundle.PINNED}).lower()
    assert not any("ray" in r.lower() for r in bundle.WHEEL_REQUIREMENTS)
    assert "ray" not in bundle.ALLOWED_IMPORTS
