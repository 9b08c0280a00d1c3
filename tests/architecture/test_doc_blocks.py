"""Every fenced block of README.md and docs/*.md, read without running anything (the doc-run markers and their
syntax: tests/support/doc_blocks.py; tests/drivers/test_doc_runs.py runs the commands): each fence names its
language, so no command hides in an untagged block; each bash block runs as written, has a short twin, or is
skipped with a reason; its Python commands run the venv's interpreter; and the flags a block gives a script, or a
short twin adds, are flags that command has (those of ``python -m server.*`` and ``device_runtime`` commands are
held to their --help by test_doc_flags.py)."""
from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from tests.architecture.test_doc_flags import FLAG, documented_commands, help_flags
from tests.support.doc_blocks import (LANGUAGES, REPO, Block, MarkerError, all_blocks, blocks, command_blocks,
                                      parse_short, shorten)

SCRIPT = re.compile(r"(?<![\w/])(scripts/\w+\.py)((?:\s+(?![|&;#>])\S+)*)")
PYTHON = re.compile(r"(?:^|[\s;&|(])((?:\S*/)?python3?)\s")


def test_every_fence_names_its_language():
    untagged = [b.name for b in all_blocks() if b.language not in LANGUAGES]
    assert untagged == [], f"fences without one of {LANGUAGES}: {untagged}"


def test_the_docs_have_command_blocks_that_run_and_blocks_skipped_for_a_reason():
    found = command_blocks()
    assert [b for b in found if b.skip is None] and [b for b in found if b.skip is not None]


@pytest.mark.parametrize("block", [b for b in command_blocks() if b.skip is None], ids=lambda b: b.name)
def test_a_block_that_runs_uses_the_venvs_python(block: Block):
    pythons = PYTHON.findall(block.script())
    assert all(p == ".venv/bin/python" for p in pythons), f"{block.name}: {pythons} (write .venv/bin/python)"


def _defined_flags(source: str) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", source))


@functools.cache
def _cli_helpers() -> dict[str, frozenset[str]]:
    """server/cli.py's functions that add flags to a parser (``add_ray_flags``, ...), by name: what they add."""
    source = (REPO / "server" / "cli.py").read_text()
    bodies = re.split(r"\n(?=def )", source)
    return {m[1]: frozenset(_defined_flags(body)) for body in bodies
            if (m := re.match(r"def (add_\w+)\(", body)) and _defined_flags(body)}


@functools.cache
def script_flags(script: str) -> frozenset[str]:
    """The flags a script's argparse parser defines, read from its source (no torch import, no process), with those
    of the server/cli.py helpers it calls (``add_ray_flags(p)``)."""
    source = (REPO / script).read_text()
    shared = [flags for name, flags in _cli_helpers().items() if re.search(rf"\b{name}\(", source)]
    return frozenset(_defined_flags(source).union(*shared))


def commands_of(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(scripts/X.py, its flags) of each script command in ``text``."""
    joined = text.replace("\\\n", " ")
    return [(m[1], tuple(FLAG.findall(" ".join(w for w in _words(m[2]) if w.startswith("--")))))
            for line in joined.splitlines() for m in SCRIPT.finditer(line)]


def _words(tail: str) -> list[str]:
    """A command's words after the script; a tail that closes a quote opened before the script (``sh -c '...
    scripts/x.py --flag'``) is split at blanks."""
    try:
        return shlex.split(tail, comments=True)
    except ValueError:
        return tail.split()


@pytest.mark.parametrize("block", command_blocks(), ids=lambda b: b.name)
def test_every_flag_a_block_gives_a_script_is_one_the_script_defines(block: Block):
    unknown = [(script, flag) for script, flags in commands_of(block.script()) for flag in flags
               if (REPO / script).exists() and flag not in script_flags(script)]
    assert unknown == [], f"{block.name}: {unknown}"


@pytest.mark.parametrize("block", [b for b in command_blocks() if b.short], ids=lambda b: b.name)
def test_a_short_twins_flags_are_the_commands_own(block: Block):
    in_fence = f"```\n{block.text}```\n"  # the flag reader reads fenced blocks
    accepted = set().union(*(help_flags(module, sub) for module, sub, _ in documented_commands(in_fence)),
                           *(script_flags(script) for script, _ in commands_of(block.text)))
    assert {flag for flag, _ in block.short} <= accepted, f"{block.name}: {block.short}"


# -- the reader itself --------------------------------------------------------------------------------


def doc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return path


def test_a_short_twin_replaces_a_flags_value_and_adds_a_missing_one_before_a_pipe():
    line = ".venv/bin/python -m server.simulate --rounds 50 --lr 0.05 | tail -n 3"
    assert shorten(line, parse_short("--rounds 2 --max-samples 600")) == \
        ".venv/bin/python -m server.simulate --rounds 2 --lr 0.05 --max-samples 600 | tail -n 3"


def test_markers_above_a_fence_are_read_in_order(tmp_path: Path):
    path = doc(tmp_path, "text\n<!-- doc-run: setup: echo one -->\n<!-- doc-run: setup: echo two -->\n"
                         "<!-- doc-run: short: --rounds 1 -->\n<!-- doc-run: timeout: 60 -->\n```bash\n"
                         ".venv/bin/python -m server.simulate --rounds 9 \\\n    --lr 1\n```\n")
    (block,) = blocks(path)
    assert (block.language, block.timeout_s, block.short) == ("bash", 60, [("--rounds", "1")])
    assert block.script().split() == "echo one echo two .venv/bin/python -m server.simulate --rounds 1 --lr 1".split()
    assert block.script().startswith("echo one\necho two\n")


@pytest.mark.parametrize("marker, problem", [("<!-- doc-run: skip: -->", "skip: needs a reason"),
                                             ("<!-- doc-run: short: rounds 1 -->", "is not a --flag"),
                                             ("<!-- doc-run: later: 1 -->", "unknown directive 'later'"),
                                             ("<!-- doc-run: timeout: soon -->", "wants whole seconds")])
def test_a_bad_marker_names_its_line_and_what_is_wrong(tmp_path: Path, marker: str, problem: str):
    path = doc(tmp_path, f"{marker}\n```bash\necho\n```\n")
    with pytest.raises(MarkerError, match=rf"doc.md:1: .*{re.escape(problem)}"):
        blocks(path)
