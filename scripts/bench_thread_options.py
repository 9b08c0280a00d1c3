"""The portable step at 2 threads: onnxruntime session options against the shipped ones, in interleaved blocks.

    .venv/bin/python scripts/bench_thread_options.py --python STOCK_PYTHON --config fedavgcnn:3x32x32 \\
        --config cnn1:3x32x32 --ratios 0.75 --out-dir DIR

Each step graph is compiled here with the current step compiler (``--config`` × ``--ratios``, parity-checked) and
timed in a worker in ``--python`` (stock onnxruntime, as a device runs it) at batch 16 on the same synthetic feeds,
one session per variant, all open at once: BLOCKS rounds over the variants, each an untimed run then PER_BLOCK timed
ones, so every variant meets the same load. Variants: the shipped options (device_runtime.trainer.session_options)
at 1 and 2 intra-op threads, and at 2 threads with one change each: no spinning (session.intra_op.allow_spinning
0), the extra thread pinned to the second logical processor (session.intra_op_thread_affinities), a smaller
dynamic block base (session.dynamic_block_base 4: finer shards of each parallel loop), the parallel executor with
2 inter-op threads and 1 intra-op, and graph optimization levels BASIC and EXTENDED (the shipped level is ALL).
Reported: p50 wall ms and p50 process CPU ms (every thread's, spinning included) per variant and their ratios to
the shipped 2-thread options. Timings on a loaded machine are contention as much as kernels: the load average at
start and end is recorded. Writes bench_thread_options.{json,md} into ``--out-dir``; prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

BLOCKS, PER_BLOCK = 16, 6
BASE = "2 threads (shipped)"
VARIANTS = ("1 thread (shipped)", BASE, "no spinning", "extra thread pinned", "dynamic block base 4",
            "parallel executor, 2 inter-op", "level BASIC", "level EXTENDED")


def _options(ort, variant: str):
    """The device runtime's options with ``variant``'s one change."""
    from device_runtime.trainer import session_options
    options = session_options(ort, 1 if variant == VARIANTS[0] else 2)
    if variant == "no spinning":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif variant == "extra thread pinned":
        options.add_session_config_entry("session.intra_op_thread_affinities", "2")  # 1-based logical processor
    elif variant == "dynamic block base 4":
        options.add_session_config_entry("session.dynamic_block_base", "4")
    elif variant == "parallel executor, 2 inter-op":
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 2
    elif variant == "level BASIC":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    elif variant == "level EXTENDED":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    return options


def interleaved_p50(sessions: dict[str, Any], feeds: dict[str, np.ndarray], blocks: int, per_block: int,
                    cpu_clock: Callable[[], float]) -> dict[str, dict[str, float]]:
    """p50 wall and CPU ms (``cpu_clock``: the thread's or the process's) of one run of each session, timed in
    ``blocks`` interleaved rounds over the sessions, each an untimed run (the threads wake, the arena is warm) then
    ``per_block`` timed ones, so every session meets the same load."""
    wall: dict[str, list[float]] = {name: [] for name in sessions}
    cpu: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(blocks):
        for name, session in sessions.items():
            session.run(None, feeds)
            for _ in range(per_block):
                w, c = time.perf_counter(), cpu_clock()
                session.run(None, feeds)
                cpu[name].append(cpu_clock() - c)
                wall[name].append(time.perf_counter() - w)
    return {name: dict(wall_ms=1e3 * float(np.median(wall[name])), cpu_ms=1e3 * float(np.median(cpu[name])))
            for name in sessions}


def time_variants(spec: dict) -> dict:
    """Worker (numpy and onnxruntime only): per graph and variant, p50 wall and process-CPU ms of one step."""
    import onnxruntime as ort
    result = dict(onnxruntime=ort.__version__, graphs={})
    for label, graph in spec["graphs"].items():
        sessions = {v: ort.InferenceSession(graph["path"], _options(ort, v), providers=["CPUExecutionProvider"])
                    for v in VARIANTS}
        result["graphs"][label] = interleaved_p50(sessions, dict(np.load(graph["feeds"])), BLOCKS, PER_BLOCK,
                                                  time.process_time)
    return result


def table(report: dict) -> str:
    graphs = report["timings"]["graphs"]
    lines = [f"Step at batch 16, onnxruntime {report['timings']['onnxruntime']}, p50 ms: wall / process CPU "
             f"(ratio to {BASE}: wall / CPU); load average {report['machine']['loadavg_at_start'][0]:.1f} at start, "
             f"{report['machine']['loadavg_at_end'][0]:.1f} at end", "",
             "| variant | " + " | ".join(graphs) + " |", "|---|" + "---:|" * len(graphs)]
    for variant in VARIANTS:
        cells = []
        for rows in graphs.values():
            row, base = rows[variant], rows[BASE]
            cells.append(f"{row['wall_ms']:.2f} / {row['cpu_ms']:.2f} ({row['wall_ms'] / base['wall_ms']:.2f} / "
                         f"{row['cpu_ms'] / base['cpu_ms']:.2f})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from device_runtime.help_format import CommandParser
    parser = CommandParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], metavar="MODEL:CxHxW",
                        help="compile this model's step graph (repeatable; default fedavgcnn:3x32x32, cnn1:3x32x32)")
    parser.add_argument("--ratios", default="0.75", help="comma-separated rank ratios of --config (default 0.75)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter with stock onnxruntime and numpy that times the steps (default: this one)")
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(time_variants(json.loads(args.worker.read_text()))))
        return 0
    if args.out_dir is None:
        parser.error("--out-dir is required")
    from bench_device import parse_config, parse_ratios  # the parent's: the worker needs no more than onnxruntime
    try:
        configs = [parse_config(c) for c in args.config] or [("fedavgcnn", (3, 32, 32)), ("cnn1", (3, 32, 32))]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--config: {exc}")
    try:
        ratios = parse_ratios(args.ratios)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--ratios: {exc}")
    import onnxruntime as ort
    from profile_step import compile_graphs, synthetic_feeds
    command = " ".join([".venv/bin/python", "scripts/bench_thread_options.py",
                        *(argv if argv is not None else sys.argv[1:])])
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        graphs = {}
        for label, path in compile_graphs(configs, ratios, work).items():
            feeds = Path(work) / f"{label.replace(' ', '_')}.npz"
            np.savez(feeds, **synthetic_feeds(ort.InferenceSession(path, providers=["CPUExecutionProvider"])))
            graphs[label] = dict(path=path, feeds=str(feeds))
        spec = Path(work) / "spec.json"
        spec.write_text(json.dumps(dict(graphs=graphs)))
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        done = subprocess.run([args.python, str(Path(__file__).resolve()), "--worker", str(spec)], capture_output=True,
                              text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"the worker in {args.python} failed:\n{done.stderr[-2000:]}")
        timings = json.loads(done.stdout.strip().splitlines()[-1])
    from server.outputs.machine import cpu_name
    report = dict(command=command, blocks=BLOCKS, per_block=PER_BLOCK, timings=timings,
                  machine=dict(platform=platform.platform(), cpu=cpu_name(), cpus=os.cpu_count(),
                               loadavg_at_start=list(load), loadavg_at_end=list(os.getloadavg())))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = table(report)
    (args.out_dir / "bench_thread_options.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out_dir / "bench_thread_options.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
