#!/bin/bash
# #23 criterion 2: the Python client over the ring (compiled ring, built here
# with the package's own setup.py) against the Rust ring in the same run, four runs.
S="$(cd "$(dirname "$0")" && pwd)"
nproc; lscpu | grep -E "Model name" | head -1
(cd clients/python && timeout 120 python3 setup.py build_ext --inplace > /dev/null 2>&1; ls src/kvrail/*.so)
for i in 1 2 3 4; do
  PYTHONPATH=clients/python/src timeout 200 python3 clients/python/benchmarks/ring_latency.py --kvrail $S/kvrail --loadgen $S/loadgen --samples 2000 2>&1 | tail -1
done
