"""Waiting for the broker when a device (or the server, or an aggregator) starts: say why it is not reachable
("connection refused", a host that does not resolve) after the first failed try, again at a bounded rate, and
give up after the connect timeout (``--connect-timeout`` of a device, ``--broker-connect-timeout`` of the server and
its aggregators; 0: never) instead of waiting without a word.

paho retries in its network thread and keeps the reason of a failed attempt to itself, so the reason comes
from ``unreachable_reason``: one plain TCP connection to the broker's address. The decisions (report now?
give up?) are plain functions of the clock.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable

from device_runtime.transport import ConnectTimeoutError, MqttEndpoint

LOG = logging.getLogger("fedara.device")
REPORT_EVERY_S = 10.0
POLL_S = 1.0
PROBE_TIMEOUT_S = 3.0
LISTENING = "accepts TCP connections but no MQTT session comes up"
SESSION_GRACE_S = 5.0
"""A listener whose MQTT session is not up yet is not reported before this: a healthy broker (NATS's MQTT gateway
among them) may take a few seconds to bring a first session up."""


class BrokerUnreachableError(RuntimeError):
    """No connection to the broker within the connect timeout; the message says why."""


def report_due(last_report: float | None, now: float, every_s: float = REPORT_EVERY_S) -> bool:
    """Whether to say again why the broker is unreachable: at the first failure, then every ``every_s``."""
    return last_report is None or now - last_report >= every_s


def timed_out(started: float, now: float, timeout_s: float) -> bool:
    """Whether the wait that began at ``started`` is over (``timeout_s`` 0: it never is)."""
    return timeout_s > 0 and now - started >= timeout_s


REFUSED_GRACE_S = 0.5
"""How long a loopback port that refuses is tried again before that is final (a broker started beside the server
listens within milliseconds)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def final_reason(host: str, port: int, grace_s: float = REFUSED_GRACE_S,
                 clock: Callable[[], float] = time.monotonic, pause: Callable[[float], None] = time.sleep) -> str | None:
    """Why no broker is at host:port where waiting would change nothing, so it can be said at once: a host name
    that does not resolve, or a loopback port nobody listens on (tried for ``grace_s``); None where a wait may help
    (no answer yet, a remote refusal, or a listener)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve the broker host {host!r}: {exc.strerror}"
    if not is_loopback(host):
        return None
    deadline = clock() + grace_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                return None
        except ConnectionRefusedError:
            if clock() >= deadline:
                return (f"connection refused: nothing listens on {host}:{port} on this machine (start the broker, "
                        "or leave --broker out for an embedded one)")
            pause(0.05)
        except OSError:
            return None


def unreachable_reason(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Why an MQTT connection to host:port does not come up, in words an operator can act on."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except ConnectionRefusedError:
        return f"connection refused (is the broker running at {host}:{port}?)"
    except socket.gaierror as exc:
        return f"cannot resolve the broker host {host!r}: {exc.strerror}"
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout_s:g} s (wrong host, or a firewall?)"
    except OSError as exc:
        return f"cannot reach {host}:{port}: {exc.strerror or exc}"
    return (f"{host}:{port} {LISTENING} (mqtts:// against a plain listener, mqtt:// against a TLS one, or a "
            f"--tls-ca that did not sign the broker's certificate?)")


def wait_for_broker(endpoint: MqttEndpoint, stop: threading.Event, timeout_s: float, *,
                    clock: Callable[[], float] = time.monotonic,
                    reason: Callable[[str, int], str] = unreachable_reason, flag: str = "--connect-timeout",
                    log: logging.Logger = LOG, final_at_once: bool = False) -> bool:
    """Block until ``endpoint`` is connected (True) or ``stop`` is set (False), logging (on ``log``) why it is not
    at most every REPORT_EVERY_S; raise BrokerUnreachableError after ``timeout_s`` (0: wait for ever), naming
    ``flag``, the timeout's flag. ``final_at_once``: raise at the first failure where waiting would change nothing
    (``final_reason``: the server, which starts after its broker; a device may start before its broker and waits).

    BrokerRefusedError (the broker answered and refused these credentials) passes through.
    """
    started, last_report = clock(), None
    while not stop.is_set():
        try:
            endpoint.wait_connected(POLL_S)
            return True
        except ConnectTimeoutError:
            now = clock()
            host, port = endpoint.url.host, endpoint.url.port  # the broker of the list it tries now
            final = final_reason(host, port) if final_at_once and last_report is None else None
            if final is not None:
                raise BrokerUnreachableError(f"no broker at {host}:{port}: {final}") from None
            if timed_out(started, now, timeout_s):
                raise BrokerUnreachableError(f"no broker at {host}:{port} after {flag} {timeout_s:g} s: "
                                             f"{reason(host, port)}") from None
            said = reason(host, port) if report_due(last_report, now) else None
            if said is not None and not (LISTENING in said and now - started < SESSION_GRACE_S):
                last_report = now
                log.warning("%s; retrying until %s %g s", said, flag, timeout_s)
    return False
