#!/usr/bin/env bash
# Create .venv with everything the server, the device runtime and the tests need.
# As root it also installs Debian's mosquitto, mosquitto-clients, nats-server, dataset-fashion-mnist, chromium, util-linux
# and iproute2 (nothing is downloaded at run time; nats-server runs the clustered broker tests, chromium is the status
# page test's headless browser, unshare and ip keep the Ray tests' traffic on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
  [ -d /usr/share/datasets/fashion-mnist ] || missing+=(dataset-fashion-mnist)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v mosquitto_pub >/dev/null || missing+=(mosquitto-clients)  # the replay tests' outside publisher
  command -v chromium >/dev/null || missing+=(chromium)  # the status page test's headless browser
  command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)  # clustered broker tests
  command -v unshare >/dev/null || missing+=(util-linux)  # the Ray tests' network namespace with loopback alone
  command -v ip >/dev/null || [ -x /usr/sbin/ip ] || missing+=(iproute2)  # ... and its `ip link set lo up`
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi
[ -x .venv/bin/python ] || { echo "setup: creating .venv"; python3 -m venv .venv; }
# torch==2.13.0 is pinned so pip takes the CPU build; a looser pin can pull a multi-GB CUDA build.
echo "setup: installing this project and its Python packages into .venv (pyproject.toml: torch CPU build, onnx,"
echo "       onnxruntime-training-cpu, amqtt, matplotlib, scikit-learn, ray (the [ray] extra), pytest ...; about a"
echo "       minute the first time)"
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
echo "setup: done"
