"""The bfloat16 local forward on each engine this CPU has, beside float32: the same
spec built in its float32-product form (a target without AMX and AVX-512 BF16), on
AVX-512 BF16 dot products (a target without AMX), on AMX tiles, and the float32 kernel
on float32 copies of the inputs; timed round-robin on the same inputs in one process,
medians of the rounds. Each bfloat16 output is compared with the float32 kernel's.

    python -m tools.experiments.matrix_engines
    python -m tools.experiments.matrix_engines --window 255 0 --dilation 2 --T 16384

Kernels run on all usable cores ($TVM_NUM_THREADS to change)."""

import argparse
import os
import statistics
import time

import torch
import tvm

from swa_tvm.compiler import build, targets
from swa_tvm.runtime import library
from swa_tvm.spec import KernelSpec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--window", type=int, nargs=2, default=[511, 0])
    p.add_argument("--dilation", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(library.cpu_threads()))
    host = targets.host_target()
    left, right = args.window
    spec = KernelSpec("local", args.D, "bfloat16", left, right, max_dilation=args.dilation)
    forms = {"float32 products": targets.without_engines(host)}
    if targets.has_bf16_dot(host):
        forms["AVX-512 BF16 dot products"] = targets.without_amx(host)
    if targets.has_amx(host):
        library.request_amx("matrix_engines")
        forms["AMX tiles"] = host
    kernels = {}
    for name, target in forms.items():
        tvm_target = tvm.target.Target(target)
        want = {"float32 products": None, "AVX-512 BF16 dot products": "bf16_dot", "AMX tiles": "amx"}[name]
        assert targets.matrix_form(spec, tvm_target) == want, (name, targets.matrix_form(spec, tvm_target))
        kernels[name] = tvm.compile(tvm.IRModule({"main": build.schedule_spec(spec, tvm_target)}), target=tvm_target)["main"]
    f32 = KernelSpec("local", args.D, "float32", left, right, max_dilation=args.dilation)
    kernels["float32"] = tvm.compile(tvm.IRModule({"main": build.schedule_spec(f32, tvm.target.Target(host))}),
                                     target=tvm.target.Target(host))["main"]

    B, H, T, D = args.B, args.H, args.T, args.D
    torch.manual_seed(0)
    bf16 = [torch.randn(B, H, T, D).bfloat16() for _ in range(3)]
    fp32 = [x.float() for x in bf16]
    dil, sink = torch.full((H,), args.dilation, dtype=torch.int32), torch.full((H,), float("-inf"))
    outs = {name: (torch.empty(B, H, T, D, dtype=torch.float32 if name == "float32" else torch.bfloat16),
                   torch.empty(B, H, T)) for name in kernels}

    def call(name):
        kernels[name](*(fp32 if name == "float32" else bf16), dil, sink, D**-0.5, *outs[name])

    times = {name: [] for name in kernels}
    for name in kernels:
        call(name)
    for r in range(args.rounds):
        for name in (kernels if r % 2 == 0 else list(kernels)[::-1]):
            t0 = time.perf_counter()
            call(name)
            times[name].append(time.perf_counter() - t0)
    ref = outs["float32"][0]
    base = statistics.median(times["float32"])
    pairs = sum(len([j for j in range(i - left * args.dilation, i + right * args.dilation + 1, args.dilation)
                     if 0 <= j < T]) for i in range(T))
    print(f"bfloat16 local forward, B={B} H={H} T={T} D={D}, window {left}:{right}, dilation {args.dilation}, "
          f"{os.environ['TVM_NUM_THREADS']} threads, {tvm.target.codegen.llvm_get_system_cpu()}, "
          f"{args.rounds} rounds")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        diff = (outs[name][0].float() - ref).abs().max().item()
        print(f"  {name:28s} {ms:8.1f} ms  {4 * B * H * pairs * D / ms / 1e6:7.1f} GFLOP/s  "
              f"{ms / base / 1e3:5.2f}x float32's time  max |out - float32's| {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
