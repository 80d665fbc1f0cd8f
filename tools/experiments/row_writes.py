"""What writing a few rows into a [B, H, T, D] tensor costs on the CPU, the way the eager
layer puts the global rows' results into the output: torch's ``scatter_`` with an
expanded index, against ``index_put_`` on a [B, T, H, D] view (``eager._put_rows``).
Medians of ``--runs`` calls of each, per dtype.

    python -m tools.experiments.row_writes
    python -m tools.experiments.row_writes --T 16384 --rows 16 --dtypes float32 bfloat16
"""

import argparse
import statistics
import time

import torch

from swa_tvm.eager import _put_rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(a.T, generator=g)[:a.rows] for _ in range(a.B)])
    for name in a.dtypes:
        dt = getattr(torch, name)
        out = torch.randn(a.B, a.H, a.T, a.D, generator=g).to(dt)
        rows = torch.randn(a.B, a.H, a.rows, a.D, generator=g).to(dt)
        ways = {
            "scatter_": lambda: out.scatter_(2, idx[:, None, :, None].expand(a.B, a.H, a.rows, a.D), rows),
            "index_put_": lambda: _put_rows(out, idx, rows),
        }
        times = {w: [] for w in ways}
        for _ in range(a.runs):  # round-robin
            for w, f in ways.items():
                t0 = time.perf_counter()
                f()
                times[w].append((time.perf_counter() - t0) * 1e3)
        print(f"{name} [{a.B}, {a.H}, {a.T}, {a.D}], {a.rows} rows: "
              + ", ".join(f"{w} {statistics.median(ts):.3f} ms" for w, ts in times.items()))


if __name__ == "__main__":
    main()
