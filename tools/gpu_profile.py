"""Launch a forward for a profiler (``ncu``) to watch at the bar shape (bf16 B=1 H=32
H_kv=8 D=128 T=32768, causal W=4096), the runtime alone (no TVM, as on the GPU machine):
a fused forward variant of the GPU bundle, or FlexAttention's compiled forward; and
name the variants worth profiling (``--pick``)::

    . tools/gpu_env.sh
    ncu_reduced default regex:tc_w4_c64_kernel $PY -m tools.gpu_profile --function tc_w4_c64
    ncu_reduced flex regex:triton_tem $PY -m tools.gpu_profile --flex
    $PY -m tools.gpu_profile --pick default            # the default forward's suffix
    $PY -m tools.gpu_profile --pick best --results $OUT/gpu_results.json
"""

from __future__ import annotations

import argparse
import json
import os

# The wgmma forward profiled when the results name none (no row ran or agreed).
FALLBACK_BEST = "tc_w8_c64_async_wgmma_s2"


def _suffix(function: str) -> str:
    return function.split("__", 1)[1]


def pick_default(meta: dict) -> str | None:
    """The suffix of variants.json's default forward (its ``default`` field)."""
    found = [e for e in meta["variants"] if e.get("kind", "local") == "local" and e.get("default")]
    return _suffix(found[0]["function"]) if found else None


def pick_best(results: dict, tolerance: float | None = None) -> str | None:
    """The suffix of the fastest wgmma forward of ``results`` (gpu_results.json) that
    agreed with the default kernels (within the forward's tolerance for the variants'
    dtype); else the fastest agreeing forward; None without one."""
    if tolerance is None:
        import torch

        from swa_tvm.compiler.tiles import TOLERANCE

        dtype = ((results.get("variants_meta") or {}).get("spec") or {}).get("dtype", "bfloat16")
        tolerance = TOLERANCE[getattr(torch, dtype)][0]
    rows = [r for r in results.get("variants") or [] if isinstance(r, dict) and r.get("kind", "local") == "local"
            and "ms" in r and r.get("rel_err_vs_default", float("inf")) < tolerance]
    pool = [r for r in rows if r.get("wgmma")] or rows
    return _suffix(min(pool, key=lambda r: r["ms"])["function"]) if pool else None


def launch_flex(calls: int, T: int, W: int = 4096) -> None:
    """FlexAttention's compiled forward (its own tiles for this GPU) at the bar shape,
    ``calls`` times after the compile (ncu -k regex:triton_tem -c 1 takes the first)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, Hkv, D = 1, 32, 8, 128
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bm = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W), None, None, T, T, device="cuda")
    f = torch.compile(flex_attention, dynamic=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    f(q, k, v, block_mask=bm, enable_gqa=True)  # the compile
    start.record()
    for _ in range(calls):
        f(q, k, v, block_mask=bm, enable_gqa=True)
    end.record()
    torch.cuda.synchronize()
    print(f"flex_attention: {start.elapsed_time(end) / calls:.3f} ms per call over {calls} calls", flush=True)


def launch_variants(libs: str, functions: list[str], calls: int, T: int) -> None:
    import torch
    import tvm_ffi

    from swa_tvm.spec import KernelSpec
    from tools.gpu_check import load_variants

    meta, module = load_variants(libs)
    spec = KernelSpec.from_dict(meta["spec"])
    B, H, Hkv, D = 1, 32, 8, spec.head_dim
    dev = torch.device("cuda")
    dtype = getattr(torch, spec.dtype)
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    k, v = (torch.randn(B, Hkv, T, D, device=dev, dtype=dtype) for _ in range(2))
    dil = torch.ones(H, dtype=torch.int32, device=dev)
    sink = torch.full((H,), float("-inf"), device=dev)
    out, lse = torch.empty_like(q), torch.empty(B, H, T, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    for suffix in functions:
        fn = module[f"{spec.name}__{suffix}"]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", 0), stream):
            fn(q, k, v, dil, sink, D**-0.5, out, lse)  # warm-up (module load)
            start.record()
            for _ in range(calls):
                fn(q, k, v, dil, sink, D**-0.5, out, lse)
            end.record()
        torch.cuda.synchronize()
        print(f"{suffix}: {start.elapsed_time(end) / calls:.3f} ms per call over {calls} calls", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.gpu_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default=os.path.join("build", "gpu", "lib"))
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--function", action="append",
                      help="variant suffix (tc_w4_c64, tc_w4_c32_async_m2, cores, ...); repeatable")
    what.add_argument("--flex", action="store_true", help="FlexAttention's compiled forward instead")
    what.add_argument("--pick", choices=("default", "best"),
                      help="print a variant's suffix and launch nothing: variants.json's default forward, or "
                           "the fastest agreeing wgmma forward of --results")
    p.add_argument("--results", help="gpu_results.json, for --pick best")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--T", type=int, default=32768)
    args = p.parse_args(argv)
    if args.pick == "default":
        with open(os.path.join(args.libs, "variants", "variants.json")) as f:
            print(pick_default(json.load(f)) or "tc_w4_c64")
        return 0
    if args.pick == "best":
        results = {}
        if args.results and os.path.exists(args.results):
            with open(args.results) as f:
                results = json.load(f)
        print(pick_best(results) or FALLBACK_BEST)
        return 0
    if args.flex:
        launch_flex(args.calls, args.T)
    else:
        launch_variants(args.libs, args.function, args.calls, args.T)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
