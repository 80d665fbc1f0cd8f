"""Tensor intrinsics for Intel's matrix engine (AMX): bfloat16 products with float32 sums.

One intrinsic per product shape: a rows x cols float32 result C = A @ B (multiples of
16) over reduction depth K (a multiple of 32), the whole reduction with its zero init,
so the result never round-trips through memory between steps. A is rows x K bfloat16,
held as uint16 bits (any row stride; ``compute.forward.bf16_value``); B is K/2 rows of
cols uint32 pair words (``compute.forward.pair_word``: the bfloat16 of two consecutive
reduction indices per word, the engine's "VNNI" layout). The description is the math
as the computes write it (``word_half`` for B's values), so ``Schedule.tensorize``
matches it as it matches TVM's own x86 intrinsics. The implementation drives the tiles
through LLVM's AMX intrinsics, tiles named by number, so no bfloat16 vector type
reaches TVM's legalization.

Tiles: 0-3 = a group of result tiles of one 16-row strip, 4 = A, 5 and 6 = B, each 16
rows of 64 bytes. Each call (one per work item and product) loads the configuration
(palette 1) first: every tile instruction needs it, and a call may run on any worker
thread. Tile state is not released between calls; the worker threads keep it for the
next. The schedule drops the zero init the description carries
(``schedules.cpu.drop_init``): the implementation starts from zeroed tiles. The
process must hold the OS's permission for tile state (``runtime.library.request_amx``)
before a kernel runs.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.s_tir import TensorIntrin

from swa_tvm.compute.forward import MATRIX_K, MATRIX_TILE, bf16_value, word_half


def intrin_name(rows: int, cols: int, depth: int) -> str:
    return f"swa_amx_bf16_{rows}x{cols}x{depth}"


def description(rows: int, cols: int, depth: int):
    """The description of a ``rows`` x ``cols`` product over ``depth``: the math as the
    computes write it, with its zero init. The dot-product engine (schedules.bf16_dot)
    registers its intrinsics with it too, so the same stages tensorize into either."""
    pairs = depth // 2

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        sa = T.int64()
        sb = T.int64()
        sc = T.int64()
        A = T.match_buffer(a, (rows, depth), "uint16", offset_factor=1, strides=[sa, 1])
        B = T.match_buffer(b, (pairs, cols), "uint32", offset_factor=1, strides=[sb, 1])
        C = T.match_buffer(c, (rows, cols), "float32", offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(A[0:rows, 0:depth], B[0:pairs, 0:cols])
            T.writes(C[0:rows, 0:cols])
            for i, j, k2, e in T.grid(rows, cols, pairs, 2):
                with T.sblock("update"):
                    vi, vj, vk, ve = T.axis.remap("SSRR", [i, j, k2, e])
                    T.reads(C[vi, vj], A[vi, vk * 2 + ve], B[vk, vj])
                    T.writes(C[vi, vj])
                    with T.init():
                        C[vi, vj] = T.float32(0)
                    C[vi, vj] = C[vi, vj] + bf16_value(A[vi, vk * 2 + ve]) * word_half(B[vk, vj], ve)

    return desc


def _implementation(rows: int, cols: int, depth: int):
    n = MATRIX_TILE
    pairs = depth // 2
    # Result tiles 0..group-1 of a 16-row strip are accumulated together, so each tile of
    # A (tile 4) is loaded once per group; B tiles alternate between 5 and 6 so a load
    # overlaps the previous product.
    group = max(g for g in (1, 2, 3, 4) if (cols // n) % g == 0)

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
            cfg = T.alloc_buffer((64,), "uint8")
            for i in range(64):
                cfg[i] = T.uint8(0)
            cfg[0] = T.uint8(1)  # palette 1
            for t in range(7):
                cfg[16 + 2 * t] = T.uint8(64)  # bytes per row
                cfg[48 + t] = T.uint8(16)  # rows
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            for m in range(rows // n):
                for g in range(cols // n // group):
                    for t in T.unroll(group):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(t)))
                    for kk in range(depth // MATRIX_K):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(4),
                                                      T.address_of(A[m * n, kk * MATRIX_K]),
                                                      T.Cast("int64", sa) * T.int64(2)))
                        for t in T.unroll(group):
                            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(5 + t % 2),
                                                          T.address_of(B[kk * (MATRIX_K // 2), (g * group + t) * n]),
                                                          T.Cast("int64", sb) * T.int64(4)))
                            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbf16ps", T.int8(t), T.int8(4),
                                                          T.int8(5 + t % 2)))
                    for t in T.unroll(group):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(t),
                                                      T.address_of(C[m * n, (g * group + t) * n]),
                                                      T.Cast("int64", sc) * T.int64(4)))

    return impl


def register(rows: int, cols: int, depth: int) -> str:
    """The name of the product intrinsic of a ``rows`` x ``cols`` result (multiples of
    16) over reduction depth ``depth`` (a multiple of MATRIX_K), registered with TVM on
    first use."""
    if rows % MATRIX_TILE or cols % MATRIX_TILE or depth % MATRIX_K:
        raise ValueError(f"matrix-engine product {rows}x{cols}x{depth}: rows and cols must be multiples of "
                         f"{MATRIX_TILE}, depth of {MATRIX_K}")
    name = intrin_name(rows, cols, depth)
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, description(rows, cols, depth), _implementation(rows, cols, depth))
    return name
