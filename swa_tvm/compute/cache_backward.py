"""Tensor expressions of the KV-cache kernels' gradients (kinds "cache_dq", "cache_dkv",
"cache_dx"; no scheduling here).

As the full-sequence gradients (``compute.backward``), every probability is recomputed
from the forward's lse, p = exp(s - lse) with s the (capped) scaled score, and

    dp = dout . v,   ds = p * (dp - delta),   delta = dout . out - dlse
    dq = scale * sum_j ds' k_j,   dk_j = scale * sum_r ds' q_r,   dv_j = sum_r p dout_r

where ds' = ds * (1 - tanh(s0 / cap)^2) under a softcap (s0 the scaled score before the
cap), else ds. Three kernels, none of which scatters:

``cache_dq``   the forward's row blocks and key spans: dq of every row.
``cache_dkv``  key-major: blocks of CACHE_KEY_BLOCK slots, each against the row blocks
               whose spans meet it (``row_lo``, from the caller); dk, dv of every slot
               from the rows that see it through their window. Sink positions are left
               to ``cache_dx``, so each (row, key) pair counts once.
``cache_dx``   dk, dv of the sink-list slots from every row (a sink is visible to every
               row, causality permitting): [B, H_kv, E, D], added into dk/dv by the caller.

dk and dv come per KV head (the rows of a GQA group are summed in the kernel), in the
accumulation dtype.
"""

from __future__ import annotations

from tvm import te, tirx

from swa_tvm.compute.cache import CacheGeometry, sink_visible, window_visible
from swa_tvm.compute.forward import _exp, _neg_inf, cast, div_nonneg, i64, mod_nonneg, product
from swa_tvm.spec import CACHE_KEY_BLOCK, KernelSpec


def _grad_rows(g: CacheGeometry, lse, delta):
    """The block's rows' lse and delta: [B, Hkv, NB, BR]."""
    def pick(x):
        return lambda b, hkv, blk, ri: x[b, g.head(hkv, g.row(blk, ri)), g.query(g.row(blk, ri))]

    shape = (g.B, g.Hkv, g.NB, g.BR64)
    return te.compute(shape, pick(lse), name="row_lse"), te.compute(shape, pick(delta), name="row_delta")


def _softcap_factor(g: CacheGeometry, c):
    """d capped(s0) / d s0 = 1 - tanh(s0 / cap)^2 = 1 - (c / cap)^2, of the capped score
    c = cap * tanh(s0 / cap)."""
    r = c / g.cap
    return tirx.const(1, g.acc) - r * r


def _grad_args(g: CacheGeometry):
    dout = te.placeholder((g.B, g.H, g.Tq, g.D), g.dt, name="dout")
    lse = te.placeholder((g.B, g.H, g.Tq), g.acc, name="lse")
    delta = te.placeholder((g.B, g.H, g.Tq), g.acc, name="delta")
    return dout, lse, delta


def _prob_ds(g: CacheGeometry, shape, score, dp, visible, lse_of, delta_of, mul, native_exp):
    """The recomputed probabilities and score gradients of one product tile, each kernel
    indexing it its own way: p = exp(capped(scale * score) - lse) where ``visible``, else
    0; ds = p * (dp - delta), times the softcap's derivative under a cap."""
    ninf = _neg_inf(g.acc)
    if g.cap is None:
        capped = None
        scaled = lambda *i: score[i] * g.scale  # noqa: E731
    else:  # a stage: the probability and the softcap's derivative share its tanh
        capped = te.compute(shape, lambda *i: g.capped(score[i] * g.scale), name="capped")
        scaled = lambda *i: capped[i]  # noqa: E731
    # Its own stage, as _exp asks: inlined into the polynomial, the mask would be copied
    # ~30 times, and TVM's passes took seconds over the copies.
    arg = te.compute(shape, lambda *i: tirx.Select(visible(*i), scaled(*i) - lse_of(*i), ninf), name="arg")
    prob = te.compute(shape, lambda *i: _exp(arg[i], g.acc, native_exp), name="prob")

    def ds_of(*i):
        d = mul(prob[i], dp[i] - delta_of(*i))
        return d if capped is None else d * _softcap_factor(g, capped[i])

    return prob, te.compute(shape, ds_of, name="ds")


