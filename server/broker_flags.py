"""The broker loop's own flags (``python -m server.broker_loop``) and their checks, torch-free: a mistake answers
(exit 2, one line) before torch and the data load. The flags both drivers share are ``server.cli``'s."""
from __future__ import annotations

import argparse

from device_runtime.broker_wait import final_reason
from device_runtime.transport import parse_brokers
from server.cli import add_broker_flags, check_async_fleet, add_status_flags, check_broker_connect_timeout, check_status_args, new_parser
from server.engine.cost_model import load_cost_model, smallest_floor
from server.engine.run_config import dp_from_args, secure_from_args
from server.mqtt import cgroups
from server.mqtt.enrollment import ENROLL_OPEN

DESCRIPTION = "The MQTT driver of the round engine: devices over a broker, the engine deciding every round."
DEFAULT_ROUND_DEADLINE_S = 300.0
DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_SECAGG_PHASE_TIMEOUT_S = 60.0
"""The longest a secure round waits for its devices' keys, their shares, and the survivors' unmasking shares."""
DEFAULT_AGGREGATOR_TIMEOUT_S = 60.0
"""At most this long between two messages the server sends a silent aggregator (its brief, or a partial request)."""


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("python -m server.broker_loop", DESCRIPTION)
    add_broker_flags(p, "default: an embedded broker on 127.0.0.1, free port")
    run = p.add_argument_group("devices and rounds")
    run.add_argument("--local-devices", type=int, default=0,
                     help="spawn this many device processes on shards of --dataset (0: devices come from outside)")
    run.add_argument("--local-memory-limit-mb", default=None,
                     help="start each local device in a memory cgroup of this many MiB (comma-separated, "
                          "round-robin by device id): the device reads its limit and gets the largest tier whose "
                          "measured memory floor fits (needs root and a writable memory controller; without them "
                          "the devices run unconfined and the server says so)")
    run.add_argument("--local-cpu-limit", default=None, metavar="CORES[,CORES...]",
                     help="start each local device in a CPU cgroup of this many cores (cpu.max; comma-separated, "
                          "round-robin by device id, e.g. 1,0.5,0.1): slow boards, really slow (needs root and a "
                          "writable cpu controller; without them the devices run unconfined and the server says so)")
    run.add_argument("--local-memory-mb", default=None,
                     help="memory budgets the local devices report in MiB (no real limit), comma-separated, "
                          "round-robin")
    run.add_argument("--min-devices", type=int, default=None,
                     help="devices a round needs ready (default: --local-devices, or 1)")
    run.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S,
                     help="seconds to wait for --min-devices before giving up (the time the server spends "
                          "building their artifacts does not count)")
    run.add_argument("--round-deadline", type=float, default=DEFAULT_ROUND_DEADLINE_S,
                     help="seconds a round waits for answers (--mode async: the longest wait for the final "
                          "version's evaluations)")
    run.add_argument("--task-timeout", type=float, default=None, metavar="SECONDS",
                     help="--mode async: a task not answered in this many seconds ends, its slot goes to another "
                          "device and its late update is refused ([timed_out]); default: a silent device holds its "
                          "slot")
    run.add_argument("--secagg-phase-timeout", type=float, default=DEFAULT_SECAGG_PHASE_TIMEOUT_S,
                     metavar="SECONDS",
                     help="with --secure-aggregation: seconds each SecAgg+ exchange waits for its devices (keys, "
                          "shares, unmasking shares; the masked inputs come by --round-deadline): a device that "
                          "misses the keys or shares is out of the round, one that drops after sharing is recovered")
    agg = p.add_argument_group("aggregation (see server/aggregator.py)")
    agg.add_argument("--aggregators", type=int, default=0,
                     help="start this many aggregator processes; each device's updates go to one of them, named in "
                          "its task (needs --broker: any MQTT 3.1.1 broker or cluster; 0: the server folds every "
                          "update itself)")
    agg.add_argument("--aggregator-timeout", type=float, default=DEFAULT_AGGREGATOR_TIMEOUT_S,
                     help="seconds the server waits for the aggregators: to start, to take a round's brief, to send "
                          "their partial sums at the round's close; a member silent this long in a round is lost: its "
                          "devices are asked again, for the others")
    auth = p.add_argument_group("enrollment (see server/mqtt/enrollment.py)")
    auth.add_argument("--enroll", default=None, metavar="FILE|open",
                      help="admit the devices of this enrollment file, or any id holding --run-key (open; lab use); "
                           "default: only the --local-devices, enrolled in OUT/enrollment.json")
    auth.add_argument("--run-key", default=None, metavar="FILE", help="the shared key of --enroll open")
    add_status_flags(p)
    return p


