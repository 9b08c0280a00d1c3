"""Every flag the docs give a command is one the command has: each `--flag` in a `python -m server.simulate`,
`server.broker_loop` or `device_runtime` command line of README.md or docs/*.md (a code block's command, joined over
its backslash line ends, or an inline code span) is in that command's --help. The help is the command's own, run as
a user would, which answers before it imports torch."""
from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"-m (server\.simulate|server\.broker_loop|device_runtime)(?![\w.])(.*)")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
END_OF_COMMAND = {"|", "||", "&&", ";", "#", ">", "2>", "&"}
TIMEOUT_S = 60


def command_lines(text: str) -> list[str]:
    """The fenced code blocks' lines (a line ending in a backslash joined to the next) and the inline code spans."""
    lines, prose, fenced = [], [], False
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line)
        else:
            prose.append(line)
    return lines + re.findall(r"`([^`\n]+)`", "\n".join(prose))


def documented_commands(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(module, subcommand or "", flags) of each command line in ``text`` that runs one of the three commands."""
    found = []
    for line in command_lines(text):
        for match in COMMAND.finditer(line):
            words = []
            for word in match[2].split():
                if word in END_OF_COMMAND:
                    break
                words.append(word)
            sub = words[0] if words and re.fullmatch(r"[a-z]+", words[0]) else ""
            flags = tuple(FLAG.match(w)[0] for w in words if FLAG.match(w))
            found.append((match[1], sub, flags))
    return found


@functools.cache
def help_flags(module: str, sub: str) -> frozenset[str]:
    done = subprocess.run([sys.executable, "-m", module, *([sub] if sub else []), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return frozenset(FLAG.findall(done.stdout))


def test_the_reader_finds_a_commands_flags_across_a_line_break_and_stops_at_a_pipe():
    text = ("Run `python -m server.simulate --rounds 3`.\n\n```\npython -m device_runtime predict --workdir W \\\n"
            "    --json x.npz | jq .  --not-this\n.venv/bin/python -m server.broker_loop --broker URL # --nor-this\n```\n")
    assert sorted(documented_commands(text)) == [("device_runtime", "predict", ("--workdir", "--json")),
                                                 ("server.broker_loop", "", ("--broker",)),
                                                 ("server.simulate", "", ("--rounds",))]


def test_the_docs_give_each_command_with_flags():
    """The reader finds what it checks: command lines of all three commands, with flags."""
    found = {module for doc in DOCS for module, _, flags in documented_commands(doc.read_text()) if flags}
    assert found == {"server.simulate", "server.broker_loop", "device_runtime"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_flag_a_doc_gives_a_command_is_in_its_help(doc: Path):
    unknown = sorted({(f"{module} {sub}".strip(), flag) for module, sub, flags in documented_commands(doc.read_text())
                      for flag in flags if flag not in help_flags(module, sub)})
    assert unknown == [], f"{doc.name} names flags the command does not have: {unknown}"
