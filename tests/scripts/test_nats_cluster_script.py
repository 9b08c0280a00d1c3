"""scripts/nats_cluster.py as the README starts it (in the background, with ``&``): SIGTERM stops its nats-server
nodes, whether they are still starting or running, and leaves none behind."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.machine import missing_binary, needs
from tests.support.processes import child_env
from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nats_cluster.py"
TIMEOUT_S = 120


def children(pid: int) -> set[int]:
    """The direct children of ``pid`` (Linux /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def wait_for(condition, timeout: float = TIMEOUT_S, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@needs(missing_binary("nats-server", "nats-server"))  # scripts/nats_cluster.py runs it from PATH
@pytest.mark.parametrize("when", ["starting", "running"])
def test_sigterm_stops_every_node(tmp_path: Path, when: str):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--nodes", "3", "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        wait_for(lambda: len(children(proc.pid)) == 3, what="three nats-server nodes")
        nodes = children(proc.pid)
        if when == "running":
            assert proc.stdout.readline().startswith("--broker mqtt://127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT_S) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [pid for pid in nodes if alive(pid)]
    for pid in left:  # a failing run leaves nothing behind either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"nats-server nodes {left} outlived the script"


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_a_stop_signal_while_a_node_starts_waits_until_the_node_is_recorded():
    """A SIGTERM that lands inside Popen (it waits there for the exec) must not lose the node it is starting: the
    script holds it until the node is stored, then stops as usual."""
    module = load_script("nats_cluster")
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, module._stop_on_signal)
    recorded = []
    try:
        with pytest.raises(module.Stop, match="SIGTERM"):
            with module.held_stop():
                os.kill(os.getpid(), signal.SIGTERM)
                recorded.append("node")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert recorded == ["node"]
