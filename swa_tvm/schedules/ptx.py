"""PTX building blocks of the tensor-core kernels (``cuda_flash_tc``, ``cuda_flash_bwd_tc``,
``cuda_wgmma``): the m16n8k16 fragment maps, the ``mma.sync`` and ``ldmatrix`` macros and
their operand loaders, cp.async and the shared tiles it fills (padded rows or wgmma's
core matrices), and the C source every macro shares (``COMMON_SOURCE``).

Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"; the same map TVM's own
``tensor_intrin.cuda.ldmatrix_32x8_to_shared_16x16_layout`` encodes), lane t of a warp,
group g = t // 4, t4 = t % 4:
- A (16x16, row-major), 8 values: row g + 8*((l % 4) // 2), column 8*(l // 4) + 2*t4 + l % 2;
- B (16x8, k x n), 4 values: k = 8*(l // 2) + 2*t4 + l % 2, n = g;
- C (16x8, fp32), 4 values: row g + 8*(l // 2), column 2*t4 + l % 2.

``emulate=True`` builds each warp-collective step (the mma, ldmatrix) as loops over the
warp's lanes, so that the kernels run serially on the CPU (see ``cuda_flash_tc``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from swa_tvm.schedules.cuda_flash import chunk_inside, clamp_row

PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
C_TYPE = {"float16": "half", "bfloat16": "bfloat16"}  # as in __half_as_ushort, __bfloat16_as_ushort


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


# Core matrices are 8 rows of 16 bytes (8 16-bit values).
CORE = 8


def core_offset(row, col, rows: int):
    """Element offset of (row, col) of a shared tile of ``rows`` rows (a multiple of 8)
    laid out as core matrices: core (row // 8, col // 8) is 64 contiguous values, row
    by row, cores down the rows first. Takes ints or index expressions."""
    return ((col // CORE) * (rows // CORE) + row // CORE) * (CORE * CORE) + (row % CORE) * CORE + col % CORE


# Guarded: each macro's source that needs it carries it, and the sources are emitted one
# by one.
COMMON_SOURCE = r"""
#ifndef SWA_WGMMA_COMMON
#define SWA_WGMMA_COMMON
__device__ __forceinline__ unsigned long long swa_gmma_desc(const void* p, unsigned lbo, unsigned sbo) {
  // PTX ISA "Matrix Descriptor Format": start address, LBO and SBO in 16-byte units at
  // bits 0, 16 and 32; base offset 0 and swizzle mode 0 (none) above them.
  unsigned a = (unsigned)__cvta_generic_to_shared(p);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16)
       | ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32);
}
#define swa_wgmma_fence() asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")
#define swa_wgmma_commit_wait0() \
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory")
#define swa_wgmma_commit() asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory")
#define swa_wgmma_wait0() asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory")
#define swa_wgmma_wait1() asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory")
// An empty asm that "modifies" a register: code writing it stays before, code reading it after.
#define swa_reg_fence_f(x) asm volatile("" : "+f"(x) :: "memory")
#define swa_reg_fence_r(x) asm volatile("" : "+r"(x) :: "memory")
// Two 16-bit values into one 32-bit operand register, the first in the low half (the
// A/B fragments of mma.sync and wgmma alike).
#define swa_pack_bf16(x, y) ((unsigned)__bfloat16_as_ushort(x) | ((unsigned)__bfloat16_as_ushort(y) << 16))
#define swa_pack_f16(x, y) ((unsigned)__half_as_ushort(x) | ((unsigned)__half_as_ushort(y) << 16))
#define swa_fence_proxy_async() asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory")
#endif
"""


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
    different banks), or wgmma's core matrices (``core_offset``; a core's 8
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


# The NaN rule on tensor cores (``cuda_flash.second_pass``): an mma cannot select per
# row, and a key a row does not see meets its weight of 0 there, 0 * NaN being NaN in
# the tensor cores as anywhere. An item whose results come out non-finite
# (``finite_vote``) is computed again, each product exact (``exact_product``).
FINITE_SOURCE = r"""
#ifndef SWA_FINITE_VOTE
#define SWA_FINITE_VOTE
// acc + x * 0: NaN once any x met is NaN or +-inf, else +-0 (an FMA, no compare; asm,
// which no fast-math can fold to acc).
__device__ __forceinline__ float swa_nonfinite_acc(float acc, float x) {
  asm("fma.rn.f32 %0, %1, 0f00000000, %0;" : "+f"(acc) : "f"(x));
  return acc;
}
// 1 in every thread of the block if any thread's acc is NaN (a barrier; the bits, as
// acc is NaN or +-0, untouched by fast-math). The warp vote over the block's answer (the
// same in every lane) tells ptxas it is uniform: a branch on it then needs no guard
// for a diverged warp at the shuffles after it.
#define swa_vote_nonfinite(acc) \
  __any_sync(0xffffffffu, __syncthreads_or((__float_as_uint(acc) & 0x7fffffffu) != 0u))
