"""The --help formatter of every FedARA command: each flag's default, where it has one to show, and plain text;
and its parser, whose error for a mistake in the flags is one line.

argparse's ArgumentDefaultsHelpFormatter also prints "(default: None)" for required flags and for flags whose
default is computed at run time; those say in their own help text what happens without them. Descriptions are
module docstrings, whose reST literals read as noise in a terminal: their double backticks are dropped.
"""
from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

RST_LITERAL = "``"
UNRECOGNIZED = "unrecognized arguments: "


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


class CommandParser(argparse.ArgumentParser):
    """The parser of every FedARA command: a mistake in the flags is one line, the one that matters, naming the fix
    (a close flag for a typo) and where the full usage is, instead of the whole usage printed before it; exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}{self._did_you_mean(message)} (all flags: {self.prog} --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """"; --rouns: did you mean --rounds?" for an unrecognized --rouns, "" when nothing is close."""
        if not message.startswith(UNRECOGNIZED):
            return ""
        known = list(self._option_string_actions)
        guesses = [(word, difflib.get_close_matches(word.split("=", 1)[0], known, n=1))
                   for word in message[len(UNRECOGNIZED):].split() if word.startswith("-")]
        return "".join(f"; {word}: did you mean {close[0]}?" for word, close in guesses if close)
