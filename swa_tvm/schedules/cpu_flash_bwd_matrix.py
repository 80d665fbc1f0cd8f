"""The five-product CPU backward on a matrix engine: kind "local_bwd" in bfloat16 on a
CPU with AMX or AVX-512 BF16 dot products (``compute.forward.amx_serves``,
``compiler.targets.matrix_form``).

The plan is ``cpu_flash_bwd``'s (one task per (batch, head); key blocks of 32 in order;
each recomputes the scores and dP of the query rows that see it; dk/dv in a local tile;
dq accumulated across key blocks; each residue of the head's dilation in turn, as a
plain window of its own), with the five products on the engine (bfloat16 operands,
float32 sums) and the softmax between them in float32 vectors, P and dS rounded to
bfloat16 for their products, as the TE kernels' matrix-engine form and FlashAttention's
backward do. Both engines take the same operand layouts: the first operand bfloat16
rows, the second pair words (two consecutive reduction indices a word). On AMX the
products run on tiles (``schedules.amx`` gives the tile conventions); on AVX-512 BF16
on register tiles of float32x16 sums, one ``vdpbf16ps`` per step (``schedules.bf16_dot``).

The products run transposed: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, so each score row is one key and
its vector runs along 32 query rows, whose lse and delta load as vectors; Pᵀ and dSᵀ, as
rounded, are then the first operands of dV += Pᵀ·dO and dK += dSᵀ·Q, and dSᵀ in pair
words (two keys per word) the second of dQᵀ += Kᵀ·dSᵀ. Every operand of the window is
staged once per residue in the engine's layouts: each key block's rows and transpose as
the block starts, each query sub-block's (aligned to 32 rows) as the first key block
that sees it starts, into a ring of slots that holds every sub-block a key block sees. A
sub-block's dQᵀ accumulates in its slot and is written to dq when the slot is reused, or
at the end. Positions past T stage as zeros (keys masked; rows with lse = +inf).

With extra keys (globals, sinks), each sub-block scores them as it is staged, a chunk
of 32 staged as a key block (once per residue where they fit one chunk), under the
forward's visibility rule (``extra_visible``): their dS·K joins its dQᵀ, their Pᵀ·dO and
dSᵀ·Q sum per chunk and go to the extras' dk/dv as the chunk leaves. The global rows
that attend to k and v join every key block as one more sub-block, a chunk of 32 in a
slot of its own (staged once per residue where they fit one chunk); their dQᵀ sums go
to dqg as the chunk leaves the slot.

Arguments, as ``cpu_flash_bwd``'s (with extra keys its longer list): q [B,H,T,D], k/v
[B,Hkv,T,D], dilation [H], [extra_idx [B,E]], dout [B,H,T,D] (bfloat16), lse [B,H,T]
(+inf: a row whose probabilities are all 0), delta [B,H,T], scale, [the global rows'
queries, positions, dout, lse, delta], then the results: dq [B,H,T,D] in bfloat16 (its
float32 sums rounded once, as its slot is written; ``cpu_flash_bwd`` sums dq in place,
so in float32), dk and dv [B,H,T,D] in bfloat16 per query head (each key block's
float32 sums rounded once; the caller sums a GQA group, as FlashAttention's interface
sums its per-head bfloat16 dk and dv), [the extras' dk/dv [B,H,E,D] and the global
rows' dq [B,H,G,D], float32].
"""

from __future__ import annotations

from tvm.script import tirx as T

from swa_tvm.compute.forward import SHORT_EXP, _exp, amx_serves, bf16_round_bits, extra_visible, pair_word
from swa_tvm.schedules import bf16_dot
from swa_tvm.schedules.bf16_dot import LANES
from swa_tvm.spec import KernelSpec

BK = BQ = 32  # keys per key block, query rows per sub-block (one tile product's depth)
TILE = 16  # rows and float32 columns of a tile


