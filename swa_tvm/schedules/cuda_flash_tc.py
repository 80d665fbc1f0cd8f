"""The fused CUDA kernel of ``cuda_flash`` on tensor cores (float16/bfloat16 inputs,
fp32 accumulation), FlashAttention-2 style: each warp owns 16 query rows of the item
(16 * m_tiles), its scores, probabilities and output accumulators live in registers as
``mma.sync.m16n8k16`` fragments, and the probabilities feed the P·V product straight
from the score fragments (the accumulator layout of one 16x8 tile pair is the operand
layout of the next product). Only the query block (once) and the key and value chunks
pass through shared memory (the chunks synchronously, or by cp.async into one K/V tile
pair or a ring of two: TCConfig).

Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"; the same map TVM's own
``tensor_intrin.cuda.ldmatrix_32x8_to_shared_16x16_layout`` encodes), lane t of a warp,
group g = t // 4, t4 = t % 4:
- A (16x16, row-major), 8 values: row g + 8*((l % 4) // 2), column 8*(l // 4) + 2*t4 + l % 2;
- B (16x8, k x n), 4 values: k = 8*(l // 2) + 2*t4 + l % 2, n = g;
- C (16x8, fp32), 4 values: row g + 8*(l // 2), column 2*t4 + l % 2.

``emulate=True`` builds the same kernel with the two warp-collective steps (the mma and
the 4-lane row reductions) written as loops over the warp's lanes, so that, with the
thread loops made serial, the CPU runs it and the tests check everything around those
instructions (fragment addressing, masks, online softmax, the P fragments' reuse)
against the reference. The instructions themselves are checked by the GPU check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

from swa_tvm.compute.forward import extra_visible, row_key_range
from swa_tvm.spec import KernelSpec

from swa_tvm.schedules.cuda_flash import (
    ITEM_SCALARS,
    SHARED_BUDGET,
    SHARED_LIMIT,
    SHARED_LIMIT_SM90,
    largest_fitting,
    shared_scope,
    block_inner_last_key,
    band_positions,
    chunk_inside,
    clamp_row,
    extra_positions_loader,
    global_split_kernel,
    global_row_last_key,
    item_scalars,
    local_kernel,
    split_item_fields,
)
from swa_tvm.schedules.cuda_wgmma import COMMON_SOURCE, a_packer, core_offset, deferred_macros, packed_a, sync_macros, wgmma_macro

# A macro, not a function: its C operands are the callers' register-array elements
# (lvalues), so no address is taken and nvcc keeps the fragments in registers. The 16-bit
# pairs pack by COMMON_SOURCE's swa_pack_*, emitted ahead of it (guarded: once per kernel).
MMA_SOURCE = r"""
#define {name}(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3) \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 " \
               "{{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\n" \
               : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) \
               : "r"(swa_pack_{ptx}(a0, a1)), "r"(swa_pack_{ptx}(a2, a3)), "r"(swa_pack_{ptx}(a4, a5)), \
                 "r"(swa_pack_{ptx}(a6, a7)), "r"(swa_pack_{ptx}(b0, b1)), "r"(swa_pack_{ptx}(b2, b3)))
"""
# The fragment maps (lane of the warp, value index) <-> (row, column) of the PTX ISA's
# m16n8k16 figures, in both directions. Plain arithmetic, so they take ints (the tests
# compare them with TVM's own maps) or index expressions (the kernel uses them).
def a_pos(lane, l):
    """(row, k) of value l of lane's A fragment (16 x 16, row-major)."""
    return lane // 4 + 8 * ((l % 4) // 2), 8 * (l // 4) + 2 * (lane % 4) + l % 2


def a_lane(row, k):
    return 4 * (row % 8) + (k % 8) // 2, 4 * (k // 8) + 2 * (row // 8) + k % 2


