"""A test certificate authority and a broker certificate it signed, made with the openssl CLI."""
from __future__ import annotations

import subprocess
from pathlib import Path

from server.mqtt.mosquitto_config import TlsFiles
from tests.support.machine import missing_binary, require


def openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA in ``directory``: (key, certificate)."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", cert, "-days", "1", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    return key, cert


def make_tls_files(directory: Path) -> TlsFiles:
    """A test CA and a server certificate for 127.0.0.1 that it signed, in ``directory``."""
    require(missing_binary("openssl", "openssl"))  # it makes the test certificates
    ca_key, ca_cert = make_ca(directory, "test-ca")
    key, csr, cert, ext = (directory / name for name in ("server.key", "server.csr", "server.pem", "san.ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
            "-out", cert, "-days", "1", "-extfile", ext)
    return TlsFiles(cafile=ca_cert, certfile=cert, keyfile=key)
