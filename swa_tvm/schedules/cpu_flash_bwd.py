"""The five-product CPU backward (kind "local_bwd"): dq, dk and dv of a local window
kernel in one hand-written TIR kernel, FlashAttention-2's plan.

The TE gradient kernels (``compute.backward``) take two passes: dq (recomputing Q·Kᵀ
and dO·Vᵀ, then dS·K) and dk/dv (both again, then Pᵀ·dO and dSᵀ·Q), seven products and
two softmax recomputations. A single pass needs dq accumulated across key blocks, a
scatter-add TE cannot write. Here each (batch, head) is one task: its key blocks run in
order, each recomputes the scores and dP of the query rows that see it (in sub-blocks
of ``BQ`` rows), keeps its dk/dv in a local tile, and adds dS·K to the dq rows in place,
which no other task writes. Five products, one recomputation. Under dilation d (the
head's runtime value) the positions of each residue r (r, r + d, r + 2d, ...) are a
plain window of their own: the task runs the same loops over each residue in turn, in
units of d.

It serves float32, bfloat16 and float16 (converted to float32 as they are staged, once
per key block or query sub-block) with a bounded window and finite inputs
(``KernelSpec.fused_backward``). With extra keys (globals, sinks) each query sub-block
also scores them once, adding their dS·K to its dq rows and their Pᵀ·dO and dSᵀ·Q to the
extras' dk/dv rows (``local_dx``'s work); the global rows that attend to k and v join
every key block as one more sub-block, their dq summed across key blocks
(``global_bwd``'s work). The TE kernels run where the (batch, head) pairs are too few to
occupy the threads, and bfloat16 on a CPU with a matrix engine (AMX, AVX-512 BF16) takes
``cpu_flash_bwd_matrix`` where it serves (``compute.forward.amx_serves``; ``swa_tvm.eager``). Probabilities use the
forward's exp (``compute.forward._exp``), and dq, dk and dv sum in the TE kernels' key
and row order; the scale is applied to dS before the sums, not after them (the same
values for a power-of-two scale).

Arguments, as the TE kernels': q [B,H,T,D], k/v [B,Hkv,T,D], dilation [H], [extra_idx
[B,E] int32 (-1: padding)], dout [B,H,T,D] (in the spec's dtype), lse [B,H,T] (+inf: a
row whose probabilities are all 0, such as a global row's), delta [B,H,T], scale;
with extra keys then the global rows: their queries [B,H,G,D], positions [B,G] int32,
dout [B,H,G,D], lse and delta [B,H,G] (G = 0: none); then the results, all float32: dq
[B,H,T,D] (accumulated in place; the caller rounds it to q's dtype), dk/dv [B,H,T,D]
per query head (the caller sums a GQA group), and with extra keys dk/dv of the extras
[B,H,E,D] and dq of the global rows [B,H,G,D].
"""

from __future__ import annotations

from tvm.script import tirx as T

from swa_tvm.compute.forward import _exp, extra_visible
from swa_tvm.spec import KernelSpec

# Keys per key block and query rows per sub-block.
BK = BQ = 32
# Register tiles of 16 accumulators (half of AVX-512's 32 registers; the rest hold the
# operands): the two score products RT rows x BK keys (2 vectors); dk/dv and dq
# ``feature_tile_rows(D)`` keys or rows x D.
RT = 8


def feature_tile_rows(D: int) -> int:
    """Rows of a [rows, D] register tile of at most 16 vectors of 16 floats (at least
    one row): a power of two up to BK = BQ = 32, so it divides both."""
    return next((n for n in (32, 16, 8, 4, 2) if n * D <= 256), 1)


