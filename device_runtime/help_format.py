"""The --help formatter of every FedARA command: each flag's default, where it has one to show, and plain text.

argparse's ArgumentDefaultsHelpFormatter also prints "(default: None)" for required flags and for flags whose
default is computed at run time; those say in their own help text what happens without them. Descriptions are
module docstrings, whose reST literals read as noise in a terminal: their double backticks are dropped.
"""
from __future__ import annotations

import argparse

RST_LITERAL = "``"


def plain(text: str) -> str:
    """``text`` without reST's double backticks."""
    return text.replace(RST_LITERAL, "")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the flag is required or its default is None; prints
    descriptions and help as plain text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return None if action.help is None else plain(action.help)
        return plain(super()._get_help_string(action))

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))
