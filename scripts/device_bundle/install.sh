#!/usr/bin/env bash
# Install the FedARA device runtime into a virtual environment.
#
#   ./install.sh [--prefix DIR] [--python PYTHON] [--ort-wheel FILE]
#
#   --prefix DIR      where venv/, fedara-device.env and fedara-device.service go (default /opt/fedara-device)
#   --python PYTHON   the interpreter the environment is made from (default python3; 3.11+)
#   --ort-wheel FILE  an onnxruntime wheel to use instead of the pinned stock onnxruntime (e.g. a training build)
#
# Every package comes from the package index (aarch64 and x86_64 wheels) and is installed with --no-deps from
# requirements-device.txt (the pins are complete): stock onnxruntime's C bindings need only numpy, and torch and
# onnx never belong on a device. pip is upgraded first: pip < 20.3 cannot see onnxruntime's manylinux_2_28 wheels.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix=/opt/fedara-device
python=python3
ort_wheel=""
ort_pin='^onnxruntime=='

die() {
  echo "install.sh: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix | --python | --ort-wheel)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --prefix) prefix="$2" ;;
        --python) python="$2" ;;
        --ort-wheel) ort_wheel="$2" ;;
      esac
      shift 2
      ;;
    -h | --help)
      sed -n '2,13s/^# \{0,1\}//p' "$0"
      exit 0
      ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ -z "$ort_wheel" ] || [ -f "$ort_wheel" ] || die "--ort-wheel $ort_wheel: no such file"
command -v "$python" >/dev/null || die "$python not found (pass --python)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$python is older than Python 3.10"

mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
"$python" -m venv "$prefix/venv" || die "could not create $prefix/venv (Debian/Ubuntu: apt install python3-venv)"
venv_python="$prefix/venv/bin/python"
pip_install=("$venv_python" -m pip install --no-deps --disable-pip-version-check --quiet)

"$venv_python" -m pip install --upgrade --disable-pip-version-check --quiet pip \
  || die "could not upgrade pip in $prefix/venv (is the package index reachable?)"
requirements="$(mktemp)"
trap 'rm -f "$requirements"' EXIT
if [ -n "$ort_wheel" ]; then
  grep -v "$ort_pin" "$here/requirements-device.txt" >"$requirements"
  echo "$ort_wheel" >>"$requirements"
else
  cp "$here/requirements-device.txt" "$requirements"
fi
"${pip_install[@]}" -r "$requirements" || die "pip could not install requirements-device.txt for $(uname -m)"
"${pip_install[@]}" "$here"/fedara_device-*-py3-none-any.whl

runtime="$("$venv_python" -c 'from device_runtime.runtimes import detect; print(detect("auto"))')" \
  || die "the installed onnxruntime does not load in $prefix/venv"

[ -f "$prefix/fedara-device.env" ] || cp "$here/fedara-device.env" "$prefix/fedara-device.env"
sed "s|@PREFIX@|$prefix|g" "$here/fedara-device.service" >"$prefix/fedara-device.service"
cp "$here/DEVICE.md" "$prefix/DEVICE.md"

cat <<DONE
Installed the FedARA device runtime in $prefix/venv (runtime: $runtime, $(uname -m)).
Next (details in $prefix/DEVICE.md):
  1. sudo install -D -m 0600 -o root -g root YOUR_ID.key /etc/fedara/device.key
     sudo install -D -m 0644 YOUR_SHARD.npz /var/lib/fedara-device/shard.npz
  2. Edit $prefix/fedara-device.env (broker, device id, MQTT password, further flags).
  3. sudo cp $prefix/fedara-device.service /etc/systemd/system/
     sudo systemctl daemon-reload && sudo systemctl enable --now fedara-device
  4. journalctl -u fedara-device -f
Or run it by hand: $venv_python -m device_runtime --help
DONE
