"""On-device cost of FedARA local training: memory and step latency of both onnxruntime runtimes beside PyTorch.

The two device runtimes: ``ort`` (onnxruntime-training: train_step + optimizer_step) and ``portable`` (stock
onnxruntime's InferenceSession running the compiled step graph; with ``--portable-python`` a second interpreter
whose environment holds stock onnxruntime measures it there, otherwise the training build's InferenceSession runs
it in this environment).

    .venv/bin/python scripts/bench_device.py --out-dir docs/results/device --cost-model device_runtime/cost_model.json
    .venv/bin/python scripts/bench_device.py --out-dir DIR --config cnn1:3x32x32 --ratios 1.0,0.5   (a subset)

For FedAvgCNN (1×28×28, 3×32×32) and CNN1 (3×32×32) at rank ratios 1.0 … 0.125 (ratios that resolve to the same
plan are measured once), the parent builds the artifacts and a synthetic shard, then measures each plan in fresh
worker processes, so that no worker inherits another's memory:
- ``ort-memory``, once per onnxruntime session-option variant (CPU arena and memory patterns, on or off): what a
  device process holds. RSS after importing the runtime, peak RSS (VmHWM) over local rounds (anchors + one
  epoch, ``run_task``): a first (cold) round and a second one at batch 16, then one at batch 64; anchor and round
  seconds, upload bytes, and the median of a few single steps. It imports numpy and the ORT C bindings only.
- ``torch-memory``: the same rounds with the PyTorch reference (``compute_anchors`` + ``train_local``).
- latency: two step servers, ``ort-steps`` and ``torch-steps`` (one runtime per process: in one process, ORT's
  spinning thread pool and PyTorch's OpenMP threads slow each other down at 2 threads), time at 1 and 2 threads
  on the same plan and batches: one training step at batch 16 (CE + λ·L_FAC, the shipped graph), one decoupled
  Frobenius decay step on all factors (what each local epoch ends with: numpy on the device, PyTorch in the
  reference), and an ORT step at batch 64 for the cost model. A step's cost with the decay amortized is
  step + decay / (steps per epoch). The parent makes the servers take turns in blocks of BLOCK calls (the first
  call of a block is not timed), so both meet the same load from other processes. The probe score
  (``device_runtime.probe``) is taken in the ORT process, so the cost model can scale the times.
Every timed block records the wall clock and the calling thread's CPU time (``time.thread_time``: at 1 thread the
step's own CPU, without the waits of a shared machine). Per plan the parent also counts the step's GFLOP (torch's
FlopCounterMode) and derives the FLOP floor at the probe's GFLOP/s. The portable runtime, what a device runs by
default, is the first column and the source of the cost model.
The parent writes bench_device.json, bench_device.md (tables) and bench_device.png into ``--out-dir`` and, with
``--cost-model``, the data file that ``server.engine.cost_model`` reads (entries it does not re-measure are kept).

    sudo .venv/bin/python scripts/bench_device.py --memory-floor --out-dir docs/results/device \\
        --cost-model device_runtime/cost_model.json

measures memory floors instead (root and a writable memory cgroup controller, server/mqtt/cgroups.py): for each plan,
runtime (``--runtimes``, default both device runtimes and a PyTorch client; ``portable`` in ``--portable-python``)
and batch size (``--batch-sizes``), the smallest cgroup limit, to 4 MiB, under which FLOOR_REPEATS fresh processes
in a row each complete FLOOR_ROUNDS local rounds on a small synthetic shard (bisection from above the charged peak
of a run in an open group); into memory_floor[_RUNTIMES].{md,json}, and as ``floors[kind].floor_mb[batch]`` into the
cost-model entries (kind: the artifact kind a device reports, DEVICE_RUNTIMES), which the server's tier choice then
prefers for devices of that runtime. With ``--secure`` each floor is measured twice in the same run, plain and with
every round ending in the device's secure step (``--secure-aggregation`` under distributed DP: the full-rank change
rounded, noised and masked against k neighbours, sent in the UPDATE's ``masked`` blob), into
memory_floor[_RUNTIMES]_secure.{md,json} with a table of the step against its analytic bound; with ``--cost-model``
only the secure floors are written, as ``floors[kind].secure_floor_mb[batch]``, which the tier choice uses under
``--secure-aggregation``.
Only the stdlib and numpy are imported at the top of this file: a worker must not carry torch unless it is the one
measuring torch.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from server.outputs.machine import cpu_name  # noqa: E402  (platform and pathlib only: the worker's python has it)

if TYPE_CHECKING:  # names for the secure worker's hints; the worker imports them where it runs
    from device_runtime.envelope import Message
    from device_runtime.secagg_client import SecAggClient
    from device_runtime.task import Task, Update

CONFIGS = (("fedavgcnn", (1, 28, 28)), ("fedavgcnn", (3, 32, 32)), ("cnn1", (3, 32, 32)))
RATIOS = (1.0, 0.75, 0.5, 0.25, 0.125)
FLOOR_CONFIGS = (("fedavgcnn", (1, 28, 28)), ("cnn1", (1, 28, 28)))
FLOOR_RATIOS = RATIOS  # every default tier: the tier choice uses floors only where every ratio has one
QUICK_CONFIGS = (("fedavgcnn", (1, 28, 28)),)
QUICK_RATIOS = (1.0, 0.25)
NUM_CLASSES = 10
TRAIN_SAMPLES = 320
TEST_SAMPLES = 16
BATCH = 16
LARGE_BATCH = 64
BATCH_SIZES = (BATCH, LARGE_BATCH)
THREADS = (1, 2)
LAM, MU, LR = 10.0, 1e-3, 5e-3
ROUND = 2  # any round after the first: λ > 0, so the round computes anchors
SEED = 0
STEPS, QUICK_STEPS = 24, 4
BLOCK = 6  # timed steps per variant per turn
VARIANT_STEPS = 9  # single steps timed in each ort-memory worker
SESSION_VARIANTS = {"arena+patterns": (True, True), "arena": (True, False), "patterns": (False, True),
                    "neither": (False, False)}
PEAK_TOLERANCE = 0.02  # session variants within 2% of the lowest total peak count as equally lean
LATENCY_VARIANTS = ("portable", "portable_decay", "portable_b64", "ort", "ort_decay", "torch", "torch_decay",
                    "ort_b64")
DEFAULT_CACHE = ROOT / "artifacts_cache" / "bench_device"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
MIB = 2**20
KIB = 2**10
FRAME_BYTES = 256 * KIB  # the device's default --max-message-bytes


# ---------------------------------------------------------------------------------------------------------------
# Measurement helpers (any process)

def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS)."""
    return _proc_status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (VmHWM)."""
    return _proc_status_bytes("VmHWM")


def percentiles_ms(seconds: list[float], cpu_seconds: list[float] | None = None) -> dict:
    """p50 and p95 in milliseconds of a list of durations, and how many there were; with ``cpu_seconds`` (the
    calling thread's CPU time of the same calls) also ``cpu_p50`` and ``cpu_p95``."""
    p50, p95 = np.percentile(np.asarray(seconds) * 1e3, [50, 95])
    out = dict(p50=float(p50), p95=float(p95), n=len(seconds))
    if cpu_seconds:
        cpu_p50, cpu_p95 = np.percentile(np.asarray(cpu_seconds) * 1e3, [50, 95])
        out.update(cpu_p50=float(cpu_p50), cpu_p95=float(cpu_p95))
    return out


def timed_block(step: Callable[[], None], count: int) -> list[float]:
    """Seconds of ``count`` calls of ``step``, after one untimed call that pays for switching caches and threads."""
    return timed_block_cpu(step, count)["wall"]


def timed_block_cpu(step: Callable[[], None], count: int) -> dict[str, list[float]]:
    """Wall-clock ("wall") and calling-thread CPU seconds ("cpu") of ``count`` calls of ``step``, after one untimed
    call. At one thread every runtime here computes in the calling thread, so "cpu" is the step's CPU time without
    the waits a shared machine adds; at more threads it misses the pool's workers (read "wall" there)."""
    step()
    wall, cpu = [], []
    for _ in range(count):
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return dict(wall=wall, cpu=cpu)


def fixed_batches(x: np.ndarray, y: np.ndarray, batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Full shuffled batches of (x, y), the same for every variant of a worker."""
    from device_runtime.batching import epoch_batches
    order = epoch_batches(len(x), batch_size, np.random.default_rng(SEED))
    return [(x[idx], y[idx]) for idx in order if len(idx) == batch_size]


# ---------------------------------------------------------------------------------------------------------------
# Workers (fresh processes)

def _use_session_variant(arena: bool, patterns: bool) -> None:
    """Make every DeviceTrainer of this process build its sessions with the given arena/memory-pattern switches
    on top of the shipped options (the variant under test replaces ``trainer.session_options``)."""
    from device_runtime import trainer
    shipped = trainer.session_options

    def options(capi, threads: int):
        chosen = shipped(capi, threads)
        chosen.enable_cpu_mem_arena = arena
        chosen.enable_mem_pattern = patterns
        return chosen

    trainer.session_options = options


def steps_per_epoch(batch_size: int) -> int:
    return -(-TRAIN_SAMPLES // batch_size)


def amortized_ms(per_variant: dict, step: str, decay: str, batch_size: int, key: str = "p50") -> float:
    """p50 of one step with the per-epoch decay spread over the epoch's steps: step + decay / steps (``key``
    "cpu_p50": the same in thread-CPU time)."""
    return per_variant[step][key] + per_variant[decay][key] / steps_per_epoch(batch_size)


def _ort_step(trainer, batch: tuple[np.ndarray, np.ndarray], anchors: np.ndarray, mask: np.ndarray,
              rng: np.random.Generator) -> None:
    """One training step (a one-batch epoch with μ = 0, so no decay: the decay is timed on its own)."""
    x, y = batch
    trainer.train(x, y, anchors=anchors, mask=mask, lam=LAM, mu=0.0, lr=LR, epochs=1, batch_size=len(x), rng=rng)


def ort_memory_worker(spec: dict) -> dict:
    """One device process: import, load, anchors, a local round at each batch size; memory after each."""
    rss_python = rss_bytes()
    from device_runtime.auth import Direction
    from device_runtime.envelope import Message, MessageType, seal
    from device_runtime.local_round import run_task
    from device_runtime.portable_trainer import training_build_installed
    from device_runtime.runtimes import open_trainer
    from device_runtime.shard import load_shard
    from device_runtime.task import Phase, Task, tensor_bytes
    from device_runtime.trainer import load_ort_capi
    if spec.get("portable") and not training_build_installed():
        import onnxruntime  # noqa: F401  stock onnxruntime: the public package, as the portable trainer loads it
    else:
        load_ort_capi()
    rss_import = rss_bytes()
    _use_session_variant(*spec["session"])
    shard = load_shard(spec["shard"])
    start = time.perf_counter()
    trainer = open_trainer(spec["portable_artifacts"] if spec.get("portable") else spec["artifacts"], threads=1)
    load_seconds = time.perf_counter() - start
    rss_loaded = rss_bytes()
    start = time.perf_counter()
    trainer.compute_anchors(shard.x_train, shard.y_train)
    anchor_seconds = time.perf_counter() - start
    def local_round(batch_size: int):
        task = Task(ROUND, trainer.get_fe(), LAM, MU, LR, (Phase("all", 1),), batch_size, SEED)
        start = time.perf_counter()
        update = run_task(trainer, shard, task)
        return time.perf_counter() - start, update

    first_round_seconds, _ = local_round(BATCH)
    rounds = {}
    for batch_size in BATCH_SIZES:
        seconds, update = local_round(batch_size)
        rounds[str(batch_size)] = dict(seconds=seconds, steps=update.metrics["steps"], peak_rss_bytes=peak_rss_bytes())
    wire = seal(Message(MessageType.UPDATE, "bench", ROUND, "bench-device", "bench-update",
                        dict(num_samples=update.num_samples), update.weights), bytes(32), Direction.UP, 1)
    anchors, mask = trainer.compute_anchors(shard.x_train, shard.y_train)
    rng = np.random.default_rng(SEED)
    next_batch = itertools.cycle(fixed_batches(shard.x_train, shard.y_train, BATCH)).__next__
    step_times = timed_block(lambda: _ort_step(trainer, next_batch(), anchors, mask, rng), VARIANT_STEPS)
    from device_runtime.probe import probe_gflops
    return dict(probe_gflops=probe_gflops(), rss_python_bytes=rss_python, rss_import_bytes=rss_import, rss_loaded_bytes=rss_loaded,
                load_seconds=load_seconds, anchor_seconds=anchor_seconds, first_round_seconds=first_round_seconds,
                rounds=rounds,
                upload_tensor_bytes=tensor_bytes(update.weights), upload_wire_bytes=len(wire),
                step_ms=percentiles_ms(step_times), imported_torch="torch" in sys.modules,
                imported_onnx="onnx" in sys.modules)


def torch_memory_worker(spec: dict) -> dict:
    """The same local round in PyTorch eager (one thread): import, anchors + one epoch at each batch size."""
    rss_python = rss_bytes()
    import torch
    from device_runtime.shard import load_shard
    from fedcore.lowrank import factorize_model
    from fedcore.models import build_model
    from fedcore.objective import compute_anchors
    from server.training import train_local
    torch.set_num_threads(1)
    rss_import = rss_bytes()
    shard = load_shard(spec["shard"])
    model = factorize_model(build_model(spec["model"], tuple(spec["input_shape"]), NUM_CLASSES, seed=SEED),
                            spec["ranks"])
    rss_loaded = rss_bytes()

    def local_round(batch_size: int):
        start = time.perf_counter()
        anchors, mask = compute_anchors(model.fe, shard.x_train, shard.y_train, NUM_CLASSES)
        anchor_seconds = time.perf_counter() - start
        stats = train_local(model, shard.x_train, shard.y_train, anchors=anchors, mask=mask, lam=LAM, mu=MU, lr=LR,
                            epochs=1, batch_size=batch_size, rng=np.random.default_rng(SEED))
        return time.perf_counter() - start, anchor_seconds, stats.steps

    first_round_seconds, _, _ = local_round(BATCH)
    rounds = {}
    for batch_size in BATCH_SIZES:
        seconds, anchor_seconds, steps = local_round(batch_size)
        rounds[str(batch_size)] = dict(seconds=seconds, anchor_seconds=anchor_seconds, steps=steps,
                                       peak_rss_bytes=peak_rss_bytes())
    return dict(rss_python_bytes=rss_python, rss_import_bytes=rss_import, rss_loaded_bytes=rss_loaded,
                anchor_seconds=rounds[str(BATCH)]["anchor_seconds"], first_round_seconds=first_round_seconds,
                rounds=rounds)


def _device_steppers(spec: dict, variant: str, open_trainer: Callable[[int], object],
                     batch_sizes: dict[str, int]) -> dict[tuple[str, int], Callable[[], None]]:
    """(variant + suffix, threads) -> one step of a device trainer at each named batch size (suffix "" is
    batch 16), and (variant + "_decay", threads) -> one decay step (numpy) on all factors."""
    from device_runtime.shard import load_shard
    shard = load_shard(spec["shard"])
    batches = {suffix: itertools.cycle(fixed_batches(shard.x_train, shard.y_train, size)).__next__
               for suffix, size in batch_sizes.items()}
    rng = np.random.default_rng(SEED)
    steppers = {}
    for threads in THREADS:
        trainer = open_trainer(threads)
        anchors, mask = trainer.compute_anchors(shard.x_train, shard.y_train)
        for suffix, next_batch in batches.items():
            steppers[(variant + suffix, threads)] = (
                lambda t=trainer, b=next_batch, a=anchors, m=mask: _ort_step(t, b(), a, m, rng))
        steppers[(variant + "_decay", threads)] = lambda t=trainer: t.decay_factors(MU, LR * steps_per_epoch(BATCH))
    return steppers


def ort_steppers(spec: dict) -> dict[tuple[str, int], Callable[[], None]]:
    """onnxruntime-training: one step at batch 16 ("ort") and 64 ("ort_b64"), and the decay step."""
    from device_runtime.trainer import DeviceTrainer
    return _device_steppers(spec, "ort", lambda threads: DeviceTrainer(spec["artifacts"], threads=threads),
                            {"": BATCH, "_b64": LARGE_BATCH})


def portable_steppers(spec: dict) -> dict[tuple[str, int], Callable[[], None]]:
    """The compiled step graph on stock onnxruntime: one step at batch 16 ("portable") and 64 ("portable_b64"), and
    the decay step."""
    from device_runtime.portable_trainer import PortableTrainer
    return _device_steppers(spec, "portable",
                            lambda threads: PortableTrainer(spec["portable_artifacts"], threads=threads),
                            {"": BATCH, "_b64": LARGE_BATCH})


def torch_steppers(spec: dict) -> dict[tuple[str, int], Callable[[], None]]:
    """(variant, threads) -> one PyTorch eager step of the same plan, or one decay step on all its factors."""
    import torch
    from device_runtime.shard import load_shard
    from fedcore.lowrank import decay_factors, factorize_model
    from fedcore.models import build_model
    from fedcore.objective import compute_anchors, local_loss
    shard = load_shard(spec["shard"])
    model = factorize_model(build_model(spec["model"], tuple(spec["input_shape"]), NUM_CLASSES, seed=SEED),
                            spec["ranks"])
    anchors, mask = (torch.from_numpy(a) for a in compute_anchors(model.fe, shard.x_train, shard.y_train, NUM_CLASSES))
    batches = itertools.cycle([(torch.from_numpy(x), torch.from_numpy(y))
                               for x, y in fixed_batches(shard.x_train, shard.y_train, BATCH)]).__next__
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()

    def use_threads(threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def step(threads: int) -> None:
        use_threads(threads)
        x, y = batches()
        loss, _ = local_loss(model, x, y, anchors, mask, LAM)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def decay(threads: int) -> None:
        use_threads(threads)
        decay_factors(model, MU, LR * steps_per_epoch(BATCH))

    steppers = {}
    for threads in THREADS:
        steppers[("torch", threads)] = lambda threads=threads: step(threads)
        steppers[("torch_decay", threads)] = lambda threads=threads: decay(threads)
    return steppers


STEPPERS = {"ort-steps": ort_steppers, "torch-steps": torch_steppers, "portable-steps": portable_steppers}


def step_server(kind: str, spec: dict) -> None:
    """Serve timed blocks over stdin/stdout: ``VARIANT THREADS COUNT`` -> JSON list of seconds; ``probe`` -> the
    probe score; ``quit`` ends. One runtime per process, so neither's thread pool spins against the other."""
    from device_runtime.probe import probe_gflops
    steppers = STEPPERS[kind](spec)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words == ["quit"]:
            return
        if words == ["probe"]:
            print(json.dumps(probe_gflops()), flush=True)
            continue
        name, threads, count = words
        print(json.dumps(timed_block_cpu(steppers[(name, int(threads))], int(count))), flush=True)


class StepProcess:
    """A step_server subprocess; ``block`` and ``probe`` ask it for timings, ``close`` ends it."""

    def __init__(self, kind: str, spec: dict, python: str = sys.executable):
        self.kind = kind
        self._proc = subprocess.Popen(
            worker_command(kind, spec, python),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env())
        self._read()

    def _read(self):
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            raise RuntimeError(f"{self.kind} step server died:\n{self._proc.stderr.read()}")
        return json.loads(line) if line.strip() != "ready" else None

    def _ask(self, command: str):
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return self._read()

    def block(self, variant: str, threads: int, count: int) -> dict[str, list[float]]:
        return self._ask(f"{variant} {threads} {count}")

    def probe(self) -> float:
        return self._ask("probe")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.write("quit\n")
            self._proc.stdin.close()
        self._proc.wait()

    def __enter__(self) -> StepProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def has_training_kind(plan: dict) -> bool:
    """Whether the plan has onnxruntime-training artifacts (a BatchNorm model has none: ``training_refused``)."""
    return "training_refused" not in plan


def measure_latency(spec: dict, steps: int) -> dict:
    """p50/p95 per (threads, variant): ORT and PyTorch step servers take turns in blocks of BLOCK timed calls,
    so both meet the same load; the probe is taken in the ORT process before and after (the portable one where
    the plan has no onnxruntime-training artifacts)."""
    training = "artifacts" in spec
    variants = [name for name in LATENCY_VARIANTS if training or not name.startswith("ort")]
    with contextlib.ExitStack() as stack:
        servers = {"torch": stack.enter_context(StepProcess("torch-steps", spec)),
                   "portable": stack.enter_context(StepProcess("portable-steps", spec, spec["portable_python"]))}
        if training:
            servers["ort"] = stack.enter_context(StepProcess("ort-steps", spec))
        prober = servers["ort" if training else "portable"]
        probes = [prober.probe()]
        per_threads = {}
        for threads in THREADS:
            times: dict[str, list[float]] = {name: [] for name in variants}
            cpu: dict[str, list[float]] = {name: [] for name in variants}
            while min(len(t) for t in times.values()) < steps:
                for name, so_far in times.items():
                    server = servers[name.split("_")[0]]
                    block = server.block(name, threads, min(BLOCK, steps - len(so_far)))
                    so_far += block["wall"]
                    cpu[name] += block["cpu"]
            per_threads[str(threads)] = {name: percentiles_ms(t, cpu[name]) for name, t in times.items()}
        probes.append(prober.probe())
    return dict(threads=per_threads, probe_gflops=max(probes), probes=probes)


def device_floor_worker(spec: dict, artifacts_key: str) -> dict:
    """What a device process does for ``spec["rounds"]`` rounds on the artifacts at ``spec[artifacts_key]`` (the
    runtime follows their kind, as the agent's ``open_trainer`` picks it): run the compute probe first, as the
    device's main does (its arrays, 12 MiB, come and go before the modules load: ``device_runtime.probe``); import
    the modules the agent imports (paho included); write the plan's artifact files into its workdir and load them
    from there (page cache a device writes is charged to its cgroup); per round, take the task as MQTT frames
    through the transport's reassembler and decode it, run the local round with the received-model evaluation
    (``run_task``), save the head and the encoded answer, and split the answer into the frames the transport
    publishes (kept until the next round, as paho keeps unacknowledged frames)."""
    from device_runtime.probe import probe_gflops
    probe_gflops()
    import device_runtime.agent  # noqa: F401 -- the modules a device process holds
    from device_runtime.auth import Direction
    from device_runtime.envelope import Message, MessageType, decode, seal
    from device_runtime.framing import Reassembler, chunk
    from device_runtime.local_round import run_task
    from device_runtime.runtimes import open_trainer
    from device_runtime.shard import load_shard
    from device_runtime.task import Phase, Task
    shard = load_shard(spec["shard"])
    sent: list[bytes] = []
    with tempfile.TemporaryDirectory() as workdir:
        artifacts = Path(workdir) / "artifacts"
        artifacts.mkdir()
        for source in Path(spec[artifacts_key]).iterdir():
            (artifacts / source.name).write_bytes(source.read_bytes())
        trainer = open_trainer(artifacts, threads=1)
        fe = trainer.get_fe()
        for index in range(spec["rounds"]):
            round_index = ROUND + index
            frames = chunk(seal(Message(MessageType.TASK, "bench", round_index, "bench-device", "bench-task", {}, fe),
                                bytes(32), Direction.DOWN, index + 1), FRAME_BYTES, "bench-task")
            reassembler = Reassembler(2 * sum(len(f) for f in frames), timeout_s=60.0, max_pending=1)
            payload = [p for f in frames if (p := reassembler.feed(f, now=0.0)) is not None][0]
            del frames
            task = Task(round_index, decode(payload, max_bytes=len(payload)).tensors, LAM, MU, LR,
                        (Phase("all", 1),), spec["batch_size"], SEED)
            del payload
            secure = secure_round(spec["secure"], round_index) if spec.get("secure") else None
            if secure is not None:
                task.secure = secure[0].spec
            update = run_task(trainer, shard, task)
            trainer.save_head(Path(workdir) / "head.npz")
            if secure is None:
                message = Message(MessageType.UPDATE, "bench", round_index, "bench-device", "bench-update",
                                  dict(num_samples=update.num_samples), update.weights)
            else:
                message = secure_message(update, task, *secure)
            answer = seal(message, bytes(32), Direction.UP, index + 1)
            del message
            (Path(workdir) / "last_answer.bin").write_bytes(answer)
            sent = chunk(answer, FRAME_BYTES, "bench-update")
            fe = update.weights
            del task, answer, update
    return dict(peak_rss_bytes=peak_rss_bytes(), frames=len(sent), imported_torch="torch" in sys.modules)


def secure_round(secure: dict, round_index: int) -> tuple[SecAggClient, dict[str, bytes]]:
    """The first device's SecAgg+ client of a round of ``secure["participants"]`` devices under distributed DP
    (``--secure-aggregation --dp-noise-multiplier``), and the sealed shares its neighbours sent it: the keys and
    shares exchanged as the agent exchanges them (``device_runtime.secagg_client``), so that the round's masking is
    the agent's, against k neighbours."""
    from device_runtime.secagg_client import SecAggClient, SecureSpec
    from device_runtime.secagg_noise import total_mu
    from device_runtime.secagg_quantize import dp_quantizer
    shapes = {k: tuple(v) for k, v in secure["dense_shapes"].items()}
    d = sum(int(np.prod(v)) for v in shapes.values())
    n, s, z, clip = secure["participants"], secure["min_survivors"], secure["noise_multiplier"], secure["clip"]
    quantizer = dp_quantizer(clip, d, n, lambda g: n / s * total_mu(z, g, clip, d))
    mu = total_mu(z, quantizer.scale, clip, d)
    ids = tuple(f"dev_{i:03d}" for i in range(n))
    spec = SecureSpec(f"bench|{round_index}".encode(), ids, secure["neighbors"], secure["threshold"], s,
                      b"bench-graph", quantizer, clip, True, mu / s, shapes)
    clients = {i: SecAggClient(i, spec) for i in ids}
    keys = {i: c.advertise() for i, c in clients.items()}
    sealed = {i: c.share_keys({v: keys[v] for v in c.mine}) for i, c in clients.items()}
    return clients[ids[0]], {v: sealed[v][ids[0]] for v in clients[ids[0]].mine}


def secure_message(update: Update, task: Task, client: SecAggClient, shares: dict[str, bytes]) -> Message:
    """The UPDATE a device sends in a secure round, as the agent builds it (``Agent._answer``): the full-rank
    change clipped, rounded and noised (``secure_answer``), masked against the neighbours, in the ``masked`` blob
    of an update without tensors. (The worker keeps the trained factors until its round ends, where the agent
    drops them once masked: the measured floor errs high by at most their size.)"""
    from device_runtime import secagg_wire
    from device_runtime.messages import update_message
    from device_runtime.secagg_client import secure_answer
    from device_runtime.secagg_noise import secure_generator
    answer, x = secure_answer(update, task, secure_generator())
    masked = client.masked_input(x, shares)
    del x
    message = update_message(answer, plan_hash="0" * 64, device_id=client.device_id, run_id="bench")
    message.blobs[secagg_wire.MASKED_BLOB] = secagg_wire.masked_blob(masked, task.secure.quantizer.bits)
    return message


def torch_floor_worker(spec: dict) -> dict:
    """A PyTorch client's rounds at the same plan: anchors from the current FE, then one epoch
    (``compute_anchors`` + ``train_local``), ``spec["rounds"]`` times."""
    import torch
    from device_runtime.shard import load_shard
    from fedcore.lowrank import factorize_model
    from fedcore.models import build_model
    from fedcore.objective import compute_anchors
    from server.training import train_local
    torch.set_num_threads(1)
    shard = load_shard(spec["shard"])
    model = factorize_model(build_model(spec["model"], tuple(spec["input_shape"]), NUM_CLASSES, seed=SEED),
                            spec["ranks"])
    for _ in range(spec["rounds"]):
        anchors, mask = compute_anchors(model.fe, shard.x_train, shard.y_train, NUM_CLASSES)
        train_local(model, shard.x_train, shard.y_train, anchors=anchors, mask=mask, lam=LAM, mu=MU, lr=LR,
                    epochs=1, batch_size=spec["batch_size"], rng=np.random.default_rng(SEED))
    return dict(peak_rss_bytes=peak_rss_bytes())


FLOOR_WORKERS = {"ort-training": lambda spec: device_floor_worker(spec, "artifacts"),
                 "portable": lambda spec: device_floor_worker(spec, "portable_artifacts"),
                 "torch": torch_floor_worker}
"""Runtime name -> the worker that does a device's rounds on it (``portable``: the step graph on stock onnxruntime,
in ``--portable-python``)."""
DEVICE_RUNTIMES = {"portable": "onnxruntime", "ort-training": "onnxruntime-training"}
"""The runtimes whose floors go into the cost model, each under the artifact kind a device names in its profile
(device_runtime.artifact_contract.KINDS); the others (torch) are references."""


def runtime_probe_worker(spec: dict) -> dict:
    """The onnxruntime build of this interpreter: its version and the artifact kinds it runs (a training build
    also runs the portable kind, but is not the stock onnxruntime a device installs)."""
    import importlib.metadata
    from device_runtime.runtimes import available
    versions = {}
    for distribution in ("onnxruntime", "onnxruntime-training-cpu", "onnxruntime-training"):
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return dict(kinds=list(available()), distributions=versions)


WORKERS = {"ort-memory": ort_memory_worker, "torch-memory": torch_memory_worker,
           "runtime-probe": runtime_probe_worker,
           **{f"floor-{name}": worker for name, worker in FLOOR_WORKERS.items()}}


def worker_env() -> dict[str, str]:
    """The environment of a worker: one BLAS/OpenMP thread unless it sets its own, no inherited PYTHONPATH."""
    env = dict(os.environ, **{name: "1" for name in THREAD_ENV})
    env.pop("PYTHONPATH", None)
    return env


WORKER_LAUNCH = ("import importlib.util, sys; "
                 "spec = importlib.util.spec_from_file_location('fedara_bench_device', sys.argv[1]); "
                 "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
                 "sys.exit(module.main(['--worker', *sys.argv[2:]]))")


def worker_command(kind: str, spec: dict, python: str = sys.executable) -> list[str]:
    """The command line of a ``kind`` worker in ``python``: this file imported as a module, as a device runs
    ``python -m device_runtime``. CPython frees an imported module's parse tree once it is compiled, but keeps a
    script's until the script returns: run as a script, a worker held this file's, about 4 MiB, to its end (in an
    open memory cgroup, the token classifier's floor worker: 39.0 against 35.0 MiB), which no device holds."""
    return [python, "-c", WORKER_LAUNCH, str(Path(__file__).resolve()), kind, json.dumps(spec)]


def run_worker(kind: str, spec: dict, python: str = sys.executable) -> dict:
    """``WORKERS[kind](spec)`` in a fresh interpreter (``python``)."""
    done = subprocess.run(worker_command(kind, spec, python), capture_output=True, text=True, env=worker_env())
    if done.returncode != 0:
        raise RuntimeError(f"{kind} worker for {spec.get('label')} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------
# Parent: artifacts, shards, orchestration

def write_synthetic_shard(path: Path, input_shape: tuple[int, ...], train_samples: int = TRAIN_SAMPLES,
                          vocabulary: int | None = None) -> None:
    """A shard of standard-normal images (token ids below ``vocabulary`` for a model that embeds them,
    fedcore/tokens.py) with uniform labels: a step's cost does not depend on the values."""
    from device_runtime.shard import Shard, save_shard
    rng = np.random.default_rng(SEED)

    def samples(n: int) -> np.ndarray:
        if vocabulary is None:
            return rng.standard_normal((n, *input_shape), dtype=np.float32)
        return rng.integers(0, vocabulary, (n, *input_shape)).astype(np.float32)

    shard = Shard(samples(train_samples), rng.integers(0, NUM_CLASSES, train_samples).astype(np.int64),
                  samples(TEST_SAMPLES), rng.integers(0, NUM_CLASSES, TEST_SAMPLES).astype(np.int64), NUM_CLASSES)
    save_shard(path, shard)


def step_gflop(model_name: str, input_shape: tuple[int, ...], ranks: dict, batch_size: int = BATCH) -> float:
    """GFLOP of the matrix products and convolutions of one SGD step of the plan at ``batch_size`` (forward and
    backward of CE + λ·L_FAC, counted by torch's FlopCounterMode; elementwise work left out): a floor, not an
    estimate."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from fedcore.lowrank import factorize_model
    from fedcore.models import build_model
    from fedcore.objective import local_loss
    model = factorize_model(build_model(model_name, tuple(input_shape), NUM_CLASSES, seed=SEED), ranks)
    x, y = torch.zeros(batch_size, *input_shape), torch.arange(batch_size) % NUM_CLASSES
    anchors, mask = torch.zeros(NUM_CLASSES, model.feature_dim), torch.ones(NUM_CLASSES)
    with FlopCounterMode(display=False) as counter:
        loss, _ = local_loss(model, x, y, anchors, mask, LAM)
        loss.backward()
    return counter.get_total_flops() / 1e9


def shape_name(shape) -> str:
    return "x".join(str(d) for d in shape)


def prepare_plans(configs, ratios, cache_dir: Path, shard_dir: Path, train_samples: int = TRAIN_SAMPLES) -> list[dict]:
    """One entry per distinct (model, input shape, plan): its artifacts (both kinds), shard (of ``train_samples``
    synthetic training samples) and the ratios that resolve to it."""
    from device_runtime.artifact_contract import PORTABLE_KIND
    from export.artifacts import build_artifacts, build_artifacts_of_kind
    from fedcore.lowrank import resolve_plan
    from fedcore.models import build_model, rank_plan
    from fedcore.tensors import UnsupportedModel
    from fedcore.tokens import token_vocabulary
    plans: list[dict] = []
    for model_name, input_shape in configs:
        model = build_model(model_name, input_shape, NUM_CLASSES, seed=SEED)
        vocabulary = token_vocabulary(model)
        shard = shard_dir / f"{shape_name(input_shape)}{'' if vocabulary is None else f'-ids{vocabulary}'}.npz"
        if not shard.exists():
            write_synthetic_shard(shard, input_shape, train_samples, vocabulary)
        by_hash: dict[str, dict] = {}
        for ratio in ratios:
            plan = resolve_plan(model, rank_plan(model, ratio))
            portable = build_artifacts_of_kind(PORTABLE_KIND, model, plan.ranks, input_shape, NUM_CLASSES,
                                               cache_dir / "fedara")
            if portable.hash not in by_hash:
                try:
                    shipped = build_artifacts(model, plan.ranks, input_shape, NUM_CLASSES, cache_dir / "fedara")
                    training = dict(artifacts=str(shipped.directory), artifact_bytes=shipped.total_bytes,
                                    artifact_file_bytes=shipped.sizes)
                except UnsupportedModel as refused:  # BatchNorm: the training kind has no step state
                    training = dict(training_refused=str(refused))
                except RuntimeError as failed:  # onnxruntime-training's gradient builder (LayerNorm, attention)
                    last = str(failed).strip().splitlines()[-1]
                    training = dict(training_refused="onnxruntime-training's gradient builder failed: "
                                    + (last.split(" ", 1)[-1] if last.startswith("/") else last)[:160])
                by_hash[portable.hash] = dict(
                    model=model_name, input_shape=list(input_shape), ratios=[], plan=plan.describe(),
                    ranks=plan.ranks, portable_artifacts=str(portable.directory),
                    portable_artifact_bytes=portable.total_bytes,
                    step_gflop=step_gflop(model_name, input_shape, plan.ranks),
                    shard=str(shard), label=f"{model_name} {shape_name(input_shape)} {plan.describe()}", **training)
                plans.append(by_hash[portable.hash])
            by_hash[portable.hash]["ratios"].append(ratio)
    return plans


def shipped_session_variant() -> str:
    """The name of the session-option variant device_runtime.trainer ships (read from its options)."""
    from device_runtime.trainer import load_ort_capi, session_options
    options = session_options(load_ort_capi(), 1)
    switches = (options.enable_cpu_mem_arena, options.enable_mem_pattern)
    return next(name for name, value in SESSION_VARIANTS.items() if value == switches)


def measure_plan(plan: dict, steps: int, portable_python: str) -> dict:
    """Every worker for one plan; the plan dict gains their results."""
    spec = {k: plan[k] for k in ("model", "input_shape", "ranks", "artifacts", "portable_artifacts", "shard", "label")
            if k in plan}
    spec["portable_python"] = portable_python
    sessions = {name: run_worker("ort-memory", dict(spec, session=switches))
                for name, switches in SESSION_VARIANTS.items()} if has_training_kind(plan) else {}
    portable = run_worker("ort-memory", dict(spec, session=SESSION_VARIANTS[shipped_session_variant()], portable=True),
                          portable_python)
    torch_memory = run_worker("torch-memory", spec)
    latency = measure_latency(spec, steps)
    return dict(plan, sessions=sessions, portable=portable, torch=torch_memory, latency=latency)


# ---------------------------------------------------------------------------------------------------------------
# Memory floors: the smallest cgroup limit at which a fresh device process completes its rounds

FLOOR_TRAIN_SAMPLES = 64  # a small shard: the floor is set by the model, the plan and the batch, not the data
FLOOR_ROUNDS = 2  # a round after a round: what the second one adds (fragmentation, kept frames) counts too
FLOOR_RESOLUTION_MB = 4
FLOOR_REPEATS = 3  # a limit counts as enough only when this many fresh processes in a row complete under it
FLOOR_OPEN_LIMIT_MB = 4096  # the "unconstrained" reference run, inside a group so its charged peak is read
FLOOR_HEADROOM_MB = 16  # first upper bracket: the reference run's charged peak plus this
FLOOR_TIME_FACTOR, FLOOR_TIME_SLACK_S = 4.0, 20.0  # a trial must finish within 4x the reference run + 20 s


def bisect_floor(completes: Callable[[int], bool], upper_mb: int, resolution_mb: int = FLOOR_RESOLUTION_MB,
                 max_upper_mb: int = FLOOR_OPEN_LIMIT_MB) -> tuple[int, list[tuple[int, bool]]]:
    """The smallest limit (a multiple of ``resolution_mb``) at which ``completes(limit)`` holds, assuming it holds
    at every larger limit; and the trials, in order. Starts from ``upper_mb`` (doubled until it completes, up to
    ``max_upper_mb``: RuntimeError beyond) and halves the interval above the largest known failure (or 0)."""
    trials: list[tuple[int, bool]] = []

    def trial(limit: int) -> bool:
        trials.append((limit, completes(limit)))
        return trials[-1][1]

    high = -(-upper_mb // resolution_mb) * resolution_mb
    low = 0
    while not trial(high):
        low, high = high, 2 * high
        if high > max_upper_mb:
            raise RuntimeError(f"no limit up to {max_upper_mb} MiB completes: {trials}")
    while high - low > resolution_mb:
        middle = (low + high) // 2 // resolution_mb * resolution_mb
        if trial(middle):
            high = middle
        else:
            low = middle
    return high, trials


def run_in_group(kind: str, spec: dict, limit_mb: int, timeout_s: float, python: str = sys.executable) -> dict:
    """``WORKERS[kind](spec)`` in a fresh interpreter (``python``) inside a new memory cgroup of ``limit_mb`` MiB:
    whether it completed within ``timeout_s``, its result, seconds, and the group's evidence (OOM kills, peak)."""
    from server.mqtt.cgroups import create_group, popen_in_group
    group = create_group(f"floor-{limit_mb}", limit_mb)
    try:
        start = time.perf_counter()
        proc = popen_in_group(group, worker_command(kind, spec, python), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=worker_env())
        try:
            out, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            timed_out = True
        except BaseException:  # interrupted: leave no worker behind, so the group can go
            proc.kill()
            proc.wait()
            raise
        seconds = time.perf_counter() - start
        evidence = group.evidence()
    finally:
        group.remove()
    completed = proc.returncode == 0 and not timed_out
    return dict(limit_mb=limit_mb, completed=completed, returncode=proc.returncode, timed_out=timed_out,
                seconds=seconds, oom_kills=evidence.oom_kills, group_peak_mb=evidence.peak_mb,
                result=json.loads(out.strip().splitlines()[-1]) if completed else None,
                error=None if completed or evidence.oom_killed else err.strip()[-400:])


def measure_floor(plan: dict, runtime: str, batch_size: int, rounds: int, python: str = sys.executable,
                  secure: dict | None = None) -> dict:
    """The memory floor of ``plan`` on ``runtime`` (workers in ``python``): a reference run in an open group, then
    bisection; a limit passes when FLOOR_REPEATS fresh processes in a row complete under it (stopping at the first
    that does not). ``secure`` (``secure_settings``): each round ends with the device's secure step instead."""
    spec = {k: plan[k] for k in ("model", "input_shape", "ranks", "artifacts", "portable_artifacts", "shard", "label")
            if k in plan}
    spec.update(batch_size=batch_size, rounds=rounds, secure=secure)
    kind = f"floor-{runtime}"
    reference = run_in_group(kind, spec, FLOOR_OPEN_LIMIT_MB, timeout_s=600, python=python)
    if not reference.get("completed"):
        raise RuntimeError(f"{runtime} worker for {plan['label']} failed without a limit:\n{reference['error']}")
    timeout_s = FLOOR_TIME_FACTOR * reference["seconds"] + FLOOR_TIME_SLACK_S
    runs: dict[int, list[dict]] = {}

    def completes(limit: int) -> bool:
        runs[limit] = []
        while len(runs[limit]) < FLOOR_REPEATS:
            runs[limit].append(run_in_group(kind, spec, limit, timeout_s, python))
            if not runs[limit][-1]["completed"]:
                return False
        return True

    floor, order = bisect_floor(completes, int(reference["group_peak_mb"]) + FLOOR_HEADROOM_MB)
    return dict(model=plan["model"], input_shape=plan["input_shape"], ratios=plan["ratios"], plan=plan["plan"],
                runtime=runtime, batch_size=batch_size, rounds=rounds, floor_mb=floor, secure=secure is not None,
                reference=reference, trials=[dict(limit_mb=limit, completed=passed, runs=runs[limit])
                                             for limit, passed in order])


SECURE_PARTICIPANTS = 10  # a round of 10: the rule's complete graph, k = 9 (masking against 9 neighbours)
SECURE_NOISE_MULTIPLIER, SECURE_CLIP = 1.0, 0.5  # distributed DP on: the noise's temporaries count too


def secure_settings(model_name: str, input_shape) -> dict:
    """--secure: the round a device's secure step is measured in (SECURE_PARTICIPANTS devices under distributed DP,
    k and t by the rule of ``server.engine.secagg_parameters``), the shared model's dense shapes (a device masks its
    full-rank change at every tier) and the analytic bound the tier choice adds today (``secure_step_mb``)."""
    from fedcore.models import build_model
    from server.engine.round_engine import algorithm_for
    from server.engine.run_config import FederationConfig
    from server.engine.secagg_parameters import DEFAULT_CORRUPT_RATE, DEFAULT_DROPOUT_RATE, parameters
    from server.run_setup import global_state, secure_step_mb
    model = build_model(model_name, tuple(input_shape), NUM_CLASSES, seed=SEED)
    algorithm = algorithm_for(FederationConfig(algo="fedara"))
    graph = parameters(SECURE_PARTICIPANTS, None, None, DEFAULT_DROPOUT_RATE, DEFAULT_CORRUPT_RATE)
    return dict(dense_shapes={k: list(v.shape) for k, v in global_state(model, algorithm).items()},
                participants=SECURE_PARTICIPANTS, neighbors=graph.neighbors, threshold=graph.threshold,
                min_survivors=graph.min_survivors(SECURE_PARTICIPANTS), noise_multiplier=SECURE_NOISE_MULTIPLIER,
                clip=SECURE_CLIP, bound_mb=secure_step_mb(model, algorithm))


def secure_floor_table(floors: list[dict]) -> str:
    """--secure: per (model, input, ratio, batch, runtime), the plain floor and the floor with the secure step,
    both measured in this run, against the plain floor plus the analytic bound the tier choice adds."""
    plain = {(f["model"], shape_name(f["input_shape"]), f["plan"], f["batch_size"], f["runtime"]): f
             for f in floors if not f["secure"]}
    lines = ["| model | input | ratio | batch | runtime | plain floor MiB | secure floor MiB | measured secure step MiB "
             "| analytic bound MiB | plain floor + bound MiB | bound / measured step |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for f in sorted((f for f in floors if f["secure"]),
                    key=lambda f: (f["model"], f["input_shape"], f["batch_size"], -max(f["ratios"]))):
        base = plain[(f["model"], shape_name(f["input_shape"]), f["plan"], f["batch_size"], f["runtime"])]
        step, bound = f["floor_mb"] - base["floor_mb"], f["secure_settings"]["bound_mb"]
        lines.append(f"| {f['model']} | {shape_name(f['input_shape'])} | {','.join(f'{r:g}' for r in f['ratios'])} "
                     f"| {f['batch_size']} | {f['runtime']} | {base['floor_mb']} | {f['floor_mb']} | {step} "
                     f"| {bound:.1f} | {base['floor_mb'] + bound:.1f} | {f'{bound / step:.2f}' if step > 0 else '-'} |")
    return "\n".join(lines) + "\n"


def floor_tables(floors: list[dict]) -> str:
    """One row per (model, input, ratio, batch size): the floor of each runtime, and its reference run's peaks."""
    runtimes = sorted({f["runtime"] for f in floors}, key=lambda r: (r not in DEVICE_RUNTIMES, r))
    by_key = {(f["model"], shape_name(f["input_shape"]), ratio, f["batch_size"], f["runtime"]): f
              for f in floors for ratio in f["ratios"]}
    rows = sorted({key[:4] for key in by_key}, key=lambda k: (k[0], k[1], k[3], -k[2]))
    header = ["model", "input", "ratio", "batch", "plan"]
    for runtime in runtimes:
        header += [f"{runtime} floor MiB", f"{runtime} open-group peak MiB (charged / VmHWM)",
                   f"{runtime} s at floor / open"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---:|---:|---|" + "---:|" * (3 * len(runtimes))]
    for model, shape, ratio, batch in rows:
        plan = next(f["plan"] for k, f in by_key.items() if k[:4] == (model, shape, ratio, batch))
        cells = [model, shape, f"{ratio:g}", str(batch), plan]
        for runtime in runtimes:
            f = by_key.get((model, shape, ratio, batch, runtime))
            if f is None:
                cells += ["", "", ""]
                continue
            ref = f["reference"]
            at_floor = next(t for t in f["trials"] if t["limit_mb"] == f["floor_mb"])["runs"]
            seconds = float(np.median([run["seconds"] for run in at_floor]))
            cells += [f"{f['floor_mb']}", f"{ref['group_peak_mb']:.0f} / {ref['result']['peak_rss_bytes'] / MIB:.0f}",
                      f"{seconds:.1f} / {ref['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def with_floors(document: dict, floors: list[dict], command: str) -> dict:
    """The cost-model document with each device runtime's floors set on its entries, under ``floors[kind]`` (the
    artifact kind a device reports: DEVICE_RUNTIMES): ``floor_mb`` by batch size, ``floor_samples`` (the samples
    of the shard they were measured with), and by batch size the command that measured each (``generated_by``)
    and the onnxruntime distribution it ran on (``onnxruntime``); from a ``--secure`` run only the floors with the
    secure step, as ``secure_floor_mb`` (and ``secure_generated_by``), on entries whose plain floors exist;
    floors of other runtimes and batch sizes already there are kept. KeyError names a (model, input, ratio) the
    document lacks."""
    entries = {(e["model"], tuple(e["input_shape"]), e["ratio"]): e for e in document["entries"]}
    secure_run = any(f.get("secure") for f in floors)
    for f in floors:
        if f["runtime"] not in DEVICE_RUNTIMES or f.get("secure", False) != secure_run:
            continue  # a --secure run sets the secure floors only (its plain ones are the report's comparison)
        for ratio in f["ratios"]:
            key = (f["model"], tuple(f["input_shape"]), ratio)
            if key not in entries:
                raise KeyError(f"the cost model has no entry for {f['model']} {shape_name(f['input_shape'])} ratio "
                               f"{ratio}: measure it first (scripts/bench_device.py --config "
                               f"{f['model']}:{shape_name(f['input_shape'])} --cost-model PATH)")
            record = entries[key].setdefault("floors", {}).setdefault(DEVICE_RUNTIMES[f["runtime"]], {})
            batch = str(f["batch_size"])
            if secure_run:
                if batch not in record.get("floor_mb", {}):
                    raise KeyError(f"the cost model has no {f['runtime']} floor at batch {batch} for {f['model']} "
                                   f"{shape_name(f['input_shape'])} ratio {ratio}: measure the plain floors first "
                                   "(the same command without --secure)")
                record["secure_floor_mb"] = dict(record.get("secure_floor_mb", {}), **{batch: f["floor_mb"]})
                record["secure_generated_by"] = dict(record.get("secure_generated_by", {}), **{batch: command})
                record["secure_onnxruntime"] = dict(record.get("secure_onnxruntime", {}),
                                                    **{batch: f.get("onnxruntime")})
                continue
            record["floor_mb"] = dict(record.get("floor_mb", {}), **{batch: f["floor_mb"]})
            record["floor_samples"] = FLOOR_TRAIN_SAMPLES + TEST_SAMPLES
            record["generated_by"] = dict(record.get("generated_by", {}), **{batch: command})
            record["onnxruntime"] = dict(record.get("onnxruntime", {}), **{batch: f.get("onnxruntime")})
    return document


FLOOR_FIELDS = ("floors",)


def merge_cost_model(old: dict | None, new: dict) -> dict:
    """``new`` with the entries of ``old`` it does not re-measure kept (each entry says which command measured it);
    a re-measured entry keeps the memory floors of the old one (``--memory-floor`` measures those, not this run)."""
    for entry in new["entries"]:
        entry.setdefault("generated_by", new["generated_by"])
    if old is None:
        return new
    previous = {(e["model"], tuple(e["input_shape"]), e["ratio"]): e for e in old["entries"]}
    for entry in new["entries"]:
        before = previous.get((entry["model"], tuple(entry["input_shape"]), entry["ratio"]), {})
        entry.update({k: before[k] for k in FLOOR_FIELDS if k in before})
    measured = {(e["model"], tuple(e["input_shape"]), e["ratio"]) for e in new["entries"]}
    kept = [dict(e, generated_by=e.get("generated_by", old.get("generated_by", ""))) for e in old["entries"]
            if (e["model"], tuple(e["input_shape"]), e["ratio"]) not in measured]
    return dict(new, entries=kept + new["entries"])


def floor_report_name(runtimes: tuple[str, ...]) -> str:
    """``memory_floor`` for the default runtimes, else ``memory_floor_<runtime>[_<runtime>...]``, so a run of one
    runtime does not overwrite the report of all of them."""
    return "memory_floor" if set(runtimes) == set(FLOOR_WORKERS) else "_".join(("memory_floor", *runtimes))


def run_memory_floors(args: argparse.Namespace, configs, ratios, command: str) -> int:
    """--memory-floor: floors of every plan on every runtime, the tables, and the cost model's floors."""
    from server.mqtt.cgroups import available
    if args.shard and args.cost_model:
        print("error: --shard with --cost-model: the cost model's floors are measured on the synthetic shard "
              "(its size is recorded with them); drop one of the two", file=sys.stderr)
        return 2
    why_not = available()
    if why_not is not None:
        print(f"error: --memory-floor needs memory cgroups: {why_not}", file=sys.stderr)
        return 2
    builds = {runtime: run_worker("runtime-probe", {}, args.portable_python if runtime == "portable" else sys.executable)
              for runtime in args.runtimes if runtime in DEVICE_RUNTIMES}
    if args.cost_model and "portable" in builds and "onnxruntime-training" in builds["portable"]["kinds"]:
        print(f"error: --runtimes portable with --cost-model: --portable-python {args.portable_python} has "
              f"onnxruntime-training's build ({builds['portable']['distributions']}), not the stock onnxruntime a "
              "device runs; pass an interpreter whose environment has stock onnxruntime", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: workers and groups go
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as shard_dir:
        plans = prepare_plans(configs, ratios, args.cache_dir, Path(shard_dir), FLOOR_TRAIN_SAMPLES)
        if args.shard:
            plans = [dict(plan, shard=str(args.shard)) for plan in plans]
        floors = []
        for batch_size in args.batch_sizes:
            for plan in plans:
                for runtime in args.runtimes:
                    python = args.portable_python if runtime == "portable" else sys.executable
                    secure = secure_settings(plan["model"], plan["input_shape"]) if args.secure else None
                    for variant in (None, secure) if args.secure else (None,):  # plain, then secure: same load
                        floors.append(dict(measure_floor(plan, runtime, batch_size, FLOOR_ROUNDS, python, variant),
                                           onnxruntime=builds.get(runtime, {}).get("distributions"),
                                           secure_settings=variant))
                        print(f"floor {runtime}{' secure' if variant else ''} batch {batch_size} {plan['label']}: "
                              f"{floors[-1]['floor_mb']} MiB ({time.perf_counter() - started:.0f} s)",
                              file=sys.stderr)
    tables = floor_tables([f for f in floors if not f["secure"]])
    if args.secure:
        tables += "\n" + secure_floor_table(floors)
    report = dict(command=command, settings=dict(train_samples=FLOOR_TRAIN_SAMPLES, rounds=FLOOR_ROUNDS,
                                                 shard=str(args.shard) if args.shard else "synthetic",
                                                 repeats=FLOOR_REPEATS,
                                                 batch_sizes=list(args.batch_sizes), resolution_mb=FLOOR_RESOLUTION_MB,
                                                 time_factor=FLOOR_TIME_FACTOR, time_slack_s=FLOOR_TIME_SLACK_S),
                  machine=dict(platform=platform.platform(), cpu=cpu_name(), cpus=os.cpu_count(),
                               loadavg_at_end=list(os.getloadavg())),
                  wall_seconds=time.perf_counter() - started, floors=floors)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = floor_report_name(args.runtimes) + ("_secure" if args.secure else "")
    (args.out_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(tables)
    if args.cost_model:
        try:
            document = with_floors(json.loads(args.cost_model.read_text()), floors, command)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: --cost-model {args.cost_model}: {exc}", file=sys.stderr)
            return 2
        args.cost_model.write_text(json.dumps(document, indent=1) + "\n")
    print(tables)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Summaries (pure)

def best_session_variant(results: list[dict]) -> str:
    """The variant with the lowest total peak RSS at batch 16; among those within PEAK_TOLERANCE of it, the one
    with the lowest total median step."""
    totals = {name: sum(r["sessions"][name]["rounds"][str(BATCH)]["peak_rss_bytes"] for r in results)
              for name in SESSION_VARIANTS}
    lean = [name for name, total in totals.items() if total <= min(totals.values()) * (1 + PEAK_TOLERANCE)]
    return min(lean, key=lambda name: sum(r["sessions"][name]["step_ms"]["p50"] for r in results))


def derived(result: dict, session: str) -> dict:
    """Per plan: ORT over PyTorch (peak memory, amortized step p50 per thread count), the amortized step p50 of
    each runtime (step + per-epoch decay / steps per epoch), and the decay's share of an epoch; at 1 thread the
    same in thread-CPU time, and the FLOP floor (``step_gflop`` at the probe's GFLOP/s) with each runtime over it."""
    ort = result["sessions"][session]
    peak_ort = ort["rounds"][str(BATCH)]["peak_rss_bytes"]
    peak_torch = result["torch"]["rounds"][str(BATCH)]["peak_rss_bytes"]
    out = dict(peak_ort_over_torch=peak_ort / peak_torch, step_ort_over_torch={}, amortized_ort_ms={},
               amortized_torch_ms={}, decay_share_ort={}, decay_share_torch={}, amortized_portable_ms={},
               step_portable_over_torch={}, step_portable_over_ort={},
               peak_portable_over_torch=result["portable"]["rounds"][str(BATCH)]["peak_rss_bytes"] / peak_torch)
    one = result["latency"]["threads"]["1"]
    cpu = {name: amortized_ms(one, name, name + "_decay", BATCH, "cpu_p50") for name in ("portable", "ort", "torch")}
    floor_ms = 1e3 * result["step_gflop"] / result["latency"]["probe_gflops"]
    out.update(cpu_amortized_ms_1t=cpu, cpu_portable_over_torch_1t=cpu["portable"] / cpu["torch"],
               floor_ms_1t=floor_ms, portable_over_floor_1t=amortized_ms(one, "portable", "portable_decay", BATCH) / floor_ms,
               cpu_portable_over_floor_1t=cpu["portable"] / floor_ms)
    steps = steps_per_epoch(BATCH)
    for threads, t in result["latency"]["threads"].items():
        ort_ms, torch_ms = amortized_ms(t, "ort", "ort_decay", BATCH), amortized_ms(t, "torch", "torch_decay", BATCH)
        out["amortized_ort_ms"][threads], out["amortized_torch_ms"][threads] = ort_ms, torch_ms
        out["step_ort_over_torch"][threads] = ort_ms / torch_ms
        portable_ms = amortized_ms(t, "portable", "portable_decay", BATCH)
        out["amortized_portable_ms"][threads] = portable_ms
        out["step_portable_over_torch"][threads] = portable_ms / torch_ms
        out["step_portable_over_ort"][threads] = portable_ms / ort_ms
        out["decay_share_ort"][threads] = t["ort_decay"]["p50"] / (steps * ort_ms)
        out["decay_share_torch"][threads] = t["torch_decay"]["p50"] / (steps * torch_ms)
    return out


def portable_derived(result: dict) -> dict:
    """Per plan, whatever its artifact kinds: the portable step and PyTorch eager's at 1 thread (p50, the
    per-epoch decay amortized; and in thread-CPU time), their ratio, and the peak RSS of each at batch 16."""
    one = result["latency"]["threads"]["1"]
    wall = {name: amortized_ms(one, name, name + "_decay", BATCH) for name in ("portable", "torch")}
    cpu = {name: amortized_ms(one, name, name + "_decay", BATCH, "cpu_p50") for name in ("portable", "torch")}
    return dict(portable_ms=wall["portable"], torch_ms=wall["torch"], ratio=wall["portable"] / wall["torch"],
                cpu_ratio=cpu["portable"] / cpu["torch"],
                peak_portable_mb={str(b): result["portable"]["rounds"][str(b)]["peak_rss_bytes"] / MIB
                                  for b in BATCH_SIZES},
                peak_torch_mb={str(b): result["torch"]["rounds"][str(b)]["peak_rss_bytes"] / MIB for b in BATCH_SIZES})


def model_label(model: str) -> str:
    """A model as the tables name it: a file of this checkout by its relative path (``examples/dscnn.py:build``)."""
    path, colon, function = model.rpartition(":")
    try:
        return str(Path(path).relative_to(ROOT)) + colon + function if path else model
    except ValueError:
        return model


def step_table(results: list[dict], session: str | None) -> str:
    """One row per (model, input, ratio): the portable step (what a device runs) against PyTorch eager at 1
    thread, peak memory, and the onnxruntime-training step or why the plan has none."""
    lines = ["| model | input | ratio | plan | portable step ms 1t | PyTorch eager ms 1t | portable / PyTorch 1t "
             "(thread-CPU) | peak RSS MiB b16: portable / PyTorch | peak RSS MiB b64: portable / PyTorch "
             "| onnxruntime-training step ms 1t |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for ratio, r in _rows(results):
        d = portable_derived(r)
        training = (f"{derived(r, session)['amortized_ort_ms']['1']:.1f}" if has_training_kind(r)
                    else f"skipped: {r['training_refused']}")
        lines.append(f"| {model_label(r['model'])} | {shape_name(r['input_shape'])} | {ratio} | {r['plan']} "
                     f"| {d['portable_ms']:.1f} | {d['torch_ms']:.1f} | {d['ratio']:.2f} ({d['cpu_ratio']:.2f}) "
                     f"| {d['peak_portable_mb'][str(BATCH)]:.0f} / {d['peak_torch_mb'][str(BATCH)]:.0f} "
                     f"| {d['peak_portable_mb'][str(LARGE_BATCH)]:.0f} / {d['peak_torch_mb'][str(LARGE_BATCH)]:.0f} "
                     f"| {training} |")
    return "\n".join(["### Step time against PyTorch eager (batch 16, per-epoch decay amortized, p50)", "", *lines, ""])


def cost_model_document(results: list[dict], session: str, command: str) -> dict:
    """The data file server.engine.cost_model reads: per (model, input, ratio), peak MiB per batch size and p50 step ms
    (per-epoch decay amortized) per thread count and batch size of the portable runtime (stock onnxruntime, what
    a device runs by default), with the probe score of the process that timed the steps."""
    from server.engine.cost_model import COST_MODEL_FORMAT
    entries = []
    for r in results:
        portable = r["portable"]
        peak = {str(b): portable["rounds"][str(b)]["peak_rss_bytes"] / MIB for b in BATCH_SIZES}
        step = {threads: {str(BATCH): amortized_ms(t, "portable", "portable_decay", BATCH),
                          str(LARGE_BATCH): amortized_ms(t, "portable_b64", "portable_decay", LARGE_BATCH)}
                for threads, t in r["latency"]["threads"].items()}
        for ratio in r["ratios"]:
            entries.append(dict(model=r["model"], input_shape=r["input_shape"], ratio=ratio, plan=r["plan"],
                                probe_gflops=r["latency"]["probe_gflops"], peak_mb=peak, step_ms=step))
    return dict(format_version=COST_MODEL_FORMAT, generated_by=command, machine=platform.machine(),
                runtime="portable", session_options=session, train_samples=TRAIN_SAMPLES, lam=LAM, mu=MU,
                entries=entries)


def _rows(results: list[dict]):
    for r in results:
        for ratio in r["ratios"]:
            yield ratio, r


def markdown_tables(results: list[dict], session: str) -> str:
    """Memory, latency, Frobenius-decay and session-option tables, one row per (model, input, ratio)."""
    memory = ["| model | input | ratio | plan | artifacts KiB | upload KiB (wire) | ORT RSS import MiB "
              "| ORT peak MiB | PyTorch RSS import MiB | PyTorch peak MiB | peak ORT/PyTorch |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    latency = ["| model | input | ratio | ORT 1t p50 amortized / p95 step ms | PyTorch 1t p50 amortized / p95 step ms "
               "| ORT/PyTorch 1t "
               "| ORT 2t p50 amortized / p95 step ms | PyTorch 2t p50 amortized / p95 step ms | ORT/PyTorch 2t "
               "| anchors ms "
               "| round s ORT / PyTorch "
               "| first round s ORT / PyTorch |",
               "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    decay = ["| model | input | ratio | ORT step ms | ORT decay ms/epoch | ORT amortized step ms | decay share ORT "
             "| PyTorch step ms | PyTorch decay ms/epoch | PyTorch amortized step ms | decay share PyTorch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    runtimes = ["| model | input | ratio | step p50 / p95 ms 1t: portable | onnxruntime-training | PyTorch "
                "| thread-CPU p50 ms 1t: portable / training / PyTorch | portable/PyTorch 1t wall | thread-CPU "
                "| FLOP floor ms (GFLOP) | portable/floor 1t wall / thread-CPU | portable/training 1t "
                "| step p50 ms 2t: portable / training / PyTorch "
                "| peak MiB: portable / training / PyTorch | load ms: portable / training | portable artifacts KiB |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    sessions = ["| model | input | ratio | " + " | ".join(f"{n} peak MiB / step ms" for n in SESSION_VARIANTS) + " |",
                "|---|---|---:|" + "---:|" * len(SESSION_VARIANTS)]
    for ratio, r in _rows(results):
        head = f"| {r['model']} | {shape_name(r['input_shape'])} | {ratio} "
        ort, pt, d = r["sessions"][session], r["torch"], derived(r, session)
        t1, t2 = r["latency"]["threads"]["1"], r["latency"]["threads"]["2"]
        memory.append(
            head + f"| {r['plan']} | {r['artifact_bytes'] / KIB:.0f} | {ort['upload_tensor_bytes'] / KIB:.0f} "
            f"({ort['upload_wire_bytes'] / KIB:.0f}) | {ort['rss_import_bytes'] / MIB:.0f} "
            f"| {ort['rounds'][str(BATCH)]['peak_rss_bytes'] / MIB:.0f} | {pt['rss_import_bytes'] / MIB:.0f} "
            f"| {pt['rounds'][str(BATCH)]['peak_rss_bytes'] / MIB:.0f} | {d['peak_ort_over_torch']:.2f} |")
        latency.append(
            head + f"| {d['amortized_ort_ms']['1']:.1f} / {t1['ort']['p95']:.1f} | {d['amortized_torch_ms']['1']:.1f} / "
            f"{t1['torch']['p95']:.1f} | {d['step_ort_over_torch']['1']:.2f} | {d['amortized_ort_ms']['2']:.1f} / "
            f"{t2['ort']['p95']:.1f} | {d['amortized_torch_ms']['2']:.1f} / {t2['torch']['p95']:.1f} "
            f"| {d['step_ort_over_torch']['2']:.2f} | {1e3 * ort['anchor_seconds']:.0f} "
            f"| {ort['rounds'][str(BATCH)]['seconds']:.2f} / {pt['rounds'][str(BATCH)]['seconds']:.2f} "
            f"| {ort['first_round_seconds']:.2f} / {pt['first_round_seconds']:.2f} |")
        decay.append(
            head + f"| {t1['ort']['p50']:.1f} | {t1['ort_decay']['p50']:.2f} | {d['amortized_ort_ms']['1']:.1f} "
            f"| {100 * d['decay_share_ort']['1']:.1f}% | {t1['torch']['p50']:.1f} | {t1['torch_decay']['p50']:.2f} "
            f"| {d['amortized_torch_ms']['1']:.1f} | {100 * d['decay_share_torch']['1']:.1f}% |")
        po, cpu = r["portable"], d["cpu_amortized_ms_1t"]
        runtimes.append(
            head + f"| {t1['portable']['p50']:.1f} / {t1['portable']['p95']:.1f} | {t1['ort']['p50']:.1f} / "
            f"{t1['ort']['p95']:.1f} | {t1['torch']['p50']:.1f} / {t1['torch']['p95']:.1f} "
            f"| {cpu['portable']:.1f} / {cpu['ort']:.1f} / {cpu['torch']:.1f} "
            f"| {d['step_portable_over_torch']['1']:.2f} | {d['cpu_portable_over_torch_1t']:.2f} "
            f"| {d['floor_ms_1t']:.1f} ({r['step_gflop']:.3f}) "
            f"| {d['portable_over_floor_1t']:.1f} / {d['cpu_portable_over_floor_1t']:.1f} "
            f"| {d['step_portable_over_ort']['1']:.2f} "
            f"| {t2['portable']['p50']:.1f} / {t2['ort']['p50']:.1f} / {t2['torch']['p50']:.1f} "
            f"| {po['rounds'][str(BATCH)]['peak_rss_bytes'] / MIB:.0f} / "
            f"{ort['rounds'][str(BATCH)]['peak_rss_bytes'] / MIB:.0f} / {pt['rounds'][str(BATCH)]['peak_rss_bytes'] / MIB:.0f} "
            f"| {1e3 * po['load_seconds']:.0f} / {1e3 * ort['load_seconds']:.0f} "
            f"| {r['portable_artifact_bytes'] / KIB:.0f} |")
        sessions.append(head + "| " + " | ".join(
            f"{r['sessions'][n]['rounds'][str(BATCH)]['peak_rss_bytes'] / MIB:.0f} / {r['sessions'][n]['step_ms']['p50']:.1f}"
            for n in SESSION_VARIANTS) + " |")
    return "\n".join(["### Device runtimes side by side (batch 16; ratios with the per-epoch decay amortized; "
                      "thread-CPU: the calling thread's CPU time, less noisy on a shared machine)", "",
                      *runtimes, "", "### Memory (1 thread, batch 16)", "", *memory, "", "### Step latency (batch 16)", "", *latency,
                      "", f"### Frobenius decay, once per epoch of {steps_per_epoch(BATCH)} steps (1 thread, batch 16, p50)",
                      "", *decay, "",
                      "### onnxruntime session options (1 thread, batch 16)", "", *sessions, ""])


def plot(results: list[dict], session: str, path: Path) -> None:
    """Peak RSS and p50 step with the per-epoch decay amortized (1 thread, batch 16) against the rank ratio: ORT
    solid, PyTorch dashed."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    fig, (mem_ax, step_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = sorted({(r["model"], shape_name(r["input_shape"])) for r in results})
    for index, (model, shape) in enumerate(series):
        rows = sorted((ratio, r) for ratio, r in _rows(results)
                      if (r["model"], shape_name(r["input_shape"])) == (model, shape))
        ratios, color, name = [ratio for ratio, _ in rows], f"C{index}", f"{model} {shape}"
        one_thread = [derived(r, session) for _, r in rows]
        mem_ax.plot(ratios, [r["sessions"][session]["rounds"][str(BATCH)]["peak_rss_bytes"] / MIB for _, r in rows],
                    "o-", color=color, label=f"{name} ORT")
        mem_ax.plot(ratios, [r["torch"]["rounds"][str(BATCH)]["peak_rss_bytes"] / MIB for _, r in rows],
                    "s--", color=color, label=f"{name} PyTorch")
        step_ax.plot(ratios, [d["amortized_ort_ms"]["1"] for d in one_thread], "o-", color=color, label=f"{name} ORT")
        step_ax.plot(ratios, [d["amortized_torch_ms"]["1"] for d in one_thread], "s--", color=color,
                     label=f"{name} PyTorch")
    mem_ax.set(xlabel="rank ratio", ylabel="peak RSS over a local round (MiB)", title="Peak memory")
    step_ax.set(xlabel="rank ratio", ylabel="train step p50, decay amortized (ms)",
                title="Step latency, 1 thread, batch 16")
    mem_ax.set_ylim(bottom=0)
    step_ax.set_ylim(bottom=0)
    mem_ax.legend(fontsize=7)
    step_ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Command line

def parse_shape(text: str) -> tuple[int, ...]:
    """``1x28x28`` -> (1, 28, 28): 1 to 4 positive sizes."""
    try:
        dims = tuple(int(d) for d in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 1x28x28, got {text!r}") from None
    if not 1 <= len(dims) <= 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected 1 to 4 positive sizes like 1x28x28, got {text!r}")
    return dims


def parse_config(text: str) -> tuple[str, tuple[int, ...]]:
    """``fedavgcnn:3x32x32`` -> ("fedavgcnn", (3, 32, 32)); a model of your own as ``PATH.py:FUNCTION:1x28x28``
    (or ``MODULE:FUNCTION:20x6``: a sample of 1 to 4 sizes), its path made absolute for the workers."""
    from fedcore.model_spec import absolute_spec
    model, _, shape = text.rpartition(":")
    try:
        dims = parse_shape(shape)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected MODEL:CxHxW with positive sizes, got {text!r}") from None
    if not model:
        raise argparse.ArgumentTypeError(f"expected MODEL:CxHxW with positive sizes, got {text!r}")
    return absolute_spec(model), dims


def parse_ratios(text: str) -> tuple[float, ...]:
    try:
        ratios = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ratios, got {text!r}") from None
    if not all(0 < r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"ratios must lie in (0, 1], got {text!r}")
    return ratios


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def parse_runtimes(text: str) -> tuple[str, ...]:
    runtimes = tuple(text.split(","))
    unknown = [r for r in runtimes if r not in FLOOR_WORKERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown runtime(s) {unknown}; choose from {','.join(FLOOR_WORKERS)}")
    return runtimes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, help="where bench_device.{json,md,png} go")
    p.add_argument("--cost-model", type=Path, default=None,
                   help="also write the cost-model data file here (entries of other configurations already in it are "
                        "kept); with --memory-floor: set the floors on its entries")
    p.add_argument("--quick", action="store_true",
                   help=f"small subset: FedAvgCNN 1x28x28 at ratios {QUICK_RATIOS}, {QUICK_STEPS} steps per variant")
    p.add_argument("--config", action="append", type=parse_config, metavar="MODEL:CxHxW",
                   help="measure this model and input shape (repeatable; default: every configuration); a model of "
                        "your own as PATH.py:FUNCTION:1x28x28 (docs/your_model.md)")
    p.add_argument("--model", action="append", default=None, metavar="PATH.py:FUNCTION",
                   help="measure a model of your own (repeatable; MODULE:FUNCTION too) on --input-shape samples: "
                        "the same as --config MODEL:SHAPE")
    p.add_argument("--input-shape", type=parse_shape, default=(1, 28, 28), metavar="CxHxW",
                   help="with --model: the per-sample shape (default 1x28x28; a sequence e.g. 20x6)")
    p.add_argument("--ratios", type=parse_ratios, default=None, help=f"comma-separated rank ratios (default {RATIOS})")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per latency variant (default {STEPS})")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="artifact cache (built once per plan)")
    p.add_argument("--memory-floor", action="store_true",
                   help="measure memory floors instead: the smallest cgroup limit (to 4 MiB) at which a fresh device "
                        f"process completes {FLOOR_ROUNDS} rounds (needs root; default configs "
                        f"{', '.join(f'{m}:{shape_name(s)}' for m, s in FLOOR_CONFIGS)}, ratios {FLOOR_RATIOS})")
    p.add_argument("--shard", type=Path, default=None,
                   help="with --memory-floor: measure on this device shard (.npz) instead of a small synthetic one; "
                        "the floors then describe that shard and are not written into a cost model")
    p.add_argument("--runtimes", type=parse_runtimes, default=tuple(FLOOR_WORKERS),
                   help="with --memory-floor: comma-separated runtimes "
                        f"(default and choices: {','.join(FLOOR_WORKERS)})")
    p.add_argument("--batch-sizes", type=parse_batch_sizes, default=(BATCH,),
                   help=f"with --memory-floor: comma-separated batch sizes to measure floors at (default {BATCH}; the "
                        f"cost model's floors cover {','.join(map(str, BATCH_SIZES))})")
    p.add_argument("--secure", action="store_true",
                   help="with --memory-floor: measure each floor twice, plain and with the device's secure step "
                        f"(--secure-aggregation under distributed DP, {SECURE_PARTICIPANTS} participants) ending each "
                        "round, into memory_floor[_RUNTIMES]_secure.{md,json}")
    p.add_argument("--portable-python", default=sys.executable,
                   help="interpreter whose environment has stock onnxruntime, for the portable runtime's workers "
                        "(latency and --memory-floor; default: this one, whose training build's InferenceSession "
                        "runs the step graph)")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        kind, spec = args.worker
        if kind in STEPPERS:
            step_server(kind, json.loads(spec))
        else:
            print(json.dumps(WORKERS[kind](json.loads(spec))))
        return 0
    if args.out_dir is None:
        parser.error("--out-dir is required")
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else STEPS)
    if steps < 1:
        parser.error(f"--steps must be >= 1, got {steps}")
    configs, ratios = (QUICK_CONFIGS, QUICK_RATIOS) if args.quick else (CONFIGS, RATIOS)
    if args.memory_floor and not args.quick:
        configs, ratios = FLOOR_CONFIGS, FLOOR_RATIOS
    own = [parse_config(f"{model}:{shape_name(args.input_shape)}") for model in args.model or ()]
    configs, ratios = tuple((args.config or []) + own or configs), args.ratios or ratios
    command = " ".join([".venv/bin/python", "scripts/bench_device.py", *(argv if argv is not None else sys.argv[1:])])
    if args.memory_floor:
        return run_memory_floors(args, configs, ratios, command)
    started, load = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory() as shard_dir:
        plans = prepare_plans(configs, ratios, args.cache_dir, Path(shard_dir))
        build_seconds = time.perf_counter() - started
        results = []
        for plan in plans:
            results.append(measure_plan(plan, steps, args.portable_python))
            print(f"measured {plan['label']} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    full = [r for r in results if has_training_kind(r)]  # the others: the training kind refused the model
    shipped = shipped_session_variant()
    best = best_session_variant(full) if full else None
    for r in results:
        r["derived"] = derived(r, shipped) if has_training_kind(r) else portable_derived(r)
    tables = step_table(results, shipped) + "\n" + (markdown_tables(full, shipped) if full else "")
    report = dict(command=command, settings=dict(num_classes=NUM_CLASSES, train_samples=TRAIN_SAMPLES, batch=BATCH,
                                                 large_batch=LARGE_BATCH, threads=list(THREADS), lam=LAM, mu=MU,
                                                 lr=LR, steps=steps, block=BLOCK),
                  shipped_session=shipped, best_session=best,
                  machine=dict(platform=platform.platform(), cpu=cpu_name(), cpus=os.cpu_count(),
                               loadavg_at_start=list(load), loadavg_at_end=list(os.getloadavg())),
                  build_seconds=build_seconds, wall_seconds=time.perf_counter() - started, results=results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_device.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out_dir / "bench_device.md").write_text(tables)
    if full:
        plot(full, shipped, args.out_dir / "bench_device.png")
    if args.cost_model:
        args.cost_model.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(args.cost_model.read_text()) if args.cost_model.exists() else None
        document = merge_cost_model(old, cost_model_document(results, shipped, command))
        args.cost_model.write_text(json.dumps(document, indent=1) + "\n")
    print(tables)
    print(f"session options: shipped {shipped}, leanest {best or '(not measured: no onnxruntime-training plan)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
