"""Tensor-expression definitions of the attention math (no scheduling here).

Two computes, both O(T * (W + G)) in work and memory; neither ever builds a T x T tensor.

``local``: the blocked ("chunks") form. With dilation d, row i = r + d*t has residue
r = i mod d and only ever sees keys of the same residue, so each residue class is an
ordinary (non-dilated) banded problem over t. A *work item* is one block of ``block_q``
consecutive t of one residue: item beta of head h covers

    ib = beta // d,  r = beta % d,  rows  i(qi) = ib*Bq*d + r + d*qi,    qi < Bq
                                    keys  j(kj) = ib*Bq*d + r + d*(kj - left), kj < Kw

so its window keys form one contiguous band of Kw = Bq + left + right keys, and the score
stage is a dense (Kw x D) @ (D x Bq) product per item (key-major: see local_attention). d is read at runtime from a [H]
tensor, so one kernel serves uniform and per-head dilation up to ``max_dilation``; the
item grid has ceil(T/Bq) + max_dilation - 1 entries, enough for any d <= max_dilation.

``global``: G global rows, each against all T keys (causal: keys j <= its position),
as blocks of GLOBAL_BLOCK rows against chunks of GLOBAL_CHUNK keys (split-K softmax with
a combine stage; see global_attention).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

from tvm import te, tirx

from swa_tvm.spec import CACHE_MATRIX_BLOCK, KernelSpec, accum_dtype

# Key bands are padded to a multiple of this many keys (one AVX-512 vector of fp32).
LANES = 16
# The extra keys' axis is padded to a multiple of this many (masked), so a schedule can
# tile it into register rows as it tiles the band.
EXTRA_TILE = 4


def _neg_inf(dtype: str):
    return tirx.infinity(dtype) * tirx.const(-1, dtype)


# Cephes' expf: exp(r) = 1 + r + r^2 * p(r) on |r| <= ln2/2, p of degree 5 (exp of degree
# 7, ~1 ulp).
CEPHES_EXP = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
# p of degree 3 (exp of degree 5), fitted near-minimax to exp's relative error: within
# 3e-7 of exp in float32 (tests/test_amx.py::test_short_exp_error), two multiply-adds
# fewer per probability. For the matrix-engine form, whose probabilities are rounded to
# bfloat16 (2^-9) for their product.
SHORT_EXP = (0.00834533893965831, 0.04192566279447259, 0.1666679418325884, 0.49998878308726225)


def _exp(x, dtype: str, native: bool = False, coeffs=CEPHES_EXP):
    """exp(x) for x <= 0 (scores minus their row max), vectorizable.

    ``native``: the target's own exp (CUDA has a fast hardware one). Otherwise, on the
    CPU: LLVM scalarises ``tir.exp`` into libm calls, which would dominate the
    kernel. This is Cephes' expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp),
    returning exactly 0 below the float32 range so masked (-inf) scores add nothing.
    float64 (used by gradient tests) keeps the exact intrinsic.

    ``x`` appears many times in the expanded polynomial, so callers pass a cheap
    expression (a few buffer loads; the stages it reads are materialized). It is not
    Let-bound: MetaSchedule's FLOP estimator rejects Let, and LLVM removes the repeats.
    NaN in, NaN out: a row that sees a NaN score comes out NaN, as in the reference
    (and as the nonfinite check in swa_tvm.eager needs to notice it).
    """
    if native or dtype != "float32":
        return tirx.exp(x)
    return _exp_poly(x, lambda c: tirx.const(c, "float32"), coeffs)


def _exp_poly(x, f, coeffs=CEPHES_EXP):
    xc = tirx.max(x, f(-87.0))
    n = tirx.floor(xc * f(1.44269504088896341) + f(0.5))
    r = xc - n * f(0.693359375) - n * f(-2.12194440e-4)
    p = f(coeffs[0])
    for c in coeffs[1:]:
        p = p * r + f(c)
    y = p * r * r + r + f(1.0)
    pow2n = tirx.reinterpret("float32", (n.astype("int32") + 127) << 23)
    # Only NaN fails both compares (the clamp above drops NaN): it comes out as it went in.
    return tirx.Select(x >= f(-87.0), y * pow2n, tirx.Select(x < f(-87.0), f(0.0), x))


# Cephes' tanhf: tanh(x) = x + x z p(z), z = x^2, on |x| <= 0.625 (p of degree 4).
CEPHES_TANH = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1)


def _tanh(x, dtype: str, native: bool = False):
    """tanh(x), vectorizable. On the CPU TVM lowers ``tir.tanh`` to two scalar ``expf``
    calls per lane, which cost a softcap kernel a third of its time. This is Cephes'
    tanhf (~2 ulp): the odd polynomial near 0, else (1 - t) / (1 + t) with t =
    exp(-2|x|) from ``_exp_poly`` (an argument <= 0; 0 past float32's range, so
    tanh(+-inf) = +-1), the sign put back. NaN in, NaN out. ``native`` (GPU targets) and
    float64 keep the intrinsic. ``x`` appears some 35 times in the expansion: callers
    pass a cheap expression, as to ``_exp``."""
    if native or dtype != "float32":
        return tirx.tanh(x)
    f = lambda c: tirx.const(c, "float32")  # noqa: E731
    z = x * x
    p = f(CEPHES_TANH[0])
    for c in CEPHES_TANH[1:]:
        p = p * z + f(c)
    t = _exp_poly(tirx.abs(x) * f(-2.0), f)
    far = (f(1.0) - t) / (f(1.0) + t)
    return tirx.Select(tirx.abs(x) <= f(0.625), x + x * z * p, tirx.Select(x < f(0.0), f(0.0) - far, far))


def product(exact: bool):
    """The weight-times-value product of a kernel: ``weigh`` for kernels that must keep
    non-finite values from rows that cannot see them (KernelSpec.nonfinite, and GPU
    targets, whose fused kernels guard the same way), else the plain product."""
    return weigh if exact else operator.mul


def weigh(p, x):
    """p * x, and exactly 0 where the weight p is 0 (a probability or score gradient).

    A key a row cannot see gets weight 0, and must add nothing to that row whatever
    its value holds: an unwritten cache slot, padding, or a NaN beyond the window
    (0 * NaN is NaN). One compare per product, no branch; a NaN weight (a row that sees
    a NaN score) still propagates, as in the reference.
    """
    prod = p * x
    zero = tirx.const(0, str(prod.ty))  # an expression's dtype (TensorSlice has no .ty)
    return tirx.Select(p != zero, prod, zero)


def _dims(shapes: dict | None, names: str):
    """Each named dimension: the int given in ``shapes``, else a symbolic int64 var."""
    shapes = shapes or {}
    return [shapes[n] if n in shapes else te.var(n, dtype="int64") for n in names.split()]


def band_width(block: int, lo: int, hi: int, lanes: int = LANES) -> int:
    """Partners of a block of a bounded window: block + lo + hi, rounded up to whole SIMD
    vectors (``lanes``; the extra partners are masked like any position beyond the window)."""
    return -(-(block + lo + hi) // lanes) * lanes


def cast(x, dtype: str):
    """x in ``dtype``; no Cast node when it already is (keeps fp32 kernels' IR unchanged)."""
    return x if x.dtype == dtype else x.astype(dtype)


def bf16_bits(x):
    """The 16 bits of a bfloat16 value, as uint32: what the matrix engine's operands hold."""
    return tirx.reinterpret("uint16", x).astype("uint32")


def bf16_round_bits(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), its bits as uint32.
    Integer operations only, so it vectorizes wherever uint32 does."""
    u = tirx.reinterpret("uint32", x)
    one, half = tirx.const(1, "uint32"), tirx.const(0x7FFF, "uint32")
    return tirx.shift_right(u + half + tirx.bitwise_and(tirx.shift_right(u, tirx.const(16, "uint32")), one),
                            tirx.const(16, "uint32"))


def pair_word(lo_bits, hi_bits):
    """Two bfloat16 values' bits in one uint32 word, ``lo`` in the low half: a VNNI pair,
    the layout the matrix engine's second operand takes (a 16 x 64-byte tile holds 16 x 16
    pairs: a 32 x 16 block of values, 32 along the reduction axis)."""
    return tirx.bitwise_or(lo_bits, tirx.shift_left(hi_bits, tirx.const(16, "uint32")))


def bf16_value(bits):
    """The float32 value of bfloat16 bits held as uint16. The matrix engine's operands
    are kept as bits: TVM stores intermediate bfloat16 buffers as float32, which the
    engine would read as garbage."""
    return tirx.reinterpret("float32", tirx.shift_left(bits.astype("uint32"), tirx.const(16, "uint32")))


def word_half(word, e):
    """The float32 value of half ``e`` (0: low, 1: high) of a pair word: bfloat16 to
    float32 is the bits moved to the top. The matrix engine's tensor intrinsic
    (schedules.amx) describes its second operand with this same expression."""
    shift = (e * 16).astype("uint32")
    return tirx.reinterpret("float32", tirx.shift_left(tirx.shift_right(word, shift), tirx.const(16, "uint32")))


def i64(x):
    return x.astype("int64") if hasattr(x, "astype") else x


# Division of index expressions known to be >= 0 by a divisor >= 1 (positions, items,
# heads by the GQA group, by the runtime dilation). Truncating division equals floor
# division there, and it lowers to one instruction: floordiv/floormod by a runtime value
# lower to sign fix-ups (nested Let/Select) that, nested in the result gathers, made
# TVM's LLVM code generation take ~7 s per kernel instead of ~1 s.
def div_nonneg(a, b):
    return tirx.truncdiv(a, b)


def mod_nonneg(a, b):
    return tirx.truncmod(a, b)


def unit_band(spec: KernelSpec, amx: bool) -> bool:
    """Whether ``spec``'s band is built ``unit`` (``Band``): the matrix form of a kernel
    that serves dilation 1 alone. Its schedule then reads the residue copies in place
    (``schedules.cpu._amx_bands``), which needs the affine band start."""
    return amx and spec.max_dilation == 1


class Band:
    """The blocked band structure shared by the local kernels (forward and backward).

    A *work item* is one block of ``block`` consecutive positions of one residue class
    mod d (the head's dilation). Block position p sees partner position p + s*d for
    -lo <= s <= hi, so an item's partners form one contiguous band of ``width``
    positions: the forward and dq kernels use (lo, hi) = (left, right) with queries as
    block positions and keys as partners; the dk/dv kernel uses (right, left) with the
    roles swapped (key j is seen by query i = j + u*d, -right <= u <= left).

    Item beta of head h covers ib = beta // d, r = beta % d:
        block positions  pos(qi) = ib*block*d + r + d*qi,            qi < block
        partners         partner(kj) = pos(0) + d*(kj - lo),          kj < width
    (partner(kj) = r + d*kj when lo is unbounded). ``info`` [H, nitems, 4] holds, per
    item, pos(0), partner(0), ib*block and r, so inner loops never divide by the
    runtime dilation.

    ``unit``: the kernel serves dilation 1 alone (max_dilation 1), so d is the constant
    1 and not the runtime value: items are plain blocks, ``item_of`` divides by the
    constant block, and an item's first band slot is ``beta * block`` (``start``),
    affine in the item loop. The matrix-engine form takes it; the float32-product
    form keeps the runtime d, so its PrimFuncs, and their tuning records, stay as they
    were.
    """

    def __init__(self, lo: int, hi: int, block: int, max_dilation: int, T, H, dil, name: str = "item_info",
                 lanes: int = LANES, unit: bool = False):
        assert not unit or max_dilation == 1
        self.lo, self.hi, self.block, self.T, self.H, self.dil, self.unit = lo, hi, block, T, H, dil, unit
        self.nitems = tirx.floordiv(T + (block - 1), block) + (max_dilation - 1)
        # Unbounded side: the band is the whole (residue) sequence, O(T^2) as the math says.
        self.width = band_width(block, lo, hi, lanes) if lo >= 0 and hi >= 0 else T + max(lo, 0)

        def field(h, beta, f):
            d = self.d(h)
            ib, r = div_nonneg(beta, d), mod_nonneg(beta, d)
            row0 = ib * (block * d) + r
            key0 = row0 - lo * d if lo >= 0 else r
            return tirx.Select(f == 0, row0, tirx.Select(f == 1, key0, tirx.Select(f == 2, ib * block, r)))

        self.info = te.compute((H, self.nitems, 4), field, name=name)

    def d(self, h):
        """Head h's dilation: the constant 1 for a ``unit`` band."""
        return tirx.const(1, "int64") if self.unit else i64(self.dil[h])

    def start(self, h, beta):
        """The item's first band slot in residue space, ib*block: affine in beta for a
        ``unit`` band, read from ``info`` otherwise."""
        return i64(beta) * self.block if self.unit else self.info[h, beta, 2]

    def residue(self, h, beta):
        return tirx.const(0, "int64") if self.unit else self.info[h, beta, 3]

    def pos(self, h, beta, qi):
        return self.info[h, beta, 0] + self.d(h) * qi

    def partner(self, h, beta, kj):
        return self.info[h, beta, 1] + self.d(h) * kj

    def clamp(self, x):
        return tirx.max(tirx.min(x, self.T - 1), 0)

    def ok(self, h, beta, qi, kj):
        """Partner kj of the band is in range and inside block position qi's window. In
        residue space its offset from qi is kj - lo - qi (bounded lo) or
        kj - t(pos 0) - qi (unbounded lo), independent of the dilation."""
        T, lo, hi = self.T, self.lo, self.hi
        j = self.partner(h, beta, kj)
        ok = tirx.all(j >= 0, j < T, self.pos(h, beta, qi) < T)
        off = kj - lo - qi if lo >= 0 else kj - self.start(h, beta) - qi
        if lo >= 0:
            ok = tirx.all(ok, off >= -lo)
        if hi >= 0:
            ok = tirx.all(ok, off <= hi)
        return ok

    def key_range(self, h, beta, qi):
        """(first, last) partner index kj that block position qi sees: the same set as
        ``ok``, as one interval (empty, first > last, for rows past the end). A mask
        from two compares per entry, instead of ``ok``'s int64 arithmetic."""
        return row_key_range(self.lo, self.hi, self.T, self.d(h), self.start(h, beta), self.residue(h, beta), qi)

    def interval_mask(self, name: str = "krange"):
        """``ok`` as a stage plus a predicate: the per-item table [H, nitems, 2, block]
        (int32; band indices are small) of each block position's partner interval, and
        ok(h, beta, qi, kj) reading it, two compares per entry."""
        def field(h, beta, f, qi):
            first, last = self.key_range(h, beta, qi)
            return tirx.Select(f == 0, first, last).astype("int32")

        rng = te.compute((self.H, self.nitems, 2, self.block), field, name=name)

        def ok(h, beta, qi, kj):
            kj = kj.astype("int32")
            return tirx.all(kj >= rng[h, beta, 0, qi], kj <= rng[h, beta, 1, qi])

        return ok

    def item_of(self, h, i):
        """(item, block position) of sequence position i: for gathering results back."""
        d = self.d(h)
        # i = (ib*block + qi)*d + r: one division by d, the rest by the constant block.
        t = div_nonneg(i, d)
        return div_nonneg(t, self.block) * d + mod_nonneg(i, d), mod_nonneg(t, self.block)


def row_key_range(lo: int, hi: int, T, d, m0, r, qi):
    """(first, last) band index that block position ``qi`` of an item sees (int64; empty,
    first > last, for a row past the end), under dilation ``d``: index arithmetic only,
    shared by the TE mask (``Band.key_range``) and hand-written kernels.

    In residue space the item's block positions are m0 + qi (m0 = ib*block) and partner
    kj is m0 - lo + kj (bounded lo) or kj; residue r has nres = ceil((T - r) / d)
    positions."""
    qi = i64(qi)
    nres = div_nonneg(T - r + d - 1, d)
    if lo >= 0:
        first = tirx.max(qi, lo - m0)
        last = nres - m0 + lo - 1
        if hi >= 0:
            last = tirx.min(last, qi + lo + hi)
    else:
        first = tirx.const(0, "int64")
        last = nres - 1
        if hi >= 0:
            last = tirx.min(last, m0 + qi + hi)
    past_end = m0 + qi >= nres
    one, zero = tirx.const(1, "int64"), tirx.const(0, "int64")
    return tirx.Select(past_end, one, i64(first)), tirx.Select(past_end, zero, i64(last))


def item_inner_span(lo: int, hi: int, block: int, T, d, m0, r):
    """(first, last): the band indices every row of an item that is not past the end
    sees, all of [first, last] (empty when first > last); a kernel may skip the mask
    there (rows past the end write nothing). Both ends of ``row_key_range`` are
    non-decreasing in the row, so that is [first of the last row (past the end or not),
    last of row 0]."""
    first_max = tirx.max(tirx.const(block - 1, "int64"), lo - m0) if lo >= 0 else tirx.const(0, "int64")
    return first_max, row_key_range(lo, hi, T, d, m0, r, 0)[1]


def item_interior(lo: int, hi: int, block: int, T, d, m0, r, k0, k1):
    """Whether every row of an item that is not past the end sees every band index in
    [k0, k1] (``item_inner_span``)."""
    first, last = item_inner_span(lo, hi, block, T, d, m0, r)
    return tirx.all(k0 >= first, k1 <= last)


def item_key_span(lo: int, hi: int, block: int, T, d, beta):
    """(first, last) band index that any block position of item ``beta`` sees, under
    dilation ``d`` (int64): the union of its rows' ``Band.key_range`` intervals (a
    superset for rows past the end). Index arithmetic on ``d`` only (no stage), so a
    schedule can test it in a loop guard: see schedules.cpu.skip_dead_keys."""
    ib, r = div_nonneg(beta, d), mod_nonneg(beta, d)
    m0 = ib * block
    nres = div_nonneg(T - r + d - 1, d)
    zero = tirx.const(0, "int64")
    if lo >= 0:
        first, last = tirx.max(zero, lo - m0), nres - m0 + lo - 1
        if hi >= 0:
            last = tirx.min(last, tirx.const(block - 1 + lo + hi, "int64"))
    else:
        first, last = zero, nres - 1
        if hi >= 0:
            last = tirx.min(last, m0 + block - 1 + hi)
    return first, last


class Extras:
    """Visibility of the extra keys (global positions and sinks, [B, E] int32, -1 =
    padding) to ordinary rows. Calling it with a row's position i, residue-space index
    t and residue r (so no division by the dilation is needed per score) says whether
    extra e is visible: not padding, not in the future of a causal row, and not already
    inside the row's window (a position counts once)."""

    def __init__(self, xidx, dil, B, H, E, left: int, right: int, T):
        self.xidx, self.left, self.right, self.T = xidx, left, right, T
        # Residue and residue-space index of each extra position under each head's dilation.
        self.info = te.compute(
            (B, H, E, 2),
            lambda b, h, e, f: tirx.Select(
                f == 0, tirx.floormod(i64(xidx[b, e]), i64(dil[h])), tirx.floordiv(i64(xidx[b, e]), i64(dil[h]))
            ),
            name="extra_info",
        )

    def __call__(self, b, h, e, i, t, r):
        x = i64(self.xidx[b, e])
        return extra_visible(self.left, self.right, self.T, x, self.info[b, h, e, 0], self.info[b, h, e, 1], i, t, r)


def extra_visible(left: int, right: int, T, x, xr, xt, i, t, r):
    """Whether extra key position ``x`` (residue ``xr``, residue-space index ``xt`` under
    the head's dilation; x = -1 is padding) is visible to the row at position ``i``
    (residue ``r``, residue-space index ``t``): not padding, not in a causal row's
    future, not already inside its window (a position counts once)."""
    s = xt - t
    in_band = xr == r
    if left >= 0:
        in_band = tirx.all(in_band, s >= -left)
    if right >= 0:
        in_band = tirx.all(in_band, s <= right)
    ok = tirx.all(x >= 0, i < T, tirx.Not(in_band))
    if right == 0:
        ok = tirx.all(ok, x <= i)
    return ok


class ResidueCopies:
    """Tensors of every head, residue-major and zero-padded: the matrix-engine form's
    operands (the local kernels' forward and gradients). Slot p of residue r holds
    position r + d*(p - lo) of the head's sequence (d its dilation, lo the band's side
    before its block), zero where that is before 0, at or past T, or where r >= d. Item
    beta's band is then slots [ib*block, ib*block + width) of residue r: contiguous
    rows, never out of bounds, whatever the dilation. Zero keys and values add nothing:
    their scores are masked and their probabilities 0.

    ``rows(x, name, head)``: [B, heads, max_dilation, slots, D], where heads are x's own
    when max_dilation is 1 (every dilation is 1, so a GQA group shares one copy) and
    the query heads otherwise (a head's dilation decides its layout); ``head`` maps a
    query head to x's. ``cols``: the same transposed, [.., D, slots], made from the
    rows, so the transpose does no index arithmetic. Both hold bfloat16 bits as uint16
    (``bf16_value``). ``band_rows``/``band_cols`` copy an item's band out of them. Each
    copy holds about max_dilation x T x D values per head (AMX_MAX_DILATION bounds it)."""

    def __init__(self, dil, T, lo: int, slots, max_dilation: int, band: Band):
        self.dil, self.T, self.lo, self.slots, self.md, self.band = dil, T, lo, slots, max_dilation, band
        self._rows = {}
        self._head = {}  # copy name -> query head -> the copy's head

    def _pos(self, h, r, p):
        return i64(r) + i64(self.dil[h]) * (i64(p) - self.lo)

    def rows(self, x, name: str, head=lambda h: h):
        """x [B, heads, T, D] (``head`` maps a query head to x's head) as residue rows."""
        if name not in self._rows:
            B, D, T, lo = x.shape[0], x.shape[3], self.T, self.lo
            zero = tirx.const(0, "uint16")

            if self.md == 1:
                def value(b, hx, r, p, c):
                    pos = i64(p) - lo
                    ok = tirx.all(p >= lo, pos < T)
                    return tirx.Select(ok, tirx.reinterpret("uint16", x[b, hx, tirx.max(tirx.min(pos, T - 1), 0), c]), zero)

                self._rows[name] = te.compute((B, x.shape[1], 1, self.slots, D), value, name=name)
                self._head[name] = head
            else:
                def value(b, h, r, p, c):
                    pos = self._pos(h, r, p)
                    ok = tirx.all(p >= lo, r < self.dil[h], pos < T)
                    return tirx.Select(ok, tirx.reinterpret("uint16", x[b, head(h), tirx.max(tirx.min(pos, T - 1), 0), c]),
                                       zero)

                self._rows[name] = te.compute((B, self.dil.shape[0], self.md, self.slots, D), value, name=name)
                self._head[name] = lambda h: h
        return self._rows[name]

    def cols(self, x, name: str, head=lambda h: h):
        rows = self.rows(x, name, head)
        B, H, md, slots, D = rows.shape
        self._head[name + "_t"] = self._head[name]
        return te.compute((B, H, md, D, slots), lambda b, h, r, c, p: rows[b, h, r, p, c], name=name + "_t")

    def band_rows(self, res, width, name: str):
        """Item beta's band of residue rows ``res``: [B, H, items, width, D]. Of a
        ``unit`` band its slots are affine in beta, so a schedule may inline it and let
        the products read the copy in place."""
        B, D, band, head = res.shape[0], res.shape[4], self.band, self._head[res.op.name]
        return te.compute(
            (B, self.dil.shape[0], band.nitems, width, D),
            lambda b, h, beta, j, c: res[b, head(h), band.residue(h, beta), band.start(h, beta) + j, c], name=name,
        )

    def band_cols(self, res_t, width, name: str):
        """Item beta's band of transposed residue rows ``res_t``: [B, H, items, D, width]."""
        B, D, band, head = res_t.shape[0], res_t.shape[3], self.band, self._head[res_t.op.name]
        return te.compute(
            (B, self.dil.shape[0], band.nitems, D, width),
            lambda b, h, beta, c, j: res_t[b, head(h), band.residue(h, beta), c, band.start(h, beta) + j], name=name,
        )


def block_words(x, H, block: int, nitems, row, name: str, head=lambda h: h):
    """Pair words [B, H, items, D/2, block] of the block rows of x [B, heads, T, D]
    (``row(h, beta, i)``: the clamped position of block row i; ``head`` maps a query
    head to x's): the second operand of a product over the head dim (``pair_word``)."""
    B, D = x.shape[0], x.shape[3]

    def word(b, h, beta, c2, i):
        pos = row(h, beta, i)
        return pair_word(bf16_bits(x[b, head(h), pos, 2 * c2]), bf16_bits(x[b, head(h), pos, 2 * c2 + 1]))

    return te.compute((B, H, nitems, D // 2, block), word, name=name)


def band_words(p, name: str):
    """Pair words [B, H, items, width/2, block] of float32 weights p [B, H, items,
    width, block] (probabilities, score gradients) rounded to bfloat16: the second
    operand of a product over the band, formed from two rows with vector integer ops."""
    B, H, n, width, block = p.shape
    return te.compute(
        (B, H, n, width // 2, block),
        lambda b, h, beta, j2, i: pair_word(bf16_round_bits(p[b, h, beta, 2 * j2, i]),
                                            bf16_round_bits(p[b, h, beta, 2 * j2 + 1, i])),
        name=name,
    )


def matrix_product(a, words, name: str):
    """[B, H, items, M, N] = sum over K of A[.., M, K] * W[.., K, N]: ``a`` bfloat16 bits
    [.., M, K] (uint16), ``words`` pair words [.., K/2, N]; float32 sums. The expression
    the matrix-engine intrinsic (schedules.amx) describes."""
    B, H, n, M, K = a.shape
    N = words.shape[4]
    k2 = te.reduce_axis((0, K // 2), name=name + "_k2")
    e = te.reduce_axis((0, 2), name=name + "_e")
    return te.compute(
        (B, H, n, M, N),
        lambda b, h, beta, i, j: te.sum(bf16_value(a[b, h, beta, i, 2 * k2 + e]) * word_half(words[b, h, beta, k2, j], e),
                                        axis=[k2, e]),
        name=name,
    )


# Reduction depth of one matrix-engine step: a tile row of 64 bytes holds 32 bfloat16.
MATRIX_K = 32
# Rows and columns of one matrix-engine result tile (16 x 16 float32).
MATRIX_TILE = 16


# The local kernels with a matrix-engine form: the forward and its window gradients
# (the KV-cache forward's and the five-product backward's: ``amx_serves``).
AMX_KINDS = ("local", "local_dq", "local_dkv")
# The largest dilation bound the form takes: its operand copies hold max_dilation slots
# per position (ResidueCopies). Larger bounds keep the float32-product form.
AMX_MAX_DILATION = 4

# The widest window (left + right) of the five-product backward's matrix-engine form:
# each task holds about (left + right) / 32 + 2 query sub-blocks of staged operands, 24 KB
# each at D = 64 (6 MB here). Wider windows keep the TE gradient kernels' form.
AMX_FUSED_MAX_SPAN = 8192


def amx_serves(spec: KernelSpec) -> bool:
    """Whether ``spec`` has a matrix-engine form (AMX tiles or AVX-512 BF16 dot products:
    ``compiler.targets.matrix_form``): a local forward or window gradient
    (AMX_KINDS) of a bounded window in bfloat16, the head dim a whole number of tile
    rows, its items a whole number of result tiles, a dilation bound of at most
    AMX_MAX_DILATION. The nonfinite variant keeps its guarded products. The five-product
    backward ("local_bwd", schedules/cpu_flash_bwd_matrix.py) has one for any dilation (it
    runs each residue in turn) and extra keys, the head dim a whole number of product
    depths, a window of at most AMX_FUSED_MAX_SPAN keys (its ring of query sub-blocks
    grows with the window). The KV-cache forward ("cache") has one for blocks of
    CACHE_MATRIX_BLOCK rows or more (its gradients keep float32 products)."""
    if spec.kind == "cache":
        return (spec.dtype == "bfloat16" and not spec.nonfinite and spec.head_dim % MATRIX_K == 0
                and spec.block_q >= CACHE_MATRIX_BLOCK and spec.block_q % MATRIX_TILE == 0)
    if spec.kind == "local_bwd":
        return (spec.fused_backward and spec.dtype == "bfloat16" and spec.head_dim % MATRIX_K == 0
                and spec.left + spec.right <= AMX_FUSED_MAX_SPAN)
    return (spec.kind in AMX_KINDS and spec.dtype == "bfloat16" and not spec.nonfinite and spec.left >= 0
            and spec.right >= 0 and spec.head_dim % MATRIX_K == 0 and amx_block(spec) % MATRIX_TILE == 0
            and spec.max_dilation <= AMX_MAX_DILATION)


def fused_backward_runs(spec: KernelSpec, engine: str | None) -> bool:
    """Whether the five-product backward (a "local_bwd" ``spec``) runs rather than the TE
    gradient kernels, on a CPU whose bfloat16 engine is ``engine`` (None, "amx" or
    "bf16_dot": ``compiler.targets.matrix_engine``). Everywhere for float32, float16 and
    extra keys (the extra keys' TE kernels do not use an engine). For bfloat16 on an
    engine: where its own matrix-engine form serves (``amx_serves``), and where neither
    it nor the TE kernels' form does (both then multiply in float32, and the fused kernel
    recomputes less); the TE kernels' form where only theirs serves (a window wider than
    AMX_FUSED_MAX_SPAN). The rule of export and of first-use compiles alike."""
    if engine is None or spec.dtype != "bfloat16" or spec.extras:
        return True
    return amx_serves(spec) or not amx_serves(dataclasses.replace(spec, kind="local_dq"))


# Rows per work item of the matrix-engine form, at least. `python -m
# tools.experiments.amx_blocks` (causal W=512 at T=16384, 2 Emerald Rapids cores,
# 2026-12-06): 35.2 ms at 64 rows, 36.2 at 32, 36.6 at 128.
AMX_MIN_BLOCK = 64


def amx_block(spec: KernelSpec) -> int:
    """Rows per work item of the matrix-engine form of ``spec``: its block_q, raised to
    AMX_MIN_BLOCK (the result does not depend on the blocking)."""
    return max(spec.block_q, AMX_MIN_BLOCK)


def convert_once(spec: KernelSpec, native_exp: bool) -> bool:
    """Whether the local forward's float32-product form converts 16-bit k and v to
    float32 once per call (CPU targets, whose exp is not native; a bounded window: an
    unbounded one reads its rows in place)."""
    return (spec.dtype in ("bfloat16", "float16") and not native_exp and spec.left >= 0 and spec.right >= 0)


def local_attention(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False, amx: bool = False):
    """TE for the local (window + extra keys) kernel.

    Returns the PrimFunc argument list: tensors q [B,H,T,D], k/v [B,Hkv,T,D],
    dilation [H] int32, extra_idx [B,E] int32 (-1 = padding; only with spec.extras),
    sink_logit [H] (-inf = none), the scale Var, out [B,H,T,D], lse [B,H,T] (float32 or
    the kernel dtype for float64).
    ``shapes`` may fix any of B, H, Hkv, T, E to ints (tuning needs concrete shapes).
    ``native_exp``: use the target's exp intrinsic (GPU targets) instead of the
    vectorizable polynomial the CPU needs (see ``_exp``).
    ``amx``: the two products in the matrix engine's operand layouts (``amx_serves``
    says which specs have them): bfloat16 operands, float32 sums. The keys come from
    per-head, residue-major, zero-padded copies of k (rows) and v (transposed), made
    once per call, in which every item's band is one contiguous block of rows; the
    query block is packed as pair words (``pair_word``);
    the probabilities are rounded to bfloat16 pair words for the second product, and
    its result is [D, block] (the values' features as the engine's rows).
    """
    assert spec.kind == "local"
    assert not amx or amx_serves(spec), f"{spec.name} has no matrix-engine form"
    B, H, Hkv, T, E = _dims(shapes, "B H Hkv T E")
    D, dt, Bq = spec.head_dim, spec.dtype, amx_block(spec) if amx else spec.block_q
    acc = accum_dtype(dt)
    left, right = spec.left, spec.right

    q = te.placeholder((B, H, T, D), dt, name="q")
    k = te.placeholder((B, Hkv, T, D), dt, name="k")
    v = te.placeholder((B, Hkv, T, D), dt, name="v")
    dil = te.placeholder((H,), "int32", name="dilation")
    xidx = te.placeholder((B, E), "int32", name="extra_idx") if spec.extras else None
    sink = te.placeholder((H,), acc, name="sink_logit")
    scale = te.var("scale", dtype=acc)

    exact = spec.nonfinite or native_exp
    mul = product(exact)
    band = Band(left, right, Bq, spec.max_dilation, T, H, dil, lanes=MATRIX_K if amx else LANES,
                unit=unit_band(spec, amx))
    nitems, kw = band.nitems, band.width
    row_of, key_of, clamp = band.pos, band.partner, band.clamp
    group = div_nonneg(H, Hkv)
    ninf = _neg_inf(acc)

    # Per-item stages are key-major: [band key, block row], the block rows contiguous.
    # The score product is then a (Kw x D) @ (D x Bq) matmul whose vector axis is the
    # block rows, so only the small query block is transposed, the key and value bands
    # are read row by row straight from k and v (a CPU schedule inlines the band
    # gathers; a GPU one stages them in shared memory), and the softmax reductions over
    # keys are vertical (elementwise across rows of vectors). Out-of-range indices are
    # clamped, never read out of bounds; key_ok masks them. Gathers keep the input dtype
    # (half inputs reach tensor cores as half); products accumulate in acc.
    qblk_t = te.compute(
        (B, H, nitems, D, Bq), lambda b, h, beta, cc, qi: q[b, h, clamp(row_of(h, beta, qi)), cc], name="qblk_t"
    )
    if amx:
        res = ResidueCopies(dil, T, left, nitems * Bq + kw, spec.max_dilation, band)
        kv_head = lambda h: div_nonneg(h, group)  # noqa: E731
        kband = res.band_rows(res.rows(k, "kres", kv_head), kw, "kband")
        vband_t = res.band_cols(res.cols(v, "vres", kv_head), kw, "vband_t")
        qword = block_words(q, H, Bq, nitems, lambda h, beta, i: clamp(row_of(h, beta, i)), "qword")
        score = matrix_product(kband, qword, "score")
    else:
        # 16-bit keys and values of a bounded window on the CPU are converted to float32
        # once per call (kconv, vconv), which the bands then read in place as float32
        # inputs are: converted per item instead, every key row took the conversion once
        # per item whose band holds it (about (left + right) / block times).
        kin, vin = k, v
        if convert_once(spec, native_exp):
            kin = te.compute(k.shape, lambda *i: k(*i).astype(acc), name="kconv")
            vin = te.compute(v.shape, lambda *i: v(*i).astype(acc), name="vconv")
        kband = te.compute(
            (B, H, nitems, kw, D),
            lambda b, h, beta, kj, cc: kin[b, div_nonneg(h, group), clamp(key_of(h, beta, kj)), cc],
            name="kband",
        )
        vband = te.compute(
            (B, H, nitems, kw, D),
            lambda b, h, beta, kj, cc: vin[b, div_nonneg(h, group), clamp(key_of(h, beta, kj)), cc],
            name="vband",
        )
        c = te.reduce_axis((0, D), name="c")
        score = te.compute(
            (B, H, nitems, kw, Bq),
            lambda b, h, beta, kj, qi: te.sum(
                cast(kband[b, h, beta, kj, c], acc) * cast(qblk_t[b, h, beta, c, qi], acc), axis=c
            ),
            name="score",
        )
    # Each block row's visible band keys are one interval: two compares per score.
    key_ok = band.interval_mask()
    masked = te.compute(
        (B, H, nitems, kw, Bq),
        lambda b, h, beta, kj, qi: tirx.Select(key_ok(h, beta, qi, kj), score[b, h, beta, kj, qi] * scale, ninf),
        name="masked",
    )

    stages_x = None
    if spec.extras:

        extra_ok = Extras(xidx, dil, B, H, E, left, right, T)
        # Padded extras' axis: entries e >= E repeat extra E-1 and are masked.
        nx = tirx.floordiv(E + (EXTRA_TILE - 1), EXTRA_TILE) * EXTRA_TILE
        xe = lambda e: tirx.min(e, E - 1)  # noqa: E731
        band_extra_ok = lambda b, h, beta, qi, e: tirx.all(  # noqa: E731
            e < E, extra_ok(b, h, xe(e), row_of(h, beta, qi), band.start(h, beta) + qi, band.residue(h, beta))
        )

        c2 = te.reduce_axis((0, D), name="c2")
        xscore = te.compute(
            (B, H, nitems, nx, Bq),
            lambda b, h, beta, e, qi: te.sum(
                cast(k[b, div_nonneg(h, group), clamp(i64(xidx[b, xe(e)])), c2], acc) * cast(qblk_t[b, h, beta, c2, qi], acc),
                axis=c2,
            ),
            name="xscore",
        )
        xmasked = te.compute(
            (B, H, nitems, nx, Bq),
            lambda b, h, beta, e, qi: tirx.Select(band_extra_ok(b, h, beta, qi, e), xscore[b, h, beta, e, qi] * scale, ninf),
            name="xmasked",
        )
        stages_x = (xscore, xmasked)

    kr = te.reduce_axis((0, kw), name="kr")
    wmax = te.compute(
        (B, H, nitems, Bq), lambda b, h, beta, qi: te.max(masked[b, h, beta, kr, qi], axis=kr), name="wmax"
    )
    if spec.extras:
        er = te.reduce_axis((0, nx), name="er")
        xmax = te.compute(
            (B, H, nitems, Bq), lambda b, h, beta, qi: te.max(stages_x[1][b, h, beta, er, qi], axis=er), name="xmax"
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
        """Probabilities [n, Bq] of one key set (window band or extras) against the
        shared row max, their sum and their probability-weighted values (None for
        ``value`` None: the caller forms them)."""
        prob = te.compute(
            (B, H, nitems, n, Bq),
            lambda b, h, beta, j, qi: _exp(scores[b, h, beta, j, qi] - rowmax[b, h, beta, qi], acc, native_exp,
                                           SHORT_EXP if amx else CEPHES_EXP),
            name=f"{prefix}prob",
        )
        r = te.reduce_axis((0, n), name=f"{prefix}r_sum")
        total = te.compute(
            (B, H, nitems, Bq), lambda b, h, beta, qi: te.sum(prob[b, h, beta, r, qi], axis=r), name=f"{prefix}sum"
        )
        if value is None:
            return prob, total, None
        r2 = te.reduce_axis((0, n), name=f"{prefix}r_acc")
        weighted = te.compute(
            (B, H, nitems, Bq, D),
            lambda b, h, beta, qi, cc: te.sum(mul(prob[b, h, beta, r2, qi], value(b, h, beta, r2, cc)), axis=r2),
            name=f"{prefix}acc",
        )
        return prob, total, weighted

    if amx:
        wprob, wsum, _ = softmax_part("w", masked, kw, None)
        # P rounded to bfloat16, as pair words along the band: the second product's operand.
        wacc_t = matrix_product(vband_t, band_words(wprob, "pword"), "wacc_t")
        # Read as [Bq, D] like the other parts' sums of weighted values.
        parts = [(wsum, lambda b, h, beta, qi, cc: wacc_t[b, h, beta, cc, qi])]
    else:
        parts = [softmax_part("w", masked, kw, lambda b, h, beta, j, cc: cast(vband[b, h, beta, j, cc], acc))[1:]]
    if spec.extras:
        parts.append(
            softmax_part(
                "x", stages_x[1], nx, lambda b, h, beta, e, cc: cast(v[b, div_nonneg(h, group), clamp(i64(xidx[b, xe(e)])), cc], acc)
            )[1:]
        )
    sums, accs = zip(*parts)
    denom = te.compute(
        (B, H, nitems, Bq),
        lambda b, h, beta, qi: functools.reduce(operator.add, [t[b, h, beta, qi] for t in sums])
        + _exp(sink[h] - rowmax[b, h, beta, qi], acc, native_exp),
        name="denom",
    )

    def numer(b, h, beta, qi, cc):
        return functools.reduce(operator.add, [t(b, h, beta, qi, cc) if callable(t) else t[b, h, beta, qi, cc] for t in accs])

    blk_out = te.compute(
        (B, H, nitems, Bq, D),
        lambda b, h, beta, qi, cc: numer(b, h, beta, qi, cc) / denom[b, h, beta, qi],
        name="blk_out",
    )

    item_of_row = band.item_of

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


# Global rows are processed GLOBAL_BLOCK at a time (the vector axis of their key-major
# tiles: one AVX-512 or two AVX2 registers), keys in chunks of GLOBAL_CHUNK.
GLOBAL_BLOCK, GLOBAL_CHUNK = 16, 256


def global_attention(spec: KernelSpec, shapes: dict | None = None, native_exp: bool = False):
    """TE for global rows: q_global [B,H,G,D] against k_global/v_global [B,Hkv,T,D].

    Row g sees every key j (causal: j <= global_idx[b, g]). Returns the argument list
    q_global, k_global, v_global, global_idx [B,G] int32, sink_logit [H], scale,
    out [B,H,G,D], lse [B,H,G].

    Split-K softmax, as the local kernel's items: a work item is one block of
    GLOBAL_BLOCK global rows (the last one padded with copies of row G-1) against one
    chunk of GLOBAL_CHUNK keys (the last one padded, masked), with key-major tiles
    [chunk key, block row] as the local kernel's. Each item keeps its own max, sum of
    probabilities (relative to that max) and probability-weighted values; a combine
    stage rescales the chunks to the row's overall max. No [G, T] tensor exists, and
    a short sequence still has B*H*chunks items to spread over cores.
    """
    assert spec.kind == "global"
    B, H, Hkv, T, G = _dims(shapes, "B H Hkv T G")
    D, dt = spec.head_dim, spec.dtype
    GB, KC = GLOBAL_BLOCK, GLOBAL_CHUNK
    acc = accum_dtype(dt)
    qg = te.placeholder((B, H, G, D), dt, name="q_global")
    kg = te.placeholder((B, Hkv, T, D), dt, name="k_global")
    vg = te.placeholder((B, Hkv, T, D), dt, name="v_global")
    gidx = te.placeholder((B, G), "int32", name="global_idx")
    sink = te.placeholder((H,), acc, name="sink_logit")
    scale = te.var("scale", dtype=acc)
    group = div_nonneg(H, Hkv)
    ninf = _neg_inf(acc)
    nblk = tirx.floordiv(G + (GB - 1), GB)
    nchunk = tirx.floordiv(T + (KC - 1), KC)
    exact = spec.nonfinite or native_exp
    mul = product(exact)

    def row(gb, gi):  # global row of block position gi (the padding repeats row G-1)
        return tirx.min(gb * GB + gi, G - 1)

    def key(ch, kk):
        return ch * KC + kk

    qg_t = te.compute((B, H, nblk, D, GB), lambda b, h, gb, c, gi: qg[b, h, row(gb, gi), c], name="qg_t")
    c = te.reduce_axis((0, D), name="c")
    gscore = te.compute(
        (B, H, nblk, nchunk, KC, GB),
        lambda b, h, gb, ch, kk, gi: te.sum(
            cast(kg[b, div_nonneg(h, group), tirx.min(key(ch, kk), T - 1), c], acc) * cast(qg_t[b, h, gb, c, gi], acc),
            axis=c,
        ),
        name="gscore",
    )

    def ok(b, gb, ch, kk, gi):
        j = key(ch, kk)
        if spec.causal:
            return tirx.all(j < T, j <= gidx[b, row(gb, gi)].astype("int64"))
        return j < T

    gmasked = te.compute(
        (B, H, nblk, nchunk, KC, GB),
        lambda b, h, gb, ch, kk, gi: tirx.Select(ok(b, gb, ch, kk, gi), gscore[b, h, gb, ch, kk, gi] * scale, ninf),
        name="gmasked",
    )
    kr = te.reduce_axis((0, KC), name="kr")
    cmax = te.compute(
        (B, H, nblk, nchunk, GB), lambda b, h, gb, ch, gi: te.max(gmasked[b, h, gb, ch, kr, gi], axis=kr), name="cmax"
    )
    # A chunk wholly in a causal row's future has max -inf: its probabilities are taken
    # against 0 instead (all exactly 0), never against -inf (NaN).
    cref = te.compute(
        (B, H, nblk, nchunk, GB),
        lambda b, h, gb, ch, gi: tirx.Select(cmax[b, h, gb, ch, gi] == ninf, tirx.const(0, acc), cmax[b, h, gb, ch, gi]),
        name="cref",
    )
    cprob = te.compute(
        (B, H, nblk, nchunk, KC, GB),
        lambda b, h, gb, ch, kk, gi: _exp(gmasked[b, h, gb, ch, kk, gi] - cref[b, h, gb, ch, gi], acc, native_exp),
        name="cprob",
    )
    kr2 = te.reduce_axis((0, KC), name="kr2")
    csum = te.compute(
        (B, H, nblk, nchunk, GB), lambda b, h, gb, ch, gi: te.sum(cprob[b, h, gb, ch, kr2, gi], axis=kr2), name="csum"
    )
    kr3 = te.reduce_axis((0, KC), name="kr3")
    cacc = te.compute(
        (B, H, nblk, nchunk, GB, D),
        lambda b, h, gb, ch, gi, cc: te.sum(
            mul(cprob[b, h, gb, ch, kr3, gi], cast(vg[b, div_nonneg(h, group), tirx.min(key(ch, kr3), T - 1), cc], acc)),
            axis=kr3,
        ),
        name="cacc",
    )

    # Combine the chunks of each block row: rescale each to the row's overall max (a
    # wholly masked chunk by exp(-inf) = 0).
    chr_ = te.reduce_axis((0, nchunk), name="chr")
    gmax0 = te.compute((B, H, nblk, GB), lambda b, h, gb, gi: te.max(cmax[b, h, gb, chr_, gi], axis=chr_), name="gmax0")
    gmax = te.compute((B, H, nblk, GB), lambda b, h, gb, gi: tirx.max(gmax0[b, h, gb, gi], sink[h]), name="gmax")
    cfac = te.compute(
        (B, H, nblk, nchunk, GB),
        lambda b, h, gb, ch, gi: _exp(cmax[b, h, gb, ch, gi] - gmax[b, h, gb, gi], acc, native_exp),
        name="cfac",
    )
    chr2 = te.reduce_axis((0, nchunk), name="chr2")
    gsum = te.compute(
        (B, H, nblk, GB),
        lambda b, h, gb, gi: te.sum(csum[b, h, gb, chr2, gi] * cfac[b, h, gb, chr2, gi], axis=chr2),
        name="gsum",
    )
    gden = te.compute(
        (B, H, nblk, GB),
        lambda b, h, gb, gi: gsum[b, h, gb, gi] + _exp(sink[h] - gmax[b, h, gb, gi], acc, native_exp),
        name="gden",
    )
    chr3 = te.reduce_axis((0, nchunk), name="chr3")
    gacc = te.compute(
        (B, H, nblk, GB, D),
        # Guarded: a chunk's factor of 0 (a +inf sink takes the softmax) adds nothing, even
        # where the chunk's values are NaN. (Plain: the product as tuning records know it.)
        lambda b, h, gb, gi, cc: te.sum(
            weigh(cfac[b, h, gb, chr3, gi], cacc[b, h, gb, chr3, gi, cc]) if exact
            else cacc[b, h, gb, chr3, gi, cc] * cfac[b, h, gb, chr3, gi],
            axis=chr3,
        ),
        name="gacc",
    )
    blk_out = te.compute(
        (B, H, nblk, GB, D), lambda b, h, gb, gi, cc: gacc[b, h, gb, gi, cc] / gden[b, h, gb, gi], name="blk_out"
    )
    blk_lse = te.compute(
        (B, H, nblk, GB), lambda b, h, gb, gi: gmax[b, h, gb, gi] + tirx.log(gden[b, h, gb, gi]), name="blk_lse"
    )
    gout = te.compute(
        (B, H, G, D), lambda b, h, g, cc: blk_out[b, h, div_nonneg(g, GB), mod_nonneg(g, GB), cc].astype(dt), name="out"
    )
    glse = te.compute((B, H, G), lambda b, h, g: blk_lse[b, h, div_nonneg(g, GB), mod_nonneg(g, GB)], name="lse")
    return [qg, kg, vg, gidx, sink, scale, gout, glse]


FORWARD_COMPUTES = {"local": local_attention, "global": global_attention}


__all__ = ["local_attention", "global_attention", "weigh", "product", "FORWARD_COMPUTES"]