def fused_backward_matrix(spec: KernelSpec, engine: str):
    """The PrimFunc of a "local_bwd" spec this form serves (symbolic B, H, Hkv and T), its
    products on ``engine``: "amx" or "bf16_dot" (``compiler.targets.matrix_engine``)."""
    assert spec.kind == "local_bwd" and amx_serves(spec) and engine in ("amx", "bf16_dot"), (spec.name, engine)
    dot_engine = engine == "bf16_dot"
    # The dot step is LLVM IR imported into the module (schedules.bf16_dot).
    step_import = {"pragma_import_llvm": bf16_dot.STEP_IR} if dot_engine else {}
    CG = 4 if spec.head_dim % (4 * LANES) == 0 else 2  # 16-lane column groups per dot register tile
    D, left, right = spec.head_dim, spec.left, spec.right
    NT = D // TILE  # result tiles across the features
    KC = D // 32  # depth chunks of the score products
    group = max(g for g in (1, 2, 3, 4) if NT % g == 0)  # result tiles sharing one A tile
    R = (BK - 1 + left + right) // BQ + 2  # ring slots: the most sub-blocks one key block sees
    GS = R  # with extra keys, the slot of a chunk of global rows
    RS = R + 1 if spec.extras else R
    u16, u32 = "uint16", "uint32"

    def load(t, ptr, stride_bytes):
        return T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(t), ptr, T.int64(stride_bytes)))

    def store(t, ptr, stride_bytes):
        return T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(t), ptr, T.int64(stride_bytes)))

    def dot(c, a, b):
        return T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbf16ps", T.int8(c), T.int8(a), T.int8(b)))

    def zero(t):
        return T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(t)))

    def at(res, d, x):  # the position of index x of residue res (dilation d)
        return res + d * x

    def dilation(dil, h):
        # Dilation 1 alone: the constant 1, so the code is the plain window's.
        return T.int64(1) if spec.max_dilation == 1 else T.Cast("int64", dil[h])

    def bits(x):
        return T.reinterpret(u16, x)

    def word(lo, hi):
        return pair_word(T.Cast(u32, lo), T.Cast(u32, hi))

    def rounded(x):
        return T.Cast(u16, bf16_round_bits(x))

    @T.macro
    def stage_rows(x, b, hx, i0, Tr, res, d, rows_u16, cols_w, pairs_w, slot):
        # The 32 rows of x from index i0 of residue res (zeros past its Tr positions): as
        # bfloat16 rows, as pair words transposed [D/2, 32] (cols_w, where given), as
        # row-pair words [16, D] (pairs_w, where given).
        for r in range(BQ):
            for c in T.vectorized(D):
                rows_u16[r, c] = T.Select(i0 + r < Tr, bits(x[b, hx, at(res, d, T.min(i0 + r, Tr - 1)), c]),
                                          T.uint16(0))
        if cols_w is not None:
            for c2, r in T.grid(D // 2, BQ):
                cols_w[slot, c2, r] = word(rows_u16[r, 2 * c2], rows_u16[r, 2 * c2 + 1])
        if pairs_w is not None:
            for r2 in range(BQ // 2):
                for c in T.vectorized(D):
                    pairs_w[slot, r2, c] = word(rows_u16[2 * r2, c], rows_u16[2 * r2 + 1, c])

    @T.macro
    def write_dq(dq, dQt, held, slot, b, h, res, d, Tr):
        # The rows of the sub-block a slot holds (if any), from its dQᵀ sums, rounded once.
        if held[slot] >= 0:
            for r in range(BQ):
                if held[slot] * BQ + r < Tr:
                    for c in T.vectorized(D):
                        dq[b, h, at(res, d, held[slot] * BQ + r), c] = T.reinterpret("bfloat16",
                                                                                     rounded(dQt[slot, c, r]))

    @T.macro
    def key_tiles_update(total, weights_t, rows_w, slot, st, g):
        # total[16 keys from st, group tiles of 16 features from g] += weights_tᵀ-strip
        # (16 keys x 32 rows, bfloat16) x rows_w[slot] (the rows' pair words).
        for t in T.unroll(group):
            load(t, T.address_of(total[st * TILE, (g * group + t) * TILE]), D * 4)
        load(4, T.address_of(weights_t[st * TILE, 0]), BQ * 2)
        for t in T.unroll(group):
            load(5 + t % 2, T.address_of(rows_w[slot, 0, (g * group + t) * TILE]), D * 4)
            dot(t, 4, 5 + t % 2)
        for t in T.unroll(group):
            store(t, T.address_of(total[st * TILE, (g * group + t) * TILE]), D * 4)

    # Which (key kk, row r) pairs of a visit count, by what the keys and rows are:
    # "window" (the key block from j0 of residue res, the sub-block from row i0),
    # "extras" (a chunk of extra keys, the sub-block), "global" (the key block, a chunk
    # of global rows from g0 at positions Gp; -1 past G).
    def visible(what, kk, r, i0, j0, Tr, res, d, Xp, Xr, Xt, Tn, g0, G, Gp):
        if what == "window":
            return T.And(T.And(i0 + r - j0 - kk <= left, j0 + kk - i0 - r <= right), j0 + kk < Tr)
        if what == "extras":
            return T.And(i0 + r < Tr, extra_visible(left, right, Tn, Xp[kk], Xr[kk], Xt[kk], at(res, d, i0 + r), i0 + r,
                                                    res))
        ok = T.And(g0 + r < G, j0 + kk < Tr)
        return T.And(ok, at(res, d, j0 + kk) <= Gp[r]) if right == 0 else ok  # a causal global row's past

    @T.macro
    def probabilities(what, St, dPt, Pt, dSt, Ls, Ds, slot, scale, i0, j0, Tr, res, d, Xp, Xr, Xt, Tn, g0, G, Gp,
                      masked):
        for kk in range(BK):
            for r in T.vectorized(BQ):
                if masked:
                    St[kk, r] = T.Select(
                        visible(what, kk, r, i0, j0, Tr, res, d, Xp, Xr, Xt, Tn, g0, G, Gp),
                        _exp(St[kk, r] * scale - Ls[slot, r], "float32", coeffs=SHORT_EXP),
                        T.float32(0),
                    )
                else:
                    St[kk, r] = _exp(St[kk, r] * scale - Ls[slot, r], "float32", coeffs=SHORT_EXP)
                Pt[kk, r] = rounded(St[kk, r])
                dSt[kk, r] = rounded(St[kk, r] * (dPt[kk, r] - Ds[slot, r]) * scale)

    @T.macro
    def score_products_amx(Kr, Vr, Qc, dOc, St, dPt, slot, lo, hi):
        # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, a strip of 16 keys at a time.
        for st in range(BK // TILE):
            zero(0)
            zero(1)
            zero(2)
            zero(3)
            for kc in range(KC):
                load(4, T.address_of(Kr[st * TILE, kc * 32]), D * 2)
                load(5, T.address_of(Qc[slot, kc * TILE, 0]), BQ * 4)
                dot(0, 4, 5)
                load(6, T.address_of(Qc[slot, kc * TILE, TILE]), BQ * 4)
                dot(1, 4, 6)
                load(4, T.address_of(Vr[st * TILE, kc * 32]), D * 2)
                load(5, T.address_of(dOc[slot, kc * TILE, 0]), BQ * 4)
                dot(2, 4, 5)
                load(6, T.address_of(dOc[slot, kc * TILE, TILE]), BQ * 4)
                dot(3, 4, 6)
            store(0, T.address_of(St[st * TILE, 0]), BQ * 4)
            store(1, T.address_of(St[st * TILE, TILE]), BQ * 4)
            store(2, T.address_of(dPt[st * TILE, 0]), BQ * 4)
            store(3, T.address_of(dPt[st * TILE, TILE]), BQ * 4)

    @T.macro
    def gradient_products_amx(Pt, dSt, dSw, Qp, dOp, dQt, Kt, dKa, dVa, slot, lo, hi):
        for k2 in range(BK // 2):
            for r in T.vectorized(BQ):
                dSw[k2, r] = word(dSt[2 * k2, r], dSt[2 * k2 + 1, r])
        # dV += Pᵀ dO and dK += dSᵀ Q: [16 keys, group tiles of 16 features] at a time.
        for st in range(BK // TILE):
            for g in range(NT // group):
                key_tiles_update(dVa, Pt, dOp, slot, st, g)
                key_tiles_update(dKa, dSt, Qp, slot, st, g)
        # dQᵀ += Kᵀ dSᵀ: [16 features, 32 rows] at a time.
        load(5, T.address_of(dSw[0, 0]), BQ * 4)
        load(6, T.address_of(dSw[0, TILE]), BQ * 4)
        for st in range(NT):
            load(0, T.address_of(dQt[slot, st * TILE, 0]), BQ * 4)
            load(1, T.address_of(dQt[slot, st * TILE, TILE]), BQ * 4)
            load(4, T.address_of(Kt[st * TILE, 0]), BK * 2)
            dot(0, 4, 5)
            dot(1, 4, 6)
            store(0, T.address_of(dQt[slot, st * TILE, 0]), BQ * 4)
            store(1, T.address_of(dQt[slot, st * TILE, TILE]), BQ * 4)

    # The same three macros on AVX-512 BF16 dot products: register tiles of float32x16
    # sums (schedules.bf16_dot), two halves lo and hi, each under TVM's 1 KiB stack
    # bound so LLVM keeps them in registers; each step adds a pair word of A, broadcast,
    # times a row of 16 pair words of B.
    def step(acc, a, b):
        return T.call_pure_extern("float32x16", bf16_dot.STEP, acc, a, b)

    def lanes(i):
        return T.ramp(i * LANES, 1, LANES)

    @T.macro
    def score_products_dot(Kr, Vr, Qc, dOc, St, dPt, slot, lo, hi):
        # Sᵀ (in lo) and dPᵀ (in hi), 4 keys by the 32 rows at a time.
        for kb in range(BK // 4):
            for t in T.unroll(8):
                lo[lanes(t)] = T.broadcast(T.float32(0), LANES)
                hi[lanes(t)] = T.broadcast(T.float32(0), LANES)
            for c2 in range(D // 2):
                for kk in T.unroll(4):
                    for g in T.unroll(2):
                        lo[lanes(kk * 2 + g)] = step(lo[lanes(kk * 2 + g)], Kr[kb * 4 + kk, T.ramp(c2 * 2, 1, 2)],
                                                     Qc[slot, c2, lanes(g)])
                        hi[lanes(kk * 2 + g)] = step(hi[lanes(kk * 2 + g)], Vr[kb * 4 + kk, T.ramp(c2 * 2, 1, 2)],
                                                     dOc[slot, c2, lanes(g)])
            for kk in T.unroll(4):
                for g in T.unroll(2):
                    St[kb * 4 + kk, lanes(g)] = lo[lanes(kk * 2 + g)]
                    dPt[kb * 4 + kk, lanes(g)] = hi[lanes(kk * 2 + g)]

    @T.macro
    def key_rows_update_dot(total, weights_t, rows_w, slot, lo, hi):
        # total[BK keys, D] += weights_t (keys x BQ rows) rows_w[slot] (the rows' pair
        # words): 4 keys by CG x 16 features at a time, keys 0-1 in lo, 2-3 in hi.
        for kb in range(BK // 4):
            for cg in range(D // (CG * LANES)):
                for kk in T.unroll(2):
                    for g in T.unroll(CG):
                        lo[lanes(kk * CG + g)] = total[kb * 4 + kk, lanes(cg * CG + g)]
                        hi[lanes(kk * CG + g)] = total[kb * 4 + 2 + kk, lanes(cg * CG + g)]
                for r2 in range(BQ // 2):
                    for kk in T.unroll(2):
                        for g in T.unroll(CG):
                            lo[lanes(kk * CG + g)] = step(lo[lanes(kk * CG + g)],
                                                         weights_t[kb * 4 + kk, T.ramp(r2 * 2, 1, 2)],
                                                         rows_w[slot, r2, lanes(cg * CG + g)])
                            hi[lanes(kk * CG + g)] = step(hi[lanes(kk * CG + g)],
                                                         weights_t[kb * 4 + 2 + kk, T.ramp(r2 * 2, 1, 2)],
                                                         rows_w[slot, r2, lanes(cg * CG + g)])
                for kk in T.unroll(2):
                    for g in T.unroll(CG):
                        total[kb * 4 + kk, lanes(cg * CG + g)] = lo[lanes(kk * CG + g)]
                        total[kb * 4 + 2 + kk, lanes(cg * CG + g)] = hi[lanes(kk * CG + g)]

    @T.macro
    def gradient_products_dot(Pt, dSt, dSw, Qp, dOp, dQt, Kt, dKa, dVa, slot, lo, hi):
        for k2 in range(BK // 2):
            for r in T.vectorized(BQ):
                dSw[k2, r] = word(dSt[2 * k2, r], dSt[2 * k2 + 1, r])
        key_rows_update_dot(dVa, Pt, dOp, slot, lo, hi)
        key_rows_update_dot(dKa, dSt, Qp, slot, lo, hi)
        # dQᵀ += Kᵀ dSᵀ: 8 features by the 32 rows at a time, features 0-3 in lo, 4-7 in hi.
        for fb in range(D // 8):
            for f in T.unroll(4):
                for g in T.unroll(2):
                    lo[lanes(f * 2 + g)] = dQt[slot, fb * 8 + f, lanes(g)]
                    hi[lanes(f * 2 + g)] = dQt[slot, fb * 8 + 4 + f, lanes(g)]
            for k2 in range(BK // 2):
                for f in T.unroll(4):
                    for g in T.unroll(2):
                        lo[lanes(f * 2 + g)] = step(lo[lanes(f * 2 + g)], Kt[fb * 8 + f, T.ramp(k2 * 2, 1, 2)],
                                                    dSw[k2, lanes(g)])
                        hi[lanes(f * 2 + g)] = step(hi[lanes(f * 2 + g)], Kt[fb * 8 + 4 + f, T.ramp(k2 * 2, 1, 2)],
                                                    dSw[k2, lanes(g)])
            for f in T.unroll(4):
                for g in T.unroll(2):
                    dQt[slot, fb * 8 + f, lanes(g)] = lo[lanes(f * 2 + g)]
                    dQt[slot, fb * 8 + 4 + f, lanes(g)] = hi[lanes(f * 2 + g)]

    score_products = score_products_dot if dot_engine else score_products_amx
    gradient_products = gradient_products_dot if dot_engine else gradient_products_amx

    @T.macro
    def stage_slot(x, dout, lse, delta, b, h, i0, Tr, res, d, rows, Qc, dOc, Qp, dOp, Ls, Ds, dQt, slot):
        # A slot's rows (from index i0 of residue res; none past Tr), zero dQᵀ sums.
        for r in range(BQ):
            Ls[slot, r] = T.Select(i0 + r < Tr, lse[b, h, at(res, d, T.min(i0 + r, Tr - 1))], T.float32(float("inf")))
            Ds[slot, r] = T.Select(i0 + r < Tr, delta[b, h, at(res, d, T.min(i0 + r, Tr - 1))], T.float32(0))
        stage_rows(x, b, h, i0, Tr, res, d, rows, Qc, Qp, slot)
        stage_rows(dout, b, h, i0, Tr, res, d, rows, dOc, dOp, slot)
        for c, r in T.grid(D, BQ):
            dQt[slot, c, r] = T.float32(0)

    @T.macro
    def stage_extras(k, v, xidx, XKr, XVr, XKt, Xp, Xr, Xt, staged, xc, b, kh, d, E, Tn):
        # Chunk xc of the extra keys (zeros for padding and past E), zero dk/dv sums.
        staged[0] = xc
        for kk in range(BK):
            Xp[kk] = T.Select(xc * BK + kk < E, T.Cast("int64", xidx[b, T.min(xc * BK + kk, E - 1)]), T.int64(-1))
            Xr[kk] = T.floormod(T.max(Xp[kk], T.int64(0)), d)
            Xt[kk] = T.floordiv(T.max(Xp[kk], T.int64(0)), d)
            for c in T.vectorized(D):
                XKr[kk, c] = T.Select(Xp[kk] >= 0, bits(k[b, kh, T.min(T.max(Xp[kk], T.int64(0)), Tn - 1), c]),
                                      T.uint16(0))
                XVr[kk, c] = T.Select(Xp[kk] >= 0, bits(v[b, kh, T.min(T.max(Xp[kk], T.int64(0)), Tn - 1), c]),
                                      T.uint16(0))
        for c, kk in T.grid(D, BK):
            XKt[c, kk] = XKr[kk, c]

    @T.macro
    def flush_extras(dkx, dvx, dKx, dVx, staged, b, h, E):
        # The staged chunk's dk/dv sums into dkx/dvx (which sum over residues), then zero.
        if staged[0] >= 0:
            for kk in range(BK):
                if staged[0] * BK + kk < E:
                    for c in T.vectorized(D):
                        dkx[b, h, staged[0] * BK + kk, c] = dkx[b, h, staged[0] * BK + kk, c] + dKx[kk, c]
                        dvx[b, h, staged[0] * BK + kk, c] = dvx[b, h, staged[0] * BK + kk, c] + dVx[kk, c]
        for kk in range(BK):
            for c in T.vectorized(D):
                dKx[kk, c] = T.float32(0)
                dVx[kk, c] = T.float32(0)
        staged[0] = T.int64(-1)

    @T.macro
    def flush_globals(dqg, dQt, staged, b, h, G):
        # Slot GS's dQᵀ sums into dqg (which sums over residues and chunk visits).
        if staged[1] >= 0:
            for r in range(BQ):
                if staged[1] * BQ + r < G:
                    for c in range(D):
                        dqg[b, h, staged[1] * BQ + r, c] = dqg[b, h, staged[1] * BQ + r, c] + dQt[GS, c, r]
        staged[1] = T.int64(-1)

    @T.macro
    def head(bh, q, k, v, dil, xidx, dout, lse, delta, scale, qg, gidx, doutg, lseg, deltag, dq, dk, dv, dkx, dvx, dqg,
             B, H, Hkv, Tn, E, G):
        with T.sblock("head"):
            if spec.extras:
                T.reads(q[0:B, 0:H, 0:Tn, 0:D], k[0:B, 0:Hkv, 0:Tn, 0:D], v[0:B, 0:Hkv, 0:Tn, 0:D], dil[0:H],
                        xidx[0:B, 0:E], dout[0:B, 0:H, 0:Tn, 0:D], lse[0:B, 0:H, 0:Tn], delta[0:B, 0:H, 0:Tn],
                        qg[0:B, 0:H, 0:G, 0:D], gidx[0:B, 0:G], doutg[0:B, 0:H, 0:G, 0:D], lseg[0:B, 0:H, 0:G],
                        deltag[0:B, 0:H, 0:G])
                T.writes(dq[0:B, 0:H, 0:Tn, 0:D], dk[0:B, 0:H, 0:Tn, 0:D], dv[0:B, 0:H, 0:Tn, 0:D],
                         dkx[0:B, 0:H, 0:E, 0:D], dvx[0:B, 0:H, 0:E, 0:D], dqg[0:B, 0:H, 0:G, 0:D])
            else:
                T.reads(q[0:B, 0:H, 0:Tn, 0:D], k[0:B, 0:Hkv, 0:Tn, 0:D], v[0:B, 0:Hkv, 0:Tn, 0:D], dil[0:H],
                        dout[0:B, 0:H, 0:Tn, 0:D], lse[0:B, 0:H, 0:Tn], delta[0:B, 0:H, 0:Tn])
                T.writes(dq[0:B, 0:H, 0:Tn, 0:D], dk[0:B, 0:H, 0:Tn, 0:D], dv[0:B, 0:H, 0:Tn, 0:D])
            cfg = T.alloc_buffer((64,), "uint8")
            # The dot products' register tile: two halves of 8 float32x16 sums.
            sums_lo = T.alloc_buffer((8 * LANES,), "float32", scope="local")
            sums_hi = T.alloc_buffer((8 * LANES,), "float32", scope="local")
            # This key block: rows (A of Sᵀ, dPᵀ), K transposed (A of dQᵀ), dk/dv sums.
            Kr = T.alloc_buffer((BK, D), u16)
            Vr = T.alloc_buffer((BK, D), u16)
            Kt = T.alloc_buffer((D, BK), u16)
            dKa = T.alloc_buffer((BK, D), "float32")
            dVa = T.alloc_buffer((BK, D), "float32")
            # The ring of query sub-blocks: Qᵀ and dOᵀ pair words (B of Sᵀ, dPᵀ), Q and dO
            # row-pair words (B of dK, dV), lse, delta, dQᵀ sums, and which sub-block;
            # with extra keys one more slot (GS) for a chunk of global rows.
            Qc = T.alloc_buffer((RS, D // 2, BQ), u32)
            dOc = T.alloc_buffer((RS, D // 2, BQ), u32)
            Qp = T.alloc_buffer((RS, BQ // 2, D), u32)
            dOp = T.alloc_buffer((RS, BQ // 2, D), u32)
            Ls = T.alloc_buffer((RS, BQ), "float32")
            Ds = T.alloc_buffer((RS, BQ), "float32")
            dQt = T.alloc_buffer((RS, D, BQ), "float32")
            held = T.alloc_buffer((R,), "int64")
            rows = T.alloc_buffer((BQ, D), u16)  # staging scratch
            # One visit: Sᵀ, dPᵀ [keys, rows]; Pᵀ and dSᵀ rounded; dSᵀ as key-pair words.
            St = T.alloc_buffer((BK, BQ), "float32")
            dPt = T.alloc_buffer((BK, BQ), "float32")
            Pt = T.alloc_buffer((BK, BQ), u16)
            dSt = T.alloc_buffer((BK, BQ), u16)
            dSw = T.alloc_buffer((BK // 2, BQ), u32)
            hi = T.alloc_buffer((1,), "int64")
            # A chunk of BK extra keys staged as a key block, with each one's position,
            # residue and residue-space index under the head's dilation, and its dk/dv
            # sums; which chunk is staged (-1: none), and which chunk of global rows holds
            # slot GS, at positions Gp.
            XKr = T.alloc_buffer((BK, D), u16)
            XVr = T.alloc_buffer((BK, D), u16)
            XKt = T.alloc_buffer((D, BK), u16)
            dKx = T.alloc_buffer((BK, D), "float32")
            dVx = T.alloc_buffer((BK, D), "float32")
            Xp = T.alloc_buffer((BK,), "int64")
            Xr = T.alloc_buffer((BK,), "int64")
            Xt = T.alloc_buffer((BK,), "int64")
            Gp = T.alloc_buffer((BQ,), "int64")
            staged = T.alloc_buffer((2,), "int64")
            b = bh // H
            h = bh % H
            kh = h // (H // Hkv)
            if not dot_engine:
                for i in range(64):
                    cfg[i] = T.uint8(0)
                cfg[0] = T.uint8(1)  # palette 1: every tile 16 rows of 64 bytes
                for t in range(8):
                    cfg[16 + 2 * t] = T.uint8(64)
                    cfg[48 + t] = T.uint8(16)
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            if spec.extras:
                for e in range(E):
                    for c in T.vectorized(D):
                        dkx[b, h, e, c] = T.float32(0)
                        dvx[b, h, e, c] = T.float32(0)
                for g in range(G):
                    for c in T.vectorized(D):
                        dqg[b, h, g, c] = T.float32(0)
            d = dilation(dil, h)
            for res in T.serial(d, annotations=step_import):
                Tr = (Tn - res + (d - 1)) // d  # positions res, res + d, ... below T
                for s in range(R):
                    held[s] = T.int64(-1)
                hi[0] = T.int64(-1)
                staged[0] = T.int64(-1)
                staged[1] = T.int64(-1)
                nmb = (Tr + (BQ - 1)) // BQ
                for kb in range(nmb):
                    j0 = kb * BK
                    m_lo = T.max(T.floordiv(j0 - right, BQ), T.int64(0))
                    m_hi = T.min((j0 + BK - 1 + left) // BQ, nmb - 1)
                    # Stage the sub-blocks this key block is the first to see.
                    for m in range(hi[0] + 1, m_hi + 1):
                        slot = T.floormod(m, R)
                        write_dq(dq, dQt, held, slot, b, h, res, d, Tr)
                        held[slot] = m
                        stage_slot(q, dout, lse, delta, b, h, m * BQ, Tr, res, d, rows, Qc, dOc, Qp, dOp, Ls, Ds,
                                   dQt, slot)
                        if spec.extras:
                            # The extra keys, once per sub-block, as it is staged.
                            for xc in range((E + (BK - 1)) // BK):
                                if staged[0] != xc:
                                    flush_extras(dkx, dvx, dKx, dVx, staged, b, h, E)
                                    stage_extras(k, v, xidx, XKr, XVr, XKt, Xp, Xr, Xt, staged, xc, b, kh, d, E, Tn)
                                score_products(XKr, XVr, Qc, dOc, St, dPt, slot, sums_lo, sums_hi)
                                probabilities("extras", St, dPt, Pt, dSt, Ls, Ds, slot, scale, m * BQ, 0, Tr, res, d,
                                              Xp, Xr, Xt, Tn, 0, G, Gp, True)
                                gradient_products(Pt, dSt, dSw, Qp, dOp, dQt, XKt, dKx, dVx, slot, sums_lo, sums_hi)
                    hi[0] = T.max(hi[0], m_hi)
                    stage_rows(k, b, kh, j0, Tr, res, d, Kr, None, None, 0)
                    stage_rows(v, b, kh, j0, Tr, res, d, Vr, None, None, 0)
                    for c, kk in T.grid(D, BK):
                        Kt[c, kk] = Kr[kk, c]
                    for kk in range(BK):
                        for c in T.vectorized(D):
                            dKa[kk, c] = T.float32(0)
                            dVa[kk, c] = T.float32(0)
                    for m in range(m_lo, m_hi + 1):
                        slot = T.floormod(m, R)
                        i0 = m * BQ
                        score_products(Kr, Vr, Qc, dOc, St, dPt, slot, sums_lo, sums_hi)
                        # Pᵀ and dSᵀ = scale Pᵀ (dPᵀ - delta), in float32, rounded to bfloat16; the
                        # mask only where some pair of the visit is outside the window or T.
                        if T.And(T.And(i0 + BQ - 1 - j0 <= left, j0 + BK - 1 - i0 <= right), j0 + BK <= Tr):
                            probabilities("window", St, dPt, Pt, dSt, Ls, Ds, slot, scale, i0, j0, Tr, res, d, Xp, Xr,
                                          Xt, Tn, 0, G, Gp, False)
                        else:
                            probabilities("window", St, dPt, Pt, dSt, Ls, Ds, slot, scale, i0, j0, Tr, res, d, Xp, Xr,
                                          Xt, Tn, 0, G, Gp, True)
                        gradient_products(Pt, dSt, dSw, Qp, dOp, dQt, Kt, dKa, dVa, slot, sums_lo, sums_hi)
                    if spec.extras:
                        # The global rows that attend to k and v, a chunk of BQ at a time in
                        # slot GS (staged once per residue where they fit one chunk), as a
                        # sub-block of every key block: their dQᵀ sums go to dqg as the
                        # chunk leaves the slot.
                        for gc in range((G + (BQ - 1)) // BQ):
                            if staged[1] != gc:
                                flush_globals(dqg, dQt, staged, b, h, G)
                                staged[1] = gc
                                for r in range(BQ):
                                    Gp[r] = T.Select(gc * BQ + r < G,
                                                     T.Cast("int64", gidx[b, T.min(gc * BQ + r, G - 1)]), T.int64(-1))
                                stage_slot(qg, doutg, lseg, deltag, b, h, gc * BQ, G, 0, T.int64(1), rows, Qc, dOc, Qp,
                                           dOp, Ls, Ds, dQt, GS)
                            score_products(Kr, Vr, Qc, dOc, St, dPt, GS, sums_lo, sums_hi)
                            probabilities("global", St, dPt, Pt, dSt, Ls, Ds, GS, scale, 0, j0, Tr, res, d, Xp, Xr, Xt,
                                          Tn, gc * BQ, G, Gp, True)
                            gradient_products(Pt, dSt, dSw, Qp, dOp, dQt, Kt, dKa, dVa, GS, sums_lo, sums_hi)
                    for kk in range(BK):
                        if j0 + kk < Tr:
                            for c in T.vectorized(D):
                                dk[b, h, at(res, d, j0 + kk), c] = T.reinterpret("bfloat16", rounded(dKa[kk, c]))
                                dv[b, h, at(res, d, j0 + kk), c] = T.reinterpret("bfloat16", rounded(dVa[kk, c]))
                for s in range(R):
                    write_dq(dq, dQt, held, s, b, h, res, d, Tr)
                if spec.extras:
                    flush_extras(dkx, dvx, dKx, dVx, staged, b, h, E)
                    flush_globals(dqg, dQt, staged, b, h, G)

    if not spec.extras:
        @T.prim_func(s_tir=True)
        def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, do_h: T.handle, lse_h: T.handle,
                   delta_h: T.handle, scale: T.float32, dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            B, H, Hkv, Tn = T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (B, H, Tn, D), "bfloat16")
            k = T.match_buffer(k_h, (B, Hkv, Tn, D), "bfloat16")
            v = T.match_buffer(v_h, (B, Hkv, Tn, D), "bfloat16")
            dil = T.match_buffer(dil_h, (H,), "int32")
            dout = T.match_buffer(do_h, (B, H, Tn, D), "bfloat16")
            lse = T.match_buffer(lse_h, (B, H, Tn), "float32")
            delta = T.match_buffer(delta_h, (B, H, Tn), "float32")
            dq = T.match_buffer(dq_h, (B, H, Tn, D), "bfloat16")
            dk = T.match_buffer(dk_h, (B, H, Tn, D), "bfloat16")
            dv = T.match_buffer(dv_h, (B, H, Tn, D), "bfloat16")
            for bh in T.parallel(B * H):
                head(bh, q, k, v, dil, None, dout, lse, delta, scale, None, None, None, None, None, dq, dk, dv, None,
                     None, None, B, H, Hkv, Tn, None, None)
    else:
        @T.prim_func(s_tir=True)
        def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, x_h: T.handle, do_h: T.handle,
                   lse_h: T.handle, delta_h: T.handle, scale: T.float32, qg_h: T.handle, gi_h: T.handle,
                   dog_h: T.handle, lseg_h: T.handle, deltag_h: T.handle, dq_h: T.handle, dk_h: T.handle,
                   dv_h: T.handle, dkx_h: T.handle, dvx_h: T.handle, dqg_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            B, H, Hkv, Tn, E, G = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (B, H, Tn, D), "bfloat16")
            k = T.match_buffer(k_h, (B, Hkv, Tn, D), "bfloat16")
            v = T.match_buffer(v_h, (B, Hkv, Tn, D), "bfloat16")
            dil = T.match_buffer(dil_h, (H,), "int32")
            xidx = T.match_buffer(x_h, (B, E), "int32")
            dout = T.match_buffer(do_h, (B, H, Tn, D), "bfloat16")
            lse = T.match_buffer(lse_h, (B, H, Tn), "float32")
            delta = T.match_buffer(delta_h, (B, H, Tn), "float32")
            qg = T.match_buffer(qg_h, (B, H, G, D), "bfloat16")
            gidx = T.match_buffer(gi_h, (B, G), "int32")
            doutg = T.match_buffer(dog_h, (B, H, G, D), "bfloat16")
            lseg = T.match_buffer(lseg_h, (B, H, G), "float32")
            deltag = T.match_buffer(deltag_h, (B, H, G), "float32")
            dq = T.match_buffer(dq_h, (B, H, Tn, D), "bfloat16")
            dk = T.match_buffer(dk_h, (B, H, Tn, D), "bfloat16")
            dv = T.match_buffer(dv_h, (B, H, Tn, D), "bfloat16")
            dkx = T.match_buffer(dkx_h, (B, H, E, D), "float32")
            dvx = T.match_buffer(dvx_h, (B, H, E, D), "float32")
            dqg = T.match_buffer(dqg_h, (B, H, G, D), "float32")
            for bh in T.parallel(B * H):
                head(bh, q, k, v, dil, xidx, dout, lse, delta, scale, qg, gidx, doutg, lseg, deltag, dq, dk, dv, dkx,
                     dvx, dqg, B, H, Hkv, Tn, E, G)

    return kernel.with_attr("global_symbol", spec.name)


__all__ = ["fused_backward_matrix", "BK", "BQ"]
