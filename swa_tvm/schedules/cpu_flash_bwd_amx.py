"""The five-product CPU backward on the matrix engine (AMX): kind "local_bwd" in
bfloat16 on a CPU with AMX, without extra keys (``compute.forward.amx_serves``).

The plan is ``cpu_flash_bwd``'s (one task per (batch, head); key blocks of 32 in order;
each recomputes the scores and dP of the query rows that see it; dk/dv in a local tile;
dq accumulated across key blocks; each residue of the head's dilation in turn, as a
plain window of its own), with the five products on AMX tiles (bfloat16
operands, float32 sums; ``schedules.amx`` gives the tile conventions) and the softmax
between them in float32 vectors, P and dS rounded to bfloat16 for their products, as
the TE kernels' matrix-engine form and FlashAttention's backward do.

The products run transposed: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, so each score row is one key
and its vector runs along 32 query rows, whose lse and delta load as vectors; Pᵀ and
dSᵀ, as rounded, are then the first operands of dV += Pᵀ·dO and dK += dSᵀ·Q, and dSᵀ in
pair words (two keys per word) the second of dQᵀ += Kᵀ·dSᵀ. Every operand is staged
once per task in the engine's layouts: each key block's rows and transpose as the block
starts, each query sub-block's (aligned to 32 rows) as the first key block that sees it
starts, into a ring of slots that holds every sub-block a key block sees. A sub-block's
dQᵀ accumulates in its slot and is written to dq when the slot is reused, or at the end.
Positions past T stage as zeros (keys masked; rows with lse = +inf).

Arguments, as ``cpu_flash_bwd``'s: q [B,H,T,D], k/v [B,Hkv,T,D], dilation [H], dout
[B,H,T,D] (bfloat16), lse [B,H,T] (+inf: a row whose probabilities are all 0), delta
[B,H,T], scale, then the results: dq [B,H,T,D] in bfloat16 (its float32 sums rounded
once, as its slot is written; ``cpu_flash_bwd`` sums dq in place, so in float32), dk and
dv [B,H,T,D] in float32 per query head (the caller sums a GQA group).
"""

from __future__ import annotations

from tvm.script import tirx as T

from swa_tvm.compute.forward import SHORT_EXP, _exp, amx_serves, bf16_round_bits, pair_word
from swa_tvm.spec import KernelSpec

BK = BQ = 32  # keys per key block, query rows per sub-block (one tile product's depth)
TILE = 16  # rows and float32 columns of a tile


