"""Tensor expression of attention against a KV cache (kernel kind "cache").

Queries and keys live at absolute positions. Query row i of batch b is at position
``q_pos[b] + i``; key slot j holds position ``kv_pos[b, j]``, or -1 for a slot that is
padding or not written yet. Window, dilation, causality and sinks are the
full-sequence call's, evaluated on these positions, so a decode step, a chunk of a
prefill, a left-padded batch or a rolling buffer whose slots hold positions out of
order all equal the corresponding rows of one full-sequence call.

Layout, for one (batch, KV head): the rows are the query positions times the heads of
the GQA group, position-major (row r = i * G + g is query head h = hkv * G + g at
query position i), so the heads that share a KV head share every key they read. Rows
come in blocks of ``block_q`` (``spec.block_q``). Block n scans the key slots
``key_lo[b, n] .. key_lo[b, n] + nkeys - 1``: the caller (swa_tvm.eager) picks them so
that they hold every key its rows see through their windows; the sinks outside that
span come as a list of slots (``sink_slots``, -1 = none). The keys are split into
chunks of CACHE_CHUNK (CACHE_MATRIX_CHUNK in the matrix-engine form; split-K), each chunk with its own max, sum and weighted
values, merged by a combine stage as the global rows' kernel does
(``forward.global_attention``): a long cache spreads over the cores at any batch size,
and no [rows, keys] tensor exists.

The NaN rule holds as in every kernel: a slot outside a row's view (padding, unwritten,
beyond its window) adds nothing to it whatever it holds (``forward.product``). A row that
sees no key and no learned sink gets out = 0 and lse = -inf.
"""

from __future__ import annotations

from tvm import te, tirx

from swa_tvm.compute.forward import (
    CEPHES_EXP,
    SHORT_EXP,
    _dims,
    _exp,
    _neg_inf,
    _tanh,
    amx_serves,
    bf16_bits,
    bf16_round_bits,
    bf16_value,
    cast,
    div_nonneg,
    i64,
    mod_nonneg,
    pair_word,
    product,
    word_half,
)
from swa_tvm.spec import KernelSpec, accum_dtype

# Keys per chunk of a block's scan (the split-K granularity; one chunk's scores stay in L1).
CACHE_CHUNK = 64
# Keys per chunk of the matrix-engine form: its P·V sums a chunk in registers, and each
# chunk's [D, rows] partial result goes through memory to the combine: longer chunks
# write fewer of them, but at 256 keys the chunk's [key, row] tiles outgrow L1. A
# prefill chunk timed slower with either 64 or 256 than with 128 (Zen 4 class).
CACHE_MATRIX_CHUNK = 128
# Blocks of fewer rows than this lay their [key, row] tiles out row by row (keys, not
# rows, in vectors: a decode step's 4 or 8 rows are less than a vector) and their
# transposed queries [row, feature].
ROW_MAJOR_BELOW = 16


def window_visible(left: int, right: int, dilated: bool, qp, p, d):
    """Whether key position ``p`` is in the window of query position ``qp`` under
    dilation ``d`` (int64 expressions): p = qp + s*d with -left <= s <= right (-1 =
    unbounded). Without ``dilated`` (every dilation 1) no division is formed."""
    off = p - qp
    ok = []
    if dilated:
        ok.append(tirx.floormod(off, d) == 0)
        if left >= 0:
            ok.append(off >= -left * d)
        if right >= 0:
            ok.append(off <= right * d)
    else:
        if left >= 0:
            ok.append(off >= -left)
        if right >= 0:
            ok.append(off <= right)
    return tirx.all(*ok) if ok else tirx.const(True, "bool")


def sink_visible(causal: bool, qp, p, nsinks):
    """Whether key position ``p`` is one of the first ``nsinks`` positions and visible
    to query position ``qp`` (a causal row sees no sink in its future)."""
    ok = [p < nsinks]
    if causal:
        ok.append(p <= qp)
    return tirx.all(*ok)