def cache_dq(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False):
    """dq [B,H,Tq,D]. Arguments: the forward's (q .. sink_slots), dout, lse, delta,
    scale, [softcap], [num_sinks], nkeys, dq."""
    assert spec.kind == "cache_dq"
    g = CacheGeometry(spec, shapes, native_exp)
    g.row_stages()
    B, Hkv, NB, acc, D64, BR64, KC64, nchunk = g.B, g.Hkv, g.NB, g.acc, g.D64, g.BR64, g.KC64, g.nchunk
    dout, lse, delta = _grad_args(g)
    mul = product(spec.nonfinite or native_exp)
    qg_t = g.rows_t(g.q, "qg_t")
    dg_t = g.rows_t(dout, "dg_t")
    row_lse, row_delta = _grad_rows(g, lse, delta)
    shape = (B, Hkv, NB, nchunk, KC64, BR64)
    c = te.reduce_axis((0, D64), name="c")
    score = te.compute(
        shape,
        lambda b, hkv, blk, ch, kk, ri: te.sum(
            cast(g.k[b, hkv, g.slot(b, blk, ch, kk), c], acc) * cast(g.row_at(qg_t, b, hkv, blk, c, ri), acc), axis=c
        ),
        name="score",
    )
    c2 = te.reduce_axis((0, D64), name="c2")
    dp = te.compute(
        shape,
        lambda b, hkv, blk, ch, kk, ri: te.sum(
            cast(g.v[b, hkv, g.slot(b, blk, ch, kk), c2], acc) * cast(g.row_at(dg_t, b, hkv, blk, c2, ri), acc), axis=c2
        ),
        name="dp",
    )
    prob, ds = _prob_ds(g, shape, score, dp, g.visible,
                        lambda b, hkv, blk, ch, kk, ri: row_lse[b, hkv, blk, ri],
                        lambda b, hkv, blk, ch, kk, ri: row_delta[b, hkv, blk, ri], mul, native_exp)
    chr_ = te.reduce_axis((0, nchunk), name="chr")
    kr = te.reduce_axis((0, KC64), name="kr")
    dq_acc = te.compute(
        (B, Hkv, NB, BR64, D64),
        lambda b, hkv, blk, ri, cc: te.sum(
            mul(ds[b, hkv, blk, chr_, kr, ri], cast(g.k[b, hkv, g.slot(b, blk, chr_, kr), cc], acc)),
            axis=[chr_, kr],
        ),
        name="dq_acc",
    )
    dq = te.compute(
        (g.B, g.H, g.Tq, g.D),
        lambda b, h, i, cc: (dq_acc[(b,) + g.block_of(h, i) + (cc,)] * g.scale).astype(g.dt),
        name="dq",
    )
    return g.head_args() + [dout, lse, delta, g.scale] + g.scalar_args() + [dq]


