"""The simulator's own flags (``python -m server.simulate``) and their checks, torch-free: a mistake answers (exit 2,
one line) before torch and the data load. The flags both drivers share are ``server.cli``'s."""
from __future__ import annotations

import argparse

from device_runtime.artifact_contract import PORTABLE_KIND, TRAINING_KIND
from server.cli import add_ray_flags, check_async_fleet, check_ray_args, new_parser
from server.engine.device_trace import Availability, SpeedModel
from server.engine.run_config import dp_from_args, secure_from_args

BACKENDS = {"torch": None, "ort": TRAINING_KIND, "portable": PORTABLE_KIND}
"""--backend -> the artifact kind its devices run: the PyTorch reference (none), onnxruntime's training API, or
the portable step graph on stock onnxruntime (what MQTT devices run by default)."""
DEVICE_PREFIX = "device/"
TRAIN_DEVICES = ("cpu", "cuda")
NO_DEADLINE_S = 1e9


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("python -m server.simulate", "In-process federation: every device in this process, no transport.")
    sim = p.add_argument_group("in-process devices")
    sim.add_argument("--clients", type=int, default=20, help="number of in-process devices")
    sim.add_argument("--backend", choices=tuple(BACKENDS), default="torch",
                     help="train with the PyTorch reference, the device runtime's onnxruntime-training trainer (ort) "
                          "or its portable step graph on stock onnxruntime (portable, what devices run by default)")
    sim.add_argument("--workers", type=int, default=1,
                     help="train a round's devices in this many worker processes (each owns a share of the devices); "
                          "the model is bit-identical to --workers 1 (--ray: Ray tasks instead)")
    sim.add_argument("--device", choices=TRAIN_DEVICES, default="cpu",
                     help="where --backend torch trains the devices' models (cuda: an NVIDIA GPU)")
    add_ray_flags(p)
    clock = p.add_argument_group("virtual clock (every metrics row's sim_time: the cost model's step time per tier)")
    clock.add_argument("--device-speed", default=None, metavar="lognormal:SIGMA",
                       help="each device's step time is its tier's times a seeded factor exp(SIGMA·z) (default: all 1)")
    clock.add_argument("--availability", default=None, metavar="P,MEAN_S",
                       help="each device online a fraction P of the time, in online periods of mean MEAN_S virtual "
                            "seconds; away devices are not given training (default: always online)")
    clock.add_argument("--virtual-deadline", type=float, default=None, metavar="SECONDS",
                       help="sync: a round closes this many virtual seconds after it opens; trainers not done by then "
                            "are dropped, their work lost (default: a round waits for its slowest trainer)")
    sim.add_argument("--secagg-drop", type=float, default=0.0, metavar="P",
                     help="with --secure-aggregation: each device drops after sharing its keys with probability P "
                          "(seeded by --seed and the round), to study recovery")
    sim.add_argument("--secagg-test-seed", type=int, default=None, metavar="N",
                     help="with --secure-aggregation: the devices' stochastic rounding (and distributed DP noise) from "
                          "N, the round and the device instead of the OS's generator, so a run and its --resume are "
                          "reproducible; for tests only: then neither the rounding nor the noise is secret")
    return p


def check_simulate_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first in-process flag out of range."""
    if args.clients < 1:
        raise ValueError(f"--clients must be >= 1, got {args.clients}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    dp_from_args(args, args.clients)
    secure_from_args(args, args.clients)
    check_async_fleet(args, args.clients)
    if not 0 <= args.secagg_drop < 1:
        raise ValueError(f"--secagg-drop must be a probability in [0, 1), got {args.secagg_drop:g}")
    if args.secagg_drop and not args.secure_aggregation:
        raise ValueError(f"--secagg-drop {args.secagg_drop:g} needs --secure-aggregation")
    if args.secagg_test_seed is not None and not args.secure_aggregation:
        raise ValueError(f"--secagg-test-seed {args.secagg_test_seed} needs --secure-aggregation")
    if args.ray is not None and args.workers != 1:
        raise ValueError(f"--ray trains the devices as Ray tasks, as many at once as the cluster has CPUs: leave out "
                         f"--workers {args.workers}")
    if args.mode == "async" and args.workers != 1:
        raise ValueError(f"--mode async trains each device when its task ends on the virtual clock: use --workers 1 "
                         f"or --ray (got --workers {args.workers})")
    if args.virtual_deadline is not None and not args.virtual_deadline > 0:
        raise ValueError(f"--virtual-deadline must be positive virtual seconds, got {args.virtual_deadline:g}")
    if args.virtual_deadline is not None and args.mode == "async":
        raise ValueError("--virtual-deadline closes sync rounds; --mode async has none (--max-staleness bounds it)")
    if args.device_speed:
        SpeedModel.parse(args.device_speed)
    if args.availability:
        Availability.parse(args.availability)
    check_ray_args(args)
    if args.device == "cuda":
        if args.backend != "torch":
            raise ValueError(f"--device cuda trains with PyTorch: use --backend torch (got --backend {args.backend}; "
                             "the ONNX backends run on the CPU)")
        import torch  # only when asked: flag checks otherwise answer before torch loads
        if args.ray is None and not torch.cuda.is_available():  # with --ray the cluster's nodes have the GPUs
            raise ValueError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                             "use --device cpu")
