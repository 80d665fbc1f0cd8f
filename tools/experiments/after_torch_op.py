"""How much slower a swa_tvm CPU call runs right after a torch op than right after
another swa_tvm call: torch's OpenMP threads keep spinning for a while after a parallel
op, and TVM's own thread pool competes with them for the cores. Medians of --runs
pairs, per dtype, causal W=512, B=1 H=8 D=64.

    python -m tools.experiments.after_torch_op
    OMP_WAIT_POLICY=PASSIVE python -m tools.experiments.after_torch_op   # torch's threads sleep at once

OMP_WAIT_POLICY is read when torch loads its OpenMP runtime, so it has to be set before
Python starts."""

import argparse
import statistics
import time

import torch

import swa_tvm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    a = torch.randn(2048, 2048)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 8, args.T, 64, dtype=dtype) for _ in range(3))

        def call():
            t0 = time.perf_counter()
            swa_tvm.sliding_window_attention(q, k, v, window_size=(511, 0))
            return time.perf_counter() - t0

        call()  # compile or load the kernel
        for _ in range(args.rounds):
            after_ours, after_torch = [], []
            for _ in range(args.runs):
                after_ours.append(call())  # follows the previous iteration's swa_tvm call
                torch.mm(a, a)
                after_torch.append(call())
            mine, theirs = statistics.median(after_ours) * 1e3, statistics.median(after_torch) * 1e3
            print(f"{str(dtype):15s} after swa_tvm {mine:7.2f} ms   after torch.mm {theirs:7.2f} ms   ratio {theirs / mine:.3f}")


if __name__ == "__main__":
    main()
