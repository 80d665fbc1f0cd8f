"""Tensor-expression definitions of the gradients (no scheduling here).

With the forward's saved lse (which includes the sink term), every probability is
recomputed exactly as p_ij = exp(scale * q_i.k_j - lse_i), never normalised again,
and the backward is O(T * (W + G)) with no T x T tensor, as FlashAttention's is:

    dp_ij = dout_i . v_j
    ds_ij = p_ij * (dp_ij - delta_i),   delta_i = dout_i . out_i - dlse_i
    dq_i  = scale * sum_j ds_ij k_j,    dk_j = scale * sum_i ds_ij q_i,    dv_j = sum_i p_ij dout_i

(dlse is the gradient flowing into the returned lse; d lse_i / d score_ij = p_ij.)
``delta`` is computed by the caller (an O(T*D) row dot product) and passed in, as is
the sink gradient, which needs only lse and delta.

Four kernels, none of which scatters (TE cannot), each owning the outputs it writes:

``local_dq``   query-major, the forward's work items: dq of every row from its window
               band and its extra keys.
``local_dkv``  key-major: items are blocks of keys, whose band is the queries that see
               them (the window transposed: :class:`Band` with (right, left)); dk, dv
               of every key from the rows whose window holds it.
``local_dx``   dk, dv of the extra keys (global positions, sinks) from every row that
               sees them as extras: [B, H, E, D], added into dk/dv by the caller.
``global_bwd`` the global rows: d q_global [B,H,G,D] and d k_global, d v_global.

Products are laid out [band, block] with the block axis innermost, so each product
runs along a small contiguous gathered tile and the large bands are gathered as plain
rows (no transposed gather); rows are reduced along their outer axis.
dk/dv are per *query* head ([B, H, ...]) and in the accumulation dtype (float32 for
float16/bfloat16 inputs): the caller sums each GQA group before rounding to the input
dtype. ``native_exp`` (GPU targets): the target's exp, as in the forward computes, and
each product its own gather of a band (the CUDA schedule computes gathers straight into
shared-memory tiles; the CPU's share one per item).
"""

from __future__ import annotations

import functools
import operator

from tvm import te, tirx

from swa_tvm.compute.forward import (
    LANES,
    MATRIX_K,
    SHORT_EXP,
    CEPHES_EXP,
    Band,
    Extras,
    ResidueCopies,
    _dims,
    _exp,
    _neg_inf,
    amx_block,
    amx_serves,
    band_words,
    block_words,
    div_nonneg,
    i64,
    matrix_product,
    mod_nonneg,
    product,
    unit_band,
)
from swa_tvm.spec import KernelSpec, accum_dtype


def _grad_inputs(spec: KernelSpec, B, H, Hkv, T, E):
    """The placeholders every local gradient kernel takes, in argument order."""
    D, dt, acc = spec.head_dim, spec.dtype, accum_dtype(spec.dtype)
    q = te.placeholder((B, H, T, D), dt, name="q")
    k = te.placeholder((B, Hkv, T, D), dt, name="k")
    v = te.placeholder((B, Hkv, T, D), dt, name="v")
    dil = te.placeholder((H,), "int32", name="dilation")
    xidx = te.placeholder((B, E), "int32", name="extra_idx") if spec.extras else None
    dout = te.placeholder((B, H, T, D), dt, name="dout")
    lse = te.placeholder((B, H, T), acc, name="lse")
    delta = te.placeholder((B, H, T), acc, name="delta")
    scale = te.var("scale", dtype=acc)
    ins = [q, k, v, dil] + ([xidx] if xidx is not None else []) + [dout, lse, delta, scale]
    return ins, (q, k, v, dil, xidx, dout, lse, delta, scale)


