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
  libcpp-httplib-dev nlohmann-json3-dev    # qkv serve: HTTP server and its JSON API
  fonts-dejavu-core        # the figures' text
  libgtest-dev libgmock-dev
  libbenchmark-dev
  pybind11-dev python3-dev python3-numpy   # the Python module (python/)
  python3-pytest python3-torch             # its tests: parity with PyTorch (tests/python)
)

# The explorer's browser test (tests/serve): headless Chromium driven by Selenium. Installed apart:
# where Chromium cannot be installed the rest still is, and that one test says why it skips.
browser_packages=(chromium chromium-driver python3-selenium)

# The packages of a list that are not installed yet.
missing_from() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}
mapfile -t missing < <(missing_from "${packages[@]}")
mapfile -t missing_browser < <(missing_from "${browser_packages[@]}")
[ ${#missing[@]} -eq 0 ] && [ ${#missing_browser[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get install -y --no-install-recommends "${missing[@]}"
fi
if [ ${#missing_browser[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing_browser[*]} (the explorer's browser test)"
  $sudo apt-get install -y --no-install-recommends "${missing_browser[@]}" ||
    echo "install-deps: warning: could not install ${missing_browser[*]}; the browser test (serve_browser) will skip"
fi
