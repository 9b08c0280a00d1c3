"""The documented commands: every fenced code block of README.md and docs/*.md, with the doc-run markers that say
how tests run it (tests/architecture/test_doc_blocks.py checks them all, fast; tests/drivers/test_doc_runs.py runs
the commands, slow).

A command block is a fence tagged ``bash``; every other fence names what it holds (``text``, ``python``, ``yaml``,
``toml``, ``json``), so no command hides in an untagged block. A bash block runs as written, from the root of a
scratch copy of the repository (its ``.venv`` linked in, so outputs land in the copy, never in the clone), with
``bash -e``; what it leaves running in the background (a broker started with ``&``) is stopped after it. HTML
comments on the lines right before the fence say otherwise, one directive each:

    <!-- doc-run: skip: REASON -->          not run; REASON says why (needs an ARM board, root and cgroups, a
                                            template with the reader's HOST, ...)
    <!-- doc-run: short: --rounds 1 -->     run a shorter twin: each ``--flag value`` replaces that flag's value
                                            in every ``python -m server.*`` / ``device_runtime`` / ``scripts/*.py``
                                            command of the block that has the flag, and is added to those that
                                            do not (``--flag`` alone adds a switch); the doc states the full
                                            command's runtime
    <!-- doc-run: timeout: SECONDS -->      the run's limit (default DEFAULT_TIMEOUT_S)
    <!-- doc-run: setup: COMMAND -->        run COMMAND first, in the same scratch copy (what the block reads: a
                                            run folder made by an earlier command of the doc)

A doc states the runtime of each command it gives (a short twin's command included).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = ("bash", "text", "python", "yaml", "toml", "json")
DEFAULT_TIMEOUT_S = 300
MARKER = re.compile(r"<!--\s*doc-run:\s*(?P<directive>[a-z]+)\s*:\s*(?P<value>.*?)\s*-->\s*$")
RUNNABLE = re.compile(r"(-m (server\.simulate|server\.broker_loop|server\.shards|device_runtime)(?![\w.])"
                      r"|scripts/[\w/]+\.py)")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


class MarkerError(ValueError):
    """A doc-run marker that does not parse: the doc, its line and what is wrong."""


@dataclass
class Block:
    """One fenced block: where it is, its language, its text and its doc-run directives."""

    doc: Path
    line: int  # the fence's line, 1-based
    language: str
    text: str
    skip: str | None = None
    short: list[tuple[str, str | None]] = field(default_factory=list)
    timeout_s: int = DEFAULT_TIMEOUT_S
    setup: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{shown(self.doc)}:{self.line}"

    def script(self) -> str:
        """The text to run: the block as written, or its short twin."""
        text = self.text
        if self.short:
            lines = text.replace("\\\n", " ").splitlines()
            text = "\n".join(shorten(line, self.short) if RUNNABLE.search(line) else line for line in lines) + "\n"
        return "".join(f"{command}\n" for command in self.setup) + text


def parse_short(value: str) -> list[tuple[str, str | None]]:
    """``--flag value --switch ...`` as (flag, value or None) pairs; raises MarkerError for a word that is no flag."""
    words, pairs = shlex.split(value), []
    while words:
        flag = words.pop(0)
        if not FLAG.fullmatch(flag):
            raise MarkerError(f"short: {flag!r} is not a --flag")
        pairs.append((flag, words.pop(0) if words and not words[0].startswith("--") else None))
    if not pairs:
        raise MarkerError("short: names no flag")
    return pairs


def shorten(line: str, short: list[tuple[str, str | None]]) -> str:
    """One command line with the short twin's flags: a flag it has gets the new value, one it lacks is added
    before anything that ends the command (a pipe, a redirection, a comment, ``&``)."""
    end = re.search(r"\s(\||&&|;|#|>|2>|&)(\s|$)", line)
    command, rest = (line[:end.start()], line[end.start():]) if end else (line, "")
    for flag, value in short:
        given = re.search(rf"(?<!\S){re.escape(flag)}(?:[ =](?!--)\S+)?(?!\S)", command)
        new = flag if value is None else f"{flag} {shlex.quote(value)}"
        command = command[:given.start()] + new + command[given.end():] if given else f"{command} {new}"
    return command + rest


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of one doc, each with the directives of the marker lines right above it."""
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"\s*```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), None)
        if end is None:
            raise MarkerError(f"{doc.name}:{i + 1}: a fence that is never closed")
        block = Block(doc, i + 1, fence[1], "\n".join(lines[i + 1:end]) + "\n")
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("<!-- doc-run"):
            apply(block, lines[j].strip(), doc, j + 1)
            j -= 1
        found.append(block)
        i = end + 1
    return found


def apply(block: Block, marker: str, doc: Path, line: int) -> None:
    """Set one directive of ``block`` from its marker line; raises MarkerError naming the doc and line."""
    match = MARKER.match(marker)
    try:
        if match is None:
            raise MarkerError("not <!-- doc-run: DIRECTIVE: VALUE -->")
        directive, value = match["directive"], match["value"]
        if directive == "skip":
            if not value:
                raise MarkerError("skip: needs a reason")
            block.skip = value
        elif directive == "short":
            block.short = parse_short(value)
        elif directive == "setup":
            if not value:
                raise MarkerError("setup: needs a command")
            block.setup.insert(0, value)
        elif directive == "timeout":
            if not value.isdigit() or int(value) < 1:
                raise MarkerError(f"timeout: wants whole seconds, got {value!r}")
            block.timeout_s = int(value)
        else:
            raise MarkerError(f"unknown directive {directive!r} (skip, short, timeout, setup)")
    except MarkerError as exc:
        raise MarkerError(f"{shown(doc)}:{line}: {exc}") from None


def shown(doc: Path) -> str:
    """A doc's name as a reader finds it: relative to the repository where it is in it."""
    return doc.relative_to(REPO).as_posix() if doc.is_relative_to(REPO) else doc.name


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


def command_blocks() -> list[Block]:
    """Every bash block of README.md and docs/*.md."""
    return [b for b in all_blocks() if b.language == "bash"]
