"""The --help formatter of every FedARA command: each flag's default, where it has one to show.

argparse's ArgumentDefaultsHelpFormatter also prints "(default: None)" for required flags and for flags whose
default is computed at run time; those say in their own help text what happens without them.
"""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the flag is required or its default is None."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)
