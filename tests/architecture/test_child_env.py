"""Every process a test starts inherits the test's environment (tests/support/processes.child_env), never one built from
scratch: a machine's settings (OPENBLAS_CORETYPE, proxies, locale) reach the child as they reach real devices."""
import ast
from pathlib import Path

from tests.support.processes import child_env

TESTS = Path(__file__).resolve().parents[1]
STARTERS = {"run", "Popen", "check_output", "check_call", "call", "popen_in_group"}


def env_arguments(source: str) -> list[tuple[int, str]]:
    """(line, source) of each ``env=`` given to a process starter that is not ``child_env(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        for keyword in node.keywords:
            value = keyword.value
            if name in STARTERS and keyword.arg == "env" and not (
                    isinstance(value, ast.Call) and getattr(value.func, "id", None) == "child_env"):
                found.append((node.lineno, ast.unparse(value)))
    return found


def test_a_child_keeps_the_environment_and_takes_the_tests_settings(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    env = child_env(drop=("HOME",), OMP_NUM_THREADS="1")
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and env["OMP_NUM_THREADS"] == "1" and "HOME" not in env


def test_the_check_finds_an_environment_built_from_scratch():
    assert env_arguments("subprocess.run(['x'], env={'PATH': '/bin'})") == [(1, "{'PATH': '/bin'}")]
    assert env_arguments("subprocess.run(['x'], env=child_env(PATH='/bin'))") == []


def test_every_process_a_test_starts_passes_the_environment_on():
    offenders = {f"{path.relative_to(TESTS)}:{line}: env={value}" for path in sorted(TESTS.rglob("*.py"))
                 for line, value in env_arguments(path.read_text())}
    assert not offenders, "start processes with env=child_env(...) (tests/support/processes.py):\n" + "\n".join(sorted(offenders))