def fused_backward_amx(spec: KernelSpec):
    """The PrimFunc of a "local_bwd" spec this form serves (symbolic B, H, Hkv and T)."""
    assert spec.kind == "local_bwd" and amx_serves(spec), spec.name
    D, left, right = spec.head_dim, spec.left, spec.right
    NT = D // TILE  # result tiles across the features
    KC = D // 32  # depth chunks of the score products
    group = max(g for g in (1, 2, 3, 4) if NT % g == 0)  # result tiles sharing one A tile
    R = (BK - 1 + left + right) // BQ + 2  # ring slots: the most sub-blocks one key block sees
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

    @T.macro
    def probabilities(St, dPt, Pt, dSt, Ls, Ds, slot, scale, i0, j0, Tr, masked):
        for kk in range(BK):
            for r in T.vectorized(BQ):
                if masked:
                    St[kk, r] = T.Select(
                        T.And(T.And(i0 + r - j0 - kk <= left, j0 + kk - i0 - r <= right), j0 + kk < Tr),
                        _exp(St[kk, r] * scale - Ls[slot, r], "float32", coeffs=SHORT_EXP),
                        T.float32(0),
                    )
                else:
                    St[kk, r] = _exp(St[kk, r] * scale - Ls[slot, r], "float32", coeffs=SHORT_EXP)
                Pt[kk, r] = rounded(St[kk, r])
                dSt[kk, r] = rounded(St[kk, r] * (dPt[kk, r] - Ds[slot, r]) * scale)

    @T.macro
    def head(bh, q, k, v, dil, dout, lse, delta, scale, dq, dk, dv, B, H, Hkv, Tn):
        with T.sblock("head"):
            T.reads(q[0:B, 0:H, 0:Tn, 0:D], k[0:B, 0:Hkv, 0:Tn, 0:D], v[0:B, 0:Hkv, 0:Tn, 0:D], dil[0:H],
                    dout[0:B, 0:H, 0:Tn, 0:D], lse[0:B, 0:H, 0:Tn], delta[0:B, 0:H, 0:Tn])
            T.writes(dq[0:B, 0:H, 0:Tn, 0:D], dk[0:B, 0:H, 0:Tn, 0:D], dv[0:B, 0:H, 0:Tn, 0:D])
            cfg = T.alloc_buffer((64,), "uint8")
            # This key block: rows (A of Sᵀ, dPᵀ), K transposed (A of dQᵀ), dk/dv sums.
            Kr = T.alloc_buffer((BK, D), u16)
            Vr = T.alloc_buffer((BK, D), u16)
            Kt = T.alloc_buffer((D, BK), u16)
            dKa = T.alloc_buffer((BK, D), "float32")
            dVa = T.alloc_buffer((BK, D), "float32")
            # The ring of query sub-blocks: Qᵀ and dOᵀ pair words (B of Sᵀ, dPᵀ), Q and dO
            # row-pair words (B of dK, dV), lse, delta, dQᵀ sums, and which sub-block.
            Qc = T.alloc_buffer((R, D // 2, BQ), u32)
            dOc = T.alloc_buffer((R, D // 2, BQ), u32)
            Qp = T.alloc_buffer((R, BQ // 2, D), u32)
            dOp = T.alloc_buffer((R, BQ // 2, D), u32)
            Ls = T.alloc_buffer((R, BQ), "float32")
            Ds = T.alloc_buffer((R, BQ), "float32")
            dQt = T.alloc_buffer((R, D, BQ), "float32")
            held = T.alloc_buffer((R,), "int64")
            rows = T.alloc_buffer((BQ, D), u16)  # staging scratch
            # One visit: Sᵀ, dPᵀ [keys, rows]; Pᵀ and dSᵀ rounded; dSᵀ as key-pair words.
            St = T.alloc_buffer((BK, BQ), "float32")
            dPt = T.alloc_buffer((BK, BQ), "float32")
            Pt = T.alloc_buffer((BK, BQ), u16)
            dSt = T.alloc_buffer((BK, BQ), u16)
            dSw = T.alloc_buffer((BK // 2, BQ), u32)
            hi = T.alloc_buffer((1,), "int64")
            b = bh // H
            h = bh % H
            kh = h // (H // Hkv)
            for i in range(64):
                cfg[i] = T.uint8(0)
            cfg[0] = T.uint8(1)  # palette 1: every tile 16 rows of 64 bytes
            for t in range(8):
                cfg[16 + 2 * t] = T.uint8(64)
                cfg[48 + t] = T.uint8(16)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            d = dilation(dil, h)
            for res in range(d):
                Tr = (Tn - res + (d - 1)) // d  # positions res, res + d, ... below T
                for s in range(R):
                    held[s] = T.int64(-1)
                hi[0] = T.int64(-1)
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
                        for r in range(BQ):
                            Ls[slot, r] = T.Select(m * BQ + r < Tr, lse[b, h, at(res, d, T.min(m * BQ + r, Tr - 1))],
                                                   T.float32(float("inf")))
                            Ds[slot, r] = T.Select(m * BQ + r < Tr, delta[b, h, at(res, d, T.min(m * BQ + r, Tr - 1))],
                                                   T.float32(0))
                        stage_rows(q, b, h, m * BQ, Tr, res, d, rows, Qc, Qp, slot)
                        stage_rows(dout, b, h, m * BQ, Tr, res, d, rows, dOc, dOp, slot)
                        for c, r in T.grid(D, BQ):
                            dQt[slot, c, r] = T.float32(0)
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
                        # Pᵀ and dSᵀ = scale Pᵀ (dPᵀ - delta), in float32, rounded to bfloat16; the
                        # mask only where some pair of the visit is outside the window or T.
                        if T.And(T.And(i0 + BQ - 1 - j0 <= left, j0 + BK - 1 - i0 <= right), j0 + BK <= Tr):
                            probabilities(St, dPt, Pt, dSt, Ls, Ds, slot, scale, i0, j0, Tr, False)
                        else:
                            probabilities(St, dPt, Pt, dSt, Ls, Ds, slot, scale, i0, j0, Tr, True)
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
                    for kk in range(BK):
                        if j0 + kk < Tr:
                            for c in T.vectorized(D):
                                dk[b, h, at(res, d, j0 + kk), c] = dKa[kk, c]
                                dv[b, h, at(res, d, j0 + kk), c] = dVa[kk, c]
                for s in range(R):
                    write_dq(dq, dQt, held, s, b, h, res, d, Tr)

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
        dk = T.match_buffer(dk_h, (B, H, Tn, D), "float32")
        dv = T.match_buffer(dv_h, (B, H, Tn, D), "float32")
        for bh in T.parallel(B * H):
            head(bh, q, k, v, dil, dout, lse, delta, scale, dq, dk, dv, B, H, Hkv, Tn)

    return kernel.with_attr("global_symbol", spec.name)


__all__ = ["fused_backward_amx", "BK", "BQ"]
