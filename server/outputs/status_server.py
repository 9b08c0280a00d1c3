"""An operator's live view of a running federation: ``--status-port PORT`` on ``python -m server.broker_loop``.

Three read-only pages, from the engine's own records (the same ones metrics.jsonl is written from):

- ``/metrics``: the Prometheus text format (``prometheus_client``), for Prometheus and Grafana;
- ``/``: a status page with the device table, the open round and accuracy per tier over rounds (an inline SVG
  that updates itself by fetching ``/api/status``; no external assets, so it works on an air-gapped site);
- ``/api/status``: the snapshot the page draws, as JSON.

Functional core, thin shell: :func:`fleet_snapshot` is a pure function of the engine's state that returns
plain, freshly built data; the run loop calls it and hands the result to :meth:`StatusServer.publish` (one
reference swap). The HTTP thread only ever reads the latest snapshot: it never touches the engine, so nothing
on a page or the endpoint can change the run. GET and HEAD only: POST, PUT, DELETE, PATCH and OPTIONS get 405,
any other method http.server's 501. The port closes when the run ends.
"""
from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from server.outputs.prometheus_metrics import METRICS_CONTENT_TYPE, SnapshotCollector
from server.outputs.status_snapshot import Snapshot

LOG = logging.getLogger("fedara.status")
STATUS_PAGE = (Path(__file__).with_name("status_page.html")).read_text(encoding="utf-8")
"""The status page: static HTML and script that draws ``/api/status`` (a package data file)."""


class StatusServer:
    """Serves the latest published snapshot on ``host:port`` from a daemon thread until :meth:`close`."""

    def __init__(self, host: str, port: int) -> None:
        self._snapshot: Snapshot | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self._snapshot))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes: the server's RSS, and its CPU
        handler = type("Handler", (_Handler,), {"status": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ValueError(f"--status-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                             "pick a free port, or 0 for any") from None
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="fedara-status", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def publish(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` the one served (the caller must not change it afterwards)."""
        self._snapshot = snapshot

    def latest(self) -> Snapshot | None:
        return self._snapshot

    def close(self) -> None:
        """Stop serving and close the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def __enter__(self) -> StatusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    """GET/HEAD of /, /metrics and /api/status; POST, PUT, DELETE, PATCH and OPTIONS are refused with 405."""

    status: StatusServer
    server_version = "fedara-status"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(HTTPStatus.OK, METRICS_CONTENT_TYPE, generate_latest(self.status.registry), body)
        elif path == "/api/status":
            snapshot = self.status.latest()
            data = json.dumps(snapshot if snapshot is not None else {"starting": True}).encode()
            self._send(HTTPStatus.OK, "application/json", data, body)
        elif path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", STATUS_PAGE.encode(), body)
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found: see / /metrics /api/status\n",
                       body)

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", b"read-only: GET only\n", True,
                   allow="GET, HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def _send(self, code: HTTPStatus, content_type: str, data: bytes, body: bool, allow: str | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        LOG.debug("%s " + format, self.address_string(), *args)