def _band_block_product(shape, band, blk_t, D: int, name: str, axis: str):
    """[.., band, block] = band rows [.., band, D] times block columns [.., D, block],
    summed over the features: the scores and dP of the float32-product gradients."""
    c = te.reduce_axis((0, D), name=axis)
    return te.compute(
        shape, lambda b, h, be, j, i: te.sum(band[b, h, be, j, c] * blk_t[b, h, be, c, i], axis=c), name=name
    )


def local_dq(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False, amx: bool = False):
    """dq [B,H,T,D] of the local kernel.

    Arguments: q, k, v, dilation, [extra_idx], dout, lse, delta, scale, dq. Rows that
    the caller hands to the global kernel carry lse = +inf (and delta = 0): each of
    their probabilities is exactly 0, so they contribute nothing here.
    ``amx``: the three products in the matrix engine's operand layouts, as the forward's
    (``forward.local_attention``): the score gradients rounded to bfloat16 for dq.
    """
    assert spec.kind == "local_dq"
    assert not amx or amx_serves(spec), f"{spec.name} has no matrix-engine form"
    B, H, Hkv, T, E = _dims(shapes, "B H Hkv T E")
    D, dt, acc = spec.head_dim, spec.dtype, accum_dtype(spec.dtype)
    Bq = amx_block(spec) if amx else spec.block_q
    ins, (q, k, v, dil, xidx, dout, lse, delta, scale) = _grad_inputs(spec, B, H, Hkv, T, E)
    band = Band(spec.left, spec.right, Bq, spec.max_dilation, T, H, dil, lanes=MATRIX_K if amx else LANES,
                unit=unit_band(spec, amx))
    n, kw, clamp = band.nitems, band.width, band.clamp
    group = div_nonneg(H, Hkv)
    ninf = _neg_inf(acc)
    exact = spec.nonfinite or native_exp
    mul = product(exact)

    def row(h, beta, qi):
        return clamp(band.pos(h, beta, qi))

    def key(h, beta, kj):
        return clamp(band.partner(h, beta, kj))

    if not amx or spec.extras:  # (the matrix-engine form reads them for the extras only)
        qblk_t = te.compute(
            (B, H, n, D, Bq), lambda b, h, be, c, qi: q[b, h, row(h, be, qi), c].astype(acc), name="qblk_t"
        )
        dblk_t = te.compute(
            (B, H, n, D, Bq), lambda b, h, be, c, qi: dout[b, h, row(h, be, qi), c].astype(acc), name="dblk_t"
        )
    rstat = te.compute(
        (B, H, n, 2, Bq),
        lambda b, h, be, f, qi: tirx.Select(f == 0, lse[b, h, row(h, be, qi)], delta[b, h, row(h, be, qi)]),
        name="rstat",
    )
    if amx:
        res = ResidueCopies(dil, T, spec.left, n * Bq + kw, spec.max_dilation, band)
        kv = lambda h: div_nonneg(h, group)  # noqa: E731
        kband = res.band_rows(res.rows(k, "kres", kv), kw, "kband")
        kband_t = res.band_cols(res.cols(k, "kres", kv), kw, "kband_t")
        vband = res.band_rows(res.rows(v, "vres", kv), kw, "vband")
        score = matrix_product(kband, block_words(q, H, Bq, n, row, "qword"), "score")
        dp = matrix_product(vband, block_words(dout, H, Bq, n, row, "dword"), "dp")
    else:
        kband = te.compute(
            (B, H, n, kw, D), lambda b, h, be, kj, c: k[b, div_nonneg(h, group), key(h, be, kj), c].astype(acc),
            name="kband",
        )
        vband = te.compute(
            (B, H, n, kw, D), lambda b, h, be, kj, c: v[b, div_nonneg(h, group), key(h, be, kj), c].astype(acc),
            name="vband",
        )
        score = _band_block_product((B, H, n, kw, Bq), kband, qblk_t, D, "score", "c")
        dp = _band_block_product((B, H, n, kw, Bq), vband, dblk_t, D, "dp", "c2")
    # The exponent is materialized (masked entries -inf) because the exp polynomial
    # repeats its argument; exp(-inf) is exactly 0. Each row's band keys: one interval.
    key_ok = band.interval_mask()
    arg = te.compute(
        (B, H, n, kw, Bq),
        lambda b, h, be, kj, qi: tirx.Select(
            key_ok(h, be, qi, kj), score[b, h, be, kj, qi] * scale - rstat[b, h, be, 0, qi], ninf
        ),
        name="arg",
    )
    exp_coeffs = SHORT_EXP if amx else CEPHES_EXP
    ds = te.compute(
        (B, H, n, kw, Bq),
        lambda b, h, be, kj, qi: mul(_exp(arg[b, h, be, kj, qi], acc, native_exp, exp_coeffs),
                                     dp[b, h, be, kj, qi] - rstat[b, h, be, 1, qi]),
        name="ds",
    )
    kband_dq = kband
    if native_exp:
        # GPU: each product gathers its own band straight into its shared tiles; one
        # gather read by two products would have to be materialized (D x the scores).
        kband_dq = te.compute(
            (B, H, n, kw, D), lambda b, h, be, kj, c: k[b, div_nonneg(h, group), key(h, be, kj), c].astype(acc),
            name="kband_dq",
        )
    if amx:
        dq_t = matrix_product(kband_t, band_words(ds, "dsword"), "dq_t")  # [D, Bq]
        parts = [lambda b, h, be, qi, cc: dq_t[b, h, be, cc, qi]]
    else:
        kr = te.reduce_axis((0, kw), name="kr")
        dqw = te.compute(
            (B, H, n, Bq, D),
            lambda b, h, be, qi, cc: te.sum(mul(ds[b, h, be, kr, qi], kband_dq[b, h, be, kr, cc]), axis=kr),
            name="dqw",
        )
        parts = [dqw]
    if spec.extras:
        visible = Extras(xidx, dil, B, H, E, spec.left, spec.right, T)

        def xkey(b, e):
            return clamp(i64(xidx[b, e]))

        c3 = te.reduce_axis((0, D), name="c3")
        xscore = te.compute(
            (B, H, n, E, Bq),
            lambda b, h, be, e, qi: te.sum(
                k[b, div_nonneg(h, group), xkey(b, e), c3].astype(acc) * qblk_t[b, h, be, c3, qi], axis=c3
            ),
            name="xscore",
        )
        c4 = te.reduce_axis((0, D), name="c4")
        xdp = te.compute(
            (B, H, n, E, Bq),
            lambda b, h, be, e, qi: te.sum(
                v[b, div_nonneg(h, group), xkey(b, e), c4].astype(acc) * dblk_t[b, h, be, c4, qi], axis=c4
            ),
            name="xdp",
        )
        xarg = te.compute(
            (B, H, n, E, Bq),
            lambda b, h, be, e, qi: tirx.Select(
                visible(b, h, e, band.pos(h, be, qi), band.start(h, be) + qi, band.residue(h, be)),
                xscore[b, h, be, e, qi] * scale - rstat[b, h, be, 0, qi],
                ninf,
            ),
            name="xarg",
        )
        xds = te.compute(
            (B, H, n, E, Bq),
            lambda b, h, be, e, qi: mul(_exp(xarg[b, h, be, e, qi], acc, native_exp), xdp[b, h, be, e, qi] - rstat[b, h, be, 1, qi]),
            name="xds",
        )
        er = te.reduce_axis((0, E), name="er")
        parts.append(
            te.compute(
                (B, H, n, Bq, D),
                lambda b, h, be, qi, cc: te.sum(
                    mul(xds[b, h, be, er, qi], k[b, div_nonneg(h, group), xkey(b, er), cc].astype(acc)), axis=er
                ),
                name="dqx",
            )
        )
    dq_blk = te.compute(
        (B, H, n, Bq, D),
        lambda b, h, be, qi, cc: functools.reduce(
            operator.add, [p(b, h, be, qi, cc) if callable(p) else p[b, h, be, qi, cc] for p in parts]
        ),
        name="dq_blk",
    )
    dq = te.compute(
        (B, H, T, D),
        lambda b, h, i, cc: (dq_blk[(b, h) + band.item_of(h, i) + (cc,)] * scale).astype(dt),
        name="dq",
    )
    return ins + [dq]