class CacheGeometry:
    """The placeholders and index arithmetic the cache kernels share (forward and
    gradients): rows of a (batch, KV head) in blocks, key slots in chunks of a block's
    span then of the sink list, positions, and which (row, slot) pairs are visible."""

    def __init__(self, spec: KernelSpec, shapes: dict | None, native_exp: bool = False, chunk: int = CACHE_CHUNK):
        shapes = shapes or {}
        self.native = native_exp
        # Fixed dims (a tuning shape) as int64 constants, as the symbolic ones are int64
        # vars: every index of a stage then has one dtype, which layout transforms need.
        B, H, Hkv, Tq, Tk, NB, E = (
            tirx.const(x, "int64") if isinstance(x, int) else x for x in _dims(shapes, "B H Hkv Tq Tk NB E")
        )
        self.B, self.H, self.Hkv, self.Tq, self.Tk, self.NB, self.E = B, H, Hkv, Tq, Tk, NB, E
        self.spec = spec
        self.nk = tirx.const(shapes["NK"], "int64") if "NK" in shapes else te.var("nkeys", dtype="int64")
        D, dt, BR, KC = spec.head_dim, spec.dtype, spec.block_q, chunk
        self.D, self.dt, self.BR, self.KC, self.acc = D, dt, BR, KC, accum_dtype(dt)
        self.q = te.placeholder((B, H, Tq, D), dt, name="q")
        self.k = te.placeholder((B, Hkv, Tk, D), dt, name="k")
        self.v = te.placeholder((B, Hkv, Tk, D), dt, name="v")
        self.dil = te.placeholder((H,), "int32", name="dilation")
        self.q_pos = te.placeholder((B,), "int32", name="q_pos")
        self.kv_pos = te.placeholder((B, Tk), "int32", name="kv_pos")
        self.key_lo = te.placeholder((B, NB), "int32", name="key_lo")
        self.xslots = te.placeholder((B, E), "int32", name="sink_slots") if spec.extras else None
        self.scale = te.var("scale", dtype=self.acc)
        self.cap = te.var("softcap", dtype=self.acc) if spec.softcap else None
        self.nsinks = te.var("num_sinks", dtype="int64") if spec.extras else None
        # int64 extents throughout, so that a schedule may transform any stage's layout.
        self.D64, self.BR64, self.KC64 = (tirx.const(x, "int64") for x in (D, BR, KC))
        self.group = div_nonneg(H, Hkv)
        self.rows = i64(Tq) * self.group
        self.nscan = tirx.floordiv(self.nk + (KC - 1), KC)  # chunks of the scanned span
        # then the sinks' chunks
        self.nchunk = self.nscan + (tirx.floordiv(E + (KC - 1), KC) if spec.extras else 0)
        self.row_major = BR < ROW_MAJOR_BELOW
        self.rpos = self.rdil = None  # row_stages

    def tile(self, name, fn):
        """A chunk's [key, row] stage [B, Hkv, NB, nchunk, ...] (``fn(b, hkv, blk, ch, kk,
        ri)``), laid out [kk, ri], or [ri, kk] for row-major blocks."""
        shape = (self.B, self.Hkv, self.NB, self.nchunk) + (
            (self.BR64, self.KC64) if self.row_major else (self.KC64, self.BR64))
        if self.row_major:
            return te.compute(shape, lambda b, hkv, blk, ch, ri, kk: fn(b, hkv, blk, ch, kk, ri), name=name)
        return te.compute(shape, fn, name=name)

    def at(self, t, b, hkv, blk, ch, kk, ri):
        """Element (kk, ri) of a ``tile`` stage."""
        return t[(b, hkv, blk, ch) + ((ri, kk) if self.row_major else (kk, ri))]

    def row_at(self, t, b, hkv, blk, c, ri):
        """Element (feature c, row ri) of a ``rows_t`` stage."""
        return t[(b, hkv, blk) + ((ri, c) if self.row_major else (c, ri))]

    def head_args(self) -> list:
        """q, k, v, dilation, q_pos, kv_pos, key_lo[, sink_slots]."""
        return [self.q, self.k, self.v, self.dil, self.q_pos, self.kv_pos, self.key_lo] + (
            [self.xslots] if self.xslots is not None else [])

    def scalar_args(self) -> list:
        """[softcap][, num_sinks], then nkeys (unless fixed)."""
        out = ([self.cap] if self.cap is not None else []) + ([self.nsinks] if self.nsinks is not None else [])
        return out + ([self.nk] if isinstance(self.nk, tirx.Var) else [])

    def row(self, blk, ri):  # the block's ri-th row (padding repeats the last row; masked)
        return tirx.min(i64(blk) * self.BR + ri, self.rows - 1)

    def head(self, hkv, r):
        return hkv * self.group + mod_nonneg(r, self.group)

    def query(self, r):
        """The query row index (in q's T_q axis) of row r."""
        return div_nonneg(r, self.group)

    def position(self, b, r):
        return i64(self.q_pos[b]) + div_nonneg(r, self.group)

    def span_index(self, ch, kk):
        return i64(ch) * self.KC + kk

    def sink_index(self, ch, kk):
        return (i64(ch) - self.nscan) * self.KC + kk

    def listed(self, b, e):
        """Slot of sink-list entry e (clamped into the list)."""
        return i64(self.xslots[b, tirx.max(tirx.min(e, self.E - 1), 0)])

    def slot(self, b, blk, ch, kk):
        """The key slot chunk ``ch`` reads at ``kk``, clamped into k (masked where not real)."""
        s = i64(self.key_lo[b, blk]) + self.span_index(ch, kk)
        if self.spec.extras:
            s = tirx.Select(ch < self.nscan, s, self.listed(b, self.sink_index(ch, kk)))
        return self.clamp_slot(s)

    def clamp_slot(self, s):
        return tirx.max(tirx.min(s, self.Tk - 1), 0)

    def row_stages(self):
        """Each block row's query position and dilation as stages [B, Hkv, NB, BR]
        (``rpos``, ``rdil``), which ``visible`` then reads: computed per row (per item
        where a schedule puts them there), not per (key, row) pair, where each is two
        divisions by the runtime GQA group."""
        shape = (self.B, self.Hkv, self.NB, self.BR64)
        self.rpos = te.compute(shape, lambda b, hkv, blk, ri: self.position(b, self.row(blk, ri)), name="rpos")
        self.rdil = te.compute(shape, lambda b, hkv, blk, ri: self.dil[self.head(hkv, self.row(blk, ri))],
                               name="rdil")

    def sees(self, hkv, qp, r, p, d=None):
        """Whether the row r (at position qp) of KV head hkv sees key position p >= 0 by
        its window or as a sink (``d``: the row's dilation, if known)."""
        spec = self.spec
        d = i64(self.dil[self.head(hkv, r)] if d is None else d)
        seen = window_visible(spec.left, spec.right, spec.max_dilation > 1, qp, p, d)
        if spec.extras:
            seen = tirx.Or(seen, sink_visible(spec.causal, qp, p, self.nsinks))
        return seen

    def visible(self, b, hkv, blk, ch, kk, ri):
        """Whether chunk ``ch``'s key ``kk`` counts for row ri of block blk (each visible
        (row, key) pair once: a sink inside the span there, not in the list)."""
        spec, nk = self.spec, self.nk
        r = i64(blk) * self.BR + ri
        rc = self.row(blk, ri)
        staged = self.rpos is not None
        qp = self.rpos[b, hkv, blk, ri] if staged else self.position(b, rc)
        p = i64(self.kv_pos[b, self.slot(b, blk, ch, kk)])
        lo = i64(self.key_lo[b, blk])
        in_span = tirx.all(self.span_index(ch, kk) < nk, lo + self.span_index(ch, kk) < self.Tk)
        ok = tirx.all(in_span, p >= 0, self.sees(hkv, qp, rc, p, self.rdil[b, hkv, blk, ri] if staged else None))
        if spec.extras:
            x = self.listed(b, self.sink_index(ch, kk))
            listed = tirx.all(self.sink_index(ch, kk) < self.E, x >= 0, tirx.Or(x < lo, x >= lo + nk), p >= 0,
                              sink_visible(spec.causal, qp, p, self.nsinks))
            ok = tirx.Select(ch < self.nscan, ok, listed)
        return tirx.all(r < self.rows, ok)

    def capped(self, s):
        """The score the softmax takes: s, or cap * tanh(s / cap) with a softcap."""
        return s if self.cap is None else self.cap * _tanh(s / self.cap, self.acc, self.native)

    def block_of(self, h, i):
        """(KV head, block, row in block) of query head h at query row i."""
        r = i64(i) * self.group + mod_nonneg(h, self.group)
        return div_nonneg(h, self.group), div_nonneg(r, self.BR), mod_nonneg(r, self.BR)

    def rows_t(self, x, name):
        """The block's rows of x [B, H, T_q, D]: [B, Hkv, NB, D, BR] (transposed), or
        [.., BR, D] for row-major blocks (``row_at`` reads either)."""
        def fn(b, hkv, blk, c, ri):
            return x[b, self.head(hkv, self.row(blk, ri)), self.query(self.row(blk, ri)), c]

        if self.row_major:
            return te.compute((self.B, self.Hkv, self.NB, self.BR64, self.D64),
                              lambda b, hkv, blk, ri, c: fn(b, hkv, blk, c, ri), name=name)
        return te.compute((self.B, self.Hkv, self.NB, self.D64, self.BR64), fn, name=name)


