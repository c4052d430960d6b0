#!/usr/bin/env bash
# Installs the Debian 12 packages qkv needs to build, test and run, when any are missing.
# Idempotent: a machine that has them all returns at once without touching apt.
set -euo pipefail

packages=(
  build-essential cmake make pkg-config git
  libopenblas-dev          # GEMMs (reference kernel, Linear)
  libhwy-dev               # SIMD in the flash kernel (Highway's dynamic dispatch)
  libgomp1                 # OpenMP threads (ships with g++)
  libcli11-dev libfmt-dev  # the qkv command line tool
  libcairo2-dev            # qkv viz / scaling: PNG, SVG and PDF figures
  fonts-dejavu-core        # the figures' text
  libgtest-dev libgmock-dev
  libbenchmark-dev
  pybind11-dev python3-dev python3-numpy   # the Python module (python/)
  python3-pytest python3-torch             # its tests: parity with PyTorch (tests/python)
  libopenmpi-dev openmpi-bin               # qkv::dist, ring attention over MPI (docs/distributed.md)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y --no-install-recommends "${missing[@]}"
