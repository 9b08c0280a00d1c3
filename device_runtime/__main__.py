"""python -m device_runtime: one FedARA device, training on its local shard for a server over MQTT.

    python -m device_runtime --broker mqtt://HOST:1883 --device-id dev_000 --data dev_000.npz \\
        --workdir /var/lib/fedara [--memory-budget-mb 256] [--threads 1] [--runtime auto] [--tls-ca ca.pem]
    python -m device_runtime predict --workdir /var/lib/fedara images.npy [--json]

After every round it answers, the device writes its personalized model to WORKDIR/model/ (model.onnx for stock
onnxruntime, model.json); ``predict`` classifies with it, with or without the agent and the broker
(device_runtime.model).

The MQTT username is the device id unless --username says otherwise; the password comes from
$FEDARA_MQTT_PASSWORD. The device reconnects on its own, resumes from its workdir after a restart, and exits
cleanly on SIGTERM. At start-up it waits up to --connect-timeout seconds for the broker (0: for ever), saying
why it cannot connect every 10 s. Exit status: 0 after SIGTERM; 2 for everything that a restart would not
heal: bad arguments, an unreadable or corrupt shard, a workdir it cannot write, credentials the broker
refused, no broker within --connect-timeout, or the server refused this device.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from device_runtime.help_format import CommandParser, DefaultsHelpFormatter
from device_runtime.log_budget import hold_back_floods

PASSWORD_ENV = "FEDARA_MQTT_PASSWORD"
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
EXIT_OK, EXIT_BAD_INPUT = 0, 2
DEFAULT_CONNECT_TIMEOUT_S = 300.0
DEFAULT_MAX_INBOUND_MB = 64.0
AUTH_DIR = "auth"
PREDICT_COMMAND = "predict"
DEFAULT_KEEP_MODELS = 2  # device_runtime.model.DEFAULT_KEEP: not imported, numpy must load after THREAD_ENV_VARS


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m device_runtime", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsHelpFormatter,
                                epilog="python -m device_runtime predict --help: classify with the device's model")
    p.add_argument("--broker", required=True,
                   help="mqtt://[user[:pass]@]host[:port] or mqtts://... (TLS); several, comma-separated (the nodes "
                        "of a clustered broker): a lost connection moves to the next")
    p.add_argument("--device-id", required=True, help="this device's id: its MQTT client id and topic level")
    p.add_argument("--data", required=True,
                   help="the device's shard: an .npz of x_train, y_train, x_test, y_test and num_classes")
    p.add_argument("--workdir", required=True, help="cached artifacts, heads and state survive restarts here")
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="memory this device process may use (default: its cgroup's memory limit, else "
                        "MemAvailable); the server picks the largest rank tier predicted to fit")
    p.add_argument("--threads", type=int, default=1, help="compute threads")
    p.add_argument("--runtime", default="auto", choices=("auto", "onnxruntime", "onnxruntime-training"),
                   help="auto: stock onnxruntime's portable step graphs whenever onnxruntime is installed; "
                        "onnxruntime-training: the training API (onnxruntime-training-cpu)")
    p.add_argument("--prefix", default=None,
                   help="MQTT topic prefix, the server's --prefix (default: both sides' default)")
    p.add_argument("--username", default=None,
                   help="MQTT username (default: the user in --broker's URL, else --device-id)")
    p.add_argument("--password", default=None,
                   help=f"MQTT password (default: ${PASSWORD_ENV}, which keeps it out of the process list)")
    p.add_argument("--tls-ca", default=None, help="CA certificate to verify an mqtts:// broker")
    p.add_argument("--key-file", required=True,
                   help="this device's key file (64 hex digits), from the server's operator, who enrolled it")
    p.add_argument("--max-inbound-mb", type=float, default=DEFAULT_MAX_INBOUND_MB,
                   help="largest message taken before a plan sets a model-sized limit (also the reassembly budget)")
    p.add_argument("--max-message-bytes", type=int, default=256 * 1024,
                   help="largest MQTT publish; longer messages travel as chunks (the broker's limit or less)")
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                   help="seconds to wait for the broker at start-up before exiting with status 2 (0: for ever)")
    p.add_argument("--keep-models", type=int, default=DEFAULT_KEEP_MODELS,
                   help="model directories kept in WORKDIR/models/ (WORKDIR/model points at the newest)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first flag whose value cannot work (the rest is checked where it is used)."""
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.memory_budget_mb is not None and not args.memory_budget_mb > 0:
        raise ValueError(f"--memory-budget-mb must be positive, got {args.memory_budget_mb:g}")
    if args.tls_ca is not None and not os.path.isfile(args.tls_ca):
        raise ValueError(f"--tls-ca {args.tls_ca}: no such file")
    if not args.connect_timeout >= 0:
        raise ValueError(f"--connect-timeout must be >= 0 (0: wait for ever), got {args.connect_timeout:g}")
    if args.keep_models < 1:
        raise ValueError(f"--keep-models must be >= 1 (the current model is always kept), got {args.keep_models}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [PREDICT_COMMAND]:
        from device_runtime.model import predict_main
        return predict_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for name in THREAD_ENV_VARS:  # before numpy loads its BLAS
        os.environ.setdefault(name, str(args.threads))
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s {args.device_id} %(name)s %(levelname)s %(message)s")
    hold_back_floods()

    from device_runtime.malloc_arenas import share_one_arena
    share_one_arena()  # before any thread starts: the network thread's frames stay charged otherwise
    from device_runtime.probe import probe_gflops
    probe_score = probe_gflops()  # first: its 12 MiB of arrays must not meet the modules below (device_runtime.probe)
    from device_runtime.agent import DeviceAgent, DeviceRefused, Interrupted, inbound_screen
    from device_runtime.device_admission import DeviceAdmission
    from device_runtime.workdir import Workdir
    from device_runtime.auth import read_key_file
    from device_runtime.broker_wait import BrokerUnreachableError
    from device_runtime.link import Link
    from device_runtime.messages import DEFAULT_TOPIC_PREFIX
    from device_runtime.profile import ProfileError, collect_profile
    from device_runtime.protocol import ProtocolError
    from device_runtime.runtimes import RuntimeUnavailable, detect
    from device_runtime.shard import ShardError, load_shard
    from device_runtime.topics import Topics
    from device_runtime.transport import BrokerRefusedError, MqttEndpoint, parse_brokers, speaks_mqtt5

    try:
        brokers = parse_brokers(args.broker)
    except ValueError as exc:  # it names --broker
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    flag = "--device-id/--prefix"
    try:
        topics = Topics(args.prefix or DEFAULT_TOPIC_PREFIX, args.device_id)
        flag = "--data"
        shard = load_shard(args.data)
        flag = "--runtime"
        runtime = detect(args.runtime)
        flag = "--memory-budget-mb"
        profile = collect_profile(args.memory_budget_mb, args.threads, runtime=runtime, probe_score=probe_score)
        flag = "--max-inbound-mb"
        if args.max_inbound_mb <= 0:
            raise ValueError(f"must be positive, got {args.max_inbound_mb}")
        max_inbound = int(args.max_inbound_mb * 1024 * 1024)
        flag = "--key-file"
        key = read_key_file(args.key_file, "file")
        flag = "--workdir"
        workdir = Workdir(args.workdir)
        link = Link.device(args.device_id, key, os.path.join(args.workdir, AUTH_DIR), max_inbound)
        flag = "--broker"
        username = args.username or brokers[0].username or args.device_id
        admission = DeviceAdmission(topics.down, key)
        password = args.password or os.environ.get(PASSWORD_ENV)
        endpoint = MqttEndpoint(args.device_id, args.broker, subscriptions=[topics.down],
                                status=(topics.status, link.status_signer(args.device_id)), username=username,
                                password=password, tls_ca=args.tls_ca,
                                max_frame_bytes=args.max_message_bytes, max_message_bytes=max_inbound,
                                admit=admission.admit, check=admission.check, vouch=admission.vouch,
                                clean_session=False, screen=inbound_screen(link, args.device_id, topics.down,
                                                                      topics.payloads, admission),
                                max_queued_bytes=max_inbound,
                                mqtt5=speaks_mqtt5(args.broker, username=username, password=password,
                                                   tls_ca=args.tls_ca))
    except (ProtocolError, ShardError, ProfileError, RuntimeUnavailable, ValueError, OSError) as exc:
        print(f"error: {flag}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if profile.memory_limit_mb is not None and profile.memory_budget_mb > profile.memory_limit_mb:
        logging.getLogger("fedara.device").warning(
            "--memory-budget-mb %g is above this process's memory limit %.0f MiB (%s): a tier chosen for the budget "
            "may be killed at the limit", profile.memory_budget_mb, profile.memory_limit_mb,
            profile.memory_limit_source)
    agent = DeviceAgent(args.device_id, shard, profile, endpoint, workdir, topics, link, threads=args.threads,
                        connect_timeout_s=args.connect_timeout, keep_models=args.keep_models, admission=admission)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        if agent.computing:
            raise Interrupted()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run(stop)
    except Interrupted:
        pass
    except BrokerRefusedError as exc:
        print(f"error: {exc} (check --username and the password in ${PASSWORD_ENV} or --password)", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokerUnreachableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DeviceRefused as exc:
        print(f"error: the server refused this device: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
