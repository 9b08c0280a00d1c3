"""In-process federation: ``python -m server.simulate``.

The round engine (``server.engine.round_engine``) with every device in this process and no transport: each device gets
its plan, answers each task with the same local round a real device runs (``device_runtime.local_round``),
and keeps its personal tensors (its head; for local training its whole model). ``--backend torch`` trains with
the PyTorch reference, ``--backend ort`` with the device runtime's onnxruntime trainer. The run folder is the
MQTT server's: metrics.jsonl, metrics.csv, checkpoint.npz (``--resume``), report.md with plots.
``--workers N`` trains a round's devices in N local processes (``server.parallel_devices``), ``--ray [ADDRESS]`` as
Ray tasks on a cluster (``server.ray_devices``, joined by ``server.ray_cluster``): the same results bit for bit.
"""
from __future__ import annotations

from contextlib import ExitStack

from server.cli import (check_args, check_before_loading, check_inputs, console_logging, fail, parse,
                        run_folder, say_before_run)
from server.simulator_flags import build_parser, check_simulate_args

if __name__ == "__main__":  # --help and a mistake in the flags answer before torch and the data load
    check_before_loading(build_parser(), check_simulate_args)

# The run's imports load torch (seconds, tens under load): after the flags are checked.
from server.async_simulation import AsyncSimulation  # noqa: E402
from server.engine.rank_assignment import OverrideError  # noqa: E402
from server.engine.run_config import RunError  # noqa: E402
from server.outputs.checkpoint import CheckpointError  # noqa: E402
from server.outputs.progress import final_line  # noqa: E402
from server.parallel_devices import WorkerError  # noqa: E402
from server.ray_cluster import connected  # noqa: E402
from server.run_setup import RunFolder  # noqa: E402
from server.simulation import Simulation  # noqa: E402


def summary(records: list[dict]) -> dict:
    accuracies = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    return {"final_accuracy": accuracies[-1] if accuracies else None,
            "best_accuracy": max(accuracies) if accuracies else None}


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    console_logging()
    out = RunFolder(run_folder(args, "simulate"))
    try:
        check_inputs(args)
        check_args(args)  # every refusal before the warnings and the budget's plan
        say_before_run(args, args.clients)
        with ExitStack() as cluster:
            if args.ray is not None:  # joined before the data loads: a head that does not answer says so at once
                cluster.enter_context(connected(args.ray))
            if args.mode == "async":
                simulation = AsyncSimulation(args, out)
            else:
                simulation = Simulation(args, out)
            out.path.mkdir(parents=True, exist_ok=True)
            print(f"run folder: {out.path}", flush=True)
            records = simulation.run()
    except (ValueError, OSError, RunError, CheckpointError, OverrideError, WorkerError) as exc:
        return fail(str(exc))
    settings = dict(simulation.settings, run_id=simulation.run_id, driver="simulate", backend=args.backend)
    print(final_line(records, out.path, out.report(records, settings)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