def local_dkv(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False, amx: bool = False):
    """dk, dv [B,H,T,D] (per query head, accumulation dtype) of the window terms of the
    local kernel.

    Arguments: q, k, v, dilation, [extra_idx], dout, lse, delta, scale, dk, dv.
    ``extra_idx`` is accepted for a uniform signature; the extras' own key gradients
    come from ``local_dx``. ``amx``: the four products in the matrix engine's operand
    layouts (the probabilities and score gradients rounded to bfloat16 for dv and dk).
    """
    assert spec.kind == "local_dkv"
    assert not amx or amx_serves(spec), f"{spec.name} has no matrix-engine form"
    B, H, Hkv, T, E = _dims(shapes, "B H Hkv T E")
    D, acc = spec.head_dim, accum_dtype(spec.dtype)
    Bk = amx_block(spec) if amx else spec.block_q
    ins, (q, k, v, dil, _, dout, lse, delta, scale) = _grad_inputs(spec, B, H, Hkv, T, E)
    # Key j is seen by query i = j + u*d for -right <= u <= left: the transposed window.
    band = Band(spec.right, spec.left, Bk, spec.max_dilation, T, H, dil, lanes=MATRIX_K if amx else LANES,
                unit=unit_band(spec, amx))
    n, qw, clamp = band.nitems, band.width, band.clamp
    group = div_nonneg(H, Hkv)
    ninf = _neg_inf(acc)
    exact = spec.nonfinite or native_exp
    mul = product(exact)

    def key(h, beta, kr):
        return clamp(band.pos(h, beta, kr))

    def row(h, beta, qj):
        return clamp(band.partner(h, beta, qj))

    bstat = te.compute(
        (B, H, n, qw, 2),
        lambda b, h, be, qj, f: tirx.Select(f == 0, lse[b, h, row(h, be, qj)], delta[b, h, row(h, be, qj)]),
        name="bstat",
    )
    if amx:
        res = ResidueCopies(dil, T, spec.right, n * Bk + qw, spec.max_dilation, band)
        kv = lambda h: div_nonneg(h, group)  # noqa: E731
        qband = res.band_rows(res.rows(q, "qres"), qw, "qband")
        qband_t = res.band_cols(res.cols(q, "qres"), qw, "qband_t")
        dband = res.band_rows(res.rows(dout, "dres"), qw, "dband")
        dband_t = res.band_cols(res.cols(dout, "dres"), qw, "dband_t")
        score = matrix_product(qband, block_words(k, H, Bk, n, key, "kword", kv), "score")
        dp = matrix_product(dband, block_words(v, H, Bk, n, key, "vword", kv), "dp")
    else:
        kblk_t = te.compute(
            (B, H, n, D, Bk), lambda b, h, be, c, kr: k[b, div_nonneg(h, group), key(h, be, kr), c].astype(acc),
            name="kblk_t",
        )
        vblk_t = te.compute(
            (B, H, n, D, Bk), lambda b, h, be, c, kr: v[b, div_nonneg(h, group), key(h, be, kr), c].astype(acc),
            name="vblk_t",
        )
        qband = te.compute((B, H, n, qw, D), lambda b, h, be, qj, c: q[b, h, row(h, be, qj), c].astype(acc), name="qband")
        dband = te.compute(
            (B, H, n, qw, D), lambda b, h, be, qj, c: dout[b, h, row(h, be, qj), c].astype(acc), name="dband"
        )
        score = _band_block_product((B, H, n, qw, Bk), qband, kblk_t, D, "score", "c")
        dp = _band_block_product((B, H, n, qw, Bk), dband, vblk_t, D, "dp", "c2")
    # The queries that see each block key: one interval of the band.
    query_ok = band.interval_mask()
    arg = te.compute(
        (B, H, n, qw, Bk),
        lambda b, h, be, qj, kr: tirx.Select(
            query_ok(h, be, kr, qj), score[b, h, be, qj, kr] * scale - bstat[b, h, be, qj, 0], ninf
        ),
        name="arg",
    )
    exp_coeffs = SHORT_EXP if amx else CEPHES_EXP
    prob = te.compute(
        (B, H, n, qw, Bk), lambda b, h, be, qj, kr: _exp(arg[b, h, be, qj, kr], acc, native_exp, exp_coeffs), name="prob"
    )
    ds = te.compute(
        (B, H, n, qw, Bk),
        lambda b, h, be, qj, kr: mul(prob[b, h, be, qj, kr], dp[b, h, be, qj, kr] - bstat[b, h, be, qj, 1]),
        name="ds",
    )
    if amx:
        dv_t = matrix_product(dband_t, band_words(prob, "pword"), "dv_t")  # [D, Bk]
        dk_t = matrix_product(qband_t, band_words(ds, "dsword"), "dk_t")
        dk = te.compute((B, H, T, D), lambda b, h, j, cc: _transposed(dk_t, band, b, h, j, cc) * scale, name="dk")
        dv = te.compute((B, H, T, D), lambda b, h, j, cc: _transposed(dv_t, band, b, h, j, cc), name="dv")
        return ins + [dk, dv]
    dband_dv, qband_dk = dband, qband
    if native_exp:  # GPU: each product its own gathers (see local_dq)
        dband_dv = te.compute(
            (B, H, n, qw, D), lambda b, h, be, qj, c: dout[b, h, row(h, be, qj), c].astype(acc), name="dband_dv"
        )
        qband_dk = te.compute(
            (B, H, n, qw, D), lambda b, h, be, qj, c: q[b, h, row(h, be, qj), c].astype(acc), name="qband_dk"
        )
    qr = te.reduce_axis((0, qw), name="qr")
    dv_blk = te.compute(
        (B, H, n, Bk, D),
        lambda b, h, be, kr, cc: te.sum(mul(prob[b, h, be, qr, kr], dband_dv[b, h, be, qr, cc]), axis=qr),
        name="dv_blk",
    )
    qr2 = te.reduce_axis((0, qw), name="qr2")
    dk_blk = te.compute(
        (B, H, n, Bk, D),
        lambda b, h, be, kr, cc: te.sum(mul(ds[b, h, be, qr2, kr], qband_dk[b, h, be, qr2, cc]), axis=qr2),
        name="dk_blk",
    )
    dk = te.compute((B, H, T, D), lambda b, h, j, cc: dk_blk[(b, h) + band.item_of(h, j) + (cc,)] * scale, name="dk")
    dv = te.compute((B, H, T, D), lambda b, h, j, cc: dv_blk[(b, h) + band.item_of(h, j) + (cc,)], name="dv")
    return ins + [dk, dv]