def b_pos(lane, l):
    """(k, n) of value l of lane's B fragment (16 x 8, k x n)."""
    return 8 * (l // 2) + 2 * (lane % 4) + l % 2, lane // 4


def b_lane(k, n):
    return 4 * n + (k % 8) // 2, 2 * (k // 8) + k % 2


def c_pos(lane, l):
    """(row, column) of value l of lane's C fragment (16 x 8, fp32)."""
    return lane // 4 + 8 * (l // 2), 2 * (lane % 4) + l % 2


def c_lane(row, col):
    return 4 * (row % 8) + col // 2, 2 * (row // 8) + col % 2


def tree(op, values):
    """op over ``values`` (PrimExprs) as a balanced tree: log2(n) dependent steps
    instead of a chain of n - 1."""
    values = list(values)
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)] + values[len(values) // 2 * 2:]
    return values[0]


PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
C_TYPE = {"float16": "half", "bfloat16": "bfloat16"}  # as in __half_as_ushort, __bfloat16_as_ushort


# Index of a fragment value in a shared tile of rows padded to ``DP`` values, for lane
# tx % 32 of warp tx // 32 and value l:
def b_index_nk(tx, l, nt, ks, DP):
    """B operand (16 x 8) B[k][n] = tile[row 8*nt + n][column 16*ks + k]: a tile of rows
    as the right factor of a product over the head dim (the K of Q K^T)."""
    return (nt * 8 + b_pos(tx % 32, l)[1]) * DP + ks * 16 + b_pos(tx % 32, l)[0]


def b_index_kn(tx, l, ks, nd, DP):
    """B operand B[k][n] = tile[row 16*ks + k][column 8*nd + n]: a tile of rows as the
    right factor of a product over its rows (the V of P V)."""
    return (ks * 16 + b_pos(tx % 32, l)[0]) * DP + nd * 8 + b_pos(tx % 32, l)[1]


def mma_macro(warps: int, dtype: str, emulate: bool):
    """A T.macro ``mma(afrag, a0, bfrag, b0, cfrag, c0)``: C[16x8] += A[16x16] B[16x8] in
    every one of ``warps`` warps, fragments at offsets a0/b0/c0 of each thread's
    registers (arrays [32 * warps, n]); with ``emulate``, the same product lane by lane
    (see the module doc)."""
    nt = 32 * warps
    name = f"swa_mma_{PTX_TYPE[dtype]}"
    source = COMMON_SOURCE + MMA_SOURCE.format(name=name, ptx=PTX_TYPE[dtype])

    def f32(x):
        return T.Cast("float32", x)

    @T.macro
    def mma(afrag, a0, bfrag, b0, cfrag, c0):
        if emulate:
            for w, row, col in T.grid(warps, 16, 8):
                for kk in T.serial(16):
                    cfrag[w * 32 + c_lane(row, col)[0], c0 + c_lane(row, col)[1]] = cfrag[
                        w * 32 + c_lane(row, col)[0], c0 + c_lane(row, col)[1]
                    ] + f32(afrag[w * 32 + a_lane(row, kk)[0], a0 + a_lane(row, kk)[1]]) * f32(
                        bfrag[w * 32 + b_lane(kk, col)[0], b0 + b_lane(kk, col)[1]]
                    )
        else:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                T.evaluate(
                    T.cuda.func_call(
                        name,
                        afrag[tx, a0], afrag[tx, a0 + 1], afrag[tx, a0 + 2], afrag[tx, a0 + 3],
                        afrag[tx, a0 + 4], afrag[tx, a0 + 5], afrag[tx, a0 + 6], afrag[tx, a0 + 7],
                        bfrag[tx, b0], bfrag[tx, b0 + 1], bfrag[tx, b0 + 2], bfrag[tx, b0 + 3],
                        cfrag[tx, c0], cfrag[tx, c0 + 1], cfrag[tx, c0 + 2], cfrag[tx, c0 + 3],
                        source_code=source,
                    )
                )

    return mma


@dataclass(frozen=True)
class TileLayout:
    """A shared tile of ``rows`` rows of ``head_dim`` 16-bit values: where (row, col)
    lives (``index``), and which row and 8-value vector copy slot e fills (``slot``).
    Rows padded by 8 values (``cores`` False: the 8 rows an ldmatrix reads fall in
    different banks), or wgmma's core matrices (``cuda_wgmma.core_offset``; a core's 8
    rows go to 8 consecutive slots, so each 8 threads' 16-byte stores fill 128 contiguous
    bytes, free of bank conflicts)."""

    head_dim: int
    rows: int
    cores: bool = False

    def index(self, row, col):
        return core_offset(row, col, self.rows) if self.cores else row * (self.head_dim + 8) + col

    def slot(self, e):
        nv = self.head_dim // 8
        if self.cores:
            return (e // (8 * nv)) * 8 + e % 8, (e // 8) % nv
        return e // nv, e % nv

    @property
    def size(self) -> int:
        return self.rows * (self.head_dim if self.cores else self.head_dim + 8)


def row_position(pos, n, clamp: bool):
    """A tile row's sequence position: clamped to [0, n), or as it is where the caller
    knows it in range. Unclamped, a chunk's rows are an arithmetic sequence nvcc
    addresses by increments: 85 instructions fewer a chunk in the bf16 D=128 forward."""
    return clamp_row(pos, n) if clamp else pos


def in_sequence(pos, rows: int, n):
    """Whether positions pos(0) .. pos(rows - 1), rising, all lie in [0, n): a tile
    loaded without clamping (``row_position``)."""
    return T.And(pos(0) >= 0, T.Cast("int64", pos(rows - 1)) < n)


@T.macro
def load_band_rows(load, pos, rows, n, fence=None):
    """``load(clamp)`` of rows whose positions are ``pos(i)``, i < ``rows``, rising:
    unclamped where all lie in [0, n) (``in_sequence``), else clamped; then ``fence``
    (wgmma's proxy fence) once after whichever form ran (a fence per form would hide
    either's deletion from cuda_races, which takes both branches)."""
    if in_sequence(pos, rows, n):
        load(False)
    else:
        load(True)
    if fence is not None:
        fence()


def pair_loader(threads: int, head_dim: int, rows: int, cores: bool = False, proxy_fence=None,
                transpose_b: bool = False):
    """A T.macro ``load(A, B, src_a, src_b, b, hh, pos_of, n, clamp=True)``: rows i <
    ``rows`` of two shared tiles (``TileLayout(head_dim, rows, cores)``) from
    src_a/src_b[b, hh, pos_of(i)], the position clamped to [0, n) (a row out of range is
    masked by its scores; ``clamp`` False: the caller knows every position is in range),
    in 16-byte vectors; then ``proxy_fence`` (wgmma's reads), if given. Either tile (with
    its source) may be None: the other alone.
    ``transpose_b``: B's tile holds the transpose (``TileLayout(rows, head_dim, cores)``,
    head_dim rows of ``rows`` values), each vector stored value by value."""
    D, VEC = head_dim, 8
    lay, lay_b = TileLayout(head_dim, rows, cores), TileLayout(rows, head_dim, cores)
    steps = -(-rows * D // VEC // threads)

    @T.macro
    def load(A, Bt, src_a, src_b, b, hh, pos_of, n, clamp=True):
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for x in T.serial(steps):
                e = T.meta_var(x * threads + tx)
                if e < rows * D // VEC:
                    i, cv = T.meta_var(lay.slot(e))
                    j = T.meta_var(row_position(pos_of(i), n, clamp))
                    if A is not None:
                        for u in T.vectorized(VEC):
                            A[lay.index(i, cv * VEC + u)] = src_a[b, hh, j, cv * VEC + u]
                    if Bt is not None:
                        if transpose_b:  # one 16-byte load, then value by value
                            stage = T.alloc_buffer((VEC,), src_b.dtype, scope="local")
                            for u in T.vectorized(VEC):
                                stage[u] = src_b[b, hh, j, cv * VEC + u]
                            for u in T.unroll(VEC):
                                Bt[lay_b.index(cv * VEC + u, i)] = stage[u]
                        else:
                            for u in T.vectorized(VEC):
                                Bt[lay.index(i, cv * VEC + u)] = src_b[b, hh, j, cv * VEC + u]
        if proxy_fence is not None:
            proxy_fence()

    return load


# ldmatrix.x4.trans: four 8x8 16-bit matrices from shared memory, each transposed, in one
# instruction per warp; lane 8m + j gives the address of row j of matrix m, and lane t
# receives from matrix m the two values (row 2*(t % 4) + i, column t // 4), i = 0, 1, in
# its register m (the first in the low half). Unpacked into the operand's 16-bit values.
LDSM_SOURCE = r"""
#define {name}_HALF(r, hi) __ushort_as_{t}((unsigned short)((hi) ? (r) >> 16 : (r) & 0xffff))
#define {name}(ptr, b0, b1, b2, b3, b4, b5, b6, b7) {{ \
  unsigned r0_, r1_, r2_, r3_; \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];\n" \
               : "=r"(r0_), "=r"(r1_), "=r"(r2_), "=r"(r3_) \
               : "r"((unsigned)__cvta_generic_to_shared(ptr))); \
  b0 = {name}_HALF(r0_, 0); b1 = {name}_HALF(r0_, 1); b2 = {name}_HALF(r1_, 0); b3 = {name}_HALF(r1_, 1); \
  b4 = {name}_HALF(r2_, 0); b5 = {name}_HALF(r2_, 1); b6 = {name}_HALF(r3_, 0); b7 = {name}_HALF(r3_, 1); }}
"""


def ldsm_row(lane, ks, ndp):
    """(row, column) of the tile whose address lane gives to ``ldsm_kn``: matrix m =
    lane // 8 is rows 16*ks + 8*(m % 2) .. + 8 at columns 8*(2*ndp + m // 2) .. + 8, so
    registers 0, 1 are the B operand of output tile 2*ndp and 2, 3 of tile 2*ndp + 1."""
    m = lane // 8
    return ks * 16 + 8 * (m % 2) + lane % 8, 8 * (2 * ndp + m // 2)


def ldsm_value(lane, slot):
    """(lane that gave the row, column within its 8) of value ``slot`` (0..7) of lane's
    result: the PTX ISA's ldmatrix .trans map."""
    m, i = slot // 2, slot % 2
    return 8 * m + 2 * (lane % 4) + i, lane // 4


def ldsm_call(name, source, tile, offset, frag, tx, base):
    """The call of an ldmatrix.x4 macro (``LDSM_SOURCE``'s): thread tx gives the address
    of tile[offset] and receives values frag[tx, base .. base + 7]."""
    values = [frag[tx, base + i] for i in range(8)]
    return T.cuda.func_call(name, tile.access_ptr("r", offset=offset, extent=8), *values, source_code=source)


def kn_loader(warps: int, head_dim: int, dtype: str, ldmatrix: bool, emulate: bool):
    """A T.macro ``load(Ct, bfrag, ks, ndp)``: the B operands B[k][n] = Ct[row 16*ks + k]
    [column 8*nd + n] of output tiles nd = 2*ndp and 2*ndp + 1 (values 0..3 and 4..7 of
    each thread's bfrag), from a shared tile of rows padded to head_dim + 8: one
    ``ldmatrix.x4.trans`` per warp (``ldmatrix``), else eight 16-bit loads per thread
    (a pair of values is never adjacent in the tile: they are k, k + 1). ``emulate``
    runs ldmatrix's map (``ldsm_row``, ``ldsm_value``) lane by lane."""
    nt, DP = 32 * warps, head_dim + 8
    name = f"swa_ldsm_t_{PTX_TYPE[dtype]}"
    source = LDSM_SOURCE.format(name=name, t=C_TYPE[dtype])

    def row_index(lane, ks, ndp):
        row, col = ldsm_row(lane, ks, ndp)
        return row * DP + col

    @T.macro
    def load(Ct, bfrag, ks, ndp):
        if not ldmatrix:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                for x in T.unroll(8):
                    bfrag[tx, x] = Ct[b_index_kn(tx, x % 4, ks, 2 * ndp + x // 4, DP)]
        elif emulate:
            for w, lane, x in T.grid(warps, 32, 8):
                bfrag[w * 32 + lane, x] = Ct[
                    row_index(ldsm_value(lane, x)[0], ks, ndp) + ldsm_value(lane, x)[1]
                ]
        else:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                T.evaluate(ldsm_call(name, source, Ct, row_index(tx % 32, ks, ndp), bfrag, tx, 0))

    return load


# ldmatrix.x4 without .trans: lane 8m + j gives the address of row j of matrix m, and
# lane t receives from matrix m the two values (row t // 4, columns 2*(t % 4) + i), i =
# 0, 1, in its register m.
LDSM_A_SOURCE = LDSM_SOURCE.replace(".x4.trans.shared", ".x4.shared")


def ldsm_a_row(lane):
    """(row, column) of a 16 x 16 A tile whose address lane gives to ``ldsm_a``: matrix
    m = lane // 8 is rows 8*(m % 2) .. + 8 at columns 8*(m // 2) .. + 8, so register m
    holds A values 2m and 2m + 1 (``a_pos``)."""
    m = lane // 8
    return 8 * (m % 2) + lane % 8, 8 * (m // 2)


def ldsm_a_value(lane, slot):
    """(lane that gave the row, column within its 8) of value ``slot`` (0..7) of lane's
    result: the PTX ISA's ldmatrix map, no transpose."""
    m, i = slot // 2, slot % 2
    return 8 * m + lane // 4, 2 * (lane % 4) + i


def a_loader(warps: int, head_dim: int, dtype: str, ldmatrix: bool, emulate: bool):
    """A T.macro ``load(At, afrag, a0, row0, ks)``: the A operand (values a0 .. a0 + 7
    of each thread's afrag) of the 16 x 16 tile at rows row0(tx) .. + 16, k-step ks, of
    a row-major shared tile of rows padded to head_dim + 8: one ``ldmatrix.x4`` per warp
    (``ldmatrix``), else eight 16-bit loads per thread. ``emulate`` runs ldmatrix's map
    (``ldsm_a_row``, ``ldsm_a_value``) lane by lane."""
    nt, DP = 32 * warps, head_dim + 8
    name = f"swa_ldsm_a_{PTX_TYPE[dtype]}"
    source = LDSM_A_SOURCE.format(name=name, t=C_TYPE[dtype])

    def row_index(tx, lane, ks, row0):
        row, col = ldsm_a_row(lane)
        return (row0(tx) + row) * DP + ks * 16 + col

    @T.macro
    def load(At, afrag, a0, row0, ks):
        if not ldmatrix:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                for l in T.unroll(8):
                    afrag[tx, a0 + l] = At[(row0(tx) + a_pos(tx % 32, l)[0]) * DP + ks * 16 + a_pos(tx % 32, l)[1]]
        elif emulate:
            for w, lane, x in T.grid(warps, 32, 8):
                afrag[w * 32 + lane, a0 + x] = At[
                    row_index(w * 32, ldsm_a_value(lane, x)[0], ks, row0) + ldsm_a_value(lane, x)[1]
                ]
        else:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                T.evaluate(ldsm_call(name, source, At, row_index(tx, tx % 32, ks, row0), afrag, tx, a0))

    return load


def ldsm_nk_row(lane, ntp, ks):
    """(row, column) of a K tile (rows n, columns k) whose address lane gives to
    ``nk_loader``'s ldmatrix.x4: matrix m = lane // 8 is rows 16*ntp + 8*(m // 2) .. + 8
    (score tile 2*ntp + m // 2) at columns 16*ks + 8*(m % 2) .. + 8 (the k-step's half),
    so registers 0, 1 are the B operand of score tile 2*ntp and 2, 3 of tile 2*ntp + 1."""
    m = lane // 8
    return 16 * ntp + 8 * (m // 2) + lane % 8, 16 * ks + 8 * (m % 2)


def nk_loader(warps: int, head_dim: int, dtype: str, ldmatrix: bool, emulate: bool):
    """A T.macro ``load(Kt, bfrag, ntp, ks)``: the B operands B[k][n] = Kt[row 8*nt + n]
    [column 16*ks + k] of score tiles nt = 2*ntp and 2*ntp + 1 (values 0..3 and 4..7 of
    each thread's bfrag), from a shared tile of rows padded to head_dim + 8: one
    ``ldmatrix.x4`` per warp (``ldmatrix``, ``ldsm_nk_row``: B's pairs k, k + 1 are
    adjacent in a row of K, so no transpose), else eight 16-bit loads per thread.
    ``emulate`` runs ldmatrix's map (``ldsm_a_value``) lane by lane."""
    nt, DP = 32 * warps, head_dim + 8
    name = f"swa_ldsm_a_{PTX_TYPE[dtype]}"
    source = LDSM_A_SOURCE.format(name=name, t=C_TYPE[dtype])

    def row_index(lane, ntp, ks):
        row, col = ldsm_nk_row(lane, ntp, ks)
        return row * DP + col

    @T.macro
    def load(Kt, bfrag, ntp, ks):
        if not ldmatrix:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                for x in T.unroll(8):
                    bfrag[tx, x] = Kt[b_index_nk(tx, x % 4, 2 * ntp + x // 4, ks, DP)]
        elif emulate:
            for w, lane, x in T.grid(warps, 32, 8):
                bfrag[w * 32 + lane, x] = Kt[row_index(ldsm_a_value(lane, x)[0], ntp, ks) + ldsm_a_value(lane, x)[1]]
        else:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                T.evaluate(ldsm_call(name, source, Kt, row_index(tx % 32, ntp, ks), bfrag, tx, 0))

    return load


# cp.async (sm_80+): a 16-byte global-to-shared copy the issuing thread does not wait
# for. commit closes the thread's group of copies; wait_group 0 waits for all of its
# groups, and only a barrier after it makes every thread's copies visible to the block.
CP_ASYNC_SOURCE = r"""
#define swa_cp_async_16(dst, src) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" \
  :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src))
#define swa_cp_async_commit() asm volatile("cp.async.commit_group;\n" ::)
#define swa_cp_async_wait_all() asm volatile("cp.async.wait_group 0;\n" ::: "memory")
"""


def async_loader(threads: int, head_dim: int, rows: int, emulate: bool, cores: bool = False):
    """Macros ``issue(A, src, b, hh, pos_of, n)`` and ``wait_all(landing)`` for one shared
    tile laid out as ``pair_loader``'s, copied by cp.async: ``issue`` starts the copies
    of rows i < ``rows`` from src[b, hh, pos_of(i)] (clamped to [0, n)) and commits
    them; ``wait_all`` waits for the thread's copies (with ``cores`` and ``landing``,
    copies wgmma will read, then makes them visible to it: ``fence.proxy.async``) and
    then for the block (a barrier), after which the tile may be read, and every read
    issued before it is done, so the tile may be overwritten. ``emulate``: plain copies
    and no waits (the CPU runs threads in turn)."""
    D, VEC = head_dim, 8
    lay = TileLayout(head_dim, rows, cores)
    steps = -(-rows * D // VEC // threads)

    @T.macro
    def issue(A, src, b, hh, pos_of, n, clamp=True):
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for x in T.serial(steps):
                e = T.meta_var(x * threads + tx)
                if e < rows * D // VEC:
                    i, cv = T.meta_var(lay.slot(e))
                    j = T.meta_var(row_position(pos_of(i), n, clamp))
                    if emulate:
                        for u in T.vectorized(VEC):
                            A[lay.index(i, cv * VEC + u)] = src[b, hh, j, cv * VEC + u]
                    else:
                        # The tile marked read, not written: TVM's barrier planner, which
                        # sees tiles merged into one dynamic buffer as one, otherwise adds
                        # a barrier after each issue (no use: the copies land later; our
                        # waits and barriers order them, cuda_races checks), while the
                        # access keeps the tile live for that merge.
                        T.evaluate(
                            T.cuda.func_call(
                                "swa_cp_async_16",
                                A.access_ptr("r", offset=lay.index(i, cv * VEC), extent=VEC),
                                T.address_of(src[b, hh, j, cv * VEC]),
                                source_code=CP_ASYNC_SOURCE,
                            )
                        )
            if not emulate:
                T.evaluate(T.cuda.func_call("swa_cp_async_commit", source_code=CP_ASYNC_SOURCE))

    @T.macro
    def wait_all(landing):
        if not emulate:
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                T.evaluate(T.cuda.func_call("swa_cp_async_wait_all", source_code=CP_ASYNC_SOURCE))
                if cores and landing:
                    T.evaluate(T.cuda.func_call("swa_fence_proxy_async", source_code=COMMON_SOURCE))
                T.evaluate(T.tvm_storage_sync("shared"))

    return issue, wait_all


def two_stage_ring(wait_all):
    """A T.macro ``ring(c_begin, c_end, issue, compute)``: chunks c_begin <= c < c_end
    through two stages filled by cp.async (``async_loader``'s ``wait_all``), two chunks a
    turn, chunk c_begin + 2i in stage 0 and the next in stage 1 (one buffer per stage and
    tile, so that cuda_races' one-buffer model still applies); ``issue(s, c)`` starts
    chunk c's copies into stage s, ``compute(s, c)`` reads them. A stage's copies are
    issued right after the barrier that ends every warp's reads of its previous chunk,
    and land while the other stage's chunk is computed (CUTLASS's multistage main loop).
    The caller makes the first stage's tiles free before (a barrier if they were read)."""

    @T.macro
    def ring(c_begin, c_end, issue, compute):
        if c_begin < c_end:
            issue(0, c_begin)
        for i in T.serial((c_end - c_begin + 1) // 2):
            wait_all(True)  # chunk c in stage 0; every warp is done with stage 1
            if c_begin + 2 * i + 1 < c_end:
                issue(1, c_begin + 2 * i + 1)
            compute(0, c_begin + 2 * i)
            wait_all(True)  # chunk c + 1 in stage 1; every warp is done with stage 0
            if c_begin + 2 * i + 2 < c_end:
                issue(0, c_begin + 2 * i + 2)
            if c_begin + 2 * i + 1 < c_end:
                compute(1, c_begin + 2 * i + 1)
        wait_all(False)  # nothing in flight past the loop; both stages free again

    return ring


def chunk_mask(threads: int, slots: int, chunk: int):
    """The band mask of one chunk, for kernels whose threads hold C values of ``slots``
    rows each (row slot s, with band interval first_r[tx, s]..last_r[tx, s]) and whose
    chunk c's key kk has band index c*chunk + kk: ``inside(c, inner_lo, inner_hi)``,
    whether every row sees the chunk whole (then no mask at all); else the T.macro
    ``bounds(rel, first_r, last_r, c)`` puts each interval, once per chunk, into int32
    bounds relative to the thread's columns (C value l of score tile nt is column
    8*nt + 2*(lane % 4) + l % 2) clamped to the chunk, and ``visible(rel, tx, l, nt,
    s)`` is then two compares with a constant per score."""

    def inside(c, inner_lo, inner_hi):
        return chunk_inside(c, chunk, inner_lo, inner_hi)

    @T.macro
    def bounds(rel, first_r, last_r, c):
        # In the intervals' own type (int32 ones: the chunk's start too).
        base = T.meta_var(T.Cast(first_r.dtype, c) * chunk)
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for r in T.unroll(slots):
                rel[tx, r] = T.Cast("int32", T.max(T.min(first_r[tx, r] - base - 2 * (tx % 4), chunk), 0))
                rel[tx, slots + r] = T.Cast("int32", T.max(T.min(last_r[tx, r] - base - 2 * (tx % 4), chunk - 1), -1))

    def visible(rel, tx, l, nt, s):
        return T.And(nt * 8 + l % 2 >= rel[tx, s], nt * 8 + l % 2 <= rel[tx, slots + s])

    return inside, bounds, visible


@dataclass(frozen=True)
class TCConfig:
    warps: int = 4  # 16 * m_tiles query rows each: block_q = 16 * warps * m_tiles
    chunk: int = 64  # keys per online-softmax step (a multiple of 16)
    ldmatrix: bool = True  # K's and V's B operands by ldmatrix(.trans) (else 16-bit loads)
    # K and V chunks by cp.async, each load overlapping the other tile's product (else
    # synchronous 16-byte loads, K and V together before the chunk's products).
    async_copy: bool = False
    # 16-row tiles per warp. 1: Q's A fragments stay in registers, and Q's shared tile is
    # then K's. 2 (FlashAttention-2's 128 x 64 blocks of 4 warps): every K and V operand
    # read from shared memory feeds two mma instead of one, halving that traffic per
    # product, and the block's K/V chunks serve twice the rows; the doubled score and
    # output accumulators leave no registers for Q, whose A fragments are re-read from its
    # own shared tile at each k-step.
    m_tiles: int = 1
    # Hopper's wgmma (sm_90a only; ``cuda_wgmma``) for both products instead of mma.sync:
    # a warpgroup (4 warps, 64 rows) per instruction, K and V read by the tensor cores
    # straight from shared memory (tiles as core matrices, unpadded). Needs warps a
    # multiple of 4, m_tiles 1, chunk and head_dim at most 256; ``ldmatrix`` unused.
    wgmma: bool = False
    # wgmma's V tile stored transposed (head dim x keys), so that P V's B operand is
    # K-major as Q K^T's is, instead of MN-major (``imm-trans-b``); synchronous loads
    # only (each value stored on its own).
    transpose_v: bool = False
    # __launch_bounds__' second argument, the blocks per SM ptxas must leave registers
    # for; 0: none (ptxas's own heuristic); None: two blocks of up to 4 warps, else one.
    # Left to itself ptxas aims at occupancies it then misses: the bf16 D=128 default
    # took 180 registers (two blocks, as 213 would) and 2% more instructions a chunk,
    # the 4 x 64 wgmma forward 180 where 202 saves 8% (still two blocks), and the D=32
    # forward with extra keys 128, spilling, where 133 spill nothing. Three blocks (168
    # registers) is the sweep's question for a GPU.
    min_blocks: int | None = None
    # FlashAttention-3's intra-warpgroup pipelining (wgmma, synchronous loads): chunk c's
    # Q K^T and chunk c - 1's P V are issued together and only the first is waited for,
    # so the softmax of chunk c runs while the tensor cores do P V (V's tile lags K's
    # by a chunk; the outputs' rescale and the next P's packing wait for P V).
    overlap: bool = False
    # K/V stages (cp.async only). 1: FlashAttention-2's order on one K and one V tile,
    # each copy hidden behind half a chunk's work. 2: a ring of two K/V tile pairs,
    # chunk c + 1's copies issued before chunk c's products, so they have a whole
    # chunk's work to land behind (CUTLASS's multistage main loop); twice the tiles.
    stages: int = 1

    @property
    def block_q(self) -> int:
        return 16 * self.warps * self.m_tiles

    @property
    def blocks_per_sm(self) -> int:
        """``min_blocks`` resolved (0: no second launch bound)."""
        if self.min_blocks is None:
            return 2 if self.warps <= 4 else 1
        return self.min_blocks

    def shared_bytes(self, head_dim: int, dtype: str) -> int:
        el = tvm.runtime.DataType(dtype).bits // 8
        # Q's tile (K's too, with Q in registers), K's, V's; the extra keys' positions;
        # 64-byte alignment.
        rows = max(self.block_q, self.chunk) if self.m_tiles == 1 else self.block_q + self.chunk
        rows += (2 * self.stages - 1) * self.chunk  # V's tile, and each further stage's K and V
        return rows * (head_dim + (0 if self.wgmma else 8)) * el + self.chunk * 3 * 8 + (6 + 2 * (self.stages - 1)) * 64


def supports(spec: KernelSpec) -> bool:
    """Forward kernels (local, or global rows) in float16/bfloat16 with head_dim % 16 == 0."""
    return spec.kind in ("local", "global") and spec.dtype in PTX_TYPE and spec.head_dim % 16 == 0


def default_config(spec: KernelSpec) -> TCConfig | None:
    """The largest of (warps, chunk) = (4, 64), (4, 32), (2, 32), (2, 16) within 48 KiB."""
    return largest_fitting(TCConfig, spec, ((4, 64), (4, 32), (2, 32), (2, 16))) if supports(spec) else None


def flash_tc(spec: KernelSpec, config: TCConfig | None = None, emulate: bool = False) -> tvm.tirx.PrimFunc:
    """The tensor-core PrimFunc of a forward spec (fp16/bf16, head_dim % 16 == 0), with
    the TE kernel's arguments and name: for "local" the window (and extra keys) of every
    row; for "global" the global rows against every key (causal: up to their position),
    split-K: the keys of a block of rows in as many pieces as the caller's workspace has
    (``GLOBAL_WORKSPACE``), a thread block each, writing the rows' normalized share and
    lse there, then a second kernel combining the pieces and the sink (a block per row,
    a thread per column). 64 global rows over 32K keys made one block per head without
    it: 32 blocks for 132 SMs, each streaming 512 chunks in turn."""
    if not supports(spec):
        raise ValueError(
            f"kernel {spec.name}: the tensor-core kernel takes float16/bfloat16 forward kernels with head_dim % 16 == 0"
        )
    cfg = config or default_config(spec)
    return _build(spec, cfg, tile_scope(spec, cfg), emulate).with_attr("global_symbol", spec.name)


def shared_limit(cfg) -> int:
    """The most shared memory a block of ``cfg``'s kernel may take: sm_90's for wgmma
    (sm_90a code runs on sm_90 GPUs only), else that of every sm_80+ GPU."""
    return SHARED_LIMIT_SM90 if getattr(cfg, "wgmma", False) else SHARED_LIMIT


def tile_scope(spec: KernelSpec, cfg) -> str:
    """The shared-memory scope of a tensor-core kernel's tiles under ``cfg`` (a TCConfig
    or cuda_flash_bwd_tc.TCBwdConfig; None: no default fits), after checking it: at
    least one warp, chunks a positive multiple of 16, shared memory within ``shared_limit(cfg)``."""
    if cfg is None:
        raise ValueError(f"kernel {spec.name}: no tensor-core tile fits {SHARED_BUDGET // 1024} KiB of shared memory")
    if cfg.warps < 1 or cfg.chunk < 16 or cfg.chunk % 16 or getattr(cfg, "m_tiles", 1) < 1:
        raise ValueError(
            f"kernel {spec.name}: {cfg}: warps (and m_tiles) must be >= 1 and chunk a positive multiple of 16"
        )
    if getattr(cfg, "wgmma", False) and (cfg.warps % 4 or getattr(cfg, "m_tiles", 1) != 1 or cfg.chunk > 256
                                         or spec.head_dim > 256):
        raise ValueError(
            f"kernel {spec.name}: {cfg}: wgmma takes warps a multiple of 4 (whole warpgroups), m_tiles 1, "
            f"chunk <= 256 and head_dim <= 256 (got {spec.head_dim})"
        )
    if (getattr(cfg, "min_blocks", None) or 0) < 0:
        raise ValueError(f"kernel {spec.name}: {cfg}: min_blocks must be >= 0 (0: ptxas's own choice) or None")
    if getattr(cfg, "overlap", False) and (not cfg.wgmma or cfg.async_copy):
        raise ValueError(f"kernel {spec.name}: {cfg}: overlap takes wgmma and synchronous loads (async_copy False)")
    stages = cfg.stages
    if stages not in (1, 2) or (stages == 2 and not cfg.async_copy):
        raise ValueError(f"kernel {spec.name}: {cfg}: stages must be 1 or 2, and 2 takes cp.async (async_copy True)")
    if getattr(cfg, "transpose_v", False) and (not cfg.wgmma or cfg.async_copy):
        raise ValueError(f"kernel {spec.name}: {cfg}: transpose_v takes wgmma and synchronous loads (async_copy False)")
    try:
        return shared_scope(cfg.shared_bytes(spec.head_dim, spec.dtype), shared_limit(cfg))
    except ValueError as e:
        raise ValueError(f"kernel {spec.name}: {cfg}: {e}") from None


def _build(spec: KernelSpec, cfg: TCConfig, SH: str, emulate: bool):  # noqa: C901 - one kernel, phase by phase
    D, dt, acc = spec.head_dim, spec.dtype, "float32"
    lo, hi, maxd, extras = spec.left, spec.right, spec.max_dilation, spec.extras
    causal = spec.causal
    NW, KC, MT = cfg.warps, cfg.chunk, cfg.m_tiles
    BQ, NT = 16 * NW * MT, 32 * NW
    NS, NO, KD = KC // 8, D // 8, D // 16  # score tiles, output tiles, k-steps of Q K^T
    R = 2 * MT  # rows a thread holds C values of: two per 16-row tile
    QREG = MT == 1  # Q's A fragments in registers (else re-read from Q's shared tile)
    # The rows' band intervals in int32 (band indices are within +-T, and T < 2^31: int32
    # positions throughout): fewer registers than int64 pairs (under ptxas's own choice,
    # min_blocks=0, the bf16 D=128 default fit 168, three blocks per SM, where int64
    # took 170; two row tiles a warp spilled with int64).
    INTERVAL = "int32"
    # Shared tiles of rows padded by 8 values (the 8 rows a fragment load touches fall in
    # different banks), or with wgmma core matrices, unpadded (TileLayout).
    WG, OVERLAP, STAGES = bool(cfg.wgmma), bool(cfg.overlap), cfg.stages
    VEC = 8  # 16-bit values per 16-byte global load (D % 16 == 0: every row starts 16-byte aligned)
    Q_STEPS = -(-BQ * D // VEC // NT)
    q_tile, kv_tile = TileLayout(D, BQ, WG), TileLayout(D, KC, WG)
    load_extra_positions = extra_positions_loader(NT, KC)
    store_item, load_item = item_scalars(NT, BQ, lo, hi, KC)
    NINF = tirx.const(float("-inf"), acc)
    ZERO, ONE = tirx.const(0.0, acc), tirx.const(1.0, acc)
    # Scores in log2 units (scale * log2 e), so each probability is one exp2 (the
    # hardware's ex2; exp would scale again); lse is brought back to natural log units.
    LOG2E, LN2 = tirx.const(math.log2(math.e), acc), tirx.const(math.log(2.0), acc)
    RESCALE_SLACK = tirx.const(8.0, acc)  # log2 units: probabilities up to 256

    # Warp w = tx // 32 owns the item's 16-row tiles MT*w .. MT*w + MT - 1; a thread holds
    # C values of two rows of each, its row slots r = 2*mt + (0 or 1).
    def t_row(tx, r):
        """Row (in the item) of thread tx's row slot r."""
        return ((tx // 32) * MT + r // 2) * 16 + c_pos(tx % 32, 2 * (r % 2))[0]

    def c_row(tx, l, mt=0):
        """Row (in the item) of value l of thread tx's C fragments of tile mt."""
        return t_row(tx, 2 * mt + l // 2)

    def c_col(tx, l):
        return c_pos(tx % 32, l)[1]

    mma = mma_macro(NW, dt, emulate)
    load_kn = kn_loader(NW, D, dt, cfg.ldmatrix, emulate)
    load_a = a_loader(NW, D, dt, cfg.ldmatrix, emulate)
    load_nk = nk_loader(NW, D, dt, cfg.ldmatrix, emulate)

    @T.macro
    def quad_reduce(part, red, op_max):
        # red[tx, r] = max or sum of part[., r] over the 4 lanes of tx's group (the lanes
        # holding the same rows), r < R.
        if emulate:
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                for rr in T.serial(R):
                    if op_max:
                        red[tx, rr] = T.max(
                            T.max(part[tx // 4 * 4, rr], part[tx // 4 * 4 + 1, rr]),
                            T.max(part[tx // 4 * 4 + 2, rr], part[tx // 4 * 4 + 3, rr]),
                        )
                    else:
                        red[tx, rr] = (part[tx // 4 * 4, rr] + part[tx // 4 * 4 + 1, rr]) + (
                            part[tx // 4 * 4 + 2, rr] + part[tx // 4 * 4 + 3, rr]
                        )
        else:
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                for rr in T.unroll(R):
                    if op_max:
                        red[tx, rr] = T.cuda.warp_reduce(part[tx, rr], "max", 4)
                    else:
                        red[tx, rr] = T.cuda.warp_reduce(part[tx, rr], "sum", 4)

    wg_fence, _, wg_proxy_fence, wg_group = sync_macros(NT, emulate)
    wg_commit, wg_wait0, wg_wait1, pin = deferred_macros(NT, emulate)
    # The overlapped stream's K and V loads, one tile each (V's as the pair's B tile).
    load_k, load_v = pair_loader(NT, D, KC, WG), pair_loader(NT, D, KC, WG, None, bool(cfg.transpose_v))
    QPK = PPK = ((1, 1), "uint32")
    if WG:
        pack_a = a_packer(NT, dt, emulate)
        QPK, PPK = packed_a(NT, KD, dt, emulate), packed_a(NT, KC // 16, dt, emulate)
        wgmma_s = wgmma_macro(NW, dt, "nk", KC, KC, emulate)  # S[64 x KC] += Q K^T per warpgroup
        # O[64 x D] += P V: V's tile as it is (MN-major), or transposed.
        wgmma_o = (wgmma_macro(NW, dt, "nk", D, D, emulate) if cfg.transpose_v
                   else wgmma_macro(NW, dt, "kn", D, KC, emulate))
    # Fenced for wgmma by the callers, once after whichever of its two forms ran (one
    # fence per form would hide either's deletion from cuda_races, which takes both).
    load_rows = pair_loader(NT, D, KC, WG, None, bool(cfg.transpose_v))
    issue_rows, wait_all = async_loader(NT, D, KC, emulate, WG)

    @T.macro
    def scores(Kt, Qs, qfrag, qpk, kfrag, sfrag):
        # 1. S = Q K^T: score tile nt (keys nt*8..+8) of row tile mt, value l at
        # sfrag[(mt*NS + nt)*4 + l], over the k-steps of the head dim; each K operand
        # read feeds the MT row tiles, two score tiles per load.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.unroll(MT * NS * 4):
                sfrag[tx, x] = ZERO
        if WG:  # one wgmma per k-step per warpgroup, K's tile read in place
            wg_group(KD, lambda ks: wgmma_s(qpk, ks * 4, Kt, ks, sfrag), sfrag, NS * 4)
        for ks in T.unroll(0 if WG else KD):
            if not QREG:
                for mt in T.unroll(MT):
                    load_a(Qs, qfrag, mt * 8, lambda tx: ((tx // 32) * MT + mt) * 16, ks)
            for ntp in T.unroll(NS // 2):
                load_nk(Kt, kfrag, ntp, ks)
                for mt in T.unroll(MT):
                    if QREG:
                        mma(qfrag, ks * 8, kfrag, 0, sfrag, 2 * ntp * 4)
                        mma(qfrag, ks * 8, kfrag, 4, sfrag, (2 * ntp + 1) * 4)
                    else:
                        mma(qfrag, mt * 8, kfrag, 0, sfrag, (mt * NS + 2 * ntp) * 4)
                        mma(qfrag, mt * 8, kfrag, 4, sfrag, (mt * NS + 2 * ntp + 1) * 4)

    def row_values(sfrag, tx, mt, r):
        """Thread tx's score values of its row slot 2*mt + r (C values l = 2r, 2r + 1 of
        each score tile of row tile mt)."""
        return [sfrag[tx, (mt * NS + nt) * 4 + 2 * r + i] for nt in range(NS) for i in range(2)]

    @T.macro
    def mask_max(sfrag, m_r, part, red, visible, scale2):
        # 2. Mask (visible(tx, l, nt, mt); None: every score is visible), and the rows'
        # new running max (per thread, then over its group), in log2 units. The scores
        # stay unscaled: scale > 0, so max(s) * scale2 is the max of the scaled scores,
        # and each probability below is then one FFMA and one ex2. The row's values
        # reduce as a balanced tree: a chain of NS*2 dependent max (or adds) per row
        # left the warp stalled on each one's latency (the profile's top stall).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            if visible is not None:
                for mt in T.unroll(MT):
                    for nt in T.unroll(NS):
                        for l in T.unroll(4):
                            sfrag[tx, (mt * NS + nt) * 4 + l] = T.Select(
                                visible(tx, l, nt, mt), sfrag[tx, (mt * NS + nt) * 4 + l], NINF
                            )
            for mt in T.unroll(MT):
                for r in T.unroll(2):
                    part[tx, 2 * mt + r] = T.max(m_r[tx, 2 * mt + r], tree(T.max, row_values(sfrag, tx, mt, r)) * scale2)
        quad_reduce(part, red, True)

    @T.macro
    def rescale_rows(tx, ofrag, part):
        # Thread tx's outputs times its rows' factors part[R..2R) (``softmax``).
        for mt in T.unroll(MT):
            # Skipped where neither row's max moved (factors exactly 1), as in most of a
            # long window's chunks: NO*4 multiplies per row tile.
            if T.Or(part[tx, R + 2 * mt] != ONE, part[tx, R + 2 * mt + 1] != ONE):
                for x in T.unroll(NO * 4):
                    ofrag[tx, mt * NO * 4 + x] = ofrag[tx, mt * NO * 4 + x] * part[tx, R + 2 * mt + (x % 4) // 2]

    @T.macro
    def softmax(sfrag, pfrag, ofrag, m_r, l_r, part, red, scale2):
        # 3. Probabilities exp2(s * scale2 - max), their row sums, and the fade of the
        # old sums and outputs (ofrag None: the caller's, ``rescale``; the factors stay
        # in part[R..2R)). A row with no visible key yet keeps max -inf: its scores
        # are all -inf, so subtracting 0 instead gives probabilities 0; factor 1.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for r in T.unroll(R):
                # The running max moves only when the chunk's exceeds it by more than
                # RESCALE_SLACK (FlashAttention-4's lazy rescaling): probabilities then
                # reach at most 2^RESCALE_SLACK, harmless in fp32 sums and in the
                # 16-bit P (range to 6e4, relative rounding), and most chunks of a
                # long window keep factor 1, skipping the outputs' rescale below. The
                # sums and outputs stay relative to the same max, so the result and
                # lse are the same. First chunk: max -inf, difference +inf: moves.
                red[tx, r] = T.Select(red[tx, r] - m_r[tx, r] > RESCALE_SLACK, red[tx, r], m_r[tx, r])
                part[tx, R + r] = T.Select(red[tx, r] == NINF, ZERO, red[tx, r])
            for mt in T.unroll(MT):
                for nt in T.unroll(NS):
                    for l in T.unroll(4):
                        sfrag[tx, (mt * NS + nt) * 4 + l] = T.exp2(
                            sfrag[tx, (mt * NS + nt) * 4 + l] * scale2 - part[tx, R + 2 * mt + l // 2]
                        )
                        # The A operand of P V (row-major 16 x 16 per pair of score tiles):
                        # value l2 = 4*(nt % 2) + l holds (row, key) = C value l of score
                        # tile nt.
                        pfrag[tx, mt * NS * 4 + (nt // 2) * 8 + 4 * (nt % 2) + l] = T.Cast(
                            dt, sfrag[tx, (mt * NS + nt) * 4 + l]
                        )
            for mt in T.unroll(MT):
                for r in T.unroll(2):
                    part[tx, 2 * mt + r] = tree(lambda a, b: a + b, row_values(sfrag, tx, mt, r))
            for r in T.unroll(R):
                # part[R + r] <- this thread's factor for row slot r, kept for the outputs below.
                part[tx, R + r] = T.Select(red[tx, r] == NINF, ONE, T.exp2(m_r[tx, r] - red[tx, r]))
                m_r[tx, r] = red[tx, r]
            if ofrag is not None:
                rescale_rows(tx, ofrag, part)
        quad_reduce(part, red, False)
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for r in T.unroll(R):
                l_r[tx, r] = l_r[tx, r] * part[tx, R + r] + red[tx, r]

    @T.macro
    def softmax_pv(Vt, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, scale2):
        softmax(sfrag, pfrag, ofrag, m_r, l_r, part, red, scale2)
        # 4. O += P V: k-step ks covers keys ks*16..+16, output tiles nd columns nd*8..+8,
        # two per load, each load feeding the MT row tiles (wgmma: all D columns at once).
        if WG:
            pack_a(pfrag, 0, ppk, 0, KC // 16)
            wg_group(KC // 16, lambda ks: wgmma_o(ppk, ks * 4, Vt, ks, ofrag), ofrag, NO * 4)
        for ks in T.unroll(0 if WG else KC // 16):
            for ndp in T.unroll(NO // 2):
                load_kn(Vt, vfrag, ks, ndp)
                for mt in T.unroll(MT):
                    mma(pfrag, mt * NS * 4 + ks * 8, vfrag, 0, ofrag, mt * NO * 4 + ndp * 8)
                    mma(pfrag, mt * NS * 4 + ks * 8, vfrag, 4, ofrag, mt * NO * 4 + ndp * 8 + 4)

    chunk_inside, chunk_bounds, chunk_visible = chunk_mask(NT, R, KC)

    @T.macro
    def band_mask_max(c, sfrag, m_r, part, red, rel, first_r, last_r, inner_lo, inner_hi, scale2):
        # Step 2 for band chunk c (``chunk_mask``): a chunk every row sees whole (most of a
        # long window's) takes no mask at all.
        if chunk_inside(c, inner_lo, inner_hi):
            mask_max(sfrag, m_r, part, red, None, scale2)
        else:
            chunk_bounds(rel, first_r, last_r, c)
            mask_max(sfrag, m_r, part, red, lambda tx, l, nt, mt: chunk_visible(rel, tx, l, nt, 2 * mt + l // 2), scale2)

    @T.macro
    def issue_chunk(A, src, b, kvh, pos_of, c, n):
        # cp.async of chunk c's rows (no fence: wait_all's, once they land).
        load_band_rows(lambda clamp: issue_rows(A, src, b, kvh, lambda kk: pos_of(c, kk), n, clamp),
                       lambda kk: pos_of(c, kk), KC, n)

    @T.macro
    def issue_kv(Kt, Vt, k, v, b, kvh, pos_of, c, Tn):
        issue_chunk(Kt, k, b, kvh, pos_of, c, Tn)
        issue_chunk(Vt, v, b, kvh, pos_of, c, Tn)

    ring = two_stage_ring(wait_all)

    @T.macro
    def zero_tile(A, size):
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.serial(-(-size // VEC // NT)):
                if (x * NT + tx) * VEC < size:
                    for u in T.vectorized(VEC):
                        A[(x * NT + tx) * VEC + u] = T.Cast(dt, 0)

    @T.macro
    def overlapped_stream(QK, Vt, qpk, sfrag, pfrag, ppk, ofrag, m_r, l_r, part, red, rel, k, v, b, kvh, Tn,
                          c_begin, c_end, pos_of, first_r, last_r, inner_lo, inner_hi, scale2):
        # FlashAttention-3's intra-warpgroup overlap, on single tiles: chunk c loads K(c)
        # and V(c - 1) (zeros at the first, with P = 0: an exact no-op), issues S(c) =
        # Q K(c)^T and O += P(c - 1) V(c - 1) as two groups, waits for the first only,
        # computes chunk c's softmax while the tensor cores do P V, then waits for it,
        # rescales O to chunk c's max and packs P(c) for the next chunk. The last P V
        # follows the loop. O stays relative to the max of the chunk whose P was last
        # added: P(c - 1) V(c - 1) lands before the rescale to chunk c's max.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for i in T.unroll(PPK[0][1]):
                ppk[tx, i] = T.Cast(PPK[1], 0)
        for c in T.serial(c_begin, c_end):
            load_band_rows(lambda clamp: load_k(QK, None, k, None, b, kvh, lambda kk: pos_of(c, kk), Tn, clamp),
                           lambda kk: pos_of(c, kk), KC, Tn)
            if c > c_begin:
                load_band_rows(lambda clamp: load_v(None, Vt, None, v, b, kvh, lambda kk: pos_of(c - 1, kk), Tn, clamp),
                               lambda kk: pos_of(c - 1, kk), KC, Tn)
            else:
                zero_tile(Vt, kv_tile.size)
            wg_proxy_fence()  # once after whichever stores ran (as load_band_rows')
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                for x in T.unroll(NS * 4):
                    sfrag[tx, x] = ZERO
            pin(sfrag, NS * 4)
            pin(ofrag, NO * 4)
            wg_fence()
            for ks in T.unroll(KD):
                wgmma_s(qpk, ks * 4, QK, ks, sfrag)
            wg_commit()
            for ks in T.unroll(KC // 16):
                wgmma_o(ppk, ks * 4, Vt, ks, ofrag)
            wg_commit()
            wg_wait1()  # S(c) is done; P(c - 1) V(c - 1) may still run
            pin(sfrag, NS * 4)
            band_mask_max(c, sfrag, m_r, part, red, rel, first_r, last_r, inner_lo, inner_hi, scale2)
            softmax(sfrag, pfrag, None, m_r, l_r, part, red, scale2)
            wg_wait0()  # P V is done: O and P's registers are free
            pin(ofrag, NO * 4)
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                rescale_rows(tx, ofrag, part)
            pack_a(pfrag, 0, ppk, 0, KC // 16)
        # (Unconditional, so that the barrier before it is outside any branch: without
        # chunks, P = 0 and V's tile zeros.)
        if c_begin < c_end:
            load_band_rows(lambda clamp: load_v(None, Vt, None, v, b, kvh, lambda kk: pos_of(c_end - 1, kk), Tn, clamp),
                           lambda kk: pos_of(c_end - 1, kk), KC, Tn)
        else:
            zero_tile(Vt, kv_tile.size)
        wg_proxy_fence()
        wg_group(KC // 16, lambda ks: wgmma_o(ppk, ks * 4, Vt, ks, ofrag), ofrag, NO * 4)

    @T.macro
    def band_chunk(c, Kt, Vt, Qs, qfrag, qpk, kfrag, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, rel,
                   first_r, last_r, inner_lo, inner_hi, scale2):
        # Band chunk c's products and online softmax, its keys in Kt and values in Vt.
        scores(Kt, Qs, qfrag, qpk, kfrag, sfrag)
        band_mask_max(c, sfrag, m_r, part, red, rel, first_r, last_r, inner_lo, inner_hi, scale2)
        softmax_pv(Vt, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, scale2)

    @T.macro
    def ring_stream(QK, Qs, Vt, K1, V1, qfrag, qpk, kfrag, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, rel,
                    k, v, b, kvh, Tn, c_begin, c_end, pos_of, first_r, last_r, inner_lo, inner_hi, scale2):
        # Two K/V stages by cp.async (``two_stage_ring``): chunks c_begin + 2i in (QK,
        # Vt), the others in (K1, V1).
        wait_all(False)  # every warp holds its Q fragments before K overwrites their tile
        ring(
            c_begin, c_end,
            lambda s, c: issue_kv(QK if s == 0 else K1, Vt if s == 0 else V1, k, v, b, kvh, pos_of, c, Tn),
            lambda s, c: band_chunk(c, QK if s == 0 else K1, Vt if s == 0 else V1, Qs, qfrag, qpk, kfrag, sfrag, pfrag,
                                    ppk, vfrag, ofrag, m_r, l_r, part, red, rel, first_r, last_r, inner_lo, inner_hi,
                                    scale2),
        )

    @T.macro
    def stream(QK, Qs, Vt, K1, V1, qfrag, qpk, kfrag, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, rel, k, v,
               b, kvh, Tn, c_begin, c_end, pos_of, first_r, last_r, inner_lo, inner_hi, scale2):
        # Band chunks c_begin <= c < c_end: chunk c's keys kk at positions pos_of(c, kk),
        # masked by band_mask_max. Synchronous: K and V, then both products. Async
        # (FlashAttention-2's order, one tile each, no double buffer): V(c) loads while
        # S = Q K(c)^T is computed, K(c + 1) while the softmax and P V(c) are. Two stages
        # (K1, V1 the second pair; else None): see ``ring_stream``. Overlapped
        # (TCConfig.overlap): see ``overlapped_stream``.
        if OVERLAP:
            overlapped_stream(QK, Vt, qpk, sfrag, pfrag, ppk, ofrag, m_r, l_r, part, red, rel, k, v, b, kvh, Tn,
                              c_begin, c_end, pos_of, first_r, last_r, inner_lo, inner_hi, scale2)
        elif STAGES == 2:
            ring_stream(QK, Qs, Vt, K1, V1, qfrag, qpk, kfrag, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, rel,
                        k, v, b, kvh, Tn, c_begin, c_end, pos_of, first_r, last_r, inner_lo, inner_hi, scale2)
        elif not cfg.async_copy:
            for c in T.serial(c_begin, c_end):
                load_band_rows(lambda clamp: load_rows(QK, Vt, k, v, b, kvh, lambda kk: pos_of(c, kk), Tn, clamp),
                               lambda kk: pos_of(c, kk), KC, Tn, wg_proxy_fence if WG else None)
                band_chunk(c, QK, Vt, Qs, qfrag, qpk, kfrag, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, rel,
                           first_r, last_r, inner_lo, inner_hi, scale2)
        else:
            # Every warp holds its Q fragments before K overwrites their tile.
            wait_all(False)
            if c_begin < c_end:
                issue_chunk(QK, k, b, kvh, pos_of, c_begin, Tn)
            for c in T.serial(c_begin, c_end):
                wait_all(True)  # K(c) is in; every warp is done with V(c - 1)
                issue_chunk(Vt, v, b, kvh, pos_of, c, Tn)
                scores(QK, Qs, qfrag, qpk, kfrag, sfrag)
                wait_all(True)  # V(c) is in; every warp is done with K(c)
                if c + 1 < c_end:
                    issue_chunk(QK, k, b, kvh, pos_of, c + 1, Tn)
                band_mask_max(c, sfrag, m_r, part, red, rel, first_r, last_r, inner_lo, inner_hi, scale2)
                softmax_pv(Vt, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, scale2)
            wait_all(False)  # nothing in flight past the stream; its tiles are free again

    @T.macro
    def start_rows(QK, Qs, qfrag, qpk, ofrag, m_r, l_r, src, b, h, src_row, sink):
        # The block's query rows (row i from src[b, h, src_row(i)]) into their shared tile
        # (QK, then into A fragments for every k-step of the head dim, with Q in
        # registers; else Qs); each row's running max starts at the head's sink logit
        # (log2 units), its sum at that sink's share (sink None: -inf and 0).
        Qt = T.meta_var(QK if QREG else Qs)
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.serial(Q_STEPS):
                e = T.meta_var(x * NT + tx)
                if e < BQ * D // VEC:
                    i, cv = T.meta_var(q_tile.slot(e))
                    for u in T.vectorized(VEC):
                        Qt[q_tile.index(i, cv * VEC + u)] = src[b, h, src_row(i), cv * VEC + u]
            for r in T.unroll(R):
                if sink is None:
                    m_r[tx, r] = NINF
                    l_r[tx, r] = ZERO
                else:
                    m_r[tx, r] = sink[h] * LOG2E
                    l_r[tx, r] = T.Select(sink[h] == NINF, ZERO, ONE)
            for x in T.unroll(MT * NO * 4):
                ofrag[tx, x] = ZERO
        if QREG:
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                for ks in T.unroll(KD):
                    for l in T.unroll(8):
                        qfrag[tx, ks * 8 + l] = Qt[
                            q_tile.index((tx // 32) * 16 + a_pos(tx % 32, l)[0], ks * 16 + a_pos(tx % 32, l)[1])
                        ]
            if WG:  # once: every chunk's Q K^T reads them
                pack_a(qfrag, 0, qpk, 0, KD)

    @T.macro
    def finish_rows(out, lse, ofrag, m_r, l_r, b, h, dst_row, valid):
        # out = acc / l and lse = (m + log2 l) * ln 2 to row i's destination dst_row(i),
        # where valid(i).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for mt in T.unroll(MT):
                for nd in T.unroll(NO):
                    for l in T.unroll(4):
                        if valid(c_row(tx, l, mt)):
                            out[b, h, dst_row(c_row(tx, l, mt)), nd * 8 + c_col(tx, l)] = T.Cast(
                                dt, ofrag[tx, mt * NO * 4 + nd * 4 + l] / l_r[tx, 2 * mt + l // 2]
                            )
            for r in T.unroll(R):
                if tx % 4 == 0:
                    if valid(t_row(tx, r)):
                        lse[b, h, dst_row(t_row(tx, r))] = (m_r[tx, r] + T.log2(l_r[tx, r])) * LN2

    @T.macro
    def with_min_blocks(inner):
        # A thread block's code, under __launch_bounds__(threads, min_blocks) when the
        # config asks for it (TCConfig.min_blocks).
        if cfg.blocks_per_sm > 0:
            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", cfg.blocks_per_sm):
                inner()
        else:
            inner()

    @T.macro
    def row_block(name, body):
        # A thread block's sblock and the tiles, fragments and row state both kinds of
        # rows (local, global) use, handed to body(tiles) as one tuple, in this order.
        with T.sblock(name):
            T.reads()
            T.writes()
            # With Q in registers before the first key chunk arrives, Q and K share a
            # tile (Qs is then a stub); else Q keeps its own.
            QK = T.alloc_buffer((max(q_tile.size, kv_tile.size) if QREG else kv_tile.size,), dt, scope=SH)
            Qs = T.alloc_buffer((8 if QREG else q_tile.size,), dt, scope=SH)
            Vt = T.alloc_buffer((kv_tile.size,), dt, scope=SH)
            qfrag = T.alloc_buffer((NT, KD * 8 if QREG else MT * 8), dt, scope="local")
            # wgmma's A operands packed in 32-bit registers (stubs for mma.sync).
            qpk = T.alloc_buffer(QPK[0], QPK[1], scope="local")
            kfrag = T.alloc_buffer((NT, 8), dt, scope="local")
            vfrag = T.alloc_buffer((NT, 8), dt, scope="local")
            sfrag = T.alloc_buffer((NT, MT * NS * 4), acc, scope="local")
            pfrag = T.alloc_buffer((NT, MT * NS * 4), dt, scope="local")
            ppk = T.alloc_buffer(PPK[0], PPK[1], scope="local")
            ofrag = T.alloc_buffer((NT, MT * NO * 4), acc, scope="local")
            m_r = T.alloc_buffer((NT, R), acc, scope="local")
            l_r = T.alloc_buffer((NT, R), acc, scope="local")
            first_r = T.alloc_buffer((NT, R), INTERVAL, scope="local")
            last_r = T.alloc_buffer((NT, R), INTERVAL, scope="local")
            rel = T.alloc_buffer((NT, 2 * R), "int32", scope="local")
            part = T.alloc_buffer((NT, 2 * R), acc, scope="local")
            red = T.alloc_buffer((NT, R), acc, scope="local")
            body((QK, Qs, Vt, qfrag, qpk, kfrag, vfrag, sfrag, pfrag, ppk, ofrag, m_r, l_r, first_r, last_r, rel, part, red))

    @T.macro
    def ring_tiles(tiles, body):
        # The second K/V stage's tiles (TCConfig.stages = 2), in row_block's sblock.
        K1 = T.alloc_buffer((kv_tile.size,), dt, scope=SH)
        V1 = T.alloc_buffer((kv_tile.size,), dt, scope=SH)
        body(tiles + (K1, V1))

    def with_stages(body):
        """body(tiles), row_block's tiles then the second stage's K and V (None, None
        with one stage: no tiles allocated, so one-stage kernels are as they were)."""
        if STAGES == 2:
            return lambda tiles: ring_tiles(tiles, body)
        return lambda tiles: body(tiles + (None, None))

    @T.macro
    def local_item(tiles, item, nitems, q, k, v, dil, xidx, sink, scale, out, lse, B, H, Hkv, Tn, E):
        QK, Qs, Vt, qfrag, qpk, kfrag, vfrag, sfrag, pfrag, ppk, ofrag, m_r, l_r, first_r, last_r, rel, part, red, K1, V1 = \
            T.meta_var(tiles)
        xpos_s = T.alloc_buffer((KC,), "int64", scope=SH)
        xres_s = T.alloc_buffer((KC,), "int64", scope=SH)
        xt_s = T.alloc_buffer((KC,), "int64", scope=SH)
        fld = T.alloc_buffer((ITEM_SCALARS,), "int64", scope="local")

        store_item(fld, item, H, Hkv, nitems, dil, Tn)
        b, h, beta, d, kvh, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi = T.meta_var(load_item(fld))
        scale2 = T.meta_var(scale * LOG2E)
        # Items past the end run with every key masked and write nothing (see
        # cuda_flash: no branch around barriers).
        start_rows(QK, Qs, qfrag, qpk, ofrag, m_r, l_r, q, b, h,
                   lambda i: T.min(row0 + d * i, Tn - 1), sink)
        # Each row's visible band interval.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for rs in T.unroll(R):
                first_r[tx, rs] = T.Cast(INTERVAL, row_key_range(lo, hi, Tn, d, m0, r, t_row(tx, rs))[0])
                last_r[tx, rs] = T.Cast(INTERVAL, row_key_range(lo, hi, Tn, d, m0, r, t_row(tx, rs))[1])
        stream(
            QK, Qs, Vt, K1, V1, qfrag, qpk, kfrag, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, rel, k, v, b, kvh, Tn,
            c_begin, c_end, lambda c, kk: band_positions(key0, d, c, KC)(kk), first_r, last_r, inner_lo, inner_hi,
            scale2,
        )
        if extras:
            for xc in T.serial((E + (KC - 1)) // KC):
                load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E)
                load_rows(QK, Vt, k, v, b, kvh, lambda kk: xpos_s[kk], Tn)
                if WG:
                    wg_proxy_fence()
                scores(QK, Qs, qfrag, qpk, kfrag, sfrag)
                mask_max(
                    sfrag, m_r, part, red,
                    lambda tx, l, nt, mt: extra_visible(
                        lo, hi, Tn,
                        xpos_s[nt * 8 + c_col(tx, l)], xres_s[nt * 8 + c_col(tx, l)], xt_s[nt * 8 + c_col(tx, l)],
                        row0 + d * c_row(tx, l, mt), m0 + c_row(tx, l, mt), r,
                    ),
                    scale2,
                )
                softmax_pv(Vt, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, scale2)
        finish_rows(out, lse, ofrag, m_r, l_r, b, h, lambda i: row0 + d * i, lambda i: row0 + d * i < Tn)

    @T.macro
    def body(q, k, v, dil, xidx, sink, scale, out, lse, B, H, Hkv, Tn, E):
        nitems = T.meta_var((Tn + (BQ - 1)) // BQ + (maxd - 1))
        for item in T.thread_binding(B * H * nitems, thread="blockIdx.x"):
            with_min_blocks(lambda: row_block("flash_tc", with_stages(lambda tiles: local_item(
                tiles, item, nitems, q, k, v, dil, xidx, sink, scale, out, lse, B, H, Hkv, Tn, E))))

    @T.macro
    def finish_piece(ws_o, ws_lse, ofrag, m_r, l_r, b, h, s, g0, G):
        # One piece of the keys' share of each valid row, for the combine: o = acc / l and
        # lse = (m + log2 l) * ln 2 (a row that saw no key of the piece: 0 and -inf).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for mt in T.unroll(MT):
                for nd in T.unroll(NO):
                    for l in T.unroll(4):
                        if g0 + c_row(tx, l, mt) < G:
                            ws_o[b, h, s, g0 + c_row(tx, l, mt), nd * 8 + c_col(tx, l)] = T.Select(
                                l_r[tx, 2 * mt + l // 2] > ZERO,
                                ofrag[tx, mt * NO * 4 + nd * 4 + l] / l_r[tx, 2 * mt + l // 2],
                                ZERO,
                            )
            for r in T.unroll(R):
                if tx % 4 == 0:
                    if g0 + t_row(tx, r) < G:
                        ws_lse[b, h, s, g0 + t_row(tx, r)] = T.Select(
                            l_r[tx, r] > ZERO, (m_r[tx, r] + T.log2(l_r[tx, r])) * LN2, NINF
                        )

    @T.macro
    def combine(ws_o, ws_lse, sink, out, lse, B, H, G, S):
        # Each global row's pieces and its head's sink, a thread per column: out = sum of
        # exp(lse_s - M) o_s / sum of exp(lse_s - M) (+ exp(sink - M)), lse = M + log of
        # that denominator, M the largest of the pieces' lse and the sink. A valid row
        # sees at least one key (its own position, causal), so M is finite.
        for row in T.thread_binding(B * H * G, thread="blockIdx.x"):
            for col in T.thread_binding(D, thread="threadIdx.x"):
                with T.sblock("flash_tc_global_combine"):
                    T.reads()
                    T.writes()
                    st = T.alloc_buffer((4,), acc, scope="local")  # M, denominator, numerator, a piece's weight
                    b, h, g = T.meta_var((T.truncdiv(row, H * G), T.truncmod(T.truncdiv(row, G), H), T.truncmod(row, G)))
                    st[0] = sink[h]
                    for s in T.serial(S):
                        st[0] = T.max(st[0], ws_lse[b, h, s, g])
                    st[1] = T.exp(sink[h] - st[0])
                    st[2] = ZERO
                    for s in T.serial(S):
                        st[3] = T.exp(ws_lse[b, h, s, g] - st[0])
                        st[1] = st[1] + st[3]
                        st[2] = st[2] + st[3] * ws_o[b, h, s, g, col]
                    out[b, h, g, col] = T.Cast(dt, st[2] / st[1])
                    if col == 0:
                        lse[b, h, g] = st[0] + T.log(st[1])

    store_piece = split_item_fields(NT, BQ, KC, causal)

    @T.macro
    def global_item(tiles, item, nblk, qg, k, v, gidx, sink, scale, ws_o, ws_lse, B, H, Hkv, Tn, G, S):
        QK, Qs, Vt, qfrag, qpk, kfrag, vfrag, sfrag, pfrag, ppk, ofrag, m_r, l_r, first_r, last_r, rel, part, red, K1, V1 = \
            T.meta_var(tiles)
        # split_item_fields' (b, h, g0, kvh, the piece s, its chunks c_begin..c_end),
        # then the keys every valid row sees, 0..inner_hi (each thread's copy).
        fld = T.alloc_buffer((8,), "int64", scope="local")

        store_piece(fld, item, S, H, Hkv, nblk, gidx, G, Tn)
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            fld[7] = block_inner_last_key(gidx, fld[0], fld[2], G, Tn, BQ, causal)
        b, h, g0, kvh, s = T.meta_var((fld[0], fld[1], fld[2], fld[3], fld[4]))
        scale2 = T.meta_var(scale * LOG2E)
        start_rows(QK, Qs, qfrag, qpk, ofrag, m_r, l_r, qg, b, h, lambda i: T.min(g0 + i, G - 1), None)
        # Row slot rs sees keys 0..its last (-1: a padding row past G sees none).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for rs in T.unroll(R):
                first_r[tx, rs] = T.Cast(INTERVAL, 0)
                last_r[tx, rs] = T.Cast(INTERVAL, global_row_last_key(gidx, b, g0 + t_row(tx, rs), G, Tn, causal))
        stream(
            QK, Qs, Vt, K1, V1, qfrag, qpk, kfrag, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, rel, k, v, b, kvh, Tn,
            fld[5], fld[6], lambda c, kk: T.Cast("int32", c * KC) + kk, first_r, last_r, T.int64(0), fld[7],
            scale2,
        )
        finish_piece(ws_o, ws_lse, ofrag, m_r, l_r, b, h, s, g0, G)

    @T.macro
    def global_body(qg, k, v, gidx, sink, scale, out, lse, ws_o, ws_lse, B, H, Hkv, Tn, G, S):
        # S pieces of each block's key chunks, the pieces' shares in ws_o/ws_lse (fp32,
        # the caller's: TVM's own workspace is not ordered by streams).
        nblk = T.meta_var((G + (BQ - 1)) // BQ)
        for item in T.thread_binding(B * H * nblk * S, thread="blockIdx.x"):
            with_min_blocks(lambda: row_block("flash_tc_global", with_stages(lambda tiles: global_item(
                tiles, item, nblk, qg, k, v, gidx, sink, scale, ws_o, ws_lse, B, H, Hkv, Tn, G, S))))
        combine(ws_o, ws_lse, sink, out, lse, B, H, G, S)

    if spec.kind == "global":
        return global_split_kernel(global_body, D, dt, acc)

    return local_kernel(body, D, dt, acc, extras)
