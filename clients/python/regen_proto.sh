#!/usr/bin/env bash
# Regenerates the checked-in gRPC stubs (src/kvrail/v1/*_pb2*.py) from proto/.
# Pinned so the stubs run on protobuf >= 5.29 (the gencode's floor) and newer.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${TMPDIR:-/tmp}/kvrail-protoc-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "grpcio-tools==1.71.0"
"$venv/bin/python" -m grpc_tools.protoc -I "$here/../../proto" \
  --python_out="$here/src" --pyi_out="$here/src" --grpc_python_out="$here/src" \
  kvrail/v1/sidecar.proto
