#!/usr/bin/env bash
# Installs everything treeserve needs to build and test on Debian 12. Run it as root, or as a
# user with sudo (it then asks sudo for the apt-get calls).
# CUDA is optional: when nvcc is installed the CUDA backend is built too.
# --build-only: only what building the server and its tools needs (docker/Dockerfile's build
# stage), none of the test tools.
set -euo pipefail
build_only=0
[ "${1:-}" = --build-only ] && build_only=1
export DEBIAN_FRONTEND=noninteractive
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null; then
  as_root=(sudo --preserve-env=DEBIAN_FRONTEND)
else
  echo "install-deps.sh: run as root (or install sudo): apt-get needs root" >&2
  exit 1
fi
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build git pkg-config \
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
  libsentencepiece-dev sentencepiece libpcre2-dev libutf8proc-dev \
  libspdlog-dev nlohmann-json3-dev libcli11-dev libcpp-httplib-dev libssl-dev python3 >/dev/null
if [ $build_only = 1 ]; then
  echo "treeserve build dependencies installed"
  exit 0
fi
# The proxies (haproxy, nginx) are for tests/deploy: replicas behind a proxy.
"${as_root[@]}" apt-get install -y -qq --no-install-recommends \
  clang-format clang libclang-rt-14-dev libgtest-dev libgmock-dev libbenchmark-dev openssl curl \
  python3-grpcio python3-grpc-tools python3-setuptools python3-wheel python3-venv \
  python3-matplotlib \
  docker-compose haproxy nginx >/dev/null
# Node.js and npm for the tokenizer's reference test (tests/tokenizer_ref): Debian's, unless a
# node is installed already.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
# Debian's Chromium and a font for the tree viewer's headless-browser test (tests/viewer).
"${as_root[@]}" apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core \
  >/dev/null
echo "treeserve dependencies installed"
