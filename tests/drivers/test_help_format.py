"""--help reads as plain text: the module docstrings' reST double backticks never reach the terminal."""
from __future__ import annotations

import argparse

import pytest

from device_runtime import __main__ as device_cli
from device_runtime.help_format import DefaultsHelpFormatter


def test_descriptions_epilogs_and_flag_help_lose_their_double_backticks():
    p = argparse.ArgumentParser(prog="x", description="Run ``python -m x``.", epilog="See ``docs/x.md``.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--a", default=3, help="like ``--b``")
    p.add_argument("--b", required=True, help="the ``b``")
    text = p.format_help()
    assert "``" not in text
    assert "Run python -m x." in text and "See docs/x.md." in text
    assert "like --b (default: 3)" in text and "the b" in text


@pytest.mark.parametrize("module", ["device_runtime", "server.aggregator"])
def test_the_commands_help_has_no_double_backticks(module: str):
    if module == "device_runtime":
        parser = device_cli.build_parser()
    else:
        from server import aggregator

        parser = aggregator.build_parser()
    text = parser.format_help()
    assert "``" not in text and "python -m" in text
