"""Launch one fused forward variant of the GPU bundle a few times, for a profiler
(``ncu``) to watch: the GPU check's timing shape (bf16 B=1 H=32 H_kv=8 D=128 T=32768,
causal W=4096), the runtime alone (no TVM, as on the GPU machine):

    . tools/gpu_env.sh
    ncu --clock-control none --set full -k regex:tc_w4_c64_kernel -c 1 -o prof \\
        python3 -m tools.gpu_profile --function tc_w4_c64
"""

from __future__ import annotations

import argparse
import os

import torch

from swa_tvm.spec import KernelSpec
from tools.gpu_check import load_variants


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.gpu_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default=os.path.join("build", "gpu", "lib"))
    p.add_argument("--function", action="append", required=True,
                   help="variant suffix (tc_w4_c64, tc_w4_c32_async_m2, cores, ...); repeatable")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--T", type=int, default=32768)
    args = p.parse_args(argv)
    import tvm_ffi

    meta, module = load_variants(args.libs)
    spec = KernelSpec.from_dict(meta["spec"])
    B, H, Hkv, T, D = 1, 32, 8, args.T, spec.head_dim
    dev = torch.device("cuda")
    dtype = getattr(torch, spec.dtype)
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    k, v = (torch.randn(B, Hkv, T, D, device=dev, dtype=dtype) for _ in range(2))
    dil = torch.ones(H, dtype=torch.int32, device=dev)
    sink = torch.full((H,), float("-inf"), device=dev)
    out, lse = torch.empty_like(q), torch.empty(B, H, T, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    for suffix in args.function:
        fn = module[f"{spec.name}__{suffix}"]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", 0), stream):
            fn(q, k, v, dil, sink, D**-0.5, out, lse)  # warm-up (module load)
            start.record()
            for _ in range(args.calls):
                fn(q, k, v, dil, sink, D**-0.5, out, lse)
            end.record()
        torch.cuda.synchronize()
        print(f"{suffix}: {start.elapsed_time(end) / args.calls:.3f} ms per call over {args.calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