def cache_dkv(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False):
    """dk, dv [B,Hkv,Tk,D] (accumulation dtype) of every slot from the rows that see it
    through their window (sink positions: ``cache_dx``). Arguments: the forward's (q ..
    sink_slots), dout, lse, delta, row_lo [B, NKB] int32 (the first row block whose span
    meets key block m; NKB = ceil(Tk / CACHE_KEY_BLOCK)), scale, [softcap],
    [num_sinks], nblocks (row blocks each key block takes), dk, dv."""
    assert spec.kind == "cache_dkv"
    g = CacheGeometry(spec, shapes, native_exp)
    g.row_stages()
    shapes = shapes or {}
    B, Hkv, NB, Tk, acc, D64, BR64 = g.B, g.Hkv, g.NB, g.Tk, g.acc, g.D64, g.BR64
    KB = CACHE_KEY_BLOCK
    KB64 = tirx.const(KB, "int64")
    dout, lse, delta = _grad_args(g)
    NKB = tirx.floordiv(Tk + (KB - 1), KB)
    row_lo = te.placeholder((B, NKB), "int32", name="row_lo")
    nrb = tirx.const(shapes["NRB"], "int64") if "NRB" in shapes else te.var("nblocks", dtype="int64")
    mul = product(spec.nonfinite or native_exp)
    row_lse, row_delta = _grad_rows(g, lse, delta)

    def key(m, kj):
        return tirx.min(i64(m) * KB + kj, Tk - 1)

    def block(b, m, u):
        return tirx.min(i64(row_lo[b, m]) + u, NB - 1)

    # The key block's slots, transposed: [D, KB] (products run along the key block).
    kt = te.compute((B, Hkv, NKB, D64, KB64), lambda b, hkv, m, c, kj: cast(g.k[b, hkv, key(m, kj), c], acc), name="kt")
    vt = te.compute((B, Hkv, NKB, D64, KB64), lambda b, hkv, m, c, kj: cast(g.v[b, hkv, key(m, kj), c], acc), name="vt")

    def row_of(b, hkv, m, u, ri):
        n = block(b, m, u)
        return g.row(n, ri)

    shape = (B, Hkv, NKB, nrb, BR64, KB64)
    c = te.reduce_axis((0, D64), name="c")
    score = te.compute(
        shape,
        lambda b, hkv, m, u, ri, kj: te.sum(
            cast(g.q[b, g.head(hkv, row_of(b, hkv, m, u, ri)), g.query(row_of(b, hkv, m, u, ri)), c], acc)
            * kt[b, hkv, m, c, kj],
            axis=c,
        ),
        name="score",
    )
    c2 = te.reduce_axis((0, D64), name="c2")
    dp = te.compute(
        shape,
        lambda b, hkv, m, u, ri, kj: te.sum(
            cast(dout[b, g.head(hkv, row_of(b, hkv, m, u, ri)), g.query(row_of(b, hkv, m, u, ri)), c2], acc)
            * vt[b, hkv, m, c2, kj],
            axis=c2,
        ),
        name="dp",
    )

    def visible(b, hkv, m, u, ri, kj):
        n = i64(row_lo[b, m]) + u
        r = n * g.BR + ri
        qp = g.rpos[b, hkv, block(b, m, u), ri]
        j = i64(m) * KB + kj
        p = i64(g.kv_pos[b, key(m, kj)])
        d = i64(g.rdil[b, hkv, block(b, m, u), ri])
        ok = [n < NB, r < g.rows, j < Tk, p >= 0,
              window_visible(spec.left, spec.right, spec.max_dilation > 1, qp, p, d)]
        if spec.extras:
            ok.append(p >= g.nsinks)  # sink positions: cache_dx, with every row
        return tirx.all(*ok)

    prob, ds = _prob_ds(g, shape, score, dp, visible,
                        lambda b, hkv, m, u, ri, kj: row_lse[b, hkv, block(b, m, u), ri],
                        lambda b, hkv, m, u, ri, kj: row_delta[b, hkv, block(b, m, u), ri], mul, native_exp)
    ur = te.reduce_axis((0, nrb), name="ur")
    rr = te.reduce_axis((0, BR64), name="rr")
    ur2 = te.reduce_axis((0, nrb), name="ur2")
    rr2 = te.reduce_axis((0, BR64), name="rr2")

    def rows_of(x, b, hkv, m, u, ri, cc):
        r = row_of(b, hkv, m, u, ri)
        return cast(x[b, g.head(hkv, r), g.query(r), cc], acc)

    dk_blk = te.compute(
        (B, Hkv, NKB, KB64, D64),
        lambda b, hkv, m, kj, cc: te.sum(mul(ds[b, hkv, m, ur, rr, kj], rows_of(g.q, b, hkv, m, ur, rr, cc)), axis=[ur, rr]),
        name="dk_blk",
    )
    dv_blk = te.compute(
        (B, Hkv, NKB, KB64, D64),
        lambda b, hkv, m, kj, cc: te.sum(mul(prob[b, hkv, m, ur2, rr2, kj], rows_of(dout, b, hkv, m, ur2, rr2, cc)),
                                         axis=[ur2, rr2]),
        name="dv_blk",
    )
    dk = te.compute((B, Hkv, Tk, g.D),
                    lambda b, hkv, j, cc: dk_blk[b, hkv, div_nonneg(j, KB), mod_nonneg(j, KB), cc] * g.scale, name="dk")
    dv = te.compute((B, Hkv, Tk, g.D), lambda b, hkv, j, cc: dv_blk[b, hkv, div_nonneg(j, KB), mod_nonneg(j, KB), cc],
                    name="dv")
    args = g.head_args() + [dout, lse, delta, row_lo, g.scale] + g.scalar_args()
    return args + ([nrb] if isinstance(nrb, tirx.Var) else []) + [dk, dv]


