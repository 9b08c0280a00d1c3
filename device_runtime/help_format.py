"""The --help formatter of every FedARA command: each flag's default, where it has one to show, in plain text.

argparse's ArgumentDefaultsHelpFormatter also prints "(default: None)" for required flags and for flags whose
default is computed at run time; those say in their own help text what happens without them. Descriptions come
from module docstrings, whose reStructuredText literals (``x``) read as plain x on a terminal.
"""
from __future__ import annotations

import argparse

RST_LITERAL = "``"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the flag is required or its default is None; drops the
    docstrings' RST literal marks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help if action.required or action.default is None else super()._get_help_string(action)
        return None if text is None else text.replace(RST_LITERAL, "")

    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace(RST_LITERAL, ""))
