#!/usr/bin/env bash
# Install the FedARA device runtime into a virtual environment.
#
#   ./install.sh [--prefix DIR] [--python PYTHON] [--ort-wheel FILE]
#
#   --prefix DIR      where venv/, fedara-device.env and fedara-device.service go (default /opt/fedara-device)
#   --python PYTHON   the interpreter the environment is made from (default python3; 3.11 or 3.12 on x86_64)
#   --ort-wheel FILE  an onnxruntime wheel built with --enable_training_apis (aarch64: see DEVICE.md)
#
# Every package is installed with --no-deps from requirements-device.txt (the pins are complete):
# onnxruntime-training-cpu declares onnx, sympy, h5py... but its C bindings need only numpy, and torch
# and onnx never belong on a device. onnxruntime-training-cpu has x86_64 wheels only. On other machines
# pass --ort-wheel, or install such a wheel into DIR/venv yourself and run this script again.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix=/opt/fedara-device
python=python3
ort_wheel=""
ort_pin='^onnxruntime-training-cpu=='

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
      sed -n '2,14s/^# \{0,1\}//p' "$0"
      exit 0
      ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ -z "$ort_wheel" ] || [ -f "$ort_wheel" ] || die "--ort-wheel $ort_wheel: no such file"
command -v "$python" >/dev/null || die "$python not found (pass --python)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$python is older than Python 3.10"
arch="$(uname -m)"

mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
"$python" -m venv "$prefix/venv" || die "could not create $prefix/venv (Debian/Ubuntu: apt install python3-venv)"
venv_python="$prefix/venv/bin/python"
pip_install=("$venv_python" -m pip install --no-deps --disable-pip-version-check --quiet)

base_requirements="$(mktemp)"
trap 'rm -f "$base_requirements"' EXIT
grep -v "$ort_pin" "$here/requirements-device.txt" >"$base_requirements"
"${pip_install[@]}" -r "$base_requirements"
"${pip_install[@]}" "$here"/fedara_device-*-py3-none-any.whl
if [ -n "$ort_wheel" ]; then
  "${pip_install[@]}" "$ort_wheel"
elif [ "$arch" = x86_64 ]; then
  "${pip_install[@]}" "$(grep "$ort_pin" "$here/requirements-device.txt")"
fi

training_api_check='
from device_runtime.trainer import load_ort_capi
capi = load_ort_capi()
missing = [name for name in ("CheckpointState", "Module", "Optimizer") if not hasattr(capi, name)]
if missing:
    raise SystemExit(f"onnxruntime in this environment was built without the training API (no {missing})")
'
if ! "$venv_python" -c "$training_api_check"; then
  cat >&2 <<MESSAGE

install.sh: no onnxruntime with the training API is importable in $prefix/venv ($arch).
The PyPI package onnxruntime-training-cpu has x86_64 wheels only, and the plain onnxruntime
package lacks the training API. Options (DEVICE.md explains each):
  1. Build onnxruntime 1.19.2 from source on the board (or an arm64 container) with
       ./build.sh --config Release --build_shared_lib --build_wheel --enable_training_apis --parallel --skip_tests
     then run: $0 --prefix $prefix --ort-wheel build/Linux/Release/dist/<the wheel>.whl
  2. Install a wheel you built elsewhere for this board's Python into $prefix/venv
     ($venv_python -m pip install --no-deps WHEEL) and run this script again.
The C/C++ release tarball (onnxruntime-training-linux-aarch64-*.tgz) has no Python bindings and cannot
serve this runtime.
Everything else is installed; only onnxruntime is missing.
MESSAGE
  exit 3
fi

[ -f "$prefix/fedara-device.env" ] || cp "$here/fedara-device.env" "$prefix/fedara-device.env"
sed "s|@PREFIX@|$prefix|g" "$here/fedara-device.service" >"$prefix/fedara-device.service"
cp "$here/DEVICE.md" "$prefix/DEVICE.md"

cat <<DONE
Installed the FedARA device runtime in $prefix/venv.
Next:
  1. Edit $prefix/fedara-device.env (broker, device id, shard path, key file from the server's enrollment).
  2. sudo cp $prefix/fedara-device.service /etc/systemd/system/
     sudo systemctl daemon-reload && sudo systemctl enable --now fedara-device
  3. journalctl -u fedara-device -f
Or run it by hand: $venv_python -m device_runtime --help
DONE
