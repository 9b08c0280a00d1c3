"""One definition of the flags both drivers take (``server.simulate`` and ``server.broker_loop``): the same
names, defaults and help, shown by ``--help``, settable from a TOML file with ``--config``.

A config file holds flag names without the dashes (``local_epochs = 1`` or ``local-epochs = 1``); flags on
the command line win over the file. Checks here raise ValueError naming the flag, the value and the fix,
before any data is loaded.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES
from device_runtime.help_format import CommandParser, DefaultsHelpFormatter
from device_runtime.log_budget import hold_back_floods
from device_runtime.messages import DEFAULT_TOPIC_PREFIX
from fedcore.model_spec import absolute_spec, parse_model_spec
from server.data import DATASETS, NPZ_PREFIX, dataset_arg
from server.data.datasets import DatasetFormatError, DatasetUnavailable, check_available
from server.outputs.checkpoint import folder_taken
from server.engine.secagg_parameters import DEFAULT_CORRUPT_RATE, DEFAULT_DROPOUT_RATE
from server.engine.run_config import (AGGREGATION_RULES, ALGORITHMS, BN_STATS, DEFAULT_BN_STATS, DEFAULT_LAM_WARMUP,
                                      DEFAULT_MU, DEFAULT_TIERS, MODELS, SECAGG_DEFAULT_RANGE, FederationConfig,
                                      add_async_arguments, add_dp_arguments, add_norm_bound_arguments,
                                      async_flags_given, async_rule_from_args, dp_from_args, norm_bound_from_args,
                                      secure_from_args)

RUNS_DIR = "runs"
DEFAULT_CACHE_DIR = "artifacts_cache"


class Formatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help with every default shown and the description kept as written."""


PASSWORD_ENV = "FEDARA_MQTT_PASSWORD"
DEFAULT_BROKER_CONNECT_TIMEOUT_S = 30.0


def add_broker_flags(parser: argparse.ArgumentParser, default_broker: str = "required") -> None:
    """The broker flags of every server-side process (the server, its aggregators): where and as whom to connect."""
    mqtt = parser.add_argument_group("broker")
    mqtt.add_argument("--broker", default=None,
                      help=f"mqtt://host:port or mqtts://..., or several comma-separated (the nodes of a clustered "
                           f"broker: a lost connection moves to the next) ({default_broker})")
    mqtt.add_argument("--prefix", default=DEFAULT_TOPIC_PREFIX, help="MQTT topic prefix")
    mqtt.add_argument("--username", default=None,
                      help="MQTT username (default: the user in --broker's URL, else none: anonymous)")
    mqtt.add_argument("--password", default=None, help=f"default: ${PASSWORD_ENV} (never shown here)")
    mqtt.add_argument("--tls-ca", default=None, help="CA certificate to verify an mqtts:// broker")
    mqtt.add_argument("--tls-cert", default=None, help="client certificate (with --tls-key)")
    mqtt.add_argument("--tls-key", default=None, help="the private key of --tls-cert")
    mqtt.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                      help="largest MQTT publish (keep under the broker's limit); longer messages go as chunks")
    mqtt.add_argument("--broker-connect-timeout", type=float, default=DEFAULT_BROKER_CONNECT_TIMEOUT_S,
                      metavar="SECONDS", help="give up when no broker answers this long (why it does not - connection "
                                              "refused, a host that does not resolve - is said after the first try)")


def check_broker_connect_timeout(args: argparse.Namespace) -> None:
    """Raise ValueError for a --broker-connect-timeout that is not a positive number of seconds."""
    if not (math.isfinite(args.broker_connect_timeout) and args.broker_connect_timeout > 0):
        raise ValueError(f"--broker-connect-timeout must be positive seconds, got {args.broker_connect_timeout:g}")


STATUS_HOST = "127.0.0.1"


def add_status_flags(parser: argparse.ArgumentParser) -> None:
    """The live status flags of the server (server.outputs.status_server): where the operator's read-only pages listen."""
    status = parser.add_argument_group("live status (see server/outputs/status_server.py)")
    status.add_argument("--status-port", type=int, default=None, metavar="PORT",
                        help="serve /metrics (Prometheus), / (status page) and /api/status read-only on this port while "
                             "the run lasts (0: any free port, printed at start; default: off)")
    status.add_argument("--status-host", default=None, metavar="HOST",
                        help=f"address the status port listens on ({STATUS_HOST}: this machine only; 0.0.0.0 shows "
                             "the fleet to anyone who can reach the server)")
    status.add_argument("--status-linger", type=float, default=0.0, metavar="SECONDS",
                        help="keep the status port up this long after the run, showing its final state (Ctrl-C ends "
                             "it sooner)")