def cache_attention(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False, amx: bool = False):
    """TE for attention against a KV cache (see the module docstring).

    Returns the PrimFunc argument list: q [B,H,Tq,D], k/v [B,Hkv,Tk,D], dilation [H]
    int32, q_pos [B] int32, kv_pos [B,Tk] int32 (-1 = no key), key_lo [B,NB] int32
    (first slot each block of rows scans; NB = ceil(Tq * H/Hkv / block_q)), with
    ``spec.extras`` sink_slots [B,E] int32 (-1 = none; E >= 1), sink_logit [H] (-inf =
    none), the scale, with ``spec.softcap`` the cap, with ``spec.extras`` the number of
    sink positions, the number of slots each block scans (``nkeys``), out [B,H,Tq,D]
    and lse [B,H,Tq]. ``shapes`` may fix B, H, Hkv, Tq, Tk, NB, E and NK (nkeys) to ints.

    ``amx``: the two products in the matrix engine's operand layouts (``forward.
    amx_serves`` says which specs have them), as the local kernel's form: each chunk's
    keys are gathered as bfloat16 bits [key, feature] (its values transposed,
    [feature, key]), the block's queries packed once as pair words; the scores [key,
    row] and P·V^T [feature, row] are float32 sums, the probabilities rounded to
    bfloat16 pair words for the second product.
    """
    assert spec.kind == "cache"
    assert not amx or amx_serves(spec), f"{spec.name} has no matrix-engine form"
    g = CacheGeometry(spec, shapes, native_exp, CACHE_MATRIX_CHUNK if amx else CACHE_CHUNK)
    B, H, Hkv, Tq, NB = g.B, g.H, g.Hkv, g.Tq, g.NB
    dt, acc, D64, BR64, KC64, nchunk = g.dt, g.acc, g.D64, g.BR64, g.KC64, g.nchunk
    q, k, v, scale = g.q, g.k, g.v, g.scale
    sink = te.placeholder((H,), acc, name="sink_logit")
    ninf, zero = _neg_inf(acc), tirx.const(0, acc)
    mul = product(spec.nonfinite or native_exp)
    row, head, slot, visible, capped = g.row, g.head, g.slot, g.visible, g.capped

    at = g.at
    if amx:
        g.row_stages()
        gscore = _matrix_scores(g)
    else:
        qg_t = g.rows_t(q, "qg_t")
        c = te.reduce_axis((0, D64), name="c")
        gscore = g.tile(
            "gscore",
            lambda b, hkv, blk, ch, kk, ri: te.sum(
                cast(k[b, hkv, slot(b, blk, ch, kk), c], acc) * cast(g.row_at(qg_t, b, hkv, blk, c, ri), acc), axis=c
            ),
        )
    scaled = lambda b, hkv, blk, ch, kk, ri: at(gscore, b, hkv, blk, ch, kk, ri) * scale  # noqa: E731
    if g.cap is not None:  # its own stage: the tanh's expansion, the mask kept out of it
        gcapped = g.tile("capped", lambda *i: capped(scaled(*i)))
        scaled = lambda b, hkv, blk, ch, kk, ri: at(gcapped, b, hkv, blk, ch, kk, ri)  # noqa: E731
    gmasked = g.tile(
        "gmasked",
        lambda b, hkv, blk, ch, kk, ri: tirx.Select(visible(b, hkv, blk, ch, kk, ri), scaled(b, hkv, blk, ch, kk, ri), ninf),
    )
    kr = te.reduce_axis((0, KC64), name="kr")
    cmax = te.compute(
        (B, Hkv, NB, nchunk, BR64), lambda b, hkv, blk, ch, ri: te.max(at(gmasked, b, hkv, blk, ch, kr, ri), axis=kr),
        name="cmax",
    )
    # A chunk a row sees nothing of has max -inf: its probabilities are taken against 0
    # (all exactly 0), never against -inf (NaN).
    cref = te.compute(
        (B, Hkv, NB, nchunk, BR64),
        lambda b, hkv, blk, ch, ri: tirx.Select(cmax[b, hkv, blk, ch, ri] == ninf, zero, cmax[b, hkv, blk, ch, ri]),
        name="cref",
    )
    cprob = g.tile(
        "cprob",
        lambda b, hkv, blk, ch, kk, ri: _exp(at(gmasked, b, hkv, blk, ch, kk, ri) - cref[b, hkv, blk, ch, ri], acc, native_exp,
                                             SHORT_EXP if amx else CEPHES_EXP),
    )
    kr2 = te.reduce_axis((0, KC64), name="kr2")
    csum = te.compute(
        (B, Hkv, NB, nchunk, BR64), lambda b, hkv, blk, ch, ri: te.sum(at(cprob, b, hkv, blk, ch, kr2, ri), axis=kr2),
        name="csum",
    )
    if amx:
        cacc_t = _matrix_values(g, cprob)
        chunk_acc = lambda b, hkv, blk, ch, ri, cc: cacc_t[b, hkv, blk, ch, cc, ri]  # noqa: E731
    else:
        kr3 = te.reduce_axis((0, KC64), name="kr3")
        cacc = te.compute(
            (B, Hkv, NB, nchunk, BR64, D64),
            lambda b, hkv, blk, ch, ri, cc: te.sum(
                mul(at(cprob, b, hkv, blk, ch, kr3, ri), cast(v[b, hkv, slot(b, blk, ch, kr3), cc], acc)), axis=kr3
            ),
            name="cacc",
        )
        chunk_acc = lambda b, hkv, blk, ch, ri, cc: cacc[b, hkv, blk, ch, ri, cc]  # noqa: E731

    # Combine the chunks of each row against the row's overall max (with its learned
    # sink); a row that sees nothing at all (max -inf) against 0, so every factor is 0.
    chr_ = te.reduce_axis((0, nchunk), name="chr")
    gmax0 = te.compute(
        (B, Hkv, NB, BR64), lambda b, hkv, blk, ri: te.max(cmax[b, hkv, blk, chr_, ri], axis=chr_), name="gmax0"
    )
    gmax = te.compute(
        (B, Hkv, NB, BR64),
        lambda b, hkv, blk, ri: tirx.max(gmax0[b, hkv, blk, ri], sink[head(hkv, row(blk, ri))]),
        name="gmax",
    )
    gref = te.compute(
        (B, Hkv, NB, BR64),
        lambda b, hkv, blk, ri: tirx.Select(gmax[b, hkv, blk, ri] == ninf, zero, gmax[b, hkv, blk, ri]),
        name="gref",
    )
    cfac = te.compute(
        (B, Hkv, NB, nchunk, BR64),
        lambda b, hkv, blk, ch, ri: _exp(cmax[b, hkv, blk, ch, ri] - gref[b, hkv, blk, ri], acc, native_exp),
        name="cfac",
    )
    chr2 = te.reduce_axis((0, nchunk), name="chr2")
    gsum = te.compute(
        (B, Hkv, NB, BR64),
        lambda b, hkv, blk, ri: te.sum(csum[b, hkv, blk, chr2, ri] * cfac[b, hkv, blk, chr2, ri], axis=chr2),
        name="gsum",
    )
    gden = te.compute(
        (B, Hkv, NB, BR64),
        lambda b, hkv, blk, ri: gsum[b, hkv, blk, ri]
        + _exp(sink[head(hkv, row(blk, ri))] - gref[b, hkv, blk, ri], acc, native_exp),
        name="gden",
    )
    chr3 = te.reduce_axis((0, nchunk), name="chr3")
    # The matrix-engine form keeps the chunks' [feature, row] layout through the combine,
    # so its sums run along the rows in vectors; only the final gather transposes.
    acc_shape = (B, Hkv, NB, D64, BR64) if amx else (B, Hkv, NB, BR64, D64)
    acc_at = (lambda t, b, hkv, blk, ri, cc: t[b, hkv, blk, cc, ri]) if amx else (  # noqa: E731
        lambda t, b, hkv, blk, ri, cc: t[b, hkv, blk, ri, cc])

    def in_acc_layout(fn):
        return (lambda b, hkv, blk, cc, ri: fn(b, hkv, blk, ri, cc)) if amx else fn

    gacc = te.compute(
        acc_shape,
        in_acc_layout(lambda b, hkv, blk, ri, cc: te.sum(
            mul(cfac[b, hkv, blk, chr3, ri], chunk_acc(b, hkv, blk, chr3, ri, cc)), axis=chr3
        )),
        name="gacc",
    )
    # A denominator of exactly 0 is a row that sees nothing: out 0 (a NaN one stays NaN).
    blk_out = te.compute(
        acc_shape,
        in_acc_layout(lambda b, hkv, blk, ri, cc: tirx.Select(
            gden[b, hkv, blk, ri] == zero, zero, acc_at(gacc, b, hkv, blk, ri, cc) / gden[b, hkv, blk, ri]
        )),
        name="blk_out",
    )
    blk_lse = te.compute(
        (B, Hkv, NB, BR64),
        lambda b, hkv, blk, ri: gref[b, hkv, blk, ri] + tirx.log(gden[b, hkv, blk, ri]),
        name="blk_lse",
    )

    out = te.compute(
        (B, H, Tq, g.D), lambda b, h, i, cc: acc_at(blk_out, b, *g.block_of(h, i), cc).astype(dt), name="out"
    )
    lse = te.compute((B, H, Tq), lambda b, h, i: blk_lse[(b,) + g.block_of(h, i)], name="lse")
    return g.head_args() + [sink, scale] + g.scalar_args() + [out, lse]


