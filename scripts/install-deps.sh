#!/usr/bin/env bash
# Installs everything treeserve needs to build and test on Debian 12 (run as root or with sudo).
# CUDA is optional: when nvcc is installed the CUDA backend is built too.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build git pkg-config clang-format \
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
  libsentencepiece-dev sentencepiece \
  libspdlog-dev nlohmann-json3-dev libcli11-dev \
  libgtest-dev libgmock-dev libbenchmark-dev libcpp-httplib-dev \
  python3 python3-grpcio python3-grpc-tools \
  docker-compose >/dev/null
echo "treeserve dependencies installed"