def check_status_args(args: argparse.Namespace) -> None:
    """Raise ValueError for a --status-port out of range, a negative --status-linger, or --status-host or
    --status-linger without a port."""
    if args.status_port is None:
        for flag, value in (("--status-host", args.status_host), ("--status-linger", args.status_linger or None)):
            if value is not None:
                raise ValueError(f"{flag} {value} needs --status-port PORT")
        return
    if not (math.isfinite(args.status_linger) and args.status_linger >= 0):
        raise ValueError(f"--status-linger must be seconds >= 0, got {args.status_linger:g}")
    if not 0 <= args.status_port <= 65535:
        raise ValueError(f"--status-port must be a TCP port in 0..65535 (0: any free port), got {args.status_port}")


RAY_INSTALL = "pip install '.[ray]'"
"""How to install Ray (the optional extra in pyproject.toml; scripts/setup.sh installs it for the tests)."""
LOCAL_RAY = "local"
"""--ray without an address: join the Ray this machine runs, else start one for the run."""
DEFAULT_RAY_GPUS = 0.25


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    """--ray [ADDRESS] and --ray-gpus: the simulator's devices or a benchmark's runs as Ray tasks (docs/cluster.md)."""
    ray = parser.add_argument_group("Ray cluster (docs/cluster.md)")
    ray.add_argument("--ray", nargs="?", const=LOCAL_RAY, default=None, metavar="ADDRESS",
                     help="run as Ray tasks on the cluster whose head is at ADDRESS (host:port, as `ray start --head` "
                          "prints); --ray alone: join the Ray this machine runs, else start one for this run "
                          f"(default: off; needs {RAY_INSTALL})")
    ray.add_argument("--ray-gpus", type=float, default=DEFAULT_RAY_GPUS, metavar="FRACTION",
                     help="with --ray and --device cuda: the share of a GPU each Ray task asks for (0.25: four "
                          "tasks per GPU)")


def check_ray_args(args: argparse.Namespace) -> None:
    """Raise ValueError for --ray where Ray is not installed, or a --ray-gpus outside (0, 1] or not whole above 1."""
    if args.ray is None:
        return
    gpus = args.ray_gpus
    if not (math.isfinite(gpus) and gpus > 0 and (gpus <= 1 or gpus == int(gpus))):
        raise ValueError(f"--ray-gpus must be a share of one GPU in (0, 1] or a whole number of GPUs, got {gpus:g}")
    try:
        import ray  # noqa: F401  (only asked for with --ray: seconds to import)
    except ImportError:
        raise ValueError(f"--ray needs Ray, which is not installed in {sys.prefix}: {RAY_INSTALL} (from the "
                         "repository's root)") from None


