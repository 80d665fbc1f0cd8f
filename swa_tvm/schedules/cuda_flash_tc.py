"""The fused CUDA kernel of ``cuda_flash`` on tensor cores (float16/bfloat16 inputs,
fp32 accumulation), FlashAttention-2 style: each warp owns 16 query rows of the item
(16 * m_tiles), its scores, probabilities and output accumulators live in registers as
``mma.sync.m16n8k16`` fragments, and the probabilities feed the P·V product straight
from the score fragments (the accumulator layout of one 16x8 tile pair is the operand
layout of the next product). Only the query block (once) and the key and value chunks
pass through shared memory (the chunks synchronously, or by cp.async into one K/V tile
pair or a ring of two: TCConfig).

The fragment layouts, the mma/ldmatrix/cp.async macros and the shared tiles' loaders it
shares with the gradients (``cuda_flash_bwd_tc``) and ``cuda_wgmma`` are in ``ptx``.

The NaN rule (``cuda_flash.second_pass``): P V cannot select per row on tensor cores,
so an item whose outputs come out non-finite is computed again after its chunk loops,
on mma.sync, every P V exact (``ptx.exact_product``).

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
from swa_tvm.schedules.cuda_flash import (
    ITEM_SCALARS,
    SHARED_BUDGET,
    SHARED_LIMIT,
    SHARED_LIMIT_SM90,
    band_positions,
    block_inner_last_key,
    extra_positions_loader,
    fmax,
    global_row_last_key,
    global_split_kernel,
    item_scalars,
    largest_fitting,
    local_kernel,
    second_pass,
    shared_scope,
    split_item_fields,
)
from swa_tvm.schedules.cuda_wgmma import (
    a_packer,
    deferred_macros,
    packed_a,
    sync_macros,
    wgmma_macro,
)
from swa_tvm.schedules.ptx import (
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

# The rest of the fragment and ldmatrix maps, still importable from here (the tests do).
from swa_tvm.schedules.ptx import a_lane as a_lane
from swa_tvm.schedules.ptx import b_lane as b_lane
from swa_tvm.schedules.ptx import c_lane as c_lane
from swa_tvm.schedules.ptx import ldsm_a_row as ldsm_a_row
from swa_tvm.schedules.ptx import ldsm_a_value as ldsm_a_value
from swa_tvm.schedules.ptx import ldsm_nk_row as ldsm_nk_row
from swa_tvm.schedules.ptx import ldsm_row as ldsm_row
from swa_tvm.schedules.ptx import ldsm_value as ldsm_value
from swa_tvm.spec import KernelSpec


def tree(op, values):
    """op over ``values`` (PrimExprs) as a balanced tree: log2(n) dependent steps
    instead of a chain of n - 1."""
    values = list(values)
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)] + values[len(values) // 2 * 2:]
    return values[0]


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
                        red[tx, rr] = fmax(
                            fmax(part[tx // 4 * 4, rr], part[tx // 4 * 4 + 1, rr]),
                            fmax(part[tx // 4 * 4 + 2, rr], part[tx // 4 * 4 + 3, rr]),
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
                    part[tx, 2 * mt + r] = fmax(m_r[tx, 2 * mt + r], tree(fmax, row_values(sfrag, tx, mt, r)) * scale2)
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

    # The NaN rule (``cuda_flash.second_pass``; ptx: ``finite_vote``, ``exact_product``).
    # A key a row does not see has P exactly 0, but the tensor cores' P V cannot select
    # per row, and 0 * NaN (or inf) is NaN: a non-finite V where a row cannot see it
    # leaves NaN in that row's outputs. So the chunk loops run as they always have, and
    # an item whose outputs come out non-finite is computed again after them, each P V
    # exact (``redo``). The cost for finite data: one FMA per output register and a
    # block-wide vote, per item, outside the chunk loop.
    v_lay = TileLayout(KC, D, WG) if cfg.transpose_v else kv_tile
    vote = finite_vote(NT, emulate)

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
    def init_state(ofrag, m_r, l_r, h, sink):
        # Each row's running max at the head's sink logit (log2 units), its sum at that
        # sink's share (sink None: -inf and 0), its outputs 0.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for r in T.unroll(R):
                if sink is None:
                    m_r[tx, r] = NINF
                    l_r[tx, r] = ZERO
                else:
                    m_r[tx, r] = sink[h] * LOG2E
                    l_r[tx, r] = T.Select(sink[h] == NINF, ZERO, ONE)
            for x in T.unroll(MT * NO * 4):
                ofrag[tx, x] = ZERO

    # An item's second computation (the NaN rule, above): its chunks again in turn,
    # synchronous loads into the first K/V tiles, Q K^T and the softmax as before, every
    # P V exact (``exact_product``). On mma.sync throughout, a wgmma kernel's too (K's and
    # V's core matrices read value by value).
    exact = exact_product(NW, dt, emulate, MT, KC // 16, NO)

    def v_value(Vt):
        """V[key][column] of a V tile (transposed with TCConfig.transpose_v)."""
        if cfg.transpose_v:
            return lambda key, col: Vt[v_lay.index(col, key)]
        return lambda key, col: Vt[kv_tile.index(key, col)]

    @T.macro
    def sync_scores(Kt, q_of, qfrag, kfrag, sfrag):
        # S = Q K^T on mma.sync, K's B operands read value by value (any tile layout), Q's
        # A operands for each k-step from q_of(row, column) (its shared tile, or global
        # memory where the chunk loop held Q in registers: those die with the loop, and
        # kept live past it for this rare pass they cost the loop registers). The k-steps
        # a loop, few values live at a time.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.unroll(MT * NS * 4):
                sfrag[tx, x] = ZERO
        for ks in T.serial(KD):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                for mt in T.unroll(MT):
                    for l in T.unroll(8):
                        qfrag[tx, mt * 8 + l] = q_of(((tx // 32) * MT + mt) * 16 + a_pos(tx % 32, l)[0],
                                                     ks * 16 + a_pos(tx % 32, l)[1])
            for nt in T.unroll(NS):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for x in T.unroll(4):
                        kfrag[tx, x] = Kt[kv_tile.index(nt * 8 + b_pos(tx % 32, x)[1], ks * 16 + b_pos(tx % 32, x)[0])]
                for mt in T.unroll(MT):
                    mma(qfrag, mt * 8, kfrag, 0, sfrag, (mt * NS + nt) * 4)

    def q_source(src, Qs, b, h, src_row):
        """``sync_scores``' Q: Q's shared tile, or (with Q in registers, its tile then K's)
        src[b, h, src_row(row)]."""
        if QREG:
            return lambda row, col: src[b, h, src_row(row), col]
        return lambda row, col: Qs[q_tile.index(row, col)]

    @T.macro
    def redo_chunk(QK, q_of, Vt, qfrag, kfrag, sfrag, pfrag, ofrag, m_r, l_r, part, red, k, v, b, kvh, Tn, pos, mask,
                   scale2, scr):
        # One chunk of the second computation: keys and values at positions pos(kk), the
        # scores masked by ``mask()`` (P of a masked key exactly 0), P V exact.
        load_rows(QK, Vt, k, v, b, kvh, pos, Tn)
        sync_scores(QK, q_of, qfrag, kfrag, sfrag)
        mask()
        softmax(sfrag, pfrag, ofrag, m_r, l_r, part, red, scale2)
        exact(pfrag, lambda mt: mt * NS * 4, v_value(Vt), ofrag, lambda mt: mt * NO * 4, scr)

    @T.macro
    def redo(QK, q_of, Vt, qfrag, kfrag, sfrag, pfrag, ofrag, m_r, l_r, part, red, rel, k, v, b, kvh, Tn, c_begin, c_end,
             pos_of, first_r, last_r, inner_lo, inner_hi, scale2, scr):
        # The band chunks c_begin <= c < c_end of the second computation (``stream``'s).
        for c in T.serial(c_begin, c_end):
            redo_chunk(QK, q_of, Vt, qfrag, kfrag, sfrag, pfrag, ofrag, m_r, l_r, part, red, k, v, b, kvh, Tn,
                       lambda kk: pos_of(c, kk),
                       lambda: band_mask_max(c, sfrag, m_r, part, red, rel, first_r, last_r, inner_lo, inner_hi, scale2),
                       scale2, scr)

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
        init_state(ofrag, m_r, l_r, h, sink)
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

    SCR = exact_scratch_shapes(NT, dt, MT, KC // 16, NO)

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
            # The NaN rule's vote (``finite_vote``) and exact_product's scratch.
            flag, scr = T.meta_var(alloc_nan_guard(SCR))
            body((QK, Qs, Vt, qfrag, qpk, kfrag, vfrag, sfrag, pfrag, ppk, ofrag, m_r, l_r, first_r, last_r, rel, part, red,
                  flag, scr))

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
        (QK, Qs, Vt, qfrag, qpk, kfrag, vfrag, sfrag, pfrag, ppk, ofrag, m_r, l_r, first_r, last_r, rel, part, red, flag,
         scr, K1, V1) = T.meta_var(tiles)
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
        extra_mask = T.meta_var(lambda tx, l, nt, mt: extra_visible(
            lo, hi, Tn, xpos_s[nt * 8 + c_col(tx, l)], xres_s[nt * 8 + c_col(tx, l)], xt_s[nt * 8 + c_col(tx, l)],
            row0 + d * c_row(tx, l, mt), m0 + c_row(tx, l, mt), r,
        ))
        if extras:
            for xc in T.serial((E + (KC - 1)) // KC):
                load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E)
                load_rows(QK, Vt, k, v, b, kvh, lambda kk: xpos_s[kk], Tn)
                if WG:
                    wg_proxy_fence()
                scores(QK, Qs, qfrag, qpk, kfrag, sfrag)
                mask_max(sfrag, m_r, part, red, extra_mask, scale2)
                softmax_pv(Vt, sfrag, pfrag, ppk, vfrag, ofrag, m_r, l_r, part, red, scale2)
        # The item again where its outputs came out non-finite (``redo``).
        vote(ofrag, MT * NO * 4, flag)
        for once in T.serial(second_pass(flag)):
            init_state(ofrag, m_r, l_r, h, sink)
            q_of = T.meta_var(q_source(q, Qs, b, h, lambda i: T.min(row0 + d * i, Tn - 1)))
            redo(QK, q_of, Vt, qfrag, kfrag, sfrag, pfrag, ofrag, m_r, l_r, part, red, rel, k, v, b, kvh, Tn,
                 c_begin, c_end, lambda c, kk: band_positions(key0, d, c, KC)(kk), first_r, last_r, inner_lo,
                 inner_hi, scale2, scr)
            if extras:
                for xc in T.serial((E + (KC - 1)) // KC):
                    load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E)
                    redo_chunk(QK, q_of, Vt, qfrag, kfrag, sfrag, pfrag, ofrag, m_r, l_r, part, red, k, v, b, kvh, Tn,
                               lambda kk: xpos_s[kk], lambda: mask_max(sfrag, m_r, part, red, extra_mask, scale2),
                               scale2, scr)
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
        # lse = (m + log2 l) * ln 2 (a row that saw no key of the piece, l = 0: 0 and
        # -inf; l NaN, from a NaN score it sees, stays NaN: LLVM's l != 0 is false for
        # NaN where C's is true, hence the isnan).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for mt in T.unroll(MT):
                for nd in T.unroll(NO):
                    for l in T.unroll(4):
                        if g0 + c_row(tx, l, mt) < G:
                            ws_o[b, h, s, g0 + c_row(tx, l, mt), nd * 8 + c_col(tx, l)] = T.Select(
                                T.Or(T.isnan(l_r[tx, 2 * mt + l // 2]), l_r[tx, 2 * mt + l // 2] != ZERO),
                                ofrag[tx, mt * NO * 4 + nd * 4 + l] / l_r[tx, 2 * mt + l // 2],
                                ZERO,
                            )
            for r in T.unroll(R):
                if tx % 4 == 0:
                    if g0 + t_row(tx, r) < G:
                        ws_lse[b, h, s, g0 + t_row(tx, r)] = T.Select(
                            T.Or(T.isnan(l_r[tx, r]), l_r[tx, r] != ZERO), (m_r[tx, r] + T.log2(l_r[tx, r])) * LN2, NINF
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
                        st[0] = fmax(st[0], ws_lse[b, h, s, g])
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
        (QK, Qs, Vt, qfrag, qpk, kfrag, vfrag, sfrag, pfrag, ppk, ofrag, m_r, l_r, first_r, last_r, rel, part, red, flag,
         scr, K1, V1) = T.meta_var(tiles)
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
        vote(ofrag, MT * NO * 4, flag)
        for once in T.serial(second_pass(flag)):  # the piece again where its outputs came out non-finite
            init_state(ofrag, m_r, l_r, h, None)
            redo(QK, q_source(qg, Qs, b, h, lambda i: T.min(g0 + i, G - 1)), Vt, qfrag, kfrag, sfrag, pfrag, ofrag, m_r,
                 l_r, part, red, rel, k, v, b, kvh, Tn,
                 fld[5], fld[6], lambda c, kk: T.Cast("int32", c * KC) + kk, first_r, last_r, T.int64(0), fld[7],
                 scale2, scr)
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