def _chunk_bits(g: CacheGeometry, x, name: str):
    """The chunk's key slots of x (k or v) as bfloat16 bits [B, Hkv, NB, nchunk, KC, D]
    (uint16): a gather, since the slots come from the block's table (and the sink list),
    which a tensorized block cannot read through."""
    return te.compute(
        (g.B, g.Hkv, g.NB, g.nchunk, g.KC64, g.D64),
        lambda b, hkv, blk, ch, kk, c: tirx.reinterpret("uint16", x[b, hkv, g.slot(b, blk, ch, kk), c]),
        name=name,
    )


def _matrix_scores(g: CacheGeometry):
    """The scores [key, row] of the matrix-engine form: the chunk's key bits times the
    block's queries as pair words (two features a word), summed in float32: the
    expression the engine's intrinsic describes (schedules.amx)."""
    assert not g.row_major
    kbits = _chunk_bits(g, g.k, "kbits")

    def word(b, hkv, blk, c2, ri):
        r = g.row(blk, ri)
        x = lambda c: bf16_bits(g.q[b, g.head(hkv, r), g.query(r), c])  # noqa: E731
        return pair_word(x(2 * c2), x(2 * c2 + 1))

    qword = te.compute((g.B, g.Hkv, g.NB, tirx.const(g.D // 2, "int64"), g.BR64), word, name="qword")
    k2 = te.reduce_axis((0, tirx.const(g.D // 2, "int64")), name="gscore_k2")
    e = te.reduce_axis((0, tirx.const(2, "int64")), name="gscore_e")
    return g.tile(
        "gscore",
        lambda b, hkv, blk, ch, kk, ri: te.sum(
            bf16_value(kbits[b, hkv, blk, ch, kk, 2 * k2 + e]) * word_half(qword[b, hkv, blk, k2, ri], e),
            axis=[k2, e]),
    )


def _matrix_values(g: CacheGeometry, cprob):
    """P·V^T [B, Hkv, NB, nchunk, D, BR] of the matrix-engine form: the chunk's values
    transposed (gathered row by row first, so the transpose does no index arithmetic)
    times the probabilities rounded to bfloat16 pair words (two keys a word)."""
    vbits = _chunk_bits(g, g.v, "vbits")
    vbits_t = te.compute((g.B, g.Hkv, g.NB, g.nchunk, g.D64, g.KC64),
                         lambda b, hkv, blk, ch, c, kk: vbits[b, hkv, blk, ch, kk, c], name="vbits_t")
    pword = te.compute(
        (g.B, g.Hkv, g.NB, g.nchunk, tirx.const(g.KC // 2, "int64"), g.BR64),
        lambda b, hkv, blk, ch, j2, ri: pair_word(bf16_round_bits(cprob[b, hkv, blk, ch, 2 * j2, ri]),
                                                  bf16_round_bits(cprob[b, hkv, blk, ch, 2 * j2 + 1, ri])),
        name="pword",
    )
    j2 = te.reduce_axis((0, tirx.const(g.KC // 2, "int64")), name="cacc_t_k2")
    e = te.reduce_axis((0, tirx.const(2, "int64")), name="cacc_t_e")
    return te.compute(
        (g.B, g.Hkv, g.NB, g.nchunk, g.D64, g.BR64),
        lambda b, hkv, blk, ch, cc, ri: te.sum(
            bf16_value(vbits_t[b, hkv, blk, ch, cc, 2 * j2 + e]) * word_half(pword[b, hkv, blk, ch, j2, ri], e),
            axis=[j2, e]),
        name="cacc_t",
    )


CACHE_COMPUTES = {"cache": cache_attention}

__all__ = ["cache_attention", "window_visible", "sink_visible", "CACHE_CHUNK", "CACHE_COMPUTES"]