def new_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with --config and the shared data, model, algorithm and output flags."""
    p = CommandParser(prog=prog, description=description, formatter_class=Formatter)
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read flag values from a TOML file (keys are flag names); the command line wins")
    data = p.add_argument_group("data and model")
    data.add_argument("--dataset", type=dataset_arg, default="fmnist", metavar="NAME",
                      help=f"one of {', '.join(DATASETS)}, or {NPZ_PREFIX}PATH (your own arrays x_train, y_train, "
                           "x_test, y_test, samples of any shape; see docs/your_model.md); read from files on this "
                           "machine, never downloaded")
    data.add_argument("--data-dir", default=None, help="dataset folder (default: the dataset's standard place)")
    data.add_argument("--partition", choices=("dirichlet", "pathological"), default="dirichlet",
                      help="label skew across clients")
    data.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    data.add_argument("--classes-per-client", type=int, default=2, help="pathological partition")
    data.add_argument("--min-samples", type=int, default=40,
                      help="redraw the partition until every client has this many samples")
    data.add_argument("--max-samples", type=int, default=0, help="use a seeded subset of the dataset (0: all of it)")
    data.add_argument("--model", default="fedavgcnn", type=model_list_arg, metavar="MODEL",
                      help=f"one of {', '.join(MODELS)}, or your own as MODULE:FUNCTION or PATH.py:FUNCTION (see "
                           "docs/your_model.md); with --algo local a comma list, round-robin by device id")
    data.add_argument("--bn-stats", choices=BN_STATS, default=DEFAULT_BN_STATS,
                      help="BatchNorm running statistics: shared (averaged with the FE, sample-weighted: FedAvg-BN) "
                           "or personal (kept on each device with its head: FedBN)")
    algo = p.add_argument_group("algorithm (defaults: the paper's)")
    d = FederationConfig()
    algo.add_argument("--algo", choices=tuple(ALGORITHMS), default=d.algo, help="one file each in server/algorithms/")
    tiers = algo.add_mutually_exclusive_group()
    tiers.add_argument("--rank-ratio", type=float, default=None,
                       help="one rank ratio for every client (1.0 = dense; FedARA* is 0.5)")
    tiers.add_argument("--rank-tiers", default=None,
                       help="heterogeneous rank ratios, comma-separated: each device gets the largest predicted "
                            "to fit its memory (in-process clients without budgets: round-robin by device id) "
                            f"[default: {','.join(map(str, DEFAULT_TIERS))}]")
    algo.add_argument("--rank-overrides", default=None, help="JSON file {device_id: ratio}, taking precedence")
    algo.add_argument("--aggregate", choices=AGGREGATION_RULES, default=d.aggregate,
                      help="weights: average the clients' reconstructed weights (the paper's rule); updates: add "
                           "the average of what each client changed to the global model, which keeps what "
                           "low-rank clients cannot represent (same bytes on the wire)")
    algo.add_argument("--lam", type=float, default=d.lam, help="anchor-loss weight λ (FedARA)")
    algo.add_argument("--lam-warmup", type=int, default=DEFAULT_LAM_WARMUP, help="rounds over which λ ramps up")
    algo.add_argument("--frob", type=float, default=DEFAULT_MU, help="Frobenius decay μ on factorized layers")
    algo.add_argument("--rounds", type=int, default=d.rounds, help="federated rounds")
    algo.add_argument("--local-epochs", type=int, default=d.local_epochs, help="passes over a client's data per round")
    algo.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per SGD step")
    algo.add_argument("--lr", type=float, default=d.lr, help="plain-SGD learning rate")
    algo.add_argument("--join-ratio", type=float, default=d.join_ratio, help="share of devices sampled per round")
    algo.add_argument("--min-completion", type=float, default=d.min_completion,
                      help="fraction of a round's training devices that must deliver for it to be aggregated")
    algo.add_argument("--seed", type=int, default=d.seed, help="seeds the partition, the model and every batch order")
    algo.add_argument("--threads", type=int, default=1, help="compute threads, of the server and of each device")
    algo.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="ONNX artifact cache")
    add_norm_bound_arguments(algo)
    add_dp_arguments(p.add_argument_group("differential privacy (user-level DP-FedAvg, see docs/privacy.md)"))
    add_secagg_arguments(p.add_argument_group("secure aggregation (SecAgg+, see docs/privacy.md)"))
    add_async_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--out", default=None,
                     help="run folder: metrics.jsonl, metrics.csv, checkpoint.npz, report.md, logs "
                          f"(default: a new {RUNS_DIR}/<driver>-<algo>-<time> folder, so a command can be re-run)")
    out.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its last completed round (settings must match)")
    return p


def model_list_arg(text: str) -> str:
    """--model's type: the comma list with each model file's path made absolute (the spec travels to other
    processes and to a resumed run, whatever their working directory)."""
    return ",".join(absolute_spec(name) for name in text.split(","))


def add_secagg_arguments(group: argparse._ArgumentGroup) -> None:
    """Secure aggregation's flags (``server.engine.secure_rounds``; the simulator adds --secagg-drop)."""
    group.add_argument("--secure-aggregation", action="store_true",
                       help="SecAgg+: each device masks its full-rank change (clipped, quantized into Z_2^32) so the "
                            "server learns only the round's sum; with --dp-noise-multiplier the devices add the "
                            "noise (distributed Skellam); needs --aggregate updates, --mode sync")
    group.add_argument("--secagg-neighbors", type=int, default=None, metavar="K",
                       help="each device's neighbours in the round's random K-regular graph (even, or n-1); "
                            "default: the smallest K that meets SecAgg+'s bounds for the round's n devices, "
                            "--secagg-dropout-rate and --secagg-corrupt-rate (n-1, the complete graph, for small n)")
    group.add_argument("--secagg-threshold", type=int, default=None, metavar="T",
                       help="shares that rebuild a device's secrets, (K+1)/2 < T <= K (a majority of its K "
                            "neighbours and itself); default: the smallest that meets the bounds")
    group.add_argument("--secagg-dropout-rate", type=float, default=DEFAULT_DROPOUT_RATE, metavar="P",
                       help="the chance each device drops after sharing, that K and T are chosen to survive")
    group.add_argument("--secagg-corrupt-rate", type=float, default=DEFAULT_CORRUPT_RATE, metavar="G",
                       help="the largest fraction of a round's devices that may collude with the server")
    group.add_argument("--secagg-range", type=float, default=SECAGG_DEFAULT_RANGE, metavar="R",
                       help="without DP: each coordinate of a device's change is clipped to +-R before quantization")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` with --config's values as defaults; exits 2 with one line for a bad config file."""
    first, _ = parser.parse_known_args(argv)
    if first.config:
        try:
            parser.set_defaults(**read_config(first.config, parser))
        except ValueError as exc:
            parser.error(str(exc))
    return parser.parse_args(argv)


def check_before_loading(parser: argparse.ArgumentParser,
                         *checks: Callable[[argparse.Namespace], object]) -> None:
    """Parse this process's command line and run ``check_args`` and ``checks`` on it: a driver calls this before
    it imports torch, so --help and a mistake in the flags answer at once (one line, exit 2)."""
    args = parse(parser, sys.argv[1:])
    try:
        check_args(args)
        check_inputs(args)
        for check in checks:
            check(args)
    except ValueError as exc:
        sys.exit(fail(str(exc)))


def read_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flag values a TOML file sets, checked against the parser's flags."""
    try:
        document = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML ({exc})") from None
    known = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    values = {}
    for key, value in document.items():
        dest = key.replace("-", "_")
        if dest not in known:
            raise ValueError(f"--config {path}: unknown setting {key!r} (settings are flag names, e.g. local_epochs)")
        action = known[dest]
        if action.type is not None and not isinstance(value, bool):
            try:
                value = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise ValueError(f"--config {path}: {key} = {value!r} is not a valid value") from None
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"--config {path}: {key} = {value!r}; choose one of {', '.join(map(str, action.choices))}")
        values[dest] = value
    return values


def parse_tiers(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--rank-tiers wants comma-separated ratios such as 1.0,0.5,0.25, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> FederationConfig:
    return FederationConfig(algo=args.algo, rounds=args.rounds, lam=args.lam, lam_warmup=args.lam_warmup,
                            mu=args.frob, lr=args.lr, local_epochs=args.local_epochs, batch_size=args.batch_size,
                            join_ratio=args.join_ratio, seed=args.seed, aggregate=args.aggregate,
                            min_completion=args.min_completion)


def check_inputs(args: argparse.Namespace) -> None:
    """Raise ValueError when the dataset's files are not where the run would read them (--dataset, --data-dir) or
    --out holds a run and --resume is not given: looked at before torch and the data load (seconds in), so the
    answer comes at once."""
    try:
        check_available(args.dataset, args.data_dir)
    except (DatasetUnavailable, DatasetFormatError) as exc:
        raise ValueError(f"--dataset {args.dataset}: {exc}") from None
    taken = folder_taken(args.out, args.resume) if args.out else None
    if taken:
        raise ValueError(taken)


def check_args(args: argparse.Namespace) -> FederationConfig:
    """The run's FederationConfig; raises ValueError naming the first flag out of range."""
    config = config_from_args(args)
    for flag, value, low in (("--threads", args.threads, 1), ("--min-samples", args.min_samples, 1),
                             ("--max-samples", args.max_samples, 0), ("--classes-per-client", args.classes_per_client, 1)):
        if value < low:
            raise ValueError(f"--{flag.lstrip('-')} must be >= {low}, got {value}")
    if not (math.isfinite(args.alpha) and args.alpha > 0):
        raise ValueError(f"--alpha must be a positive number, got {args.alpha:g}")
    ratios = [args.rank_ratio] if args.rank_ratio is not None else (parse_tiers(args.rank_tiers) or [])
    for ratio in ratios:
        if not (math.isfinite(ratio) and 0 < ratio <= 1):
            flag = "--rank-ratio" if args.rank_ratio is not None else "--rank-tiers"
            raise ValueError(f"{flag}: ratios must be in (0, 1], got {ratio:g}")
    names = args.model.split(",")
    for name in names:
        parse_model_spec(name, MODELS)
    if len(set(names)) > 1 and config.algo != "local":
        raise ValueError(f"--model {args.model!r} names several models; only --algo local trains different models "
                         "per device (the others share one)")
    norm_bound_from_args(args)
    given = async_flags_given(args)
    if args.mode != "async" and given:
        raise ValueError(f"{' '.join(given)} {'is' if len(given) == 1 else 'are'} for --mode async and would be "
                         f"ignored in --mode {args.mode}: add --mode async, or leave {'it' if len(given) == 1 else 'them'}"
                         " out")
    secure_from_args(args)
    if async_rule_from_args(args) is not None and args.update_norm_bound is not None:
        raise ValueError("--mode async does not take --update-norm-bound (it bounds a sync round's updates); "
                         "leave one of them out")
    return config


def check_async_fleet(args: argparse.Namespace, devices: int | None) -> list[str]:
    """--mode async's buffer against the fleet (``devices``: how many there are, None: not known before they join):
    raises ValueError where no buffer can fill (with DP a device counts once per buffer, so K > N never fills);
    returns the warnings for a buffer larger than the devices or the concurrency (it fills, slowly: devices train
    again on the version the buffer waits for)."""
    rule = async_rule_from_args(args)
    if rule is None:
        return []
    k, c = rule.buffer_size, rule.concurrency
    if devices is not None and k > devices and args.dp_noise_multiplier is not None:
        raise ValueError(f"--buffer-size {k} with {devices} devices and DP: a device counts once per buffer, so no "
                         f"buffer would ever fill; use --buffer-size {devices} or less")
    warnings = []
    if devices is not None and k > devices:
        warnings.append(f"--buffer-size {k} is more than the {devices} devices: each version waits for updates of "
                        f"devices that train again on the version before it (--buffer-size {max(1, devices // 2)} "
                        "gives versions sooner)")
    if k > c:
        warnings.append(f"--buffer-size {k} is more than --concurrency {c}: a version waits for devices that train "
                        f"twice on the same version (docs/async.md: K ≤ C/2, e.g. --buffer-size {max(1, c // 2)})")
    return warnings


def say_before_run(args: argparse.Namespace, devices: int | None) -> None:
    """What a user should know before a run starts (flags checked): the async buffer's warnings, and where a
    private run's budget stops it (the accountant's answer, before any data loads)."""
    for warning in check_async_fleet(args, devices):
        warn(warning)
    dp = dp_from_args(args, devices) if devices else None
    if dp is not None and not args.secure_aggregation:  # distributed DP's plan needs the model: assemble says it
        print(dp.budget_plan(args.rounds, "version" if args.mode == "async" else "round"), flush=True)


def run_folder(args: argparse.Namespace, driver: str) -> Path:
    """--out, or a new timestamped folder under runs/ (a re-run never collides with an earlier run)."""
    if args.out:
        return Path(args.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(RUNS_DIR) / f"{driver}-{args.algo}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not to the one it was created with: a
    caller (a test runner, an embedding program) that swaps and closes its stderr leaves no stale handler."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def console_logging() -> None:
    """Warnings and errors on the terminal (progress lines are printed, not logged there); replaces the root
    handler onnxruntime.training installs on import. A run's server.log gets INFO through its own handler. Both
    are spared floods of refusal lines (log_budget)."""
    handler = _StderrHandler()
    handler.setLevel(logging.WARNING)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s", handlers=[handler], force=True)
    hold_back_floods()


def warn(message: str) -> None:
    """Print a warning the user can act on, as one line, before the run starts."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> int:
    """Print a user's error once, as one line, and return the exit status for bad input."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2
