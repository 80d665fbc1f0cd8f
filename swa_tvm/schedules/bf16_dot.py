"""Tensor intrinsics for AVX-512 BF16's dot product (``vdpbf16ps``): the matrix-engine
form's products on CPUs that have bfloat16 dot products but no AMX (AMD Zen 4, Intel
Cooper Lake).

Each intrinsic has the description of ``schedules.amx``'s of the same shape
(``amx.description``: the math as the computes write it), so the same stages tensorize
into either. Its implementation
is a register tile: ROWS rows of A by COLS 16-lane columns of B, ROWS x COLS float32x16
sums held in registers over the whole reduction. Each step takes one pair word of A
(the bfloat16 of two consecutive reduction indices) broadcast to 16 lanes and one row
of 16 pair words of B, and adds both products into each lane (``vdpbf16ps``).

TVM's bfloat16 legalization rewrites any bfloat16 vector operand of an LLVM intrinsic
call to float32 (``python -m tools.experiments.dpbf16_probe``), so the step is a
function in LLVM IR, imported into the kernel's module (``pragma_import_llvm``), that
takes the words as integers and bitcasts them itself; LLVM inlines it.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.s_tir import TensorIntrin

from swa_tvm.compute.forward import MATRIX_K, MATRIX_TILE
from swa_tvm.schedules import amx

LANES = 16
# The register tile: 4 rows x 4 columns of 16 lanes = 16 sums, 4 operand rows and a
# broadcast, within the 32 zmm registers; 16 independent sums hide the dot product's
# latency (6 cycles on Zen 4) at one issue per cycle.
ROWS, COLS = 4, 4

STEP = "swa_bf16_dot_step"
# acc + (the pair word a, broadcast) . b, lane by lane.
STEP_IR = f"""
define linkonce_odr <16 x float> @{STEP}(<16 x float> %acc, <2 x i16> %a, <16 x i32> %b) #0 {{
  %w = bitcast <2 x i16> %a to i32
  %v = insertelement <16 x i32> poison, i32 %w, i64 0
  %s = shufflevector <16 x i32> %v, <16 x i32> poison, <16 x i32> zeroinitializer
  %x = bitcast <16 x i32> %s to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
attributes #0 = {{ alwaysinline }}
"""


def intrin_name(rows: int, cols: int, depth: int) -> str:
    return f"swa_bf16_dot_{rows}x{cols}x{depth}"


def _implementation(rows: int, cols: int, depth: int):
    pairs = depth // 2
    tile_rows = max(r for r in (1, 2, 4) if rows % r == 0 and r <= ROWS)
    tile_cols = max(c for c in (1, 2, 4) if (cols // LANES) % c == 0 and c <= COLS)
    sums = tile_rows * tile_cols
    half = max(sums // 2, 1)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        sa = T.int64()
        sb = T.int64()
        sc = T.int64()
        A = T.match_buffer(a, (rows, depth), "uint16", offset_factor=1, strides=[sa, 1])
        B = T.match_buffer(b, (pairs, cols), "uint32", offset_factor=1, strides=[sb, 1])
        C = T.match_buffer(c, (rows, cols), "float32", offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(A[0:rows, 0:depth], B[0:pairs, 0:cols])
            T.writes(C[0:rows, 0:cols])
            # Two halves of the sums, each under TVM's stack-allocation bound (1 KiB), so
            # they live on the stack, where LLVM keeps them in registers; a larger buffer
            # would come from the workspace allocator, opaque to LLVM.
            lo = T.alloc_buffer((half * LANES,), "float32", scope="local")
            hi = T.alloc_buffer((half * LANES,), "float32", scope="local")
            for _ in T.serial(1, annotations={"pragma_import_llvm": STEP_IR}):
                for m in range(rows // tile_rows):
                    for g in range(cols // LANES // tile_cols):
                        for t in T.unroll(half):
                            lo[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
                            hi[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
                        for k2 in range(pairs):
                            for r in T.unroll(tile_rows):
                                for cc in T.unroll(tile_cols):
                                    if (r * tile_cols + cc) < half:
                                        lo[T.ramp((r * tile_cols + cc) * LANES, 1, LANES)] = T.call_pure_extern(
                                            "float32x16", STEP, lo[T.ramp((r * tile_cols + cc) * LANES, 1, LANES)],
                                            A[m * tile_rows + r, T.ramp(k2 * 2, 1, 2)],
                                            B[k2, T.ramp((g * tile_cols + cc) * LANES, 1, LANES)])
                                    else:
                                        hi[T.ramp((r * tile_cols + cc - half) * LANES, 1, LANES)] = T.call_pure_extern(
                                            "float32x16", STEP, hi[T.ramp((r * tile_cols + cc - half) * LANES, 1, LANES)],
                                            A[m * tile_rows + r, T.ramp(k2 * 2, 1, 2)],
                                            B[k2, T.ramp((g * tile_cols + cc) * LANES, 1, LANES)])
                        for r in T.unroll(tile_rows):
                            for cc in T.unroll(tile_cols):
                                if (r * tile_cols + cc) < half:
                                    C[m * tile_rows + r, T.ramp((g * tile_cols + cc) * LANES, 1, LANES)] = lo[
                                        T.ramp((r * tile_cols + cc) * LANES, 1, LANES)]
                                else:
                                    C[m * tile_rows + r, T.ramp((g * tile_cols + cc) * LANES, 1, LANES)] = hi[
                                        T.ramp((r * tile_cols + cc - half) * LANES, 1, LANES)]

    return impl


def register(rows: int, cols: int, depth: int) -> str:
    """The name of the dot-product intrinsic of a ``rows`` x ``cols`` result (multiples
    of 16) over reduction depth ``depth`` (a multiple of MATRIX_K), registered with TVM
    on first use."""
    if rows % MATRIX_TILE or cols % MATRIX_TILE or depth % MATRIX_K:
        raise ValueError(f"bfloat16 dot product {rows}x{cols}x{depth}: rows and cols must be multiples of "
                         f"{MATRIX_TILE}, depth of {MATRIX_K}")
    name = intrin_name(rows, cols, depth)
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, amx.description(rows, cols, depth), _implementation(rows, cols, depth))
    return name
