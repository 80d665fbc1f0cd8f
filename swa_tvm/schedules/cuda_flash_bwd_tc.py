"""The fused gradient kernels of ``cuda_flash_bwd`` on tensor cores (float16/bfloat16
inputs, fp32 accumulation): the same four kinds, work items, masks and arguments, with
every product an ``mma.sync.m16n8k16`` (``cuda_flash_tc``'s instruction, fragment maps
and emulation).

Each warp owns 16 rows of the item: query rows for ``local_dq`` and the global rows'
dq, keys for ``local_dkv``, ``local_dx`` and the global rows' dk/dv. The item's two
tiles (Q and dO, or K and V) stay in shared memory for the whole item, the chunk's two
(K and V, or Q and dO) pass through it; per chunk each warp computes, as C fragments in
registers,

- S = A B^T and dP = A2 B2^T over the head dim (A/A2 the item's tiles, B/B2 the chunk's);
- P = exp(scale * S - lse) where visible, and dS = P (dP - delta), with lse and delta
  of the query side (per row for dq, per chunk column for dk/dv);
- dq += dS K, or dv += P^T dO and dk += dS^T Q: the C fragments of P and dS, rounded to
  the input dtype, are the A operands of these products (as P is in the forward's P V),
  the chunk's tile the B operand read along its rows (``ldmatrix.trans``, as the
  forward's V).

Like FlashAttention-2's backward, P and dS enter their products in the input dtype;
the accumulators stay fp32. No scatter and no atomics: as in ``cuda_flash_bwd``, the
dq and dk/dv sides are separate kernels; the global rows' dq is split-K (pieces of the
keys into the caller's workspace, then summed), as the forward's global rows.

``TCBwdConfig(wgmma=True)`` (sm_90a) issues every product as Hopper's ``wgmma`` instead
(``cuda_wgmma``): S and dP with both operands from shared memory, the accumulations with
P or dS from registers.

``TCBwdConfig(stages=2)`` streams the chunks through two tile pairs filled by cp.async
(``ring``, the forward's two-stage order): chunk c + 1's copies land while chunk c is
computed, where one stage loads each chunk and then waits for it.

The NaN rule (``cuda_flash.second_pass``): dS is 0 wherever P is in the chunks that take
a mask (a select a score); an item whose dq, or dk, comes out non-finite (a non-finite K
met with a weight of 0 in dS K; a visible P of 0 met with a NaN dP or delta in a chunk
seen whole) is computed again after its chunk loops, on mma.sync, every product exact
(``ptx.exact_product``).

With ``emulate=True`` the mma runs lane by lane, so the tests run these kernels serially
on the CPU (see ``cuda_flash_tc``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import tvm
from tvm import tirx
from tvm.script import tirx as T

from swa_tvm.compute.forward import extra_visible, row_key_range
from swa_tvm.schedules.cuda_flash import (
    ITEM_SCALARS,
    band_positions,
    extra_positions_loader,
    global_fields,
    global_row_last_key,
    item_scalars,
    largest_fitting,
    second_pass,
    split_item_fields,
)
from swa_tvm.schedules.cuda_flash_bwd import (
    KINDS,
    _dkv_kernel,
    _dq_kernel,
    _dx_kernel,
    _global_split_kernel,
    last_keys_loader,
    stat_rows,
    stats_loader,
)
from swa_tvm.schedules.cuda_flash_tc import tile_scope
from swa_tvm.schedules.cuda_wgmma import (
    a_packer,
    packed_a,
    sync_macros,
    wgmma_macro,
    wgmma_ss_macro,
)
from swa_tvm.schedules.ptx import (
    CP_ASYNC_SOURCE,
    PTX_TYPE,
    TileLayout,
    a_loader,
    a_pos,
    alloc_nan_guard,
    async_loader,
    b_pos,
    c_pos,
    chunk_mask,
    exact_product,
    exact_scratch_shapes,
    finite_vote,
    kn_loader,
    load_band_rows,
    mma_macro,
    nk_loader,
    pair_loader,
    two_stage_ring,
)
from swa_tvm.spec import KernelSpec


class Frags(NamedTuple):
    """A warp's register fragments, passed whole to the step macros: A operands of the
    item's two tiles, B operands of the chunk's two, S and dP (fp32 C fragments), P and
    dS as A operands (P: None in the dq kernels)."""

    a: object
    a2: object
    b: object
    b2: object
    s: object
    dp: object
    p: object
    ds: object


@dataclass(frozen=True)
class TCBwdConfig:
    warps: int = 2  # 16 item rows each: block = 16 * warps
    chunk: int = 32  # partners per step (a multiple of 16)
    ldmatrix: bool = True  # every operand read from shared memory by ldmatrix(.trans) (else 16-bit loads)
    # Hopper's wgmma (sm_90a; cuda_wgmma), as the forward's: S and dP with both operands
    # read by the tensor cores from the item's and the chunk's tiles (core matrices), the
    # accumulations with P or dS from registers; warps a multiple of 4.
    wgmma: bool = False
    # Chunk stages. 1: the chunk's two tiles by synchronous loads, then its products. 2:
    # a ring of two tile pairs (and lse/delta tables) filled by cp.async, chunk c + 1's
    # copies issued before chunk c's products (as the forward's ``TCConfig.stages``), in
    # the band loops of dq and dk/dv, the global rows' split-K dq and the extra keys'
    # dk/dv (not the global rows' dk/dv: a few chunks of global rows; nor dq's extra keys,
    # whose positions are loaded first).
    stages: int = 1

    @property
    def block(self) -> int:
        return 16 * self.warps

    @property
    def async_copy(self) -> bool:
        """Chunks by cp.async: with two stages only. With one there is nothing to overlap
        (both of a chunk's tiles feed its first products)."""
        return self.stages == 2

    def shared_bytes(self, head_dim: int, dtype: str) -> int:
        el = tvm.runtime.DataType(dtype).bits // 8
        # The item's two tiles, each stage's two chunk tiles and lse and delta per chunk
        # column; the extra keys' three int64 tables (or the global rows' last keys);
        # alignment.
        row = head_dim + (0 if self.wgmma else 8)
        return (2 * (self.block + self.stages * self.chunk) * row * el + self.chunk * (self.stages * 2 * 4 + 3 * 8)
                + (9 + 4 * (self.stages - 1)) * 64)


# cp.async of one 4-byte value, zeros where ``bytes`` is 0 (the PTX's src-size).
CP_ASYNC_4_SOURCE = r"""
#define swa_cp_async_4(dst, src, bytes) asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" \
  :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes))
"""


def async_stats_loader(threads: int, count: int, emulate: bool):
    """A T.macro ``issue(lse_t, delta_t, lse, delta, b, h, pos_of, n)``: ``stats_loader``'s
    tables by cp.async (4 bytes a value; committed as one group, waited for by
    ``async_loader``'s ``wait_all``), lse as it is (not in log2 units) and 0 for both at
    a position outside [0, n) (the copy's zero fill): every such column is masked
    wherever it is read (past the sequence, no row's band interval holds it), and the
    masked scores take P = 0 by a select, so no value of these reaches a gradient."""
    each = stat_rows(threads, count)

    @T.macro
    def copy(t, i, src, b, h, j, ok):
        if emulate:
            t[i] = T.Select(ok, src[b, h, j], T.Cast(t.dtype, 0))
        else:
            # Marked read, not written, for TVM's barrier planner (as async_loader's).
            T.evaluate(T.cuda.func_call(
                "swa_cp_async_4", t.access_ptr("r", offset=i, extent=1), T.address_of(src[b, h, j]),
                T.Select(ok, 4, 0), source_code=CP_ASYNC_4_SOURCE,
            ))

    @T.macro
    def copy_both(lse_t, delta_t, lse, delta, b, h, i, j, ok):
        copy(lse_t, i, lse, b, h, j, ok)
        copy(delta_t, i, delta, b, h, j, ok)

    @T.macro
    def issue(lse_t, delta_t, lse, delta, b, h, pos_of, n):
        each(pos_of, n, lambda i, j, ok: copy_both(lse_t, delta_t, lse, delta, b, h, i, j, ok))
        if not emulate:
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                T.evaluate(T.cuda.func_call("swa_cp_async_commit", source_code=CP_ASYNC_SOURCE))

    return issue


# Largest first. Chunks stop at 32: a dk/dv warp holds two head-dim accumulators (64 fp32
# registers each at head_dim 128) next to the S and dP fragments (chunk / 2 each).
CONFIGS = ((4, 32), (2, 32), (4, 16), (2, 16), (1, 16))


def supports(spec: KernelSpec) -> bool:
    """Gradient kernels (``cuda_flash_bwd.KINDS``) in float16/bfloat16 with head_dim % 16 == 0."""
    return spec.kind in KINDS and spec.dtype in PTX_TYPE and spec.head_dim % 16 == 0


def default_config(spec: KernelSpec) -> TCBwdConfig | None:
    return largest_fitting(TCBwdConfig, spec, CONFIGS) if supports(spec) else None


def flash_bwd_tc(spec: KernelSpec, config: TCBwdConfig | None = None, emulate: bool = False) -> tvm.tirx.PrimFunc:
    """The tensor-core PrimFunc of a gradient spec, with the TE kernel's arguments and
    name (those of ``cuda_flash_bwd.flash_bwd``)."""
    if not supports(spec):
        raise ValueError(
            f"kernel {spec.name}: the tensor-core backward takes float16/bfloat16 gradient kernels {KINDS} "
            "with head_dim % 16 == 0"
        )
    cfg = config or default_config(spec)
    return _build(spec, cfg, tile_scope(spec, cfg), emulate).with_attr("global_symbol", spec.name)


def _build(spec: KernelSpec, cfg: TCBwdConfig, SH: str, emulate: bool):  # noqa: C901 - four kernels, phase by phase
    D, dt, acc = spec.head_dim, spec.dtype, "float32"
    lo, hi, maxd, extras, causal = spec.left, spec.right, spec.max_dilation, spec.extras, spec.causal
    NW, KC, STAGES = cfg.warps, cfg.chunk, cfg.stages
    BR, NT = 16 * NW, 32 * NW
    NS, NO, KD, KK = KC // 8, D // 8, D // 16, KC // 16  # score tiles, output tiles, k-steps (head dim, chunk)
    # Tiles of rows padded by 8 values, as in cuda_flash_tc, or wgmma's core matrices.
    WG = bool(cfg.wgmma)
    item_tile, chunk_tile = TileLayout(D, BR, WG), TileLayout(D, KC, WG)
    INF = tirx.const(float("inf"), acc)
    ZERO, ONE = tirx.const(0.0, acc), tirx.const(1.0, acc)
    # Probabilities as exp2 of scores and lse in log2 units (scale * log2 e): one FFMA
    # and the hardware's ex2 per score (see cuda_flash_tc).
    LOG2E = tirx.const(math.log2(math.e), acc)
    mma = mma_macro(NW, dt, emulate)
    load_kn = kn_loader(NW, D, dt, cfg.ldmatrix, emulate)
    load_a = a_loader(NW, D, dt, cfg.ldmatrix, emulate)
    load_nk = nk_loader(NW, D, dt, cfg.ldmatrix, emulate)
    store_item, load_item_scalars = item_scalars(NT, BR, lo, hi, KC)
    store_key_item, load_key_item_scalars = item_scalars(NT, BR, hi, lo, KC)  # the transposed band (dk/dv)
    chunk_inside, chunk_bounds, chunk_visible = chunk_mask(NT, 2, KC)
    _, _, wg_proxy_fence, wg_group = sync_macros(NT, emulate)
    # bfrag: mma.sync's B operands of a load; with wgmma (B from shared memory), the
    # chunk's A operands of ``accumulate``, packed in 32-bit registers.
    BOPS = packed_a(NT, KK, dt, emulate) if WG else ((NT, 8), dt)
    if WG:
        pack_a = a_packer(NT, dt, emulate)
        wgmma_products = wgmma_ss_macro(NW, dt, KC, BR, emulate)  # S or dP [64 x KC] per warpgroup
        wgmma_accumulate = wgmma_macro(NW, dt, "kn", D, KC, emulate)  # [64 x D] += (P or dS) C

        @T.macro
        def s_and_dp(A, A2, Bt, B2, ks, sfrag, dpfrag):
            wgmma_products(A, Bt, ks, sfrag)
            wgmma_products(A2, B2, ks, dpfrag)
    # wgmma reads both tiles after a chunk's load, whose fence (any prior store of the
    # thread, not one tile's) covers the item's tiles too.
    load_item = pair_loader(NT, D, BR, WG)
    load_chunk = pair_loader(NT, D, KC, WG, wg_proxy_fence if WG else None)
    load_chunk_unfenced = pair_loader(NT, D, KC, WG)

    @T.macro
    def load_band_chunk(A, B, src_a, src_b, b, hh, pos, n):
        # A band chunk's rows, unclamped where all lie in the sequence (as the forward's).
        load_band_rows(lambda clamp: load_chunk_unfenced(A, B, src_a, src_b, b, hh, pos, n, clamp),
                       pos, KC, n, wg_proxy_fence if WG else None)
    load_chunk_stats = stats_loader(NT, KC, acc, lse_scale=LOG2E)
    # Two chunk stages (TCBwdConfig.stages): the chunk's tiles and stats by cp.async.
    issue_tile, wait_all = async_loader(NT, D, KC, emulate, WG)
    issue_stats = async_stats_loader(NT, KC, emulate)

    @T.macro
    def issue_pair(A, B, src_a, src_b, b, hh, pos, n, clamp):
        issue_tile(A, src_a, b, hh, pos, n, clamp)
        issue_tile(B, src_b, b, hh, pos, n, clamp)

    @T.macro
    def issue_chunk(A, B, src_a, src_b, b, hh, pos, n):
        # A chunk's two tiles (rows at pos(kk), unclamped where all lie in the sequence);
        # no fence: wait_all's, once they land.
        load_band_rows(lambda clamp: issue_pair(A, B, src_a, src_b, b, hh, pos, n, clamp), pos, KC, n)

    # The synchronous stats loader stores lse in log2 units, cp.async copies it as it is.
    LSE_LOG2 = STAGES == 1

    @T.macro
    def load_query_chunk(Qt, dOt, lse_c, delta_c, q, dout, lse, delta, b, h, pos, n, clamp=False):
        # A chunk of queries for the dk/dv kernels, synchronously: Q's and dO's rows
        # (``clamp``: every row clamped, else unclamped where all lie in the sequence),
        # lse and delta.
        if clamp:
            load_chunk(Qt, dOt, q, dout, b, h, pos, n)
        else:
            load_band_chunk(Qt, dOt, q, dout, b, h, pos, n)
        load_chunk_stats(lse_c, delta_c, lse, delta, b, h, pos, n)

    @T.macro
    def issue_query_chunk(tiles, q, dout, lse, delta, b, h, pos, n):
        # A chunk of queries for the dk/dv kernels: Q's and dO's rows, lse and delta.
        issue_chunk(tiles[0], tiles[1], q, dout, b, h, pos, n)
        issue_stats(tiles[2], tiles[3], lse, delta, b, h, pos, n)

    # (The item's tiles, stored before the stream, are only read: nothing to wait for
    # ahead of the first copies.)
    ring = two_stage_ring(wait_all)

    @T.macro
    def second_stage(stats, body):
        # The second stage's chunk tiles (and lse and delta tables, with ``stats``), in the
        # kernel's sblock: ``body((A1, B1, lse1, delta1))`` (the tables None without).
        A1 = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
        B1 = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
        if stats:
            lse1 = T.alloc_buffer((KC,), acc, scope=SH)
            delta1 = T.alloc_buffer((KC,), acc, scope=SH)
            body((A1, B1, lse1, delta1))
        else:
            body((A1, B1, None, None))

    def staged(s, first, second):
        """Stage s's buffers: ``first`` (the kernel's own) or ``second`` (second_stage's)."""
        return first if s == 0 else second

    @T.macro
    def chunk_stream(c_begin, c_end, first, load, issue, compute):
        # Chunks c_begin <= c < c_end through ``first`` (the kernel's chunk tiles and its
        # lse/delta tables, or None, None): one stage, ``load(c)`` then ``compute(first,
        # c)``; two, ``ring`` over ``first`` and second_stage's (``issue(tiles, c)``
        # copies chunk c into a stage's tiles, compute reads them).
        if STAGES == 2:
            second_stage(first[2] is not None, lambda st: ring(
                c_begin, c_end, lambda s, c: issue(staged(s, first, st), c), lambda s, c: compute(staged(s, first, st), c)
            ))
        else:
            for c in T.serial(c_begin, c_end):
                load(c)
                compute(first, c)

    load_extra_positions = extra_positions_loader(NT, KC)
    load_last_keys = last_keys_loader(NT, KC, causal)

    def c_row(tx, l):
        """Row (in the item) of value l of a C fragment of thread tx."""
        return (tx // 32) * 16 + c_pos(tx % 32, l)[0]

    def c_col(tx, l):
        return c_pos(tx % 32, l)[1]

    def a_slot(nt, l):
        """The A-operand index (chunk k-step nt // 2) of C value l of score tile nt."""
        return (nt // 2) * 8 + 4 * (nt % 2) + l

    @T.macro
    def products(A, A2, Bt, B2, fr):
        # S = A Bt^T and dP = A2 B2^T: each warp's 16 item rows against the chunk's KC
        # partners, over the head dim (one A fragment per k-step, reused by every tile).
        afrag, a2frag, bfrag, b2frag, sfrag, dpfrag = T.meta_var((fr.a, fr.a2, fr.b, fr.b2, fr.s, fr.dp))
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.unroll(NS * 4):
                sfrag[tx, x] = ZERO
                dpfrag[tx, x] = ZERO
        if WG:  # S's and dP's k-steps, one group
            wg_group(KD, lambda ks: s_and_dp(A, A2, Bt, B2, ks, sfrag, dpfrag), sfrag, NS * 4, dpfrag)
        for ks in T.unroll(0 if WG else KD):
            load_a(A, afrag, 0, lambda tx: (tx // 32) * 16, ks)
            load_a(A2, a2frag, 0, lambda tx: (tx // 32) * 16, ks)
            for ntp in T.unroll(NS // 2):
                load_nk(Bt, bfrag, ntp, ks)
                load_nk(B2, b2frag, ntp, ks)
                mma(afrag, 0, bfrag, 0, sfrag, 2 * ntp * 4)
                mma(afrag, 0, bfrag, 4, sfrag, (2 * ntp + 1) * 4)
                mma(a2frag, 0, b2frag, 0, dpfrag, 2 * ntp * 4)
                mma(a2frag, 0, b2frag, 4, dpfrag, (2 * ntp + 1) * 4)

    @T.macro
    def accumulate(wfrag, Ct, bfrag, cacc):
        # cacc += W C: W the warp's rows x the chunk's KC partners (A fragments), C the
        # chunk's tile [partners, D] read along its rows, two output tiles per load
        # (wgmma: every column at once, W packed into bfrag first).
        if WG:
            pack_a(wfrag, 0, bfrag, 0, KK)
            wg_group(KK, lambda ks: wgmma_accumulate(bfrag, ks * 4, Ct, ks, cacc), cacc, NO * 4)
        for ks in T.unroll(0 if WG else KK):
            for ndp in T.unroll(NO // 2):
                load_kn(Ct, bfrag, ks, ndp)
                mma(wfrag, ks * 8, bfrag, 0, cacc, ndp * 8)
                mma(wfrag, ks * 8, bfrag, 4, cacc, ndp * 8 + 4)

    @T.macro
    def zero(cacc):
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.unroll(NO * 4):
                cacc[tx, x] = ZERO

    @T.macro
    def write_rows(dst, cacc, b, h, pos_of, n, scale):
        # dst[b, h, pos_of(row)] = cacc * scale for the rows with pos_of(row) < n, in dst's
        # dtype (the input dtype for dq, fp32 for dk and dv).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for nd in T.unroll(NO):
                for l in T.unroll(4):
                    if pos_of(c_row(tx, l)) < n:
                        dst[b, h, pos_of(c_row(tx, l)), nd * 8 + c_col(tx, l)] = T.Cast(dst.dtype, cacc[tx, nd * 4 + l] * scale)

    @T.macro
    def row_stats(lse_r, delta_r, lse, delta, b, h, pos_of, n):
        # Each thread's two rows' lse (log2 units) and delta (a row past n: +inf and 0, so P = 0).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for rr in T.unroll(2):
                lse_r[tx, rr] = T.Select(
                    pos_of(c_row(tx, 2 * rr)) < n, lse[b, h, T.min(pos_of(c_row(tx, 2 * rr)), n - 1)] * LOG2E, INF
                )
                delta_r[tx, rr] = T.Select(
                    pos_of(c_row(tx, 2 * rr)) < n, delta[b, h, T.min(pos_of(c_row(tx, 2 * rr)), n - 1)], ZERO
                )

    @T.macro
    def dq_scores(fr, lse_r, delta_r, visible, scale2, exact=False):
        # dS = P (dP - delta), 0 where masked (visible(tx, l, nt); None: every score is
        # visible); a row with lse = +inf, padding or past the end, gets P = 0. With
        # ``exact`` (the second pass, ``cuda_flash.second_pass``), dS = 0 wherever P is
        # 0, not 0 * (dP - delta): NaN where a v or the row's delta is.
        sfrag, dpfrag, dsfrag = T.meta_var((fr.s, fr.dp, fr.ds))
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for nt in T.unroll(NS):
                for l in T.unroll(4):
                    if exact:
                        sfrag[tx, nt * 4 + l] = T.exp2(sfrag[tx, nt * 4 + l] * scale2 - lse_r[tx, l // 2])
                        if visible is not None:
                            sfrag[tx, nt * 4 + l] = T.Select(visible(tx, l, nt), sfrag[tx, nt * 4 + l], ZERO)
                        dsfrag[tx, a_slot(nt, l)] = T.Cast(dt, T.Select(
                            sfrag[tx, nt * 4 + l] == ZERO, ZERO,
                            sfrag[tx, nt * 4 + l] * (dpfrag[tx, nt * 4 + l] - delta_r[tx, l // 2]),
                        ))
                    elif visible is None:
                        dsfrag[tx, a_slot(nt, l)] = T.Cast(
                            dt,
                            T.exp2(sfrag[tx, nt * 4 + l] * scale2 - lse_r[tx, l // 2])
                            * (dpfrag[tx, nt * 4 + l] - delta_r[tx, l // 2]),
                        )
                    else:
                        dsfrag[tx, a_slot(nt, l)] = T.Cast(
                            dt,
                            T.Select(
                                visible(tx, l, nt),
                                T.exp2(sfrag[tx, nt * 4 + l] * scale2 - lse_r[tx, l // 2])
                                * (dpfrag[tx, nt * 4 + l] - delta_r[tx, l // 2]),
                                ZERO,
                            ),
                        )

    # The NaN rule for dq's dS K (``cuda_flash.second_pass``; ptx: ``finite_vote``,
    # ``exact_product``): masked dS is 0, but 0 * NaN (or inf) is NaN in an mma, so a
    # non-finite K where a row cannot see it leaves NaN in that row's dq. The chunk loops
    # run as they always have; an item whose dq comes out non-finite is computed again
    # after them, each dS K exact. The cost for finite data: one FMA per dq register and
    # a block-wide vote, per item, outside the chunk loop.
    vote = finite_vote(NT, emulate)
    exact = exact_product(NW, dt, emulate, 1, KK, NO)
    SCR = exact_scratch_shapes(NT, dt, 1, KK, NO)

    @T.macro
    def dq_step(Qs, dOs, Kt, Vt, fr, lse_r, delta_r, dqacc, visible, scale2):
        products(Qs, dOs, Kt, Vt, fr)
        dq_scores(fr, lse_r, delta_r, visible, scale2)
        accumulate(fr.ds, Kt, fr.b, dqacc)

    def column_lse(lse_c, tx, l, nt, log2):
        """lse (log2 units) of the query column of C value l of score tile nt: the table's
        value as stored (``log2``: ``stats_loader`` scaled it) or scaled here (cp.async
        copies it as it is)."""
        value = lse_c[nt * 8 + c_col(tx, l)]
        return value if log2 else value * LOG2E

    @T.macro
    def dkv_scores(fr, lse_c, delta_c, visible, scale2, log2=True, exact=True):
        # Rows are keys, columns the chunk's queries: P^T and dS^T (masked as dq_scores;
        # lse_c by column_lse).
        sfrag, dpfrag, pfrag, dsfrag = T.meta_var((fr.s, fr.dp, fr.p, fr.ds))
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for nt in T.unroll(NS):
                for l in T.unroll(4):
                    if visible is None:
                        sfrag[tx, nt * 4 + l] = T.exp2(sfrag[tx, nt * 4 + l] * scale2 - column_lse(lse_c, tx, l, nt, log2))
                    else:
                        sfrag[tx, nt * 4 + l] = T.Select(
                            visible(tx, l, nt),
                            T.exp2(sfrag[tx, nt * 4 + l] * scale2 - column_lse(lse_c, tx, l, nt, log2)),
                            ZERO,
                        )
                    pfrag[tx, a_slot(nt, l)] = T.Cast(dt, sfrag[tx, nt * 4 + l])
                    if exact:
                        # Where P is 0 (masked, or a weight of 0: the NaN rule), dS 0, not
                        # 0 * (dP - delta), NaN where the item's v or the query's delta (a
                        # row that sees NaN) is: a compare and a select a score. (Not in
                        # the band's chunk loop, whose items a non-finite dk computes again.)
                        dpfrag[tx, nt * 4 + l] = sfrag[tx, nt * 4 + l] * (dpfrag[tx, nt * 4 + l] - delta_c[nt * 8 + c_col(tx, l)])
                        dsfrag[tx, a_slot(nt, l)] = T.Cast(
                            dt, T.Select(sfrag[tx, nt * 4 + l] == ZERO, ZERO, dpfrag[tx, nt * 4 + l])
                        )
                    else:
                        dsfrag[tx, a_slot(nt, l)] = T.Cast(
                            dt, sfrag[tx, nt * 4 + l] * (dpfrag[tx, nt * 4 + l] - delta_c[nt * 8 + c_col(tx, l)])
                        )

    @T.macro
    def dkv_accumulate(dOt, Qt, fr, kacc, vacc):
        # dv += P^T dO and dk += dS^T Q.
        accumulate(fr.p, dOt, fr.b, vacc)
        accumulate(fr.ds, Qt, fr.b, kacc)

    @T.macro
    def dkv_step(Ks, Vs, Qt, dOt, fr, lse_c, delta_c, kacc, vacc, visible, scale2, log2=True):
        products(Ks, Vs, Qt, dOt, fr)
        dkv_scores(fr, lse_c, delta_c, visible, scale2, log2)
        dkv_accumulate(dOt, Qt, fr, kacc, vacc)

    @T.macro
    def products_sync(A, A2, Bt, B2, fr):
        # ``products`` for an item's second pass (``cuda_flash.second_pass``): on mma.sync
        # whatever the kernel's products are, every operand read from its tile value by
        # value (any layout; and no address arithmetic shared with the chunk loop's
        # ldmatrix, which the compiler otherwise keeps live across it, at a cost to the
        # loop).
        afrag, a2frag, b2frag, sfrag, dpfrag = T.meta_var((fr.a, fr.a2, fr.b2, fr.s, fr.dp))
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.unroll(NS * 4):
                sfrag[tx, x] = ZERO
                dpfrag[tx, x] = ZERO
        for ks in T.serial(KD):  # (a loop: the fragments' indices stay constant, so registers)
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                for l in T.unroll(8):
                    afrag[tx, l] = A[item_tile.index((tx // 32) * 16 + a_pos(tx % 32, l)[0], ks * 16 + a_pos(tx % 32, l)[1])]
                    a2frag[tx, l] = A2[item_tile.index((tx // 32) * 16 + a_pos(tx % 32, l)[0], ks * 16 + a_pos(tx % 32, l)[1])]
            for nt in T.unroll(NS):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for x in T.unroll(4):
                        b2frag[tx, x] = Bt[chunk_tile.index(nt * 8 + b_pos(tx % 32, x)[1], ks * 16 + b_pos(tx % 32, x)[0])]
                        b2frag[tx, 4 + x] = B2[chunk_tile.index(nt * 8 + b_pos(tx % 32, x)[1], ks * 16 + b_pos(tx % 32, x)[0])]
                mma(afrag, 0, b2frag, 0, sfrag, nt * 4)
                mma(a2frag, 0, b2frag, 4, dpfrag, nt * 4)

    @T.macro
    def dq_band_scores(c, Qs, dOs, Kt, Vt, fr, lse_r, delta_r, rel, first_r, last_r, inner_lo, inner_hi, scale2, sync):
        # S, dP (``sync``: on mma.sync, ``products_sync``) and dS of band chunk c of a dq
        # item, its keys in Kt and values in Vt: a chunk every row sees whole (most of a
        # long window's) takes no mask.
        if sync:
            products_sync(Qs, dOs, Kt, Vt, fr)
        else:
            products(Qs, dOs, Kt, Vt, fr)
        if chunk_inside(c, inner_lo, inner_hi):
            dq_scores(fr, lse_r, delta_r, None, scale2, sync)
        else:
            chunk_bounds(rel, first_r, last_r, c)
            dq_scores(fr, lse_r, delta_r, lambda tx, l, nt: chunk_visible(rel, tx, l, nt, l // 2), scale2, sync)

    @T.macro
    def dq_band_step(c, Qs, dOs, Kt, Vt, fr, lse_r, delta_r, dqacc, rel, first_r, last_r, inner_lo, inner_hi, scale2):
        dq_band_scores(c, Qs, dOs, Kt, Vt, fr, lse_r, delta_r, rel, first_r, last_r, inner_lo, inner_hi, scale2, False)
        accumulate(fr.ds, Kt, fr.b, dqacc)

    @T.macro
    def exact_acc(wfrag, Ct, cacc, scr):
        # cacc += W C exactly (``accumulate``'s product; W of a masked pair is exactly 0).
        exact(wfrag, lambda mt: 0, lambda key, col: Ct[chunk_tile.index(key, col)], cacc, lambda mt: 0, scr)

    @T.macro
    def exact_dq(Kt, fr, dqacc, scr):
        exact_acc(fr.ds, Kt, dqacc, scr)

    @T.macro
    def dkv_band_step(c, Ks, Vs, Qt, dOt, fr, lse_c, delta_c, kacc, vacc, rel, first_r, last_r, inner_lo, inner_hi,
                      scale2, log2):
        # Band chunk c of a dk/dv item, its queries in Qt, their output gradients in dOt
        # (masked as dq_band_step's).
        products(Ks, Vs, Qt, dOt, fr)
        if chunk_inside(c, inner_lo, inner_hi):
            dkv_scores(fr, lse_c, delta_c, None, scale2, log2, False)
        else:
            chunk_bounds(rel, first_r, last_r, c)
            dkv_scores(fr, lse_c, delta_c, lambda tx, l, nt: chunk_visible(rel, tx, l, nt, l // 2), scale2, log2, False)
        dkv_accumulate(dOt, Qt, fr, kacc, vacc)

    def chunk_col(c, tx, l, nt):
        """Band index (in the item's partner space) of C value l of score tile nt in chunk c."""
        return c * KC + nt * 8 + c_col(tx, l)

    @T.macro
    def dq_body(q, k, v, dil, xidx, dout, lse, delta, scale, dq, B, H, Hkv, Tn, E):
        nitems = T.meta_var((Tn + (BR - 1)) // BR + (maxd - 1))
        for item in T.thread_binding(B * H * nitems, thread="blockIdx.x"):
            with T.sblock("flash_tc_dq"):
                T.reads()
                T.writes()
                Qs = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                dOs = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                Kt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                Vt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                xpos_s = T.alloc_buffer((KC,), "int64", scope=SH)
                xres_s = T.alloc_buffer((KC,), "int64", scope=SH)
                xt_s = T.alloc_buffer((KC,), "int64", scope=SH)
                afrag = T.alloc_buffer((NT, 8), dt, scope="local")
                a2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                bfrag = T.alloc_buffer(BOPS[0], BOPS[1], scope="local")
                b2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                sfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                dpfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                dsfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                dqacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                lse_r = T.alloc_buffer((NT, 2), acc, scope="local")
                delta_r = T.alloc_buffer((NT, 2), acc, scope="local")
                first_r = T.alloc_buffer((NT, 2), "int64", scope="local")
                last_r = T.alloc_buffer((NT, 2), "int64", scope="local")
                rel = T.alloc_buffer((NT, 4), "int32", scope="local")
                fld = T.alloc_buffer((ITEM_SCALARS,), "int64", scope="local")
                flag, scr = T.meta_var(alloc_nan_guard(SCR))
                fr = T.meta_var(Frags(afrag, a2frag, bfrag, b2frag, sfrag, dpfrag, None, dsfrag))

                store_item(fld, item, H, Hkv, nitems, dil, Tn)
                b, h, beta, d, kvh, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi = T.meta_var(
                    load_item_scalars(fld)
                )
                scale2 = T.meta_var(scale * LOG2E)
                # 1. Rows: queries and output gradients, lse and delta, band intervals.
                load_item(Qs, dOs, q, dout, b, h, lambda i: row0 + d * i, Tn)
                row_stats(lse_r, delta_r, lse, delta, b, h, lambda i: row0 + d * i, Tn)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for rr in T.unroll(2):
                        first_r[tx, rr] = row_key_range(lo, hi, Tn, d, m0, r, c_row(tx, 2 * rr))[0]
                        last_r[tx, rr] = row_key_range(lo, hi, Tn, d, m0, r, c_row(tx, 2 * rr))[1]
                zero(dqacc)
                # 2. The band chunks that meet the item's span, then the extra keys.
                chunk_stream(
                    c_begin, c_end, (Kt, Vt, None, None),
                    lambda c: load_band_chunk(Kt, Vt, k, v, b, kvh, band_positions(key0, d, c, KC), Tn),
                    lambda t, c: issue_chunk(t[0], t[1], k, v, b, kvh, band_positions(key0, d, c, KC), Tn),
                    lambda t, c: dq_band_step(c, Qs, dOs, t[0], t[1], fr, lse_r, delta_r, dqacc, rel, first_r, last_r,
                                              inner_lo, inner_hi, scale2),
                )
                extra_mask = T.meta_var(lambda tx, l, nt: extra_visible(
                    lo, hi, Tn, xpos_s[nt * 8 + c_col(tx, l)], xres_s[nt * 8 + c_col(tx, l)], xt_s[nt * 8 + c_col(tx, l)],
                    row0 + d * c_row(tx, l), m0 + c_row(tx, l), r,
                ))
                if extras:
                    for xc in T.serial((E + (KC - 1)) // KC):
                        load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E)
                        load_chunk(Kt, Vt, k, v, b, kvh, lambda kk: xpos_s[kk], Tn)
                        dq_step(Qs, dOs, Kt, Vt, fr, lse_r, delta_r, dqacc, extra_mask, scale2)
                # The item again where its dq came out non-finite: each dS K exact.
                vote(dqacc, NO * 4, flag)
                for once in T.serial(second_pass(flag)):
                    zero(dqacc)
                    for c in T.serial(c_begin, c_end):
                        load_chunk_unfenced(Kt, Vt, k, v, b, kvh, band_positions(key0, d, c, KC), Tn)
                        dq_band_scores(c, Qs, dOs, Kt, Vt, fr, lse_r, delta_r, rel, first_r, last_r, inner_lo, inner_hi,
                                       scale2, True)
                        exact_dq(Kt, fr, dqacc, scr)
                    if extras:
                        for xc in T.serial((E + (KC - 1)) // KC):
                            load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E)
                            load_chunk_unfenced(Kt, Vt, k, v, b, kvh, lambda kk: xpos_s[kk], Tn)
                            products_sync(Qs, dOs, Kt, Vt, fr)
                            dq_scores(fr, lse_r, delta_r, extra_mask, scale2, True)
                            exact_dq(Kt, fr, dqacc, scr)
                # 3. dq = scale * dS K.
                write_rows(dq, dqacc, b, h, lambda i: row0 + d * i, Tn, scale)

    # The transposed band: key j is seen by the queries j + u*d, -right <= u <= left.
    tlo, thi = hi, lo

    @T.macro
    def dkv_body(q, k, v, dil, dout, lse, delta, scale, dk, dv, B, H, Hkv, Tn):
        nitems = T.meta_var((Tn + (BR - 1)) // BR + (maxd - 1))
        for item in T.thread_binding(B * H * nitems, thread="blockIdx.x"):
            with T.sblock("flash_tc_dkv"):
                T.reads()
                T.writes()
                Ks = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                Vs = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                Qt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                dOt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                lse_c = T.alloc_buffer((KC,), acc, scope=SH)
                delta_c = T.alloc_buffer((KC,), acc, scope=SH)
                afrag = T.alloc_buffer((NT, 8), dt, scope="local")
                a2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                bfrag = T.alloc_buffer(BOPS[0], BOPS[1], scope="local")
                b2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                sfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                dpfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                pfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                dsfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                kacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                vacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                first_r = T.alloc_buffer((NT, 2), "int64", scope="local")
                last_r = T.alloc_buffer((NT, 2), "int64", scope="local")
                rel = T.alloc_buffer((NT, 4), "int32", scope="local")
                fld = T.alloc_buffer((ITEM_SCALARS,), "int64", scope="local")
                flag, scr = T.meta_var(alloc_nan_guard(SCR))
                fr = T.meta_var(Frags(afrag, a2frag, bfrag, b2frag, sfrag, dpfrag, pfrag, dsfrag))

                # row0: the item's first key; key0: the position of band (query) index 0.
                store_key_item(fld, item, H, Hkv, nitems, dil, Tn)
                b, h, beta, d, kvh, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi = T.meta_var(
                    load_key_item_scalars(fld)
                )
                scale2 = T.meta_var(scale * LOG2E)
                # 1. Keys and values; the query interval that sees each key.
                load_item(Ks, Vs, k, v, b, kvh, lambda i: row0 + d * i, Tn)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for rr in T.unroll(2):
                        first_r[tx, rr] = row_key_range(tlo, thi, Tn, d, m0, r, c_row(tx, 2 * rr))[0]
                        last_r[tx, rr] = row_key_range(tlo, thi, Tn, d, m0, r, c_row(tx, 2 * rr))[1]
                zero(kacc)
                zero(vacc)
                # 2. The queries that see the item, chunk by chunk.
                chunk_stream(
                    c_begin, c_end, (Qt, dOt, lse_c, delta_c),
                    lambda c: load_query_chunk(Qt, dOt, lse_c, delta_c, q, dout, lse, delta, b, h,
                                               band_positions(key0, d, c, KC), Tn),
                    lambda t, c: issue_query_chunk(t, q, dout, lse, delta, b, h, band_positions(key0, d, c, KC), Tn),
                    lambda t, c: dkv_band_step(c, Ks, Vs, t[0], t[1], fr, t[2], t[3], kacc, vacc, rel, first_r, last_r,
                                               inner_lo, inner_hi, scale2, LSE_LOG2),
                )
                # The item again where dk came out non-finite (``cuda_flash.second_pass``):
                # the chunk loop takes dS = P (dP - delta) as it is, a P of 0 (masked, a
                # score of -inf, a query whose lse is +inf) meeting a NaN dP or delta;
                # the second pass selects dS = 0 wherever P is. (dv = P^T dO: finite where
                # dO is.)
                vote(kacc, NO * 4, flag)
                for once in T.serial(second_pass(flag)):
                    zero(kacc)
                    zero(vacc)
                    for c in T.serial(c_begin, c_end):
                        load_chunk_unfenced(Qt, dOt, q, dout, b, h, band_positions(key0, d, c, KC), Tn)
                        load_chunk_stats(lse_c, delta_c, lse, delta, b, h, band_positions(key0, d, c, KC), Tn)
                        products_sync(Ks, Vs, Qt, dOt, fr)
                        if chunk_inside(c, inner_lo, inner_hi):
                            dkv_scores(fr, lse_c, delta_c, None, scale2, True, True)
                        else:
                            chunk_bounds(rel, first_r, last_r, c)
                            dkv_scores(fr, lse_c, delta_c, lambda tx, l, nt: chunk_visible(rel, tx, l, nt, l // 2), scale2,
                                       True, True)
                        exact_acc(fr.p, dOt, vacc, scr)
                        exact_acc(fr.ds, Qt, kacc, scr)
                # 3. dk = scale * dS^T Q and dv = P^T dO (per query head).
                write_rows(dk, kacc, b, h, lambda i: row0 + d * i, Tn, scale)
                write_rows(dv, vacc, b, h, lambda i: row0 + d * i, Tn, ONE)

    store_piece = split_item_fields(NT, BR, KC, causal)

    @T.macro
    def global_dq_body(qg, k, v, gidx, dout, lse, delta, scale, dqg, ws_dq, B, H, Hkv, Tn, G, S):
        # Split-K (as the forward's global rows): a block of BR global rows' key chunks, up
        # to its last visible key, in S near-equal pieces, a thread block each, writing
        # its share of dq (fp32, scaled) to ws_dq[b, h, s]; then a kernel summing the
        # pieces. 64 global rows at T = 32K were one block per head streaming 1024 chunks.
        nblk = T.meta_var((G + (BR - 1)) // BR)
        for item in T.thread_binding(B * H * nblk * S, thread="blockIdx.x"):
            # __launch_bounds__(threads, 2 blocks of up to 4 warps, else 1), as the forward's
            # TCConfig.min_blocks: left to its heuristic ptxas capped head_dim 32 (the cold
            # second pass included) at 128 registers and spilled; with the bound, 132, none.
            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 2 if NW <= 4 else 1):
                with T.sblock("flash_tc_global_dq"):
                    T.reads()
                    T.writes()
                    Qs = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                    dOs = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                    Kt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                    Vt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                    afrag = T.alloc_buffer((NT, 8), dt, scope="local")
                    a2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                    bfrag = T.alloc_buffer(BOPS[0], BOPS[1], scope="local")
                    b2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                    sfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                    dpfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                    dsfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                    dqacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                    lse_r = T.alloc_buffer((NT, 2), acc, scope="local")
                    delta_r = T.alloc_buffer((NT, 2), acc, scope="local")
                    last_r = T.alloc_buffer((NT, 2), "int64", scope="local")
                    fld = T.alloc_buffer((7,), "int64", scope="local")  # split_item_fields'
                    flag, scr = T.meta_var(alloc_nan_guard(SCR))
                    fr = T.meta_var(Frags(afrag, a2frag, bfrag, b2frag, sfrag, dpfrag, None, dsfrag))

                    store_piece(fld, item, S, H, Hkv, nblk, gidx, G, Tn)
                    b, h, g0, kvh, s = T.meta_var((fld[0], fld[1], fld[2], fld[3], fld[4]))
                    # 1. Global rows (padding rows past G: lse +inf, last key -1).
                    load_item(Qs, dOs, qg, dout, b, h, lambda i: g0 + i, G)
                    row_stats(lse_r, delta_r, lse, delta, b, h, lambda i: g0 + i, G)
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        for rr in T.unroll(2):
                            last_r[tx, rr] = global_row_last_key(gidx, b, g0 + c_row(tx, 2 * rr), G, Tn, causal)
                    zero(dqacc)
                    # 2. This piece's key chunks.
                    chunk_stream(
                        fld[5], fld[6], (Kt, Vt, None, None),
                        lambda c: load_chunk(Kt, Vt, k, v, b, kvh, lambda kk: c * KC + kk, Tn),
                        lambda t, c: issue_chunk(t[0], t[1], k, v, b, kvh, lambda kk: c * KC + kk, Tn),
                        lambda t, c: dq_step(
                            Qs, dOs, t[0], t[1], fr, lse_r, delta_r, dqacc,
                            lambda tx, l, nt: chunk_col(c, tx, l, nt) <= last_r[tx, l // 2], scale * LOG2E,
                        ),
                    )
                    vote(dqacc, NO * 4, flag)
                    for once in T.serial(second_pass(flag)):  # the piece again where its dq came out non-finite
                        zero(dqacc)
                        for c in T.serial(fld[5], fld[6]):
                            load_chunk_unfenced(Kt, Vt, k, v, b, kvh, lambda kk: c * KC + kk, Tn)
                            products_sync(Qs, dOs, Kt, Vt, fr)
                            dq_scores(fr, lse_r, delta_r, lambda tx, l, nt: chunk_col(c, tx, l, nt) <= last_r[tx, l // 2],
                                      scale * LOG2E, True)
                            exact_dq(Kt, fr, dqacc, scr)
                    # 3. The piece's share, scale * dS K, in fp32 (every piece writes: an empty
                    # one zeros).
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        for nd in T.unroll(NO):
                            for l in T.unroll(4):
                                if g0 + c_row(tx, l) < G:
                                    ws_dq[b, h, s, g0 + c_row(tx, l), nd * 8 + c_col(tx, l)] = dqacc[tx, nd * 4 + l] * scale
        # 4. dq_global = the pieces' sum, a block per row, a thread per column.
        for row in T.thread_binding(B * H * G, thread="blockIdx.x"):
            for col in T.thread_binding(D, thread="threadIdx.x"):
                with T.sblock("flash_tc_global_dq_sum"):
                    T.reads()
                    T.writes()
                    total = T.alloc_buffer((1,), acc, scope="local")
                    b, h, g = T.meta_var((T.truncdiv(row, H * G), T.truncmod(T.truncdiv(row, G), H), T.truncmod(row, G)))
                    total[0] = ZERO
                    for s in T.serial(S):
                        total[0] = total[0] + ws_dq[b, h, s, g, col]
                    dqg[b, h, g, col] = T.Cast(dt, total[0])

    @T.macro
    def global_dkv_body(qg, k, v, gidx, dout, lse, delta, scale, dkg, dvg, B, H, Hkv, Tn, G):
        nblk = T.meta_var((Tn + (BR - 1)) // BR)
        for item in T.thread_binding(B * H * nblk, thread="blockIdx.x"):
            with T.sblock("flash_tc_global_dkv"):
                T.reads()
                T.writes()
                Ks = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                Vs = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                Qt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                dOt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                lse_c = T.alloc_buffer((KC,), acc, scope=SH)
                delta_c = T.alloc_buffer((KC,), acc, scope=SH)
                gpos_c = T.alloc_buffer((KC,), "int64", scope=SH)
                afrag = T.alloc_buffer((NT, 8), dt, scope="local")
                a2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                bfrag = T.alloc_buffer(BOPS[0], BOPS[1], scope="local")
                b2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                sfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                dpfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                pfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                dsfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                kacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                vacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                fr = T.meta_var(Frags(afrag, a2frag, bfrag, b2frag, sfrag, dpfrag, pfrag, dsfrag))

                # A block of BR keys from j0 against every global row, KC rows a chunk.
                b, h, j0, kvh = T.meta_var(global_fields(item, H, Hkv, nblk, BR))
                load_item(Ks, Vs, k, v, b, kvh, lambda i: j0 + i, Tn)
                zero(kacc)
                zero(vacc)
                for c in T.serial((G + (KC - 1)) // KC):
                    load_chunk(Qt, dOt, qg, dout, b, h, lambda kk: c * KC + kk, G)
                    load_chunk_stats(lse_c, delta_c, lse, delta, b, h, lambda kk: c * KC + kk, G)
                    load_last_keys(gpos_c, gidx, b, c * KC, G, Tn)
                    dkv_step(
                        Ks, Vs, Qt, dOt, fr, lse_c, delta_c, kacc, vacc,
                        lambda tx, l, nt: j0 + c_row(tx, l) <= gpos_c[nt * 8 + c_col(tx, l)],
                        scale * LOG2E,
                    )
                write_rows(dkg, kacc, b, h, lambda i: j0 + i, Tn, scale)
                write_rows(dvg, vacc, b, h, lambda i: j0 + i, Tn, ONE)

    load_key_positions = extra_positions_loader(NT, BR)

    def extra_seen(xkeys, d, Tn, c, tx, l, nt):
        """Whether row i = chunk_col sees extra key c_row (xkeys: its position, residue and
        residue-space index tables) as an extra (as in cuda_flash_bwd)."""
        xpos_s, xres_s, xt_s = xkeys
        return extra_visible(
            lo, hi, Tn, xpos_s[c_row(tx, l)], xres_s[c_row(tx, l)], xt_s[c_row(tx, l)],
            chunk_col(c, tx, l, nt), T.floordiv(chunk_col(c, tx, l, nt), d), T.floormod(chunk_col(c, tx, l, nt), d),
        )

    @T.macro
    def dx_body(q, k, v, dil, xidx, dout, lse, delta, scale, dkx, dvx, B, H, Hkv, Tn, E):
        nblk = T.meta_var((E + (BR - 1)) // BR)
        for item in T.thread_binding(B * H * nblk, thread="blockIdx.x"):
            with T.sblock("flash_tc_dx"):
                T.reads()
                T.writes()
                Ks = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                Vs = T.alloc_buffer((item_tile.size,), dt, scope=SH)
                Qt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                dOt = T.alloc_buffer((chunk_tile.size,), dt, scope=SH)
                lse_c = T.alloc_buffer((KC,), acc, scope=SH)
                delta_c = T.alloc_buffer((KC,), acc, scope=SH)
                xpos_s = T.alloc_buffer((BR,), "int64", scope=SH)
                xres_s = T.alloc_buffer((BR,), "int64", scope=SH)
                xt_s = T.alloc_buffer((BR,), "int64", scope=SH)
                afrag = T.alloc_buffer((NT, 8), dt, scope="local")
                a2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                bfrag = T.alloc_buffer(BOPS[0], BOPS[1], scope="local")
                b2frag = T.alloc_buffer((NT, 8), dt, scope="local")
                sfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                dpfrag = T.alloc_buffer((NT, NS * 4), acc, scope="local")
                pfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                dsfrag = T.alloc_buffer((NT, NS * 4), dt, scope="local")
                kacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                vacc = T.alloc_buffer((NT, NO * 4), acc, scope="local")
                fr = T.meta_var(Frags(afrag, a2frag, bfrag, b2frag, sfrag, dpfrag, pfrag, dsfrag))

                # A block of BR extra keys (extra_idx[b, e0:e0+BR]) against every row.
                b, h, e0, kvh = T.meta_var(global_fields(item, H, Hkv, nblk, BR))
                d = T.meta_var(T.Cast("int64", dil[h]))
                load_key_positions(xpos_s, xres_s, xt_s, xidx, b, T.truncdiv(e0, BR), d, E)
                load_item(Ks, Vs, k, v, b, kvh, lambda i: xpos_s[i], Tn)
                xkeys = T.meta_var((xpos_s, xres_s, xt_s))
                zero(kacc)
                zero(vacc)
                chunk_stream(
                    0, (Tn + (KC - 1)) // KC, (Qt, dOt, lse_c, delta_c),
                    lambda c: load_query_chunk(Qt, dOt, lse_c, delta_c, q, dout, lse, delta, b, h,
                                               lambda kk: c * KC + kk, Tn, clamp=True),
                    lambda t, c: issue_query_chunk(t, q, dout, lse, delta, b, h, lambda kk: c * KC + kk, Tn),
                    lambda t, c: dkv_step(
                        Ks, Vs, t[0], t[1], fr, t[2], t[3], kacc, vacc,
                        lambda tx, l, nt: extra_seen(xkeys, d, Tn, c, tx, l, nt), scale * LOG2E, LSE_LOG2,
                    ),
                )
                write_rows(dkx, kacc, b, h, lambda i: e0 + i, E, scale)
                write_rows(dvx, vacc, b, h, lambda i: e0 + i, E, ONE)

    if spec.kind == "local_dx":
        return _dx_kernel(dx_body, D, dt, acc)
    if spec.kind == "global_bwd":
        return _global_split_kernel(global_dq_body, global_dkv_body, D, dt, acc)
    if spec.kind == "local_dkv":
        return _dkv_kernel(dkv_body, D, dt, acc, extras)
    return _dq_kernel(dq_body, D, dt, acc, extras)
