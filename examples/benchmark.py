"""Benchmark swa_tvm against every CPU peer in one process (same as `swa-tvm bench`).

    python examples/benchmark.py                      # full run: T = 1K..64K, 4 patterns
    python examples/benchmark.py --T 4096 --no-memory # quick look

Writes bench/results.json and bench/scaling.png; see swa_tvm/bench.py for what is measured.
"""

import sys

from swa_tvm.bench import main

if __name__ == "__main__":
    sys.exit(main())