def local_budgets(text: str | None) -> list[float | None]:
    if not text:
        return [None]
    try:
        budgets = [float(b) for b in text.split(",")]
    except ValueError:
        raise ValueError(f"--local-memory-mb wants comma-separated MiB such as 128,96, got {text!r}") from None
    if any(not b > 0 for b in budgets):
        raise ValueError(f"--local-memory-mb budgets must be positive, got {text!r}")
    return budgets


def check_broker_reachable(args: argparse.Namespace) -> None:
    """Raise ValueError, at once, where no --broker can be reached and waiting would change nothing (every node's
    host does not resolve, or is a loopback port nobody listens on); a broker that does not answer yet is waited
    for (--broker-connect-timeout), with its reason said at the first failed try."""
    if not args.broker:
        return
    reasons = [final_reason(b.host, b.port) for b in parse_brokers(args.broker)]
    if all(reasons):
        raise ValueError(f"--broker {args.broker}: {reasons[0]}")


def check_broker_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first broker/device flag out of range (before anything heavy starts)."""
    if not args.secagg_phase_timeout > 0:
        raise ValueError(f"--secagg-phase-timeout must be positive seconds, got {args.secagg_phase_timeout:g}")
    if args.mode == "async" and args.aggregators:
        raise ValueError(f"--mode async with --aggregators {args.aggregators}: aggregator processes fold sync rounds; "
                         "leave --aggregators out, or use --mode sync")
    if args.task_timeout is not None and args.mode != "async":
        raise ValueError(f"--task-timeout {args.task_timeout:g} ends async tasks; a sync round has --round-deadline "
                         "(use --mode async, or leave --task-timeout out)")
    if args.broker:
        parse_brokers(args.broker)
    for flag, value, low in (("--local-devices", args.local_devices, 0), ("--min-devices", args.min_devices or 1, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not args.local_devices and not args.broker:
        raise ValueError("--local-devices 0 with the embedded broker: no device could ever join; pass "
                         "--local-devices N, or --broker mqtt://HOST:PORT for devices that connect from outside")
    for flag, value in (("--join-timeout", args.join_timeout), ("--round-deadline", args.round_deadline)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive seconds, got {value:g}")
    local_budgets(args.local_memory_mb)
    if args.aggregators < 0:
        raise ValueError(f"--aggregators must be >= 0, got {args.aggregators}")
    if not args.aggregator_timeout > 0:
        raise ValueError(f"--aggregator-timeout must be positive seconds, got {args.aggregator_timeout:g}")
    if args.aggregators and not args.broker:
        raise ValueError(f"--aggregators {args.aggregators} needs --broker mqtt://HOST:PORT (mosquitto, or the nodes of "
                         "a cluster); aggregator processes are not run on the embedded broker")
    if args.aggregators and args.enroll == ENROLL_OPEN:
        raise ValueError(f"--aggregators {args.aggregators} needs --enroll FILE: with --enroll open every device "
                         "holds the run key, so nothing could seal what the server and its aggregators say")
    check_status_args(args)
    check_broker_connect_timeout(args)
    if args.dp_noise_multiplier is not None and not args.local_devices:
        raise ValueError("--dp-noise-multiplier needs the devices a round samples from (its fixed denominator and δ): "
                         "run with --local-devices N (devices from outside are not counted before they join)")
    dp_from_args(args, args.local_devices)
    secure_from_args(args, args.local_devices or None)  # an explicit k/t checked against this fleet's rounds
    check_async_fleet(args, args.local_devices or None)  # devices from outside: not counted before they join
    if args.local_memory_limit_mb:
        try:
            limits = cgroups.parse_limits(args.local_memory_limit_mb)
        except ValueError as exc:
            raise ValueError(f"--local-memory-limit-mb: {exc}") from None
        floor, what = smallest_floor(load_cost_model())
        if min(limits) < floor:
            raise ValueError(f"--local-memory-limit-mb {min(limits):g} MiB is below the smallest memory any measured "
                             f"device ran in ({floor:g} MiB: {what}): a device would be killed as it starts, at every "
                             f"tier; give each at least {floor:g}")
    if args.local_cpu_limit:
        try:
            cgroups.parse_cpu_limits(args.local_cpu_limit)
        except ValueError as exc:
            raise ValueError(f"--local-cpu-limit: {exc}") from None
        if not args.local_devices:
            raise ValueError(f"--local-cpu-limit {args.local_cpu_limit} confines local devices: pass --local-devices N")
