"""Two libraries of the same kernels (built at two revisions, or with two schedules)
timed against each other: each round loads one, times a call, loads the other, times a
call (order alternating), on the same inputs in one process; medians of the rounds.

    python -m tools.experiments.libraries_ab BEFORE.so AFTER.so --dtype bfloat16 --training

To build the libraries of a change (here the rocketlake code, as a CPU without AMX runs):

    git worktree add /tmp/before REV^
    PYTHONPATH=/tmp/before python -m swa_tvm.cli export --no-tuning -o /tmp/before.so \\
        --target '{"kind": "llvm", "mcpu": "rocketlake", "num-cores": 2}' \\
        --spec head_dim=64,window=511:0,backward,dtype=bfloat16
    python -m swa_tvm.cli export ... -o /tmp/after.so   # same flags, this checkout

Prints each library's median ms and AFTER / BEFORE."""

import argparse
import statistics
import time

import torch

import swa_tvm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("libraries", nargs=2, metavar="LIB", help="BEFORE.so AFTER.so, holding the same kernels")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--window", type=int, nargs=2, default=[511, 0])
    p.add_argument("--dilation", type=int, default=1)
    p.add_argument("--globals", type=int, default=0, metavar="G",
                   help="G global tokens at random positions (the libraries need 'globals')")
    p.add_argument("--training", action="store_true", help="time forward + backward (the libraries need 'backward')")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, args.H, args.T, args.D).to(dtype).requires_grad_(args.training) for _ in range(3))
    dout = torch.randn(1, args.H, args.T, args.D).to(dtype)
    kw = dict(window_size=tuple(args.window), dilation=args.dilation)
    if args.globals:
        positions = torch.randperm(args.T, generator=torch.Generator().manual_seed(1))[: args.globals]
        kw["global_idx"] = torch.sort(positions).values.to(torch.int32).view(1, -1)

    def call():
        if args.training:
            for x in (q, k, v):
                x.grad = None  # gradients replace, not accumulate, as in benchmarks.training
            swa_tvm.sliding_window_attention(q, k, v, **kw).backward(dout)
        else:
            with torch.no_grad():
                swa_tvm.sliding_window_attention(q, k, v, **kw)

    # The two must hold the same kernels: one missing from a library would be served by
    # the other's, registered under the same name.
    held = [sorted(s.name for s in swa_tvm.load_library(lib)) for lib in args.libraries]
    if held[0] != held[1]:
        p.error(f"the libraries hold different kernels: {held[0]} and {held[1]}")
    times = {lib: [] for lib in args.libraries}
    for r in range(args.rounds):
        for lib in args.libraries[:: 1 if r % 2 == 0 else -1]:
            swa_tvm.load_library(lib)  # (re)registers its kernels under the shared names
            call()  # untimed: the first call after a load, and the other library's threads
            t = time.perf_counter()
            call()
            times[lib].append(time.perf_counter() - t)
    before, after = (statistics.median(times[lib]) for lib in args.libraries)
    for lib in args.libraries:
        print(f"{lib}: {1e3 * statistics.median(times[lib]):.1f} ms (median of {args.rounds})")
    print(f"after / before: {after / before:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