def _transposed(blk_t, band, b, h, i, cc):
    """Element (position i, feature cc) of a per-item [D, block] result."""
    beta, qi = band.item_of(h, i)
    return blk_t[b, h, beta, cc, qi]


def local_dx(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False):
    """dk, dv [B,H,E,D] (accumulation dtype) of the extra keys, from every row that sees
    them as extras.

    Arguments: q, k, v, dilation, extra_idx, dout, lse, delta, scale, dk_extra,
    dv_extra. Row e of the outputs belongs to position extra_idx[b, e] (zero for
    padding); the caller adds it into dk/dv.
    """
    assert spec.kind == "local_dx" and spec.extras
    B, H, Hkv, T, E = _dims(shapes, "B H Hkv T E")
    D, acc = spec.head_dim, accum_dtype(spec.dtype)
    ins, (q, k, v, dil, xidx, dout, lse, delta, scale) = _grad_inputs(spec, B, H, Hkv, T, E)
    group = div_nonneg(H, Hkv)
    ninf = _neg_inf(acc)
    exact = spec.nonfinite or native_exp
    mul = product(exact)
    visible = Extras(xidx, dil, B, H, E, spec.left, spec.right, T)
    clamp = lambda x: tirx.max(tirx.min(x, T - 1), 0)  # noqa: E731
    # The extras' keys and values, transposed so products run along the E extras.
    xk_t = te.compute(
        (B, H, D, E), lambda b, h, c, e: k[b, div_nonneg(h, group), clamp(i64(xidx[b, e])), c].astype(acc), name="xk_t"
    )
    xv_t = te.compute(
        (B, H, D, E), lambda b, h, c, e: v[b, div_nonneg(h, group), clamp(i64(xidx[b, e])), c].astype(acc), name="xv_t"
    )
    c = te.reduce_axis((0, D), name="c")
    score = te.compute(
        (B, H, T, E), lambda b, h, i, e: te.sum(q[b, h, i, c].astype(acc) * xk_t[b, h, c, e], axis=c), name="score"
    )
    c2 = te.reduce_axis((0, D), name="c2")
    dp = te.compute(
        (B, H, T, E), lambda b, h, i, e: te.sum(dout[b, h, i, c2].astype(acc) * xv_t[b, h, c2, e], axis=c2), name="dp"
    )

    def seen(b, h, i, e):
        d = i64(dil[h])
        return visible(b, h, e, i, div_nonneg(i, d), mod_nonneg(i, d))

    arg = te.compute(
        (B, H, T, E),
        lambda b, h, i, e: tirx.Select(seen(b, h, i, e), score[b, h, i, e] * scale - lse[b, h, i], ninf),
        name="arg",
    )
    prob = te.compute((B, H, T, E), lambda b, h, i, e: _exp(arg[b, h, i, e], acc, native_exp), name="prob")
    ds = te.compute(
        (B, H, T, E), lambda b, h, i, e: mul(prob[b, h, i, e], dp[b, h, i, e] - delta[b, h, i]), name="ds"
    )
    ir = te.reduce_axis((0, T), name="ir")
    dvx_acc = te.compute(
        (B, H, E, D),
        lambda b, h, e, cc: te.sum(mul(prob[b, h, ir, e], dout[b, h, ir, cc].astype(acc)), axis=ir),
        name="dv_extra_acc",
    )
    ir2 = te.reduce_axis((0, T), name="ir2")
    dkx_acc = te.compute(
        (B, H, E, D),
        lambda b, h, e, cc: te.sum(mul(ds[b, h, ir2, e], q[b, h, ir2, cc].astype(acc)), axis=ir2),
        name="dk_extra_acc",
    )
    dkx = te.compute((B, H, E, D), lambda *i: dkx_acc[i] * scale, name="dk_extra")
    dvx = te.compute((B, H, E, D), lambda *i: dvx_acc[i], name="dv_extra")
    return ins + [dkx, dvx]