#endif
"""


def finite_vote(threads: int, emulate: bool):
    """A T.macro ``vote(frag, n, flag)``: flag[0] (a local int32) = 1 in every thread of
    the block if any of the fp32 registers frag[tx, 0 .. n - 1] of any thread is NaN or
    +-inf, else 0 (one FMA a register, one block-wide vote); emulated, the threads in
    turn."""

    @T.macro
    def vote(frag, n, flag):
        if emulate:
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                flag[0] = 0
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                for i in T.serial(n):
                    if T.Not(T.isfinite(frag[tx, i])):
                        flag[0] = 1
        else:
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                acc = T.alloc_buffer((1,), "float32", scope="local")
                acc[0] = T.float32(0)
                for i in T.unroll(n):
                    acc[0] = T.cuda.func_call("swa_nonfinite_acc", acc[0], frag[tx, i], source_code=FINITE_SOURCE,
                                              return_type="float32")
                flag[0] = T.cuda.func_call("swa_vote_nonfinite", acc[0], source_code=FINITE_SOURCE, return_type="int32")

    return vote


# The codes of ``exact_product``'s second product: an A value (P, dS) and a B value
# (V, K) as small powers of two whose products, summed over a k-step's 16 keys (at most
# 16 of each kind), keep apart the kinds of term a non-finite B value makes: A > 0 times
# +inf and A < 0 times -inf give +inf (digits 1 and 1024), the crossed pairs -inf
# (digit 32); a NaN B against a nonzero A, or a NaN A against a non-finite B, NaN
# (32768 and up). An A of 0 (a key its row does not see, or one the softmax gives
# nothing: the reference's rule) codes 0, so adds nothing. Exact in fp16 and bf16
# operands and fp32 sums.
CODE_POS, CODE_NEG, CODE_NAN = 1.0, 32.0, 32768.0


def exact_product(warps: int, dtype: str, emulate: bool, mtiles: int, ksteps: int, ntiles: int):
    """A T.macro ``exact(afrag, a0, value, cacc, c0, scr)``: C += A B on mma.sync
    (``mma_macro``; in a wgmma kernel too: its fragments are mma's), exactly under the
    NaN rule: an A value of 0 adds nothing, whatever B holds. A: the threads' A
    fragments, k-step ks of row tile mt at afrag[tx, a0(mt) + 8*ks ..]; B[k][n] =
    ``value(k, n)`` (a shared tile's element, any layout), k < 16*ksteps, n <
    8*ntiles; C at cacc[tx, c0(mt) + 4*nd ..] for output tile nd. ``scr``: scratch
    (``exact_scratch_shapes``).

    Two products per output tile and k-step: A against B with its non-finite values
    zeroed, and codes of the A values against codes of the non-finite B values
    (``CODE_*``), whose sum says which of +inf, -inf, NaN (or nothing) the non-finite
    values add to each output. For the items computed again (see above), so compact
    rather than fast: A and C copied to scratch arrays that loops over tiles and
    k-steps index at run time (local memory: the fragments keep constant indices, and
    their registers)."""
    nt = 32 * warps
    mma = mma_macro(warps, dtype, emulate)
    f32 = "float32"
    POS, NEG, NAN_ = (T.Cast(dtype, tirx.const(x, f32)) for x in (CODE_POS, CODE_NEG, CODE_NAN))
    ZERO_DT = T.Cast(dtype, tirx.const(0.0, f32))
    ZERO, INF = tirx.const(0.0, f32), tirx.const(float("inf"), f32)

    def b_code(v):
        x = T.Cast(f32, v)
        return T.Select(T.isfinite(x), ZERO_DT, T.Select(T.isnan(x), NAN_, T.Select(x > ZERO, POS, NEG)))

    def a_code(a):
        x = T.Cast(f32, a)
        return T.Select(x > ZERO, POS, T.Select(x < ZERO, NEG, T.Select(x == ZERO, ZERO_DT, NAN_)))

    def decode(t):
        # t < 32768: t = p1 + 32 m + 1024 p2, each count at most 16.
        q1 = T.floor(t / tirx.const(32.0, f32))
        q2 = T.floor(t / tirx.const(1024.0, f32))
        pos = (t - q1 * tirx.const(32.0, f32)) + q2
        neg = q1 - q2 * tirx.const(32.0, f32)
        return T.Select(
            T.Or(t >= tirx.const(CODE_NAN, f32), T.And(pos > ZERO, neg > ZERO)), tirx.const(float("nan"), f32),
            T.Select(pos > ZERO, INF, T.Select(neg > ZERO, -INF, ZERO)),
        )

    def b_value(value, tx, x, ks, nd):
        return value(ks * 16 + b_pos(tx % 32, x)[0], nd * 8 + b_pos(tx % 32, x)[1])

    @T.macro
    def exact(afrag, a0, value, cacc, c0, scr):
        bf, bc, ac, cnt, csc, asc = T.meta_var(scr)
        for tx in T.thread_binding(nt, thread="threadIdx.x"):
            for mt in T.unroll(mtiles):
                for i in T.unroll(ntiles * 4):
                    csc[tx, mt * ntiles * 4 + i] = cacc[tx, c0(mt) + i]
                for i in T.unroll(ksteps * 8):
                    asc[tx, mt * ksteps * 8 + i] = afrag[tx, a0(mt) + i]
        for mt in T.serial(mtiles):
            for nd in T.serial(ntiles):
                for ks in T.serial(ksteps):
                    for tx in T.thread_binding(nt, thread="threadIdx.x"):
                        for x in T.unroll(4):
                            bf[tx, x] = T.Select(T.isfinite(T.Cast(f32, b_value(value, tx, x, ks, nd))),
                                                 b_value(value, tx, x, ks, nd), ZERO_DT)
                            bc[tx, x] = b_code(b_value(value, tx, x, ks, nd))
                        for l in T.unroll(8):
                            ac[tx, l] = a_code(asc[tx, (mt * ksteps + ks) * 8 + l])
                        for l in T.unroll(4):
                            cnt[tx, l] = ZERO
                    mma(asc, (mt * ksteps + ks) * 8, bf, 0, csc, (mt * ntiles + nd) * 4)
                    mma(ac, 0, bc, 0, cnt, 0)
                    for tx in T.thread_binding(nt, thread="threadIdx.x"):
                        for l in T.unroll(4):
                            csc[tx, (mt * ntiles + nd) * 4 + l] = csc[tx, (mt * ntiles + nd) * 4 + l] + decode(cnt[tx, l])
        for tx in T.thread_binding(nt, thread="threadIdx.x"):
            for mt in T.unroll(mtiles):
                for i in T.unroll(ntiles * 4):
                    cacc[tx, c0(mt) + i] = csc[tx, mt * ntiles * 4 + i]

    return exact


def alloc_nan_guard(shapes):
    """(flag, scratch): the NaN rule's vote flag (a local int32, ``finite_vote``) and
    ``exact_product``'s scratch of the given ``exact_scratch_shapes``, allocated in the
    kernel body's enclosing sblock. Called there as ``T.meta_var(alloc_nan_guard(...))``:
    the parser evaluates the call, whose T.alloc_buffer land in that sblock as if
    written inline."""
    flag = T.alloc_buffer((1,), "int32", scope="local")
    return flag, tuple(T.alloc_buffer(shape, dtype, scope="local") for shape, dtype in shapes)


def exact_scratch_shapes(threads: int, dtype: str, mtiles: int, ksteps: int, ntiles: int):
    """(shape, dtype) of ``exact_product``'s scratch: the B values and codes and the A
    codes of one product, the codes' sums, then the copies of C and of A."""
    return (((threads, 4), dtype), ((threads, 4), dtype), ((threads, 8), dtype), ((threads, 4), "float32"),
            ((threads, mtiles * ntiles * 4), "float32"), ((threads, mtiles * ksteps * 8), dtype))
