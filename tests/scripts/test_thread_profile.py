"""scripts/thread_profile.py: a module run under cProfile in every thread, each thread's profile and CPU written."""
from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

from tests.support.processes import child_env
from tests.support.scripts import SCRIPTS

TWO_THREADS = '''
import threading

def spin_in_worker():
    return sum(i * i for i in range(200_000))

def spin_in_main():
    return sum(i * i for i in range(100_000))

worker = threading.Thread(target=spin_in_worker, name="worker")
worker.start()
worker.join()
spin_in_main()
'''


def test_each_thread_gets_its_own_profile_and_cpu_seconds(tmp_path: Path):
    (tmp_path / "two_threads.py").write_text(TWO_THREADS)
    out = tmp_path / "run.prof"
    done = subprocess.run([sys.executable, str(SCRIPTS / "thread_profile.py"), str(out), "-m", "two_threads"],
                          capture_output=True, text=True, timeout=120, env=child_env(PYTHONPATH=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-3000:]
    main = {name for _, _, name in pstats.Stats(str(out)).stats}
    worker = {name for _, _, name in pstats.Stats(str(tmp_path / "run.worker.prof")).stats}
    assert "spin_in_main" in main and "spin_in_worker" not in main
    assert "spin_in_worker" in worker and "spin_in_main" not in worker
    summary = json.loads((tmp_path / "run.threads.json").read_text())
    assert set(summary["threads_cpu_s"]) == {"MainThread", "worker"}, summary
    assert 0 < summary["profiled_cpu_s"] <= summary["process_cpu_s"], summary


def test_the_module_is_found_from_the_working_folder_as_python_m_finds_it(tmp_path: Path):
    (tmp_path / "two_threads.py").write_text(TWO_THREADS)
    done = subprocess.run([sys.executable, str(SCRIPTS / "thread_profile.py"), str(tmp_path / "run.prof"), "-m",
                           "two_threads"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run.worker.prof").exists()


def test_without_a_module_it_exits_2_with_its_usage(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "thread_profile.py"), str(tmp_path / "x.prof")],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 2 and "usage" in done.stderr and "Traceback" not in done.stderr, done.stderr
