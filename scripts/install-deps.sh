#!/usr/bin/env bash
# Installs the Debian 12 packages qkv needs, by purpose, when any are missing:
#   scripts/install-deps.sh build    the library alone (cmake -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_TOOLS=OFF)
#   scripts/install-deps.sh tools    the qkv command line tool (qkv demo, train, viz, ...)
#   scripts/install-deps.sh python   the Python module (python/) and `pip install .`
#   scripts/install-deps.sh test     the test suite, benchmarks, fuzzers, sanitizers and PyTorch parity
#   scripts/install-deps.sh all      all of the above (the default)
#   scripts/install-deps.sh peers    bench/peers/run.py's ONNX Runtime column (not in `all`: make test
#                                    never installs it; run.py's smoke test skips what is absent)
# Several groups may be given. Idempotent: when every package asked for is installed (checked with
# dpkg-query, which needs no root) it returns at once without touching apt or sudo.
set -euo pipefail

build=(
  build-essential cmake make pkg-config
  libopenblas-dev          # GEMMs (reference kernel, Linear)
  libhwy-dev               # SIMD in the flash kernel (Highway's dynamic dispatch)
  libgomp1                 # OpenMP threads (ships with g++)
  libdnnl-dev              # oneDNN's sgemm for large GEMMs (optional to CMake: OpenBLAS without it)
  nlohmann-json3-dev       # model folders: safetensors headers, tokenizer.json, config.json
  libicu-dev               # tokenizers: Unicode categories and normalization forms
  libsentencepiece-dev     # tokenizer.model files (optional to CMake: an error without it)
)
tools=(
  libcli11-dev libfmt-dev  # the qkv command line tool
  libcairo2-dev            # qkv viz / scaling: PNG, SVG and PDF figures
  libcpp-httplib-dev nlohmann-json3-dev    # qkv serve: HTTP server and its JSON API
  fonts-dejavu-core        # the figures' text
)
python=(
  pybind11-dev python3-dev python3-numpy                 # the Python module (python/)
  python3-pip python3-venv python3-setuptools python3-wheel  # pip install . (setup.py), offline
)
test=(
  git                                      # tests/consumer and the pip install test copy the sources
  libgtest-dev libgmock-dev                # the GoogleTest suite (tests/)
  libbenchmark-dev                         # bench/
  python3-pytest python3-torch             # tests/python: parity with PyTorch
  clang libclang-rt-14-dev libomp-dev      # fuzz/: libFuzzer, its sanitizer runtimes and clang's
                                           # OpenMP runtime (clang 14)
  libopenmpi-dev openmpi-bin               # qkv::dist, ring attention over MPI (docs/distributed.md)
)
# bench/peers: the models ONNX Runtime runs (python3-onnx) and the Node.js that runs npm's
# onnxruntime-node. npm only where no npm command exists: NodeSource's nodejs ships its own and
# conflicts with Debian's npm package.
peers=(python3-onnx nodejs)
command -v npm >/dev/null || peers+=(npm)

groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(all)
packages=()
for group in "${groups[@]}"; do
  case "$group" in
    build) packages+=("${build[@]}") ;;
    tools) packages+=("${build[@]}" "${tools[@]}") ;;
    python) packages+=("${build[@]}" "${python[@]}") ;;
    test) packages+=("${build[@]}" "${tools[@]}" "${python[@]}" "${test[@]}") ;;
    all) packages+=("${build[@]}" "${tools[@]}" "${python[@]}" "${test[@]}") ;;
    peers) packages+=("${peers[@]}") ;;
    *) echo "install-deps: unknown group '$group' (build, tools, python, test, all, peers)" >&2; exit 2 ;;
  esac
done

# The explorer's browser test (tests/serve): headless Chromium driven by Selenium, with the test
# group only. Installed apart: where Chromium cannot be installed the rest still is, and that one
# test says why it skips.
browser_packages=()
for group in "${groups[@]}"; do
  case "$group" in test|all) browser_packages=(chromium chromium-driver python3-selenium) ;; esac
done

# The packages of a list that are not installed yet, each once, in order.
missing_from() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done | awk '!seen[$0]++'
}
mapfile -t missing < <(missing_from "${packages[@]}")
mapfile -t missing_browser < <(missing_from "${browser_packages[@]}")
[ ${#missing[@]} -eq 0 ] && [ ${#missing_browser[@]} -eq 0 ] && exit 0

echo "install-deps: missing ${missing[*]} ${missing_browser[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "install-deps: not root and no sudo: install them as root: apt-get install ${missing[*]} ${missing_browser[*]}" >&2
    exit 1
  fi
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
  $sudo apt-get install -y --no-install-recommends "${missing[@]}"
fi
if [ ${#missing_browser[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing_browser[*]} (the explorer's browser test)"
  $sudo apt-get install -y --no-install-recommends "${missing_browser[@]}" ||
    echo "install-deps: warning: could not install ${missing_browser[*]}; the browser test (serve_browser) will skip"
fi
