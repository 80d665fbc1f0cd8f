"""Does a spec's tuning-record selection beat the default schedule in use?

Exports the spec twice (with the tuning logs' selected records, and with `logs=None`:
default schedules only), then times forward + backward of each library in its own
process (a process loads one library), alternating, median of 5 calls after a warm-up.

    python -m tools.experiments.records_vs_default --spec head_dim=64,window=255:0,dilation=2,backward \\
        --window 255 0 --dilation 2 --T 16384 --rounds 2

The README's "Training" section quotes this comparison.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings

import torch

import swa_tvm
from benchmarks import forward as bench


def _time(lib: str, window: tuple[int, int], dilation: int, T: int, runs: int = 5) -> float:
    swa_tvm.load_library(lib)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, T, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, T, 64)

    def step():
        out = swa_tvm.sliding_window_attention(q, k, v, window_size=window, dilation=dilation)
        torch.autograd.backward(out, grad)

    return bench.median_ms(step, runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", help="a head_dim=64 spec with ',backward' (required unless --time-lib)")
    p.add_argument("--window", type=int, nargs=2, required=True, metavar=("LEFT", "RIGHT"))
    p.add_argument("--dilation", type=int, default=1)
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--time-lib", help="only time this library (fwd+bwd median ms), in this process")
    a = p.parse_args(argv)
    if a.time_lib:
        print(f"{_time(a.time_lib, tuple(a.window), a.dilation, a.T):.1f}")
        return 0
    if not a.spec:
        p.error("--spec is required (unless --time-lib)")

    with tempfile.TemporaryDirectory() as tmp:
        libs = {"records": os.path.join(tmp, "records.so"), "default": os.path.join(tmp, "default.so")}
        spec = swa_tvm.AttentionSpec.parse(a.spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            swa_tvm.export_library([spec], libs["records"])
            swa_tvm.export_library([spec], libs["default"], logs=None)
        common = ["--spec", a.spec, "--window", *map(str, a.window), "--dilation", str(a.dilation), "--T", str(a.T)]
        for _ in range(a.rounds):
            for name, lib in libs.items():
                out = subprocess.run([sys.executable, __file__, *common, "--time-lib", lib], capture_output=True, text=True, check=True)
                print(f"{name:8s} fwd+bwd median {out.stdout.strip()} ms (T={a.T})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
