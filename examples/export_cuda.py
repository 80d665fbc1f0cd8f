"""Export a CUDA library on a machine without a GPU.

    python examples/export_cuda.py [--arch sm_90] [--out DIR] [--dtype bfloat16]

Compiling CUDA kernels needs nvcc, not a GPU: TVM generates the CUDA source, nvcc
compiles it for ``--arch`` and the library embeds the machine code, with a manifest that
names the architecture and, for each kernel, the fused kernel and tiles it was built
with and what ptxas reported (registers, spills, shared memory). Copy the library and its
manifest to the GPU machine and load it there with ``swa_tvm.load_library``: only torch
and the TVM runtime are needed. On a machine without a GPU the library loads too, and
calling a kernel raises an error that says why it cannot run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", help="CUDA architecture: sm_80, sm_86, sm_89, sm_90 or sm_90a")
    p.add_argument("--out", help="folder for the library (default: a temporary folder)")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        print("nvcc was not found: install the CUDA toolkit (the compiler only; no GPU is needed)")
        return 1

    import torch

    import swa_tvm
    from swa_tvm.compiler.build import UntunedKernelWarning
    from swa_tvm.runtime import library
    from swa_tvm.runtime.library import NoDeviceError

    out = args.out or tempfile.mkdtemp(prefix="swa_cuda_")
    os.makedirs(out, exist_ok=True)
    lib = os.path.join(out, f"swa_attn_{args.arch}.so")
    # Mistral-style causal window with its gradients, for training on the GPU.
    spec = swa_tvm.AttentionSpec(head_dim=args.head_dim, window=(4095, 0), dtype=args.dtype, backward=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntunedKernelWarning)  # no GPU here to tune on
        manifest = swa_tvm.export_library([spec], lib, target=f"cuda -arch={args.arch}")
    print(f"exported {lib} for {manifest['cuda_arch']} ({os.path.getsize(lib) // 1024} KiB)")
    for k in manifest["kernels"]:
        regs = ", ".join(f"{r['registers']} registers" for r in k.get("ptxas", {}).values())
        print(f"  {k['name']}: {k['schedule']}" + (f" ({regs})" if regs else ""))

    swa_tvm.load_library(lib)
    if torch.cuda.is_available():
        q, k, v = (torch.randn(1, 8, 4096, args.head_dim, device="cuda", dtype=getattr(torch, args.dtype))
                   for _ in range(3))
        out_t = swa_tvm.sliding_window_attention(q, k, v, window_size=(4095, 0))
        print(f"ran on {torch.cuda.get_device_name()}: output {tuple(out_t.shape)}")
        return 0
    kernels = library.REGISTRY.kernels("cuda")
    print(f"loaded here: {len(kernels)} CUDA kernels registered")
    try:
        kernels[0].func()
    except NoDeviceError as e:
        print(f"calling one without a GPU: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