def global_backward(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False):
    """Gradients of the global rows: d q_global [B,H,G,D], d k_global and d v_global
    [B,H,T,D] (per query head, accumulation dtype).

    Arguments: q_global, k_global, v_global, global_idx, dout [B,H,G,D] (the global
    rows' output gradient), lse [B,H,G], delta [B,H,G], scale, dq_global, dk_global,
    dv_global.
    """
    assert spec.kind == "global_bwd"
    B, H, Hkv, T, G = _dims(shapes, "B H Hkv T G")
    D, dt, acc = spec.head_dim, spec.dtype, accum_dtype(spec.dtype)
    qg = te.placeholder((B, H, G, D), dt, name="q_global")
    kg = te.placeholder((B, Hkv, T, D), dt, name="k_global")
    vg = te.placeholder((B, Hkv, T, D), dt, name="v_global")
    gidx = te.placeholder((B, G), "int32", name="global_idx")
    dout = te.placeholder((B, H, G, D), dt, name="dout")
    lse = te.placeholder((B, H, G), acc, name="lse")
    delta = te.placeholder((B, H, G), acc, name="delta")
    scale = te.var("scale", dtype=acc)
    group = div_nonneg(H, Hkv)
    ninf = _neg_inf(acc)
    exact = spec.nonfinite or native_exp
    mul = product(exact)
    # [T, G] tiles: products run along the G rows, transposed once per head.
    qg_t = te.compute((B, H, D, G), lambda b, h, c, g: qg[b, h, g, c].astype(acc), name="qg_t")
    dg_t = te.compute((B, H, D, G), lambda b, h, c, g: dout[b, h, g, c].astype(acc), name="dg_t")
    c = te.reduce_axis((0, D), name="c")
    score = te.compute(
        (B, H, T, G),
        lambda b, h, j, g: te.sum(kg[b, div_nonneg(h, group), j, c].astype(acc) * qg_t[b, h, c, g], axis=c),
        name="gscore",
    )
    c2 = te.reduce_axis((0, D), name="c2")
    dp = te.compute(
        (B, H, T, G),
        lambda b, h, j, g: te.sum(vg[b, div_nonneg(h, group), j, c2].astype(acc) * dg_t[b, h, c2, g], axis=c2),
        name="gdp",
    )
    if spec.causal:
        ok = lambda b, g, j: j <= i64(gidx[b, g])  # noqa: E731
    else:
        ok = lambda b, g, j: tirx.const(True, "bool")  # noqa: E731
    arg = te.compute(
        (B, H, T, G),
        lambda b, h, j, g: tirx.Select(ok(b, g, j), score[b, h, j, g] * scale - lse[b, h, g], ninf),
        name="garg",
    )
    prob = te.compute((B, H, T, G), lambda b, h, j, g: _exp(arg[b, h, j, g], acc, native_exp), name="gprob")
    ds = te.compute((B, H, T, G), lambda b, h, j, g: mul(prob[b, h, j, g], dp[b, h, j, g] - delta[b, h, g]), name="gds")
    jr = te.reduce_axis((0, T), name="jr")
    dqg_acc = te.compute(
        (B, H, G, D),
        lambda b, h, g, cc: te.sum(mul(ds[b, h, jr, g], kg[b, div_nonneg(h, group), jr, cc].astype(acc)), axis=jr),
        name="dq_global_acc",
    )
    gr = te.reduce_axis((0, G), name="gr")
    dkg_acc = te.compute(
        (B, H, T, D),
        lambda b, h, j, cc: te.sum(mul(ds[b, h, j, gr], qg[b, h, gr, cc].astype(acc)), axis=gr),
        name="dk_global_acc",
    )
    gr2 = te.reduce_axis((0, G), name="gr2")
    dvg_acc = te.compute(
        (B, H, T, D),
        lambda b, h, j, cc: te.sum(mul(prob[b, h, j, gr2], dout[b, h, gr2, cc].astype(acc)), axis=gr2),
        name="dv_global_acc",
    )
    dqg = te.compute((B, H, G, D), lambda *i: (dqg_acc[i] * scale).astype(dt), name="dq_global")
    dkg = te.compute((B, H, T, D), lambda *i: dkg_acc[i] * scale, name="dk_global")
    dvg = te.compute((B, H, T, D), lambda *i: dvg_acc[i], name="dv_global")
    return [qg, kg, vg, gidx, dout, lse, delta, scale, dqg, dkg, dvg]


BACKWARD_COMPUTES = {
    "local_dq": local_dq,
    "local_dkv": local_dkv,
    "local_dx": local_dx,
    "global_bwd": global_backward,
}

__all__ = ["local_dq", "local_dkv", "local_dx", "global_backward", "BACKWARD_COMPUTES"]
