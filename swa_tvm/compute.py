"""Tensor-expression definitions of the attention math (no scheduling here).

Two computes, both O(T * (W + G)) in work and memory; neither ever builds a T x T tensor.

``local``: the blocked ("chunks") form. With dilation d, row i = r + d*t has residue
r = i mod d and only ever sees keys of the same residue, so each residue class is an
ordinary (non-dilated) banded problem over t. A *work item* is one block of ``block_q``
consecutive t of one residue: item beta of head h covers

    ib = beta // d,  r = beta % d,  rows  i(qi) = ib*Bq*d + r + d*qi,    qi < Bq
                                    keys  j(kj) = ib*Bq*d + r + d*(kj - left), kj < Kw

so its window keys form one contiguous band of Kw = Bq + left + right keys, and the score
stage is a dense (Bq x D) @ (D x Kw) product per item. d is read at runtime from a [H]
tensor, so one kernel serves uniform and per-head dilation up to ``max_dilation``; the
item grid has ceil(T/Bq) + max_dilation - 1 entries, enough for any d <= max_dilation.

``global``: G global rows, each against all T keys (causal: keys j <= its position).
"""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import te, tirx

from .spec import KernelSpec

# Key bands are padded to a multiple of this many keys (one AVX-512 vector of fp32).
LANES = 16



def _neg_inf(dtype: str):
    return tirx.infinity(dtype) * tirx.const(-1, dtype)


def _exp(x, dtype: str):
    """exp(x) for x <= 0 (scores minus their row max), vectorizable.

    LLVM scalarises ``tir.exp`` into libm calls on the CPU, which would dominate the
    kernel. This is Cephes' expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp),
    returning exactly 0 below the float32 range so masked (-inf) scores add nothing.
    float64 (used by gradient tests) keeps the exact intrinsic.

    ``x`` appears many times in the expanded polynomial, so callers pass a cheap
    expression (a few buffer loads; the stages it reads are materialized). It is not
    Let-bound: MetaSchedule's FLOP estimator rejects Let, and LLVM removes the repeats.
    """
    if dtype != "float32":
        return tirx.exp(x)
    return _exp_poly(x, lambda c: tirx.const(c, "float32"))