def cache_dx(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False):
    """dk, dv [B,Hkv,E,D] (accumulation dtype) of the sink-list slots, from every row
    that sees them. Arguments: the forward's (q .. sink_slots), dout, lse, delta, scale,
    [softcap], num_sinks, nkeys, dkx, dvx."""
    assert spec.kind == "cache_dx" and spec.extras
    g = CacheGeometry(spec, shapes, native_exp)
    B, Hkv, E, acc = g.B, g.Hkv, g.E, g.acc
    dout, lse, delta = _grad_args(g)
    mul = product(spec.nonfinite or native_exp)

    shape = (B, Hkv, E, g.rows)
    c = te.reduce_axis((0, g.D64), name="c")
    score = te.compute(
        shape,
        lambda b, hkv, e, r: te.sum(
            cast(g.k[b, hkv, g.clamp_slot(g.listed(b, e)), c], acc) * cast(g.q[b, g.head(hkv, r), g.query(r), c], acc),
            axis=c,
        ),
        name="score",
    )
    c2 = te.reduce_axis((0, g.D64), name="c2")
    dp = te.compute(
        shape,
        lambda b, hkv, e, r: te.sum(
            cast(g.v[b, hkv, g.clamp_slot(g.listed(b, e)), c2], acc) * cast(dout[b, g.head(hkv, r), g.query(r), c2], acc),
            axis=c2,
        ),
        name="dp",
    )

    def visible(b, hkv, e, r):
        x = g.listed(b, e)
        p = i64(g.kv_pos[b, g.clamp_slot(x)])
        return tirx.all(x >= 0, p >= 0, sink_visible(spec.causal, g.position(b, r), p, g.nsinks))

    prob, ds = _prob_ds(g, shape, score, dp, visible,
                        lambda b, hkv, e, r: lse[b, g.head(hkv, r), g.query(r)],
                        lambda b, hkv, e, r: delta[b, g.head(hkv, r), g.query(r)], mul, native_exp)
    rr = te.reduce_axis((0, g.rows), name="rr")
    rr2 = te.reduce_axis((0, g.rows), name="rr2")
    dkx_acc = te.compute(
        (B, Hkv, E, g.D),
        lambda b, hkv, e, cc: te.sum(mul(ds[b, hkv, e, rr], cast(g.q[b, g.head(hkv, rr), g.query(rr), cc], acc)), axis=rr),
        name="dkx_acc",
    )
    dkx = te.compute((B, Hkv, E, g.D), lambda *i: dkx_acc[i] * g.scale, name="dkx")
    dvx = te.compute(
        (B, Hkv, E, g.D),
        lambda b, hkv, e, cc: te.sum(mul(prob[b, hkv, e, rr2], cast(dout[b, g.head(hkv, rr2), g.query(rr2), cc], acc)),
                                     axis=rr2),
        name="dvx",
    )
    return g.head_args() + [dout, lse, delta, g.scale] + g.scalar_args() + [dkx, dvx]


CACHE_BACKWARD_COMPUTES = {"cache_dq": cache_dq, "cache_dkv": cache_dkv, "cache_dx": cache_dx}

__all__ = ["cache_dq", "cache_dkv", "cache_dx", "CACHE_KEY_BLOCK", "CACHE_BACKWARD_COMPUTES"]
