"""Rows per work item of the matrix-engine (AMX) form of the bfloat16 local forward: the
same kernel built at several item sizes and timed round-robin on the same inputs in one
process (medians), beside the float32-product form of the same bfloat16 spec. What
``compute.forward.AMX_MIN_BLOCK`` was chosen from.

    python -m tools.experiments.amx_blocks
    python -m tools.experiments.amx_blocks --blocks 32 64 128 --T 16384 --window 511 0

Needs a CPU with AMX (amx_tile, amx_bf16); kernels run on all usable cores."""

import argparse
import os
import statistics
import time

import torch
import tvm

from swa_tvm.compiler import build, targets
from swa_tvm.compute import forward
from swa_tvm.runtime import library
from swa_tvm.spec import KernelSpec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--window", type=int, nargs=2, default=[511, 0])
    p.add_argument("--runs", type=int, default=15)
    args = p.parse_args(argv)
    if not {"amx_tile", "amx_bf16"} <= library.host_cpu_flags():
        raise SystemExit("this CPU has no AMX bfloat16 (amx_tile, amx_bf16)")
    os.environ.setdefault("TVM_NUM_THREADS", str(library.cpu_threads()))
    library.request_amx("amx_blocks")
    target = targets.host_target()
    tvm_target = tvm.target.Target(target)
    forward.AMX_MIN_BLOCK = 16  # every block asked for is built as asked
    left, right = args.window
    kernels = {}
    for block in args.blocks:
        spec = KernelSpec("local", 64, "bfloat16", left, right, block_q=block)
        func = build.schedule_spec(spec, tvm_target)
        kernels[f"AMX, {block} rows"] = tvm.compile(tvm.IRModule({"main": func}), target=tvm_target)["main"]
    # The float32-product form of the same spec: an llvm target without AMX and AVX-512 BF16.
    plain = KernelSpec("local", 64, "bfloat16", left, right)
    no_amx = tvm.target.Target(targets.without_engines(target))
    assert not targets.uses_amx(plain, no_amx)
    kernels["float32 products, 32 rows"] = tvm.compile(
        tvm.IRModule({"main": build.schedule_spec(plain, no_amx)}), target=no_amx
    )["main"]

    B, H, T, D = 1, args.H, args.T, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D).bfloat16() for _ in range(3))
    dil, sink = torch.ones(H, dtype=torch.int32), torch.full((H,), float("-inf"))
    outs = {name: (torch.empty(B, H, T, D, dtype=torch.bfloat16), torch.empty(B, H, T)) for name in kernels}

    def call(name):
        kernels[name](q, k, v, dil, sink, D**-0.5, *outs[name])

    times = {name: [] for name in kernels}
    for name in kernels:
        call(name)
    for _ in range(args.runs):
        for name in kernels:
            t0 = time.perf_counter()
            call(name)
            times[name].append(time.perf_counter() - t0)
    ref = outs["float32 products, 32 rows"][0].float()
    pairs = sum(min(i, left) + 1 + min(T - 1 - i, right) for i in range(T))
    print(f"bfloat16 local forward, B={B} H={H} T={T} D={D}, window {left}:{right}, "
          f"{os.environ['TVM_NUM_THREADS']} threads, {tvm.target.codegen.llvm_get_system_cpu()}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        diff = (outs[name][0].float() - ref).abs().max().item()
        print(f"  {name:28s} {ms:8.1f} ms {4 * B * H * pairs * D / ms / 1e6:7.1f} GFLOP/s  "
              f"max |out - float32 products'| {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