def _exp_poly(x, f):
    xc = tirx.max(x, f(-87.0))
    n = tirx.floor(xc * f(1.44269504088896341) + f(0.5))
    r = xc - n * f(0.693359375) - n * f(-2.12194440e-4)
    p = f(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    y = p * r * r + r + f(1.0)
    pow2n = tirx.reinterpret("float32", (n.astype("int32") + 127) << 23)
    return tirx.Select(x > f(-87.0), y * pow2n, f(0.0))


def _dims(shapes: dict | None, names: str):
    """Each named dimension: the int given in ``shapes``, else a symbolic int64 var."""
    shapes = shapes or {}
    return [shapes[n] if n in shapes else te.var(n, dtype="int64") for n in names.split()]


def local_attention(spec: KernelSpec, shapes: dict | None = None):
    """TE for the local (window + extra keys) kernel.

    Returns the PrimFunc argument list: tensors q [B,H,T,D], k/v [B,Hkv,T,D],
    dilation [H] int32, extra_idx [B,E] int32 (-1 = padding; only with spec.extras),
    sink_logit [H] (-inf = none), the scale Var, out [B,H,T,D], lse [B,H,T] (float32 or
    the kernel dtype for float64).
    ``shapes`` may fix any of B, H, Hkv, T, E to ints (tuning needs concrete shapes).
    """
    assert spec.kind == "local"
    B, H, Hkv, T, E = _dims(shapes, "B H Hkv T E")
    D, dt, Bq = spec.head_dim, spec.dtype, spec.block_q
    acc = "float64" if dt == "float64" else "float32"
    left, right = spec.left, spec.right

    q = te.placeholder((B, H, T, D), dt, name="q")
    k = te.placeholder((B, Hkv, T, D), dt, name="k")
    v = te.placeholder((B, Hkv, T, D), dt, name="v")
    dil = te.placeholder((H,), "int32", name="dilation")
    xidx = te.placeholder((B, E), "int32", name="extra_idx") if spec.extras else None
    sink = te.placeholder((H,), acc, name="sink_logit")
    scale = te.var("scale", dtype=acc)

    i64 = lambda x: x.astype("int64") if hasattr(x, "astype") else x  # noqa: E731
    nitems = tirx.floordiv(T + (Bq - 1), Bq) + (spec.max_dilation - 1)
    if left >= 0 and right >= 0:
        # Rounded up to whole SIMD vectors; the extra columns are masked like any key
        # beyond the window.
        kw = -(-(Bq + left + right) // LANES) * LANES
    else:  # unbounded side: the band is the whole (residue) sequence, O(T^2) as the math says
        kw = T + max(left, 0)
    group = tirx.floordiv(H, Hkv)
    ninf = _neg_inf(acc)

    # Per-item integers, computed once per item so that the inner loops see no division
    # by the runtime dilation: [0] sequence position of the item's first row, [1] that of
    # its first key, [2] the first row's residue-space index t, [3] the residue r.
    def _item_field(h, beta, f):
        d = i64(dil[h])
        ib, r = tirx.floordiv(beta, d), tirx.floormod(beta, d)
        row0 = ib * (Bq * d) + r
        key0 = row0 - left * d if left >= 0 else r
        return tirx.Select(f == 0, row0, tirx.Select(f == 1, key0, tirx.Select(f == 2, ib * Bq, r)))

    item_info = te.compute((H, nitems, 4), _item_field, name="item_info")

    def row_of(h, beta, qi):
        return item_info[h, beta, 0] + i64(dil[h]) * qi

    def key_of(h, beta, kj):
        return item_info[h, beta, 1] + i64(dil[h]) * kj

    def clamp(x):
        return tirx.max(tirx.min(x, T - 1), 0)

    def key_ok(h, beta, qi, kj):
        """Key kj of the band is in range and inside row qi's window. In residue space
        the offset of key kj from row qi is kj - left - qi (bounded left) or
        kj - t(row 0) - qi (unbounded left), independent of the dilation."""
        j = key_of(h, beta, kj)
        ok = tirx.all(j >= 0, j < T, row_of(h, beta, qi) < T)
        off = kj - left - qi if left >= 0 else kj - item_info[h, beta, 2] - qi
        if left >= 0:
            ok = tirx.all(ok, off >= -left)
        if right >= 0:
            ok = tirx.all(ok, off <= right)
        return ok

    # Per-item gathers: the item's query rows, its key band transposed (so the score
    # product runs along contiguous keys) and its value band. Out-of-range indices are
    # clamped, never read out of bounds; key_ok masks them.
    qblk = te.compute(
        (B, H, nitems, Bq, D), lambda b, h, beta, qi, cc: q[b, h, clamp(row_of(h, beta, qi)), cc].astype(acc), name="qblk"
    )
    kblk_t = te.compute(
        (B, H, nitems, D, kw),
        lambda b, h, beta, cc, kj: k[b, h // group, clamp(key_of(h, beta, kj)), cc].astype(acc),
        name="kblk_t",
    )
    vblk = te.compute(
        (B, H, nitems, kw, D),
        lambda b, h, beta, kj, cc: v[b, h // group, clamp(key_of(h, beta, kj)), cc].astype(acc),
        name="vblk",
    )
    c = te.reduce_axis((0, D), name="c")
    score = te.compute(
        (B, H, nitems, Bq, kw),
        lambda b, h, beta, qi, kj: te.sum(qblk[b, h, beta, qi, c] * kblk_t[b, h, beta, c, kj], axis=c),
        name="score",
    )
    masked = te.compute(
        (B, H, nitems, Bq, kw),
        lambda b, h, beta, qi, kj: tirx.Select(key_ok(h, beta, qi, kj), score[b, h, beta, qi, kj] * scale, ninf),
        name="masked",
    )

    stages_x = None
    if spec.extras:

        # Residue and residue-space index of each extra position under each head's
        # dilation, so the per-score window test needs no division.
        extra_info = te.compute(
            (B, H, E, 2),
            lambda b, h, e, f: tirx.Select(
                f == 0, tirx.floormod(i64(xidx[b, e]), i64(dil[h])), tirx.floordiv(i64(xidx[b, e]), i64(dil[h]))
            ),
            name="extra_info",
        )

        def extra_ok(b, h, beta, qi, e):
            """Extra key x is visible to row i unless padding, in the future of a causal
            row, or already inside the row's window (a position counts once)."""
            i = row_of(h, beta, qi)
            x = i64(xidx[b, e])
            s = extra_info[b, h, e, 1] - (item_info[h, beta, 2] + qi)
            in_band = extra_info[b, h, e, 0] == item_info[h, beta, 3]
            if left >= 0:
                in_band = tirx.all(in_band, s >= -left)
            if right >= 0:
                in_band = tirx.all(in_band, s <= right)
            ok = tirx.all(x >= 0, i < T, tirx.Not(in_band))
            if right == 0:
                ok = tirx.all(ok, x <= i)
            return ok

        c2 = te.reduce_axis((0, D), name="c2")
        xscore = te.compute(
            (B, H, nitems, Bq, E),
            lambda b, h, beta, qi, e: te.sum(
                qblk[b, h, beta, qi, c2]
                * k[b, h // group, clamp(i64(xidx[b, e])), c2].astype(acc),
                axis=c2,
            ),
            name="xscore",
        )
        xmasked = te.compute(
            (B, H, nitems, Bq, E),
            lambda b, h, beta, qi, e: tirx.Select(extra_ok(b, h, beta, qi, e), xscore[b, h, beta, qi, e] * scale, ninf),
            name="xmasked",
        )
        stages_x = (xscore, xmasked)

    kr = te.reduce_axis((0, kw), name="kr")
    wmax = te.compute(
        (B, H, nitems, Bq), lambda b, h, beta, qi: te.max(masked[b, h, beta, qi, kr], axis=kr), name="wmax"
    )
    if spec.extras:
        er = te.reduce_axis((0, E), name="er")
        xmax = te.compute(
            (B, H, nitems, Bq), lambda b, h, beta, qi: te.max(stages_x[1][b, h, beta, qi, er], axis=er), name="xmax"
        )
        rowmax = te.compute(
            (B, H, nitems, Bq),
            lambda b, h, beta, qi: tirx.max(tirx.max(wmax[b, h, beta, qi], xmax[b, h, beta, qi]), sink[h]),
            name="rowmax",
        )
    else:
        rowmax = te.compute(
            (B, H, nitems, Bq), lambda b, h, beta, qi: tirx.max(wmax[b, h, beta, qi], sink[h]), name="rowmax"
        )

    def softmax_part(prefix, scores, n, value):
        """Probabilities of one key set (window band or extras) against the shared row
        max, their sum and their probability-weighted values."""
        prob = te.compute(
            (B, H, nitems, Bq, n),
            lambda b, h, beta, qi, j: _exp(scores[b, h, beta, qi, j] - rowmax[b, h, beta, qi], acc),
            name=f"{prefix}prob",
        )
        r = te.reduce_axis((0, n), name=f"{prefix}r_sum")
        total = te.compute(
            (B, H, nitems, Bq), lambda b, h, beta, qi: te.sum(prob[b, h, beta, qi, r], axis=r), name=f"{prefix}sum"
        )
        r2 = te.reduce_axis((0, n), name=f"{prefix}r_acc")
        weighted = te.compute(
            (B, H, nitems, Bq, D),
            lambda b, h, beta, qi, cc: te.sum(prob[b, h, beta, qi, r2] * value(b, h, beta, r2, cc), axis=r2),
            name=f"{prefix}acc",
        )
        return total, weighted

    parts = [softmax_part("w", masked, kw, lambda b, h, beta, j, cc: vblk[b, h, beta, j, cc])]
    if spec.extras:
        parts.append(
            softmax_part(
                "x", stages_x[1], E, lambda b, h, beta, e, cc: v[b, h // group, clamp(i64(xidx[b, e])), cc].astype(acc)
            )
        )
    sums, accs = zip(*parts)
    denom = te.compute(
        (B, H, nitems, Bq),
        lambda b, h, beta, qi: functools.reduce(operator.add, [t[b, h, beta, qi] for t in sums])
        + _exp(sink[h] - rowmax[b, h, beta, qi], acc),
        name="denom",
    )

    def numer(b, h, beta, qi, cc):
        return functools.reduce(operator.add, [t[b, h, beta, qi, cc] for t in accs])

    blk_out = te.compute(
        (B, H, nitems, Bq, D),
        lambda b, h, beta, qi, cc: numer(b, h, beta, qi, cc) / denom[b, h, beta, qi],
        name="blk_out",
    )

    def item_of_row(h, i):
        d = i64(dil[h])
        span = Bq * d
        return tirx.floordiv(i, span) * d + tirx.floormod(i, d), tirx.floordiv(tirx.floormod(i, span), d)

    out = te.compute(
        (B, H, T, D),
        lambda b, h, i, cc: blk_out[(b, h) + item_of_row(h, i) + (cc,)].astype(dt),
        name="out",
    )
    blk_lse = te.compute(
        (B, H, nitems, Bq),
        lambda b, h, beta, qi: rowmax[b, h, beta, qi] + tirx.log(denom[b, h, beta, qi]),
        name="blk_lse",
    )
    lse = te.compute((B, H, T), lambda b, h, i: blk_lse[(b, h) + item_of_row(h, i)], name="lse")
    args = [q, k, v, dil] + ([xidx] if spec.extras else []) + [sink, scale, out, lse]
    return args


def global_attention(spec: KernelSpec, shapes: dict | None = None):
    """TE for global rows: q_global [B,H,G,D] against k_global/v_global [B,Hkv,T,D].

    Row g sees every key j (causal: j <= global_idx[b, g]). Returns the argument list
    q_global, k_global, v_global, global_idx [B,G] int32, sink_logit [H], scale,
    out [B,H,G,D], lse [B,H,G].
    """
    assert spec.kind == "global"
    B, H, Hkv, T, G = _dims(shapes, "B H Hkv T G")
    D, dt = spec.head_dim, spec.dtype
    acc = "float64" if dt == "float64" else "float32"
    qg = te.placeholder((B, H, G, D), dt, name="q_global")
    kg = te.placeholder((B, Hkv, T, D), dt, name="k_global")
    vg = te.placeholder((B, Hkv, T, D), dt, name="v_global")
    gidx = te.placeholder((B, G), "int32", name="global_idx")
    sink = te.placeholder((H,), acc, name="sink_logit")
    scale = te.var("scale", dtype=acc)
    group = tirx.floordiv(H, Hkv)
    ninf = _neg_inf(acc)

    c = te.reduce_axis((0, D), name="c")
    gscore = te.compute(
        (B, H, G, T),
        lambda b, h, g, j: te.sum(qg[b, h, g, c].astype(acc) * kg[b, h // group, j, c].astype(acc), axis=c),
        name="gscore",
    )
    if spec.causal:
        ok = lambda b, g, j: j <= gidx[b, g].astype("int64")  # noqa: E731
    else:
        ok = lambda b, g, j: tirx.const(True, "bool")  # noqa: E731
    gmasked = te.compute(
        (B, H, G, T), lambda b, h, g, j: tirx.Select(ok(b, g, j), gscore[b, h, g, j] * scale, ninf), name="gmasked"
    )
    # te.max with an extra operand is not a pure reduction; split it into two stages.
    jr = te.reduce_axis((0, T), name="jr")
    gmax0 = te.compute((B, H, G), lambda b, h, g: te.max(gmasked[b, h, g, jr], axis=jr), name="gmax0")
    gmax = te.compute((B, H, G), lambda b, h, g: tirx.max(gmax0[b, h, g], sink[h]), name="gmax")
    gprob = te.compute((B, H, G, T), lambda b, h, g, j: _exp(gmasked[b, h, g, j] - gmax[b, h, g], acc), name="gprob")
    jr2 = te.reduce_axis((0, T), name="jr2")
    gsum = te.compute(
        (B, H, G),
        lambda b, h, g: te.sum(gprob[b, h, g, jr2], axis=jr2),
        name="gsum",
    )
    gden = te.compute((B, H, G), lambda b, h, g: gsum[b, h, g] + _exp(sink[h] - gmax[b, h, g], acc), name="gden")
    jr3 = te.reduce_axis((0, T), name="jr3")
    gacc = te.compute(
        (B, H, G, D),
        lambda b, h, g, cc: te.sum(gprob[b, h, g, jr3] * vg[b, h // group, jr3, cc].astype(acc), axis=jr3),
        name="gacc",
    )
    gout = te.compute(
        (B, H, G, D), lambda b, h, g, cc: (gacc[b, h, g, cc] / gden[b, h, g]).astype(dt), name="out"
    )
    glse = te.compute((B, H, G), lambda b, h, g: gmax[b, h, g] + tirx.log(gden[b, h, g]), name="lse")
    return [qg, kg, vg, gidx, sink, scale, gout, glse]


def prim_func(spec: KernelSpec, shapes: dict | None = None) -> tvm.tirx.PrimFunc:
    """The unscheduled PrimFunc of a spec, named by ``spec.name``."""
    args = (local_attention if spec.kind == "local" else global_attention)(spec, shapes)
    func = te.create_prim_func(args)
    return func.with_attr("global_symbol", spec.name)


def flops(spec: KernelSpec, B: int, H: int, T: int, G: int = 0, window_entries: int | None = None) -> float:
    """Useful FLOPs (4*D per visible score: QK^T and PV), for GFLOP/s reports."""
    if spec.kind == "global":
        return 4.0 * B * H * G * T * spec.head_dim
    w = window_entries if window_entries is not None else spec.left + spec.right + 1
    return 4.0 * B * H * T * w * spec.head_dim


__all__ = ["local_attention", "global_attention", "prim_func", "flops"]
