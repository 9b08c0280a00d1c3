"""Where a compiled step graph spends its time: onnxruntime's profiler by op type and by node, and the session settings.

    .venv/bin/python scripts/profile_step.py --config fedavgcnn:1x28x28 --ratios 1.0,0.25 --out-dir DIR
    .venv/bin/python scripts/profile_step.py --graph before=OLD/step_model.onnx --config fedavgcnn:1x28x28 \\
        --ratios 1.0 --sessions --out-dir DIR

Each graph is compiled here with the current step compiler (``--config`` × ``--ratios``) or read from a file
(``--graph LABEL=PATH``: e.g. the step_model.onnx of an artifact set an older compiler built, for a before/after).
The graphs are profiled in turn, ``--repeats`` times, so they meet the same load: onnxruntime's profiler over
``--runs`` runs at 1 thread and batch 16 on synthetic feeds gives kernel time per run, shares by op type and the
slowest nodes with their input shapes (the profiler inflates absolute times; shares and ratios are the point).
With ``--sessions``, per graph: step time at each graph optimization level (BASIC, EXTENDED, ALL) in interleaved
blocks at 1 and 2 threads (thread-CPU and wall p50), all the graphs' steps at level ALL and 1 thread timed
against each other in interleaved blocks (a before/after comparison under the same load), and load time from the
graph at level ALL against loading onnxruntime's saved optimized graph with optimizations off (what a cache of
optimized graphs on a device would save). With ``--torch``, each ``--config`` plan's PyTorch eager step (the one
scripts/bench_device.py times: forward, backward, SGD) at 1 thread, in the same rounds: thread-CPU time per aten
op (each timed around its own call), so both runtimes' op classes can be set side by side. Writes
profile_step.json and profile_step.md into ``--out-dir``; prints the tables.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_device import BATCH, NUM_CLASSES, parse_config, parse_ratios, shape_name
from bench_thread_options import interleaved_p50
from device_runtime.artifact_contract import ANCHOR_MASK, ANCHORS, INPUT, LABELS, LAM, LR
from device_runtime.trainer import session_options

TOP_NODES = 12
BLOCKS, PER_BLOCK = 8, 8
LOADS = 10


def synthetic_feeds(session, batch: int = BATCH) -> dict[str, np.ndarray]:
    """Inputs of a step (or eval) graph: a standard-normal batch, labels, anchors, λ = 10, lr = 5e-3, small weights."""
    rng = np.random.default_rng(0)
    feeds = {}
    for value in session.get_inputs():
        shape = [batch if not isinstance(d, int) else d for d in value.shape]
        if value.name == LABELS:
            feeds[value.name] = rng.integers(0, NUM_CLASSES, shape).astype(np.int64)
        elif value.name in (LAM, LR):
            feeds[value.name] = np.array(10.0 if value.name == LAM else 5e-3, np.float32)
        elif value.name == ANCHOR_MASK:
            feeds[value.name] = np.ones(shape, np.float32)
        else:
            scale = 1.0 if value.name in (INPUT, ANCHORS) else 0.05  # parameters: small weights
            feeds[value.name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return feeds


def _options(ort, threads: int, level=None, profile_prefix: str | None = None, save_to: str | None = None):
    """The device runtime's session options (device_runtime.trainer.session_options), with the study's changes."""
    options = session_options(ort, threads)
    if level is not None:
        options.graph_optimization_level = level
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    if save_to:
        options.optimized_model_filepath = save_to
    return options


def profile(ort, path: str, runs: int, workdir: str) -> dict:
    """Kernel µs per run by op type and by node (with input shapes) under onnxruntime's profiler, 1 thread."""
    session = ort.InferenceSession(path, _options(ort, 1, profile_prefix=os.path.join(workdir, "p")),
                                   providers=["CPUExecutionProvider"])
    feeds = synthetic_feeds(session)
    for _ in range(runs):
        session.run(None, feeds)
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    by_node, op_of, shapes = collections.Counter(), {}, {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            node = e["name"][:-len("_kernel_time")]
            by_node[node] += e["dur"] / runs
            op_of[node] = e["args"]["op_name"]
            shapes[node] = [next(iter(s.values())) for s in e["args"].get("input_type_shape", [])]
    by_op = collections.Counter()
    for node, us in by_node.items():
        by_op[op_of[node]] += us
    return dict(kernel_us=sum(by_node.values()), kernels=len(by_node), by_op_us=dict(by_op.most_common()),
                top_nodes=[dict(node=n, op=op_of[n], us=us, input_shapes=shapes[n])
                           for n, us in by_node.most_common(TOP_NODES)])


def torch_profile(model_name: str, shape: tuple[int, ...], ratio: float, runs: int) -> dict:
    """Thread-CPU µs per run by aten op of the PyTorch eager step of this plan (batch 16, 1 thread, synthetic
    feeds), each op timed around its own call (a TorchDispatchMode; torch.profiler's per-op overhead would inflate
    the small ones), and the plain step's thread-CPU p50 beside it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from fedcore.lowrank import RankPlan, factorize_model, resolve_plan
    from fedcore.models import build_model
    from fedcore.objective import compute_anchors, local_loss

    class OpTimes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ns = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.thread_time_ns()
            out = func(*args, **(kwargs or {}))
            self.ns[func.overloadpacket.__name__] += time.thread_time_ns() - start
            return out

    torch.set_num_threads(1)
    model = build_model(model_name, shape, NUM_CLASSES, seed=0)
    model = factorize_model(model, resolve_plan(model, RankPlan(ratio)).ranks)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, *shape)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, BATCH).astype(np.int64)
    anchors, mask = (torch.from_numpy(a) for a in compute_anchors(model.fe, x, y, NUM_CLASSES))
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    optimizer = torch.optim.SGD(model.parameters(), lr=5e-3)
    model.train()

    def step() -> None:
        loss, _ = local_loss(model, x, y, anchors, mask, 10.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    plain = []
    for _ in range(runs):
        start = time.thread_time()
        step()
        plain.append(time.thread_time() - start)
    timer = OpTimes()
    with timer:
        for _ in range(runs):
            step()
    by_op = {op: ns / runs / 1e3 for op, ns in timer.ns.most_common()}
    return dict(step_cpu_us=float(np.median(plain) * 1e6), ops_cpu_us=sum(by_op.values()), by_op_us=by_op)


def graphs_interleaved(ort, graphs: dict[str, str]) -> dict[str, dict[str, float]]:
    """Step wall and thread-CPU p50 ms of each graph at 1 thread and level ALL, the graphs timed against each other
    in interleaved blocks (the order reversed every other block), so a before and an after meet the same load."""
    sessions = {label: ort.InferenceSession(path, _options(ort, 1), providers=["CPUExecutionProvider"])
                for label, path in graphs.items()}
    feeds = {label: synthetic_feeds(session) for label, session in sessions.items()}
    wall: dict[str, list[float]] = {label: [] for label in sessions}
    cpu: dict[str, list[float]] = {label: [] for label in sessions}
    for block in range(2 * BLOCKS):
        for label in (list(sessions) if block % 2 else list(sessions)[::-1]):
            sessions[label].run(None, feeds[label])
            for _ in range(PER_BLOCK):
                w, c = time.perf_counter(), time.thread_time()
                sessions[label].run(None, feeds[label])
                cpu[label].append(time.thread_time() - c)
                wall[label].append(time.perf_counter() - w)
    return {label: dict(wall_ms=1e3 * float(np.median(wall[label])), cpu_ms=1e3 * float(np.median(cpu[label])))
            for label in sessions}


def session_settings(ort, path: str) -> dict:
    """Step ms per optimization level (interleaved, 1 and 2 threads) and load ms with and without a saved graph."""
    levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    out = {}
    for threads in (1, 2):
        sessions = {name: ort.InferenceSession(path, _options(ort, threads, level), providers=["CPUExecutionProvider"])
                    for name, level in levels.items()}
        out[f"{threads}t"] = interleaved_p50(sessions, synthetic_feeds(sessions["all"]), BLOCKS, PER_BLOCK,
                                             time.thread_time)
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(path, _options(ort, 1, levels["all"], save_to=saved), providers=["CPUExecutionProvider"])
        loads = collections.defaultdict(list)
        for _ in range(LOADS):
            for name, source, level in (("graph_at_all", path, levels["all"]),
                                        ("saved_optimized", saved, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)):
                start = time.perf_counter()
                ort.InferenceSession(source, _options(ort, 1, level), providers=["CPUExecutionProvider"])
                loads[name].append(time.perf_counter() - start)
    out["load_ms"] = {name: float(np.median(v) * 1e3) for name, v in loads.items()}
    return out


def compile_graphs(configs, ratios, workdir: str) -> dict[str, str]:
    """label -> path of a step graph compiled (and parity-checked) by the current step compiler."""
    if not configs:
        return {}
    import onnx
    from export.artifacts import inference_session
    from export.step_compiler import check_parity, compile_step
    from fedcore.lowrank import RankPlan, factorize_model, resolve_plan
    from fedcore.models import build_model
    graphs = {}
    for model_name, shape in configs:
        for ratio in ratios:
            model = build_model(model_name, shape, NUM_CLASSES, seed=0)
            client = factorize_model(model, resolve_plan(model, RankPlan(ratio)).ranks)
            step, evaluate = compile_step(client, shape, NUM_CLASSES, client.feature_dim)
            check_parity(client, step, evaluate, shape, NUM_CLASSES, client.feature_dim, inference_session)
            label = f"{model_name} {shape_name(shape)} {ratio:g}"
            graphs[label] = os.path.join(workdir, f"compiled_{len(graphs)}.onnx")  # in workdir whatever the label
            onnx.save(step, graphs[label])
            print(f"compiled {label}", flush=True)
    return graphs


def markdown(results: dict) -> str:
    lines = ["| graph | kernels | kernel ms/run (profiler) | shares of kernel time |", "|---|---:|---:|---|"]
    torch_results = {label: r["torch"] for label, r in results.items() if "torch" in r}
    results = {label: r for label, r in results.items() if "profile" in r}
    for label, r in results.items():
        total = r["profile"]["kernel_us"]
        shares = ", ".join(f"{op} {us / total * 100:.1f} %" for op, us in list(r["profile"]["by_op_us"].items())[:8])
        lines.append(f"| {label} | {r['profile']['kernels']} | {total / 1e3:.2f} | {shares} |")
    for label, r in results.items():
        lines += ["", f"Slowest nodes of {label}:", "", "| µs/run | op | node | input shapes |", "|---:|---|---|---|"]
        lines += [f"| {n['us']:.0f} | {n['op']} | {n['node'][:60]} | {n['input_shapes']} |"
                  for n in r["profile"]["top_nodes"]]
    for label, r in torch_results.items():
        lines += ["", f"{label}: thread-CPU µs/run by aten op, {r['ops_cpu_us'] / 1e3:.2f} ms in ops, the plain step "
                      f"{r['step_cpu_us'] / 1e3:.2f} ms (p50):", "",
                  "| µs/run | aten op |", "|---:|---|"]
        lines += [f"| {us:.0f} | {op} |" for op, us in list(r["by_op_us"].items())[:TOP_NODES * 2]]
    with_sessions = {k: r["sessions"] for k, r in results.items() if "sessions" in r}
    if with_sessions:
        lines += ["", "| graph | threads | BASIC wall / CPU ms | EXTENDED | ALL |", "|---|---:|---:|---:|---:|"]
        for label, s in with_sessions.items():
            for threads in ("1t", "2t"):
                cells = " | ".join(f"{s[threads][lv]['wall_ms']:.2f} / {s[threads][lv]['cpu_ms']:.2f}"
                                   for lv in ("basic", "extended", "all"))
                lines.append(f"| {label} | {threads} | {cells} |")
        lines += ["", "| graph | step at 1 thread, level ALL, the graphs interleaved: wall / thread-CPU p50 ms |",
                  "|---|---:|"]
        lines += [f"| {label} | {t['wall_ms']:.2f} / {t['cpu_ms']:.2f} |"
                  for label, t in ((label, s["graphs_interleaved_1t"]) for label, s in with_sessions.items())]
        lines += ["", "| graph | load ms at level ALL | load ms of the saved optimized graph |", "|---|---:|---:|"]
        lines += [f"| {label} | {s['load_ms']['graph_at_all']:.1f} | {s['load_ms']['saved_optimized']:.1f} |"
                  for label, s in with_sessions.items()]
    return "\n".join(lines) + "\n"


def parse_graph(text: str) -> tuple[str, str]:
    label, _, path = text.partition("=")
    if not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"--graph {text}: no file {path}")
    return label, path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", type=parse_config, default=[], metavar="MODEL:CxHxW",
                   help="compile this model's step graph with the current compiler (repeatable)")
    p.add_argument("--ratios", type=parse_ratios, default=(1.0,), help="rank ratios of --config (default 1.0)")
    p.add_argument("--graph", action="append", type=parse_graph, default=[], metavar="LABEL=PATH",
                   help="profile this ONNX step graph as LABEL (repeatable)")
    p.add_argument("--runs", type=int, default=40, help="profiled runs per graph and repeat (default 40)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over all graphs (default 2); the last is kept")
    p.add_argument("--sessions", action="store_true", help="also time optimization levels and load with a cache")
    p.add_argument("--torch", action="store_true",
                   help="also time each --config plan's PyTorch eager step per aten op (1 thread)")
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args(argv)
    if not args.config and not args.graph:
        p.error("name a graph: --config MODEL:CxHxW and/or --graph LABEL=PATH")
    if args.runs < 1 or args.repeats < 1:
        p.error(f"--runs and --repeats must be >= 1, got {args.runs} and {args.repeats}")
    import onnxruntime as ort
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        graphs = dict(args.graph) | compile_graphs(args.config, args.ratios, workdir)
        results: dict[str, dict] = {}
        for _ in range(args.repeats):
            for label, path in graphs.items():
                source = path if label in dict(args.graph) else "compiled by the current step compiler"
                results[label] = dict(source=source, profile=profile(ort, path, args.runs, workdir))
            if args.torch:
                for model_name, shape in args.config:
                    for ratio in args.ratios:
                        label = f"PyTorch eager {model_name} {shape_name(shape)} {ratio:g}"
                        results[label] = dict(torch=torch_profile(model_name, shape, ratio, args.runs))
        if args.sessions:
            for label, path in graphs.items():
                results[label]["sessions"] = session_settings(ort, path)
            for label, timed in graphs_interleaved(ort, graphs).items():
                results[label]["sessions"]["graphs_interleaved_1t"] = timed
    report = markdown(results)
    print(report)
    (args.out_dir / "profile_step.md").write_text(report)
    document = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), onnxruntime=ort.__version__,
                    machine=dict(platform=platform.platform(), cpus=os.cpu_count(), loadavg=os.getloadavg()),
                    batch=BATCH, runs=args.runs, repeats=args.repeats, results=results)
    (args.out_dir / "profile_step.json").write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
