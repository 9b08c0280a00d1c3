"""Run a Python module under cProfile in every thread, on each thread's own CPU time.

    .venv/bin/python scripts/thread_profile.py OUT.prof -m server.broker_loop --rounds 1 ...

``python -m cProfile`` profiles the main thread only; a server's other threads (paho's network thread: socket reads,
MQTT parsing, frames and reassembly; timers) are not in it. This profiles each thread on ``time.thread_time`` (the
CPU that thread spent, which a loaded machine cannot stretch) and writes, at the module's end (or on SIGTERM),
``OUT.prof`` for the main thread, ``OUT.<thread name>.prof`` for each other thread that ran Python code (read them
with pstats), and ``OUT.threads.json``: each thread's CPU seconds as its profile counted them, the profiled total, and
the process's CPU seconds (``time.process_time``: with threads that never ran Python code, torch's, say). The
profiler's own cost lands in the threads it profiles (a thread of many short Python calls is inflated the most).
"""
from __future__ import annotations

import atexit
import cProfile
import json
import os
import pstats
import re
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

_lock = threading.Lock()
_profiles: dict[str, cProfile.Profile] = {}


def _file_name(out: Path, thread: str) -> Path:
    if thread == "MainThread":
        return out
    return out.with_name(f"{out.stem}.{re.sub(r'[^A-Za-z0-9_-]+', '_', thread)}{out.suffix}")


def _start_thread_profile(*_: object) -> None:
    """threading.setprofile's hook: the first event of a new thread replaces it with that thread's own profiler."""
    profiler = cProfile.Profile(time.thread_time)
    name = threading.current_thread().name
    with _lock:
        while name in _profiles:
            name += "+"
        _profiles[name] = profiler
    profiler.enable()


def _write(out: Path) -> None:
    threads = {}
    with _lock:
        profiles = dict(_profiles)
    for name, profiler in profiles.items():
        if name == "MainThread":
            profiler.disable()
        profiler.create_stats() if name == "MainThread" else setattr(profiler, "stats", _snapshot(profiler))
        if not profiler.stats:
            continue
        stats = pstats.Stats(profiler)
        stats.dump_stats(_file_name(out, name))
        threads[name] = stats.total_tt
    summary = {"threads_cpu_s": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
               "profiled_cpu_s": sum(threads.values()), "process_cpu_s": time.process_time()}
    out.with_name(f"{out.stem}.threads.json").write_text(json.dumps(summary, indent=1) + "\n")


def _snapshot(profiler: cProfile.Profile) -> dict:
    """The stats of a profiler still enabled in another thread (cProfile's create_stats, without its disable)."""
    profiler.snapshot_stats()
    return profiler.stats


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "-m":
        print("usage: thread_profile.py OUT.prof -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    out, module = Path(argv[0]).resolve(), argv[2]
    threading.setprofile(_start_thread_profile)
    main_profile = cProfile.Profile(time.thread_time)
    _profiles["MainThread"] = main_profile
    atexit.register(_write, out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.argv = [module, *argv[3:]]
    sys.path[0] = os.getcwd()  # as ``python -m`` does: the module is found from the working folder, not scripts/
    main_profile.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