def fused_backward(spec: KernelSpec):
    """The PrimFunc of a "local_bwd" spec (symbolic B, H, Hkv, T, and E and G with extra
    keys)."""
    assert spec.kind == "local_bwd" and spec.fused_backward, spec.name
    D, dt, left, right = spec.head_dim, spec.dtype, spec.left, spec.right
    nsub = (BK + left + right + BQ - 1) // BQ  # query sub-blocks that see a key block
    KT = QT = feature_tile_rows(D)  # dq's tile reuses dk/dv's accumulators (tacc)

    def exp(x):
        return _exp(x, "float32")

    def clamp(i, Tn):
        return T.max(T.min(i, Tn - 1), 0)

    def f32(x):
        return T.Cast("float32", x)

    def at(res, d, x):  # the position of index x of residue res (dilation d)
        return res + d * x

    def dilation(dil, h):
        # A kernel for dilation 1 alone takes it as the constant 1 (its code is then the
        # plain window's), as compute.forward.Band(unit=True) does.
        return T.int64(1) if spec.max_dilation == 1 else T.Cast("int64", dil[h])

    # Which (row r of the staged rows, key kk of the staged keys) pairs count, by what the
    # rows and keys are: "window" (sub-block rows from i0, the key block from j0 of
    # residue res), "extras" (sub-block rows, a chunk of extra keys), "global" (a chunk
    # of global rows from g0, the key block).
    def visible(what, r, kk, i0, j0, Tr, res, d, Xp, Xr, Xt, Tn, g0, G, Gp):
        row_ok = T.And(i0 + r >= 0, i0 + r < Tr)
        if what == "window":
            return T.And(row_ok, T.And(j0 + kk < Tr, T.And(i0 + r - j0 - kk <= left, j0 + kk - i0 - r <= right)))
        if what == "extras":
            return T.And(row_ok, extra_visible(left, right, Tn, Xp[kk], Xr[kk], Xt[kk], at(res, d, i0 + r), i0 + r, res))
        ok = T.And(g0 + r < G, j0 + kk < Tr)
        return T.And(ok, at(res, d, j0 + kk) <= Gp[r]) if right == 0 else ok  # a causal global row's past

    @T.macro
    def probabilities(what, Qs, dOs, Ls, Ds, Kt, Vt, P, dS, sacc, pacc, scale, i0, j0, Tr, res, d, Xp, Xr, Xt, Tn,
                      g0, G, Gp):
        # P = exp(Q Kᵀ scale - lse) where visible, else 0, and dS = scale * P * (dO Vᵀ - delta)
        # for the BQ staged rows and BK staged keys, RT rows at a time in registers.
        for ro in range(BQ // RT):
            for r in T.unroll(RT):
                for kk in T.vectorized(BK):
                    sacc[r, kk] = T.float32(0)
                    pacc[r, kk] = T.float32(0)
            for c in range(D):
                for r in T.unroll(RT):
                    for kk in T.vectorized(BK):
                        sacc[r, kk] = sacc[r, kk] + Qs[ro * RT + r, c] * Kt[c, kk]
            for c in range(D):
                for r in T.unroll(RT):
                    for kk in T.vectorized(BK):
                        pacc[r, kk] = pacc[r, kk] + dOs[ro * RT + r, c] * Vt[c, kk]
            for r in range(RT):
                for kk in T.vectorized(BK):
                    P[ro * RT + r, kk] = T.Select(
                        visible(what, ro * RT + r, kk, i0, j0, Tr, res, d, Xp, Xr, Xt, Tn, g0, G, Gp),
                        exp(sacc[r, kk] * scale - Ls[ro * RT + r]),
                        T.float32(0),
                    )
                    dS[ro * RT + r, kk] = P[ro * RT + r, kk] * (pacc[r, kk] - Ds[ro * RT + r]) * scale

    @T.macro
    def key_tile_update(total, weights, rows, tacc, ko):
        # total[key] += sum over the staged rows r of weights[r, key] * rows[r]: KT keys of
        # the block at a time (from ko * KT), in the register tile tacc.
        for kk in T.unroll(KT):
            for c in T.vectorized(D):
                tacc[kk, c] = total[ko * KT + kk, c]
        for r in range(BQ):
            for kk in T.unroll(KT):
                for c in T.vectorized(D):
                    tacc[kk, c] = tacc[kk, c] + weights[r, ko * KT + kk] * rows[r, c]
        for kk in T.unroll(KT):
            for c in T.vectorized(D):
                total[ko * KT + kk, c] = tacc[kk, c]

    @T.macro
    def extra_tile_update(total, weights, rows, tacc, ko, b, h, e0, E):
        # total[b, h, e] += sum over the staged rows r of weights[r, e - e0] * rows[r] for
        # KT extras of the chunk at a time (from e0 + ko * KT); e < E alone written.
        for kk in T.unroll(KT):
            for c in T.vectorized(D):
                tacc[kk, c] = total[b, h, T.min(e0 + ko * KT + kk, E - 1), c]
        for r in range(BQ):
            for kk in T.unroll(KT):
                for c in T.vectorized(D):
                    tacc[kk, c] = tacc[kk, c] + weights[r, ko * KT + kk] * rows[r, c]
        for kk in T.unroll(KT):
            if e0 + ko * KT + kk < E:
                for c in T.vectorized(D):
                    total[b, h, e0 + ko * KT + kk, c] = tacc[kk, c]

    @T.macro
    def dq_rows_update(dq, dS, Krows, tacc, b, h, res, d, i0, Tr):
        # dq rows += dS Krows, in place; rows outside [0, T) (clamped reads, all-zero dS)
        # are not written back.
        for ro in range(BQ // QT):
            for r in T.unroll(QT):
                for c in T.vectorized(D):
                    tacc[r, c] = dq[b, h, at(res, d, clamp(i0 + ro * QT + r, Tr)), c]
            for kk in range(BK):
                for r in T.unroll(QT):
                    for c in T.vectorized(D):
                        tacc[r, c] = tacc[r, c] + dS[ro * QT + r, kk] * Krows[kk, c]
            for r in T.unroll(QT):
                if i0 + ro * QT + r >= 0 and i0 + ro * QT + r < Tr:
                    for c in T.vectorized(D):
                        dq[b, h, at(res, d, i0 + ro * QT + r), c] = tacc[r, c]

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
            # Staged in float32: the key block transposed (keys in vectors) and as rows,
            # the value block transposed, the sub-block's query and output-gradient rows.
            Kt = T.alloc_buffer((D, BK), "float32")
            Vt = T.alloc_buffer((D, BK), "float32")
            Kr = T.alloc_buffer((BK, D), "float32")
            Qs = T.alloc_buffer((BQ, D), "float32")
            dOs = T.alloc_buffer((BQ, D), "float32")
            Ls = T.alloc_buffer((BQ,), "float32")
            Ds = T.alloc_buffer((BQ,), "float32")
            P = T.alloc_buffer((BQ, BK), "float32")
            dS = T.alloc_buffer((BQ, BK), "float32")  # scale * P * (dP - delta)
            dKa = T.alloc_buffer((BK, D), "float32")
            dVa = T.alloc_buffer((BK, D), "float32")
            sacc = T.alloc_buffer((RT, BK), "float32", scope="local")
            pacc = T.alloc_buffer((RT, BK), "float32", scope="local")
            tacc = T.alloc_buffer((KT, D), "float32", scope="local")
            # A chunk of BK extra keys (globals, sinks) staged as a key block, with each
            # one's position, residue and residue-space index under the head's dilation;
            # the positions of a chunk of BQ global rows.
            XKt = T.alloc_buffer((D, BK), "float32")
            XVt = T.alloc_buffer((D, BK), "float32")
            XKr = T.alloc_buffer((BK, D), "float32")
            Xp = T.alloc_buffer((BK,), "int64")
            Xr = T.alloc_buffer((BK,), "int64")
            Xt = T.alloc_buffer((BK,), "int64")
            Gp = T.alloc_buffer((BQ,), "int64")
            b = bh // H
            h = bh % H
            kh = h // (H // Hkv)
            for i in range(Tn):
                for c in T.vectorized(D):
                    dq[b, h, i, c] = T.float32(0)
            if spec.extras:
                for e in range(E):
                    for c in T.vectorized(D):
                        dkx[b, h, e, c] = T.float32(0)
                        dvx[b, h, e, c] = T.float32(0)
                for g in range(G):
                    for c in T.vectorized(D):
                        dqg[b, h, g, c] = T.float32(0)
            d = dilation(dil, h)
            for res in range(d):
                Tr = (Tn - res + (d - 1)) // d  # positions res, res + d, ... below T
                nkb = (Tr + (BK - 1)) // BK
                for kb in range(nkb):
                    j0 = kb * BK
                    for c, kk in T.grid(D, BK):
                        Kt[c, kk] = f32(k[b, kh, at(res, d, T.min(j0 + kk, Tr - 1)), c])
                        Vt[c, kk] = f32(v[b, kh, at(res, d, T.min(j0 + kk, Tr - 1)), c])
                    for kk in range(BK):
                        for c in T.vectorized(D):
                            Kr[kk, c] = f32(k[b, kh, at(res, d, T.min(j0 + kk, Tr - 1)), c])
                            dKa[kk, c] = T.float32(0)
                            dVa[kk, c] = T.float32(0)
                    for s in range(nsub):
                        i0 = j0 - right + s * BQ
                        if i0 + BQ > 0 and i0 < Tr:
                            for r in range(BQ):
                                Ls[r] = lse[b, h, at(res, d, clamp(i0 + r, Tr))]
                                Ds[r] = delta[b, h, at(res, d, clamp(i0 + r, Tr))]
                                for c in T.vectorized(D):
                                    Qs[r, c] = f32(q[b, h, at(res, d, clamp(i0 + r, Tr)), c])
                                    dOs[r, c] = f32(dout[b, h, at(res, d, clamp(i0 + r, Tr)), c])
                            probabilities("window", Qs, dOs, Ls, Ds, Kt, Vt, P, dS, sacc, pacc, scale, i0, j0, Tr, res,
                                          d, Xp, Xr, Xt, Tn, 0, G, Gp)
                            # dv += Pᵀ dO and dk += dSᵀ Q over the sub-block's rows.
                            for ko in range(BK // KT):
                                key_tile_update(dVa, P, dOs, tacc, ko)
                                key_tile_update(dKa, dS, Qs, tacc, ko)
                            dq_rows_update(dq, dS, Kr, tacc, b, h, res, d, i0, Tr)
                            if spec.extras:
                                # The extra keys, once per sub-block: at its first key block
                                # (s = 0), or at the last one for the sub-blocks past it.
                                if s == 0 or kb == nkb - 1:
                                    for xc in range((E + (BK - 1)) // BK):
                                        e0 = xc * BK
                                        for kk in range(BK):
                                            Xp[kk] = T.Select(e0 + kk < E, T.Cast("int64", xidx[b, T.min(e0 + kk, E - 1)]),
                                                              T.int64(-1))
                                            Xr[kk] = T.floormod(T.max(Xp[kk], T.int64(0)), d)
                                            Xt[kk] = T.floordiv(T.max(Xp[kk], T.int64(0)), d)
                                        for c, kk in T.grid(D, BK):
                                            XKt[c, kk] = f32(k[b, kh, clamp(Xp[kk], Tn), c])
                                            XVt[c, kk] = f32(v[b, kh, clamp(Xp[kk], Tn), c])
                                        for kk in range(BK):
                                            for c in T.vectorized(D):
                                                XKr[kk, c] = f32(k[b, kh, clamp(Xp[kk], Tn), c])
                                        probabilities("extras", Qs, dOs, Ls, Ds, XKt, XVt, P, dS, sacc, pacc, scale, i0,
                                                      j0, Tr, res, d, Xp, Xr, Xt, Tn, 0, G, Gp)
                                        for ko in range(BK // KT):
                                            extra_tile_update(dvx, P, dOs, tacc, ko, b, h, e0, E)
                                            extra_tile_update(dkx, dS, Qs, tacc, ko, b, h, e0, E)
                                        dq_rows_update(dq, dS, XKr, tacc, b, h, res, d, i0, Tr)
                    if spec.extras:
                        # The global rows (every key in a causal row's past, or every key),
                        # BQ at a time, as a sub-block of the key block: their dq rows
                        # accumulate in dqg across the key blocks.
                        for gc in range((G + (BQ - 1)) // BQ):
                            g0 = gc * BQ
                            for r in range(BQ):
                                Ls[r] = lseg[b, h, T.min(g0 + r, G - 1)]
                                Ds[r] = deltag[b, h, T.min(g0 + r, G - 1)]
                                Gp[r] = T.Cast("int64", gidx[b, T.min(g0 + r, G - 1)])
                                for c in T.vectorized(D):
                                    Qs[r, c] = f32(qg[b, h, T.min(g0 + r, G - 1), c])
                                    dOs[r, c] = f32(doutg[b, h, T.min(g0 + r, G - 1), c])
                            probabilities("global", Qs, dOs, Ls, Ds, Kt, Vt, P, dS, sacc, pacc, scale, 0, j0, Tr, res,
                                          d, Xp, Xr, Xt, Tn, g0, G, Gp)
                            for ko in range(BK // KT):
                                key_tile_update(dVa, P, dOs, tacc, ko)
                                key_tile_update(dKa, dS, Qs, tacc, ko)
                            # dqg rows from g0 += dS K: its G rows as a residue 0 of dilation 1.
                            dq_rows_update(dqg, dS, Kr, tacc, b, h, 0, T.int64(1), g0, G)
                    for kk in range(BK):
                        if j0 + kk < Tr:
                            for c in T.vectorized(D):
                                dk[b, h, at(res, d, j0 + kk), c] = dKa[kk, c]
                                dv[b, h, at(res, d, j0 + kk), c] = dVa[kk, c]

    if not spec.extras:
        @T.prim_func(s_tir=True)
        def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, do_h: T.handle, lse_h: T.handle,
                   delta_h: T.handle, scale: T.float32, dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            B, H, Hkv, Tn = T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (B, H, Tn, D), dt)
            k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
            v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
            dil = T.match_buffer(dil_h, (H,), "int32")
            dout = T.match_buffer(do_h, (B, H, Tn, D), dt)
            lse = T.match_buffer(lse_h, (B, H, Tn), "float32")
            delta = T.match_buffer(delta_h, (B, H, Tn), "float32")
            dq = T.match_buffer(dq_h, (B, H, Tn, D), "float32")
            dk = T.match_buffer(dk_h, (B, H, Tn, D), "float32")
            dv = T.match_buffer(dv_h, (B, H, Tn, D), "float32")
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
            q = T.match_buffer(q_h, (B, H, Tn, D), dt)
            k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
            v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
            dil = T.match_buffer(dil_h, (H,), "int32")
            xidx = T.match_buffer(x_h, (B, E), "int32")
            dout = T.match_buffer(do_h, (B, H, Tn, D), dt)
            lse = T.match_buffer(lse_h, (B, H, Tn), "float32")
            delta = T.match_buffer(delta_h, (B, H, Tn), "float32")
            qg = T.match_buffer(qg_h, (B, H, G, D), dt)
            gidx = T.match_buffer(gi_h, (B, G), "int32")
            doutg = T.match_buffer(dog_h, (B, H, G, D), dt)
            lseg = T.match_buffer(lseg_h, (B, H, G), "float32")
            deltag = T.match_buffer(deltag_h, (B, H, G), "float32")
            dq = T.match_buffer(dq_h, (B, H, Tn, D), "float32")
            dk = T.match_buffer(dk_h, (B, H, Tn, D), "float32")
            dv = T.match_buffer(dv_h, (B, H, Tn, D), "float32")
            dkx = T.match_buffer(dkx_h, (B, H, E, D), "float32")
            dvx = T.match_buffer(dvx_h, (B, H, E, D), "float32")
            dqg = T.match_buffer(dqg_h, (B, H, G, D), "float32")
            for bh in T.parallel(B * H):
                head(bh, q, k, v, dil, xidx, dout, lse, delta, scale, qg, gidx, doutg, lseg, deltag, dq, dk, dv, dkx,
                     dvx, dqg, B, H, Hkv, Tn, E, G)

    return kernel.with_attr("global_symbol", spec.name)


__all__ = ["fused_backward", "BK", "BQ"]
