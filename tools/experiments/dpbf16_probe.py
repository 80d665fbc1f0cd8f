"""How TVM can emit AVX-512 BF16's dot product (``vdpbf16ps``), one 16-lane step whose
bfloat16 operands are uint32 pair words (as the matrix-engine form holds them), built
for sapphirerapids, two ways:

- ``call_llvm_pure_intrin`` with the words reinterpreted as bfloat16x32: TVM's
  bfloat16 legalization rewrites the operands to float32x32, and LLVM's verifier
  refuses the call;
- a function in LLVM IR imported with the ``pragma_import_llvm`` annotation, which
  bitcasts the words itself, called with ``call_pure_extern``: it builds, and where
  this CPU has avx512_bf16 the step runs and is checked against float64.

    python -m tools.experiments.dpbf16_probe

Prints each way's outcome."""

import numpy as np
import torch
import tvm
from tvm.script import tirx as T

from swa_tvm.runtime.library import host_cpu_flags

TARGET = {"kind": "llvm", "mcpu": "sapphirerapids"}


@T.prim_func(s_tir=True)
def reinterpreted(a: T.handle, b: T.handle, c: T.handle):
    A = T.match_buffer(a, (16,), "uint32")  # 16 pair words: 32 bfloat16
    B = T.match_buffer(b, (16,), "uint32")
    C = T.match_buffer(c, (16,), "float32")
    with T.sblock("root"):
        C[T.ramp(0, 1, 16)] = T.call_llvm_pure_intrin(
            "float32x16", "llvm.x86.avx512bf16.dpbf16ps.512", C[T.ramp(0, 1, 16)],
            T.reinterpret("bfloat16x32", A[T.ramp(0, 1, 16)]), T.reinterpret("bfloat16x32", B[T.ramp(0, 1, 16)]))


IMPORTED = """
define linkonce_odr <16 x float> @probe_dpbf16(<16 x float> %c, <16 x i32> %a, <16 x i32> %b) #0 {
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %c, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
attributes #0 = { alwaysinline }
"""


@T.prim_func(s_tir=True)
def imported(a: T.handle, b: T.handle, c: T.handle):
    T.func_attr({"global_symbol": "imported"})
    A = T.match_buffer(a, (16,), "uint32")
    B = T.match_buffer(b, (16,), "uint32")
    C = T.match_buffer(c, (16,), "float32")
    for _ in T.serial(1, annotations={"pragma_import_llvm": IMPORTED}):
        C[T.ramp(0, 1, 16)] = T.call_pure_extern("float32x16", "probe_dpbf16", C[T.ramp(0, 1, 16)],
                                                 A[T.ramp(0, 1, 16)], B[T.ramp(0, 1, 16)])


def _build(func, name: str):
    try:
        lib = tvm.tirx.build(func, target=tvm.target.Target(TARGET))
    except Exception as e:  # noqa: BLE001 - the outcome is what this probe reports
        lines = [line for line in str(e).splitlines() if line.strip()]
        print(f"{name}: build failed:", *lines[:4], sep="\n  ")
        return None
    found = [line.strip() for line in lib.inspect_source("asm").splitlines() if "vdpbf16ps" in line]
    print(f"{name}: built;", f"emits {found[0]}" if found else "no vdpbf16ps in the code")
    return lib


def main() -> int:
    _build(reinterpreted, "call_llvm_pure_intrin")
    lib = _build(imported, "pragma_import_llvm")
    if lib is None:
        return 1
    if "avx512_bf16" not in host_cpu_flags():
        print("pragma_import_llvm: not run (this CPU lacks avx512_bf16)")
        return 0
    a, b = torch.randn(32).bfloat16(), torch.randn(32).bfloat16()
    words = [x.view(torch.int16).numpy().view(np.uint32).copy() for x in (a, b)]
    c = tvm.runtime.tensor(np.zeros(16, "float32"))
    lib["imported"](tvm.runtime.tensor(words[0]), tvm.runtime.tensor(words[1]), c)
    want = (a.double() * b.double()).view(16, 2).sum(1).numpy()
    print(f"pragma_import_llvm: ran; max error against float64 {np.abs(c.numpy() - want).max():.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
