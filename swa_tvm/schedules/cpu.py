"""CPU (llvm) schedules for the computes in ``swa_tvm.compute``: the default, and the
MetaSchedule search space around it.

One function per kernel kind serves both. It asks a ``Knobs`` object for every tunable
decision: ``Defaults`` answers with the hand-picked value (the default schedule, used
when no tuning record applies), ``Sampled`` with a MetaSchedule random variable, so the
same code is the design space ``swa-tvm tune`` searches. Only loops whose extent the
spec fixes (block_q, the padded key band, head_dim) are ever sampled: a tuning record
is measured at one concrete shape and replayed on the symbolic-T kernel, where the
item and row loops have no fixed extent.

The plan for the local kernel: one parallel loop over work items (batch x head x query
block); every stage of an item is computed at that loop so its intermediates (the
Kw x Bq score and probability tiles, the transposed query block) stay in L1/L2; key
and value rows are read straight from k and v. The score product is register-tiled as
key rows x block-row vectors, P·V as block rows x feature vectors over chunks of the
band; max and sum over keys are vertical. The final gathers back to [B,H,T,...] run as
their own parallel loop.

The backward kernels follow the same plan (items of the query- or key-major band in
parallel, every stage at the item loop); their [band, block] products are tiled as
band rows x block vectors, and the [block, D] results as block rows x feature vectors.
The extras' and global rows' gradients run one parallel loop per (batch, head).
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir, tirx
from tvm.s_tir.stmt import SBlock, SBlockRealize
from tvm.sym import Analyzer, IntervalSet

from swa_tvm.compute.cache import CACHE_CHUNK, ROW_MAJOR_BELOW
from swa_tvm.compute.forward import (
    EXTRA_TILE,
    GLOBAL_BLOCK,
    GLOBAL_CHUNK,
    amx_block,
    band_width,
    i64,
    item_key_span,
    unit_band,
)
from swa_tvm.schedules import amx, bf16_dot
from swa_tvm.spec import KernelSpec

# Candidate values of the categorical knobs. Unroll steps feed
# pragma_auto_unroll_max_step on the item loop.
UNROLL_STEPS = (0, 16, 64)


class Defaults:
    """Knobs answered with the hand-picked default: the untuned schedule."""

    def tile(self, sch, loop, extent: int, default: int, max_inner: int) -> int:
        return default if extent % default == 0 else 1

    def choice(self, sch, candidates, default):
        return default

    def split(self, sch, loop, default: list, max_inner: int) -> list:
        return list(default)


class Sampled:
    """Knobs answered with MetaSchedule samples (recorded in the trace)."""

    def tile(self, sch, loop, extent: int, default: int, max_inner: int):
        # A 2-way perfect tile of a fixed-extent loop; only the inner factor is used.
        return sch.sample_perfect_tile(loop, n=2, max_innermost_factor=max_inner)[1]

    def choice(self, sch, candidates, default):
        candidates = list(candidates)
        return sch.sample_categorical(candidates, [1.0 / len(candidates)] * len(candidates))

    def split(self, sch, loop, default: list, max_inner: int) -> list:
        # A perfect tile of a fixed-extent loop into len(default) factors.
        return list(sch.sample_perfect_tile(loop, n=len(default), max_innermost_factor=max_inner))


class DefaultPoint(Sampled):
    """The default schedule as a point of the search space: the same sampling
    instructions as ``Sampled``, each with the default as its decision. ``swa-tvm tune``
    measures it first, so the search starts from the default and a tuned record is
    never one the default beats at the tuning shape."""

    def tile(self, sch, loop, extent: int, default: int, max_inner: int):
        inner = Defaults().tile(sch, loop, extent, default, max_inner)
        return sch.sample_perfect_tile(loop, n=2, max_innermost_factor=max_inner, decision=[extent // inner, inner])[1]

    def choice(self, sch, candidates, default):
        candidates = list(candidates)
        n = len(candidates)
        return sch.sample_categorical(candidates, [1.0 / n] * n, decision=candidates.index(default))

    def split(self, sch, loop, default: list, max_inner: int) -> list:
        return list(sch.sample_perfect_tile(loop, n=len(default), max_innermost_factor=max_inner, decision=default))


def _wide_registers(vector_lanes: int) -> bool:
    """16 float32 lanes (AVX-512): 32 vector registers, which hold register tiles of 16
    accumulators beside their operands; AVX2's 16 registers hold tiles of 8."""
    return vector_lanes >= 16


def _has(sch: s_tir.Schedule, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def _vectorize_inner(sch, loop, lanes):
    sch.vectorize(sch.split(loop, factors=[None, lanes])[1])


def _vertical_reduce(sch, name, lanes, vectorize: bool):
    """A [rows] reduction over the key axis of a key-major [keys, rows] tile: keys
    outside, rows inside as vectors, so max and sum are elementwise vector operations
    (no horizontal reduction, no serial scalar chain)."""
    blk = sch.get_sblock(name)
    rows, keys = sch.get_loops(blk)[-2:]
    sch.reorder(keys, rows)
    if vectorize:
        _vectorize_inner(sch, rows, lanes)
    sch.decompose_reduction(blk, keys)


def _key_row_product(sch, name, rows_extent, cols_extent, lanes, knobs, vector_cols: bool, tiled_rows: bool,
                     key_rows: int = 4):
    """A key-major [keys, rows] product reduced over the feature axis (score = K Q^T):
    register tile of ``key_rows`` key rows x block-row vectors (by default), the feature
    reduction outside it. Keys are the broadcast operand (read straight from k), block
    rows the vectors. Untiled key rows (a runtime key count) take the widest vector tile
    instead: its independent accumulators hide the FMA latency a single key row's chain
    exposes."""
    blk = sch.get_sblock(name)
    k_l, r_l, c_l = sch.get_loops(blk)[-3:]
    widths = _widths(cols_extent, lanes)
    if not (vector_cols and widths):
        sch.reorder(k_l, c_l, r_l)
        sch.decompose_reduction(blk, c_l)
        return
    default = widths[min(1, len(widths) - 1)] if tiled_rows else widths[-1]
    ro, ri = sch.split(r_l, factors=[None, knobs.choice(sch, widths, default)])
    if tiled_rows:
        ko, ki = sch.split(k_l, factors=[None, knobs.tile(sch, k_l, rows_extent, key_rows, 8)])
        sch.reorder(ko, ro, c_l, ki, ri)
        sch.unroll(ki)
    else:
        sch.reorder(k_l, ro, c_l, ri)
    # One vector register per vectorized loop: LLVM keeps a tile of them in registers,
    # while a wider vectorized loop gave code that reloads its accumulators.
    rv, ri = sch.split(ri, factors=[None, lanes])
    sch.unroll(rv)
    sch.vectorize(ri)
    sch.decompose_reduction(blk, c_l)


def _key_vector_product(sch, name):
    """The score product of a row-major chunk ([row, key] reduced over the features),
    after rfactor of its feature vectors: each key row loaded once as feature vectors
    and multiplied into one vector accumulator per row, then summed across lanes."""
    # At the item loop both stages' lane axis (rfactor's) comes first: item, lanes, the
    # unit loops, rows, keys (, the feature vectors of the rfactor stage).
    rf = sch.get_sblock(name + "_rf")
    loops = sch.get_loops(rf)
    ci, (r_l, k_l, co) = loops[1], loops[-3:]
    sch.reorder(k_l, co, r_l, ci)
    sch.unroll(r_l)
    sch.vectorize(ci)
    sch.decompose_reduction(rf, co)
    loops = sch.get_loops(sch.get_sblock(name))
    sch.reorder(loops[-2], loops[-1], loops[1])


def _products_feature_outer(sch, names):
    """[.., key, row] products reduced over the feature axis: the feature loop outside
    the innermost spatial loop, so the row (or key) loop runs along contiguous tiles."""
    for name in names:
        blk = sch.get_sblock(name)
        a, b_, c = sch.get_loops(blk)[-3:]
        sch.reorder(a, c, b_)
        sch.decompose_reduction(blk, c)


def schedule_cache_dq(sch, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    """Items of (batch, KV head, row block), every stage of an item at the item loop;
    then the gather back to [B, H, T_q, D]."""
    knobs = knobs or Defaults()
    _items(sch, ["dq_acc"], ["ds", "prob", "arg", "rpos", "rdil", "capped", "dp", "score", "dg_t", "qg_t", "row_delta",
                             "row_lse"], knobs, depth=3)
    _products_feature_outer(sch, ["score", "dp"])
    _row_tile_product(sch, "dq_acc", spec, vector_lanes)
    _gather_back(sch, ["dq"], spec, vector_lanes)


def schedule_cache_dkv(sch, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    """Items of (batch, KV head, key block), every stage of an item at the item loop
    (the rows' lse and delta before them); then the gathers back to [B, H_kv, T_k, D]."""
    knobs = knobs or Defaults()
    # Roots in reverse program order: the merged loop lands at dk_blk, before dk reads it.
    _items(sch, ["dv_blk", "dk_blk"], ["ds", "prob", "arg", "capped", "dp", "score", "vt", "kt"], knobs, depth=3)
    _row_stages_at_root(sch)
    _products_feature_outer(sch, ["score", "dp"])
    for name in ("dk_blk", "dv_blk"):
        _row_tile_product(sch, name, spec, vector_lanes)
    _gather_back(sch, ["dk", "dv"], spec, vector_lanes)


def _row_stages_at_root(sch) -> None:
    """The rows' positions and dilations (``CacheGeometry.row_stages``) made once, in
    parallel over (batch, KV head, row block), where several items read each row."""
    for name in ("rpos", "rdil"):
        if _has(sch, name):
            loops = sch.get_loops(sch.get_sblock(name))
            sch.parallel(sch.fuse(*loops[:3]))


def schedule_cache_dx(sch, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    """Items of (batch, KV head): the sink slots against every row."""
    knobs = knobs or Defaults()
    _items(sch, ["dvx", "dkx_acc"], ["ds", "prob", "arg", "capped", "dp", "score"], knobs, depth=2)  # lands before dkx
    for name in ("dkx_acc", "dvx"):
        _row_reduce_product(sch, name, spec, vector_lanes)
    _gather_back(sch, ["dkx"], spec, vector_lanes)


def _inline_unless(sch, names, keep: bool) -> list[str]:
    """The gather stages ``names`` inlined into their consumers, or, with ``keep``,
    returned to be computed per item."""
    if keep:
        return list(names)
    for name in names:
        sch.compute_inline(sch.get_sblock(name))
    return []


def _band_rows(sch, spec: KernelSpec, names) -> list[str]:
    """The band gathers ``names`` (rows of the inputs that a product reads many times)
    that are computed per item: none for float32, whose products read the rows straight
    from the inputs (they are inlined here), nor for the local forward, which reads
    float32 copies of 16-bit k and v made once per call (``kconv``, ``vconv``); all for
    the gradients' 16-bit inputs of a bounded window, converted to float32 once per item
    into a buffer of the item. Read in place, every use of a 16-bit value took its own
    conversion: three extra instructions per broadcast key, which made bfloat16 slower
    than float32 on CPUs without a matrix engine. An unbounded window's band is the
    whole sequence, so it stays in place."""
    converts = spec.dtype in ("bfloat16", "float16") and spec.left >= 0 and spec.right >= 0
    # The local forward converts k and v once per call instead (compute.forward.convert_once).
    return _inline_unless(sch, names, converts and not _has(sch, "kconv"))


# Rows per run of the parallel loop of a whole-tensor conversion (kconv, vconv).
CONVERT_RUN = 64


def _converted_copies(sch, names, spec: KernelSpec, vector_lanes: int) -> None:
    """The whole-tensor float32 copies ``names`` (compute.forward.convert_once), each its
    own parallel loop over runs of rows, vectorized along the head dim."""
    for name in names:
        if not _has(sch, name):
            continue
        b, h, t, c = sch.get_loops(sch.get_sblock(name))
        to, _ = sch.split(t, factors=[None, CONVERT_RUN])
        sch.parallel(sch.fuse(b, h, to))
        _vectorize_inner(sch, c, _largest_divisor_upto(spec.head_dim, vector_lanes))


def _vectorize_rows(sch, names, spec: KernelSpec, vector_lanes: int) -> None:
    """The per-item band gathers ``names`` (``_band_rows``) vectorized along the head dim."""
    for name in names:
        lanes = _largest_divisor_upto(spec.head_dim, vector_lanes)
        _vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], lanes)


def _largest_divisor_upto(n: int, cap: int) -> int:
    return max(x for x in range(1, min(n, cap) + 1) if n % x == 0)


def _row_runs(sch, loops, runs: int | None):
    """Fuse (batch, head, row) loops into one parallel-ready loop; with ``runs``, of runs
    of that many rows (the rows of a run an inner loop), so the fused index is divided
    back into batch, head and row (by runtime extents) once per run, not once per row."""
    if runs is None:
        return sch.fuse(*loops), None
    b, h, i = loops
    io, ii = sch.split(i, factors=[None, runs])
    return sch.fuse(b, h, io), ii


# Rows per run of the matrix-engine form's result gathers (``_row_runs``).
AMX_GATHER_RUN = 16


def _local_forward_loops(sch, spec: KernelSpec, vector_lanes: int, runs: int | None = None):
    """The local forward's two parallel loops: the gathers back to [B,H,T,(D)], merged
    into one loop over rows (over runs of ``runs`` rows, ``_row_runs``), and the item
    loop of blk_out and blk_lse (they share every producer, so their item loops are
    merged before the producers are computed at it). Returns the item loop."""
    out = sch.get_sblock("out")
    b, h, i, cc = sch.get_loops(out)
    row, _ = _row_runs(sch, [b, h, i], runs)
    if spec.head_dim % vector_lanes == 0:
        _vectorize_inner(sch, cc, vector_lanes)
    row_lse, _ = _row_runs(sch, sch.get_loops(sch.get_sblock("lse")), runs)
    sch.parallel(sch.merge(row, row_lse))

    root = sch.get_sblock("blk_out")
    b, h, beta, qi, cc = sch.get_loops(root)
    item = sch.fuse(b, h, beta)
    lse_blk = sch.get_sblock("blk_lse")
    b2, h2, beta2, _ = sch.get_loops(lse_blk)
    item = sch.merge(item, sch.fuse(b2, h2, beta2))
    if spec.head_dim % vector_lanes == 0:
        _vectorize_inner(sch, cc, vector_lanes)
    return item


def schedule_local(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    knobs = knobs or Defaults()
    # masked/rowmax/denom stay materialized per item: each feeds an exp polynomial that
    # repeats its argument, and the mask is then evaluated once, not twice.
    # Gathers back to [B,H,T,(D)], merged into one parallel loop over rows. `merge` puts
    # the merged loop where the last of its loops was and does not check dataflow, so
    # the gathers are merged first (landing after both item stages) and the item
    # stages second (landing before the gathers).
    item = _local_forward_loops(sch, spec, vector_lanes)

    # Key and value rows: read straight from k and v, or converted once per item from
    # 16-bit inputs (``_band_rows``).
    bounded = spec.left >= 0 and spec.right >= 0
    # Producers of blk_out, innermost first so each compute_at finds its consumer placed.
    order = ["denom", "wacc", "xacc", "wsum", "xsum", "wprob", "xprob", "rowmax", "wmax", "xmax"]
    order += ["masked", "xmasked", "krange", "score", "xscore", "qblk_t"]
    bands = _band_rows(sch, spec, ("kband", "vband"))
    _stages_at(sch, item, order + bands, knobs)
    _vectorize_rows(sch, bands, spec, vector_lanes)
    _converted_copies(sch, ("kconv", "vconv"), spec, vector_lanes)

    rows_vec = spec.block_q % vector_lanes == 0
    # Query block, transposed: walk rows outside and features inside (contiguous loads).
    blk = sch.get_sblock("qblk_t")
    cc_l, qi_l = sch.get_loops(blk)[-2:]
    sch.reorder(qi_l, cc_l)

    # With 32 vector registers (AVX-512), the band's two products take register tiles of
    # 16 accumulators: twice the FMAs per broadcast and per value row's index (clamped
    # to the sequence) than the 8-accumulator tiles that 16-register AVX2 is held to.
    wide = _wide_registers(vector_lanes)
    if bounded:
        kw = band_width(spec.block_q, spec.left, spec.right)
        _key_row_product(sch, "score", kw, spec.block_q, vector_lanes, knobs, rows_vec, True, 8 if wide else 4)
    else:
        _key_row_product(sch, "score", None, spec.block_q, vector_lanes, knobs, rows_vec, False)
    if _has(sch, "xscore"):
        # The extras' axis is a runtime multiple of EXTRA_TILE: tiled by it exactly.
        _key_row_product(sch, "xscore", EXTRA_TILE, spec.block_q, vector_lanes, Defaults(), rows_vec, True)
    # Mask and probability tiles: elementwise, vectorized along block rows.
    if rows_vec:
        for name in ("masked", "wprob", "xmasked", "xprob"):
            if _has(sch, name):
                _vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], vector_lanes)
    for name in ("wmax", "wsum", "xmax", "xsum"):
        if _has(sch, name):
            _vertical_reduce(sch, name, vector_lanes, rows_vec)
    # P @ V for the band and the extras (the extras' product, E keys, E small and
    # runtime, keeps the default tiles). The band's keys are walked in chunks (all
    # tiles of one chunk, then the next), so a chunk's value rows (chunk x D) and
    # probabilities stay in L1 while every tile uses them.
    for name in ("wacc", "xacc"):
        if _has(sch, name):
            kw = band_width(spec.block_q, spec.left, spec.right) if name == "wacc" and bounded else None
            k = knobs if name == "wacc" else Defaults()
            _prob_value_product(sch, name, spec.block_q, spec.head_dim, vector_lanes, k, kw, wide and name == "wacc")


# Slots per run of the residue copies' parallel loop.
AMX_COPY_RUN = 64


def _amx_residue_copies(sch, spec: KernelSpec, rows, cols) -> None:
    """The residue-major copies of the matrix-engine form (``compute.forward.ResidueCopies``),
    each its own parallel loop: ``rows`` vectorized along the head dim; the transposes
    of ``cols`` in 32 x 32 blocks, so their reads and writes both stay within a few pages,
    the inner loop unrolled (vectorized, it became 16-bit gathers)."""
    for name in rows:
        b, h, r, p, c = sch.get_loops(sch.get_sblock(name))
        # Parallel over runs of slots: the fused index is divided back (by runtime
        # extents) once per run, not once per slot.
        po, _ = sch.split(p, factors=[None, AMX_COPY_RUN])
        sch.parallel(sch.fuse(b, h, r, po))
        _vectorize_inner(sch, c, min(spec.head_dim, 32))
    for name in cols:
        b, h, r, c, p = sch.get_loops(sch.get_sblock(name + "_t"))
        po, pi = sch.split(p, factors=[None, 32])
        co, ci = sch.split(c, factors=[None, 32])
        sch.reorder(po, co, ci, pi)
        sch.parallel(sch.fuse(b, h, r, po))
        sch.unroll(pi)


def _amx_bands(sch, spec: KernelSpec, names) -> list[str]:
    """The item band copies ``names`` of the matrix-engine form that are computed per
    item. Under dilation 1 alone (max_dilation 1) an item's band is a slice of the
    residue copy at an offset affine in the item (``compute.forward.Band``, ``unit``),
    so the copies are inlined and the tile loads read the residue copy in place; under
    a runtime dilation the offset is read from the item table, which a tensorized block
    cannot take, so each item copies its band."""
    return _inline_unless(sch, names, not unit_band(spec, amx=True))


def _amx_item_stages(sch, spec: KernelSpec, products, band_rows, band_cols, words, elementwise, vector_lanes,
                     engine: str) -> None:
    """An item's matrix-engine stages, once they are at the item loop: each product of
    ``products`` tensorized whole into one intrinsic call of ``engine`` (MATRIX_ENGINES;
    the shapes are the stages' own); the band copies that are made (``_amx_bands``)
    vectorized along their rows; the block pair words walked rows outside; the elementwise stages two
    vectors at a time along the block."""
    for name in products:
        blk = sch.get_sblock(name)
        m, n, k2 = (int(iv.dom.extent) for iv in sch.get(blk).iter_vars[-4:-1])  # [.., M, N, K/2, 2]
        sch.tensorize(sch.get_loops(blk)[-4], MATRIX_ENGINES[engine](m, n, 2 * k2))
    for name in band_rows:
        if _has(sch, name):
            _vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], min(spec.head_dim, 32))
    for name in band_cols:
        if _has(sch, name):
            _vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], 32)
    for name in words:
        c2_l, i_l = sch.get_loops(sch.get_sblock(name))[-2:]
        sch.reorder(i_l, c2_l)
    for name in elementwise:
        if _has(sch, name):
            _vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], 2 * vector_lanes)


def schedule_local_amx(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 16, knobs=None,
                       engine: str = "amx") -> None:
    """The matrix-engine form of the local kernel (``compute.forward``, ``amx=True``):
    the plan of ``schedule_local``, with each item's two products tensorized whole into
    one call of an ``engine`` intrinsic (``schedules.amx``, ``schedules.bf16_dot``): the
    scores [band, block] over the head dim, P·V^T [D, block] over the band. The
    residue-major copies of k and v are made first, in parallel over their rows; the
    softmax between the products stays float32 vectors along the block rows."""
    knobs = knobs or Defaults()
    block = amx_block(spec)
    _amx_residue_copies(sch, spec, ["kres", "vres"], ["vres"])

    item = _local_forward_loops(sch, spec, vector_lanes, AMX_GATHER_RUN)
    order = ["denom", "wacc_t", "xacc", "wsum", "xsum", "pword", "wprob", "xprob", "rowmax", "wmax", "xmax"]
    order += ["masked", "xmasked", "krange", "score", "xscore", "qword", "qblk_t"]
    order += _amx_bands(sch, spec, ["kband", "vband_t"])
    _stages_at(sch, item, order, knobs)

    # The band's max and sum follow each row of masked scores and probabilities as it is
    # made (reverse_compute_at), instead of a pass of their own over the [band, block] tile.
    for prod, red in (("masked", "wmax"), ("wprob", "wsum")):
        sch.reverse_compute_at(sch.get_sblock(red), sch.get_loops(sch.get_sblock(prod))[-2])
    _amx_item_stages(sch, spec, AMX_PRODUCTS["local"], ["kband"], ["vband_t"], ["qword"],
                     ["masked", "wprob", "pword", "xmasked", "xprob", "wmax", "wsum"], vector_lanes, engine)
    for name in ("xmax", "xsum"):
        if _has(sch, name):
            _vertical_reduce(sch, name, vector_lanes, True)
    if _has(sch, "xscore"):
        blk = sch.get_sblock("qblk_t")
        cc_l, qi_l = sch.get_loops(blk)[-2:]
        sch.reorder(qi_l, cc_l)
        _key_row_product(sch, "xscore", EXTRA_TILE, block, vector_lanes, Defaults(), True, True)
        _prob_value_product(sch, "xacc", block, spec.head_dim, vector_lanes, Defaults(), None)


def schedule_local_dq_amx(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 16, knobs=None,
                          engine: str = "amx") -> None:
    """The matrix-engine form of dq (``compute.backward.local_dq``, ``amx=True``): the
    plan of ``schedule_local_dq`` with its three products tensorized (scores and dP
    [band, block] over the head dim, dQ^T [D, block] over the band)."""
    knobs = knobs or Defaults()
    _amx_residue_copies(sch, spec, ["kres", "vres"], ["kres"])
    _gather_back(sch, ["dq"], spec, vector_lanes, AMX_GATHER_RUN)
    per_item = ["dqx", "dq_t", "xds", "dsword", "ds", "xarg", "arg", "krange", "xdp", "xscore", "dp", "score"]
    per_item += ["rstat", "dblk_t", "qblk_t", "dword", "qword"] + _amx_bands(sch, spec, ["kband", "kband_t", "vband"])
    _items(sch, ["dq_blk"], per_item, knobs)
    _vectorize_inner(sch, sch.get_loops(sch.get_sblock("dq_blk"))[-1], vector_lanes)
    _amx_item_stages(sch, spec, AMX_PRODUCTS["local_dq"], ["kband", "vband"], ["kband_t"], ["qword", "dword"],
                     ["arg", "ds", "dsword", "xarg", "xds"], vector_lanes, engine)
    if _has(sch, "dqx"):
        _block_feature_product(sch, "dqx", dataclasses.replace(spec, block_q=amx_block(spec)), vector_lanes, knobs)
        for name in ("xscore", "xdp"):
            blk = sch.get_sblock(name)
            qi, c = sch.get_loops(blk)[-2:]
            sch.reorder(c, qi)


def schedule_local_dkv_amx(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 16, knobs=None,
                           engine: str = "amx") -> None:
    """The matrix-engine form of dk, dv (``compute.backward.local_dkv``, ``amx=True``): the
    plan of ``schedule_local_dkv`` with its four products tensorized (scores and dP
    [band, block] over the head dim, dV^T and dK^T [D, block] over the band)."""
    knobs = knobs or Defaults()
    _amx_residue_copies(sch, spec, ["qres", "dres"], ["qres", "dres"])
    _gather_back(sch, ["dk", "dv"], spec, vector_lanes, AMX_GATHER_RUN)
    per_item = ["dsword", "pword", "ds", "prob", "arg", "krange", "dp", "score", "bstat", "vword", "kword"]
    per_item += _amx_bands(sch, spec, ["qband", "qband_t", "dband", "dband_t"])
    _items(sch, ["dk_t", "dv_t"], per_item, knobs)  # program order: the TE makes dk_t first
    _amx_item_stages(sch, spec, AMX_PRODUCTS["local_dkv"], ["qband", "dband"], ["qband_t", "dband_t"],
                     ["kword", "vword"], ["arg", "prob", "ds", "pword", "dsword"], vector_lanes, engine)


def schedule_cache_amx(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 16, knobs=None,
                       engine: str = "amx") -> None:
    """The matrix-engine form of the KV-cache kernel (``compute.cache``, ``amx=True``):
    the plan of ``schedule_cache`` with each chunk's two products tensorized whole into
    one call of an ``engine`` intrinsic: the scores [key, row] over the head dim, P·V^T
    [feature, row] over the chunk's keys. The block's query pair words are made once
    per block, in parallel over the blocks; each chunk gathers its key and value bits."""
    knobs = knobs or Defaults()
    _split_k_combine(sch, spec, vector_lanes)  # gacc [feature, row]: its sums along the rows
    _vectorize_inner(sch, sch.get_loops(sch.get_sblock("blk_out"))[-1], vector_lanes)
    qword = sch.get_sblock("qword")
    b, h, blk, c2, ri = sch.get_loops(qword)
    sch.reorder(ri, c2)
    sch.parallel(sch.fuse(b, h, blk))
    per_item = ["pword", "vbits_t", "vbits", "cprob", "cref", "gmasked", "rpos", "rdil", "capped", "gscore", "kbits"]
    _items(sch, ["cmax", "csum", "cacc_t"], per_item, knobs, depth=4)
    _amx_item_stages(sch, spec, AMX_PRODUCTS["cache"], ["kbits", "vbits"], ["vbits_t"], [],
                     ["gmasked", "capped", "cprob", "cref", "pword"], vector_lanes, engine)
    for name in ("cmax", "csum"):
        _vertical_reduce(sch, name, vector_lanes, True)


# The engines of the matrix-engine form's products, each a registry of tensor intrinsics
# of the same descriptions: AMX tiles, or AVX-512 BF16 dot products in registers.
MATRIX_ENGINES = {"amx": amx.register, "bf16_dot": bf16_dot.register}
AMX_SCHEDULES = {"local": schedule_local_amx, "local_dq": schedule_local_dq_amx, "local_dkv": schedule_local_dkv_amx,
                 "cache": schedule_cache_amx}
# The products each matrix-engine kernel tensorizes (compute.forward.matrix_product stages).
AMX_PRODUCTS = {"local": ("score", "wacc_t"), "local_dq": ("score", "dp", "dq_t"),
                "local_dkv": ("score", "dp", "dv_t", "dk_t"), "cache": ("gscore", "cacc_t")}


def _prob_value_product(sch, name, rows: int, head_dim: int, vector_lanes: int, knobs, keys: int | None,
                        widest: bool = False):
    """[rows, D] = sum over keys of P[key, row] * V[key, D] (P·V): register tile of
    rows x feature vectors (by default 2 vectors, or all of D's with ``widest``), the
    reduction over keys outside the tile; value rows come straight from v. With ``keys``
    (a fixed key extent) the keys are walked in chunks."""
    widths = _widths(head_dim, vector_lanes)
    blk = sch.get_sblock(name)
    qi_l, c_l, kr = sch.get_loops(blk)[-3:]
    qo, qi_in = sch.split(qi_l, factors=[None, knobs.tile(sch, qi_l, rows, 4, 4)])
    tiles = [qo]
    if widths:
        default = widths[-1] if widest else widths[min(1, len(widths) - 1)]
        co, ci = sch.split(c_l, factors=[None, knobs.choice(sch, widths, default)])
        tiles.append(co)
    else:
        ci = c_l
    if keys is not None:
        kro, kri = sch.split(kr, factors=[None, knobs.tile(sch, kr, keys, _largest_divisor_upto(keys, 96), 136)])
        sch.reorder(kro, *tiles, kri, qi_in, ci)
        kr = kro
    else:
        sch.reorder(*tiles, kr, qi_in, ci)
    sch.unroll(qi_in)
    sch.vectorize(ci)
    sch.decompose_reduction(blk, kr)


def schedule_global(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    """Items of (batch, head, global-row block, key chunk) in parallel, every stage of
    an item at the item loop, tiled as the local kernel's (key rows x block-row vectors
    for the scores, block rows x feature vectors for P·V, vertical max and sum); then
    the per-block combine over chunks, then the gathers back to [B, H, G, ...]."""
    _schedule_split_k(sch, spec, GLOBAL_BLOCK, GLOBAL_CHUNK, vector_lanes, knobs, row_major=False)


def schedule_cache(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    """The KV-cache kernel (``compute.cache``) has the global rows' split-K stages, per
    (batch, KV head, row block, key chunk): the same plan."""
    _schedule_split_k(sch, spec, spec.block_q, CACHE_CHUNK, vector_lanes, knobs,
                      row_major=spec.block_q < ROW_MAJOR_BELOW)


def _split_k_combine(sch, spec: KernelSpec, vector_lanes: int) -> None:
    """The split-K kernels' end (global rows, KV cache, either form): the gathers of out
    and lse in one parallel loop over rows; the combine in one loop over (batch, head,
    block), the chunk rescaling at it."""
    out = sch.get_sblock("out")
    b, h, g, cc = sch.get_loops(out)
    row = sch.fuse(b, h, g)
    if spec.head_dim % vector_lanes == 0:
        _vectorize_inner(sch, cc, vector_lanes)
    sch.parallel(sch.merge(row, sch.fuse(*sch.get_loops(sch.get_sblock("lse")))))
    _items(sch, ["blk_out", "blk_lse"], ["gden", "gacc", "gsum", "cfac", "gref", "gmax", "gmax0"], Defaults(), depth=3)
    _row_reduce_product(sch, "gacc", spec, vector_lanes)


def _schedule_split_k(sch, spec: KernelSpec, block: int, chunk: int, vector_lanes: int, knobs,
                      row_major: bool) -> None:
    """``row_major``: the chunk's [key, row] tiles are laid out [row, key] (the cache
    kernel's small blocks, ``compute.cache.ROW_MAJOR_BELOW``): keys in vectors, and the
    score product's features in vectors (rfactor), where rows as vectors would leave a
    decode step's few rows scalar."""
    knobs = knobs or Defaults()
    _split_k_combine(sch, spec, vector_lanes)
    # Items: (batch, head, block, chunk). The chunk's max, sum and P·V are all read by
    # the combine, so all three are roots of the item loop (compute_at needs every
    # consumer of a stage under the loop).
    rows_vec = not row_major and block % vector_lanes == 0
    feature_vectors = row_major and spec.head_dim % vector_lanes == 0
    if feature_vectors:  # before the item loop takes the stage: rfactor wants its own loop nest
        blk = sch.get_sblock("gscore")
        _, ci = sch.split(sch.get_loops(blk)[-1], factors=[None, vector_lanes])
        sch.rfactor(ci, factor_axis=len(sch.get(blk).iter_vars) - 1)
    _items(sch, ["cmax", "csum", "cacc"], ["cprob", "cref", "gmasked", "capped", "gscore", "gscore_rf", "qg_t"], knobs, depth=4)
    if not row_major:
        blk = sch.get_sblock("qg_t")
        cc_l, gi_l = sch.get_loops(blk)[-2:]
        sch.reorder(gi_l, cc_l)
    if feature_vectors:
        _key_vector_product(sch, "gscore")
    else:
        _key_row_product(sch, "gscore", chunk, block, vector_lanes, knobs, rows_vec, True)
    if row_major:
        for name in ("gmasked", "capped", "cprob"):
            if chunk % vector_lanes == 0 and _has(sch, name):
                _vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], vector_lanes)
    else:
        _vectorize_block_axis(sch, ["gmasked", "capped", "cprob", "cref"], block, vector_lanes)
        for name in ("cmax", "csum"):
            _vertical_reduce(sch, name, vector_lanes, rows_vec)
    _prob_value_product(sch, "cacc", block, spec.head_dim, vector_lanes, knobs, None)


# --------------------------------------------------------------------------- backward


def _widths(extent: int, vector_lanes: int) -> list[int]:
    """Vector widths (1, 2 or 4 registers) that divide a fixed extent."""
    return [w for w in (vector_lanes, 2 * vector_lanes, 4 * vector_lanes) if extent % w == 0]


def _band_block_product(sch, name, spec, vector_lanes, knobs, bounded):
    """A [band, block] product reduced over the feature axis: register tile of band
    rows x block vector(s), the reduction outside the tile. With 32 vector registers
    (16 lanes: AVX-512) the default tile has 16 accumulators, else 8."""
    blk = sch.get_sblock(name)
    r_l, b_l, c_l = sch.get_loops(blk)[-3:]
    widths = _widths(spec.block_q, vector_lanes)
    if not (bounded and widths):
        sch.reorder(c_l, b_l)
        return
    r_in = knobs.tile(sch, r_l, band_width(spec.block_q, spec.left, spec.right), 8 if _wide_registers(vector_lanes) else 4,
                      8)
    ro, ri = sch.split(r_l, factors=[None, r_in])
    bo, bi = sch.split(b_l, factors=[None, knobs.choice(sch, widths, widths[min(1, len(widths) - 1)])])
    sch.reorder(ro, bo, c_l, ri, bi)
    sch.unroll(ri)
    sch.vectorize(bi)
    sch.decompose_reduction(blk, c_l)


def _block_feature_product(sch, name, spec, vector_lanes, knobs):
    """[block, D] = sum over the band of [band, block] x [band, D]: register tile of
    block rows x feature vector(s), the reduction over the band outside the tile; by
    default 4 rows with 32 vector registers (AVX-512), else 2."""
    blk = sch.get_sblock(name)
    q_l, c_l, kr = sch.get_loops(blk)[-3:]
    rows = 4 if _wide_registers(vector_lanes) else 2
    qo, qi_in = sch.split(q_l, factors=[None, knobs.tile(sch, q_l, spec.block_q, rows, 4)])
    widths = _widths(spec.head_dim, vector_lanes)
    if widths:
        co, ci = sch.split(c_l, factors=[None, knobs.choice(sch, widths, widths[-1])])
        sch.reorder(qo, co, kr, qi_in, ci)
        sch.vectorize(ci)
    else:
        sch.reorder(qo, kr, qi_in, c_l)
    sch.unroll(qi_in)
    sch.decompose_reduction(blk, kr)


def _items(sch, roots, per_item, knobs, depth: int = 3):
    """Merge the item loops (the ``depth`` outer loops: batch x head x item) of
    ``roots`` (in program order: the merged loop lands where the last one was, and merge
    does not check dataflow), compute every stage of ``per_item`` at it (innermost
    consumer first), parallel."""
    item = None
    for r in roots:
        loops = sch.get_loops(sch.get_sblock(r))
        fused = sch.fuse(*loops[:depth])
        item = fused if item is None else sch.merge(item, fused)
    _stages_at(sch, item, per_item, knobs)
    return item


def _stages_at(sch, item, names, knobs) -> None:
    """Compute each stage of ``names`` (innermost consumer first, so each finds its
    consumers placed) at the item loop, and run that loop in parallel."""
    for name in names:
        if _has(sch, name):
            sch.compute_at(sch.get_sblock(name), item, preserve_unit_loops=True)
    sch.parallel(item)
    sch.annotate(item, "pragma_auto_unroll_max_step", knobs.choice(sch, UNROLL_STEPS, 0))
    sch.annotate(item, "pragma_unroll_explicit", 1)


def _gather_back(sch, names, spec, vector_lanes, runs: int | None = None):
    """The final [B,H,T,D] gathers, merged into one parallel loop over rows (over runs
    of ``runs`` rows, ``_row_runs``)."""
    row = None
    for name in names:
        loops = sch.get_loops(sch.get_sblock(name))
        if spec.head_dim % vector_lanes == 0:
            _vectorize_inner(sch, loops[-1], vector_lanes)
        fused, _ = _row_runs(sch, loops[:3], runs)
        row = fused if row is None else sch.merge(row, fused)
    sch.parallel(row)


def _vectorize_block_axis(sch, names, block: int, vector_lanes):
    if block % vector_lanes:
        return
    for name in names:
        if _has(sch, name):
            _vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], vector_lanes)


def schedule_local_dq(sch, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    knobs = knobs or Defaults()
    bounded = spec.left >= 0 and spec.right >= 0
    _gather_back(sch, ["dq"], spec, vector_lanes)
    per_item = ["dqx", "dqw", "xds", "ds", "xarg", "arg", "krange", "xdp", "xscore", "dp", "score"]
    per_item += ["rstat", "dblk_t", "qblk_t"]
    # Key and value rows: read straight from k and v, or converted once per item from
    # 16-bit inputs (``_band_rows``).
    bands = _band_rows(sch, spec, ("kband", "vband"))
    _items(sch, ["dq_blk"], per_item + bands, knobs)
    _vectorize_rows(sch, bands, spec, vector_lanes)
    if spec.head_dim % vector_lanes == 0:
        _vectorize_inner(sch, sch.get_loops(sch.get_sblock("dq_blk"))[-1], vector_lanes)
    for name in ("score", "dp"):
        _band_block_product(sch, name, spec, vector_lanes, knobs, bounded)
    _vectorize_block_axis(sch, ["arg", "ds", "xarg", "xds"], spec.block_q, vector_lanes)
    _block_feature_product(sch, "dqw", spec, vector_lanes, knobs)
    if _has(sch, "dqx"):
        _block_feature_product(sch, "dqx", spec, vector_lanes, knobs)
        for name in ("xscore", "xdp"):
            blk = sch.get_sblock(name)
            qi, c = sch.get_loops(blk)[-2:]
            sch.reorder(c, qi)


def schedule_local_dkv(sch, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    knobs = knobs or Defaults()
    bounded = spec.left >= 0 and spec.right >= 0
    _gather_back(sch, ["dk", "dv"], spec, vector_lanes)
    per_item = ["ds", "prob", "arg", "krange", "dp", "score", "bstat", "vblk_t", "kblk_t"]
    # Query and output-gradient rows: read straight from q and dout, or converted once
    # per item from 16-bit inputs (``_band_rows``).
    bands = _band_rows(sch, spec, ("qband", "dband"))
    _items(sch, ["dv_blk", "dk_blk"], per_item + bands, knobs)
    _vectorize_rows(sch, bands, spec, vector_lanes)
    for name in ("score", "dp"):
        _band_block_product(sch, name, spec, vector_lanes, knobs, bounded)
    _vectorize_block_axis(sch, ["arg", "prob", "ds"], spec.block_q, vector_lanes)
    for name in ("dv_blk", "dk_blk"):
        _block_feature_product(sch, name, spec, vector_lanes, knobs)


def _per_head(sch, roots, per_head, knobs):
    """Merge the (batch x head) loops of ``roots``, compute ``per_head`` at it, parallel.
    ``roots`` go in program order: the merged loop lands where the last one was."""
    bh = None
    for r in roots:
        loops = sch.get_loops(sch.get_sblock(r))
        fused = sch.fuse(*loops[:2])
        bh = fused if bh is None else sch.merge(bh, fused)
    for name in per_head:
        sch.compute_at(sch.get_sblock(name), bh, preserve_unit_loops=True)
    sch.parallel(bh)
    sch.annotate(bh, "pragma_auto_unroll_max_step", knobs.choice(sch, UNROLL_STEPS, 0))
    sch.annotate(bh, "pragma_unroll_explicit", 1)


def _row_tile_product(sch, name, spec, vector_lanes):
    """[rows, D] reduced over the trailing reduction axes (the KV-cache gradients' dq,
    dk and dv sums): a register tile of several rows by every feature vector of D, the
    reductions outside it, so each operand row the sum reads (a key row for dq, a query
    or dout row for dk and dv) is loaded once for the tile's rows, not once per row. As
    ``_row_reduce_product`` where D's vectors alone fill the registers."""
    blk = sch.get_sblock(name)
    nred = sum(1 for iv in sch.get(blk).iter_vars if iv.iter_type == 2)  # IterVar.CommReduce
    loops = sch.get_loops(blk)
    r_l, c_l, red = loops[-nred - 2], loops[-nred - 1], loops[-nred:]
    vectors = spec.head_dim // vector_lanes
    budget = 16 if _wide_registers(vector_lanes) else 8
    extent = sch.get(r_l).extent
    extent = int(extent) if isinstance(extent, (int, tirx.IntImm)) else 1
    rows = next((r for r in (4, 2) if r * vectors <= budget and extent % r == 0), 1)
    if spec.head_dim % vector_lanes or rows == 1:
        _row_reduce_product(sch, name, spec, vector_lanes)
        return
    ro, ri = sch.split(r_l, factors=[None, rows])
    co, ci = sch.split(c_l, factors=[None, vector_lanes])
    sch.reorder(ro, *red, ri, co, ci)
    sch.unroll(ri)
    sch.unroll(co)
    sch.vectorize(ci)
    sch.decompose_reduction(blk, red[0])


def _row_reduce_product(sch, name, spec, vector_lanes):
    """[rows, D] = sum over r of [r, rows] x [r, D] with a runtime-length r (or over
    several reduction axes): the feature axis vectorized innermost, the reductions
    outside it."""
    blk = sch.get_sblock(name)
    nred = sum(1 for iv in sch.get(blk).iter_vars if iv.iter_type == 2)  # IterVar.CommReduce
    loops = sch.get_loops(blk)
    c_l, red = loops[-nred - 1], loops[-nred:]
    sch.reorder(*red, c_l)
    if spec.head_dim % vector_lanes == 0:
        _vectorize_inner(sch, c_l, vector_lanes)
    sch.decompose_reduction(blk, red[0])


def schedule_local_dx(sch, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    knobs = knobs or Defaults()
    per_head = ["dv_extra_acc", "dk_extra_acc", "ds", "prob", "arg", "dp", "score", "xv_t", "xk_t"]
    _per_head(sch, ["dk_extra", "dv_extra"], per_head, knobs)
    for name in ("dv_extra_acc", "dk_extra_acc"):
        _row_reduce_product(sch, name, spec, vector_lanes)
    for name in ("score", "dp"):
        blk = sch.get_sblock(name)
        e, c = sch.get_loops(blk)[-2:]
        sch.reorder(c, e)


def schedule_global_bwd(sch, spec: KernelSpec, vector_lanes: int = 8, knobs=None) -> None:
    knobs = knobs or Defaults()
    per_head = ["dq_global_acc", "dk_global_acc", "dv_global_acc", "gds", "gprob", "garg", "gdp", "gscore", "dg_t", "qg_t"]
    _per_head(sch, ["dq_global", "dk_global", "dv_global"], per_head, knobs)
    for name in ("dq_global_acc", "dk_global_acc", "dv_global_acc"):
        _row_reduce_product(sch, name, spec, vector_lanes)
    for name in ("gscore", "gdp"):
        blk = sch.get_sblock(name)
        g, c = sch.get_loops(blk)[-2:]
        sch.reorder(c, g)


# --------------------------------------------------------------- after any schedule


def _guard_key_loop(func, block: str, key_axis: int, span_of):
    """Wrap the body of the outermost loop that walks band keys of ``block`` in a test
    that the keys of that iteration meet the item's span (``span_of(iter_values)`` ->
    (first, last)); iterations whose keys no row sees are skipped. The keys of one
    iteration are ``iter_values[key_axis]`` over the loops inside it, a contiguous
    range for the splits these schedules make (bounds from the analyzer)."""
    found = {}

    def find(stmt, loops):
        if isinstance(stmt, tirx.SeqStmt):
            for x in stmt.seq:
                find(x, loops)
        elif isinstance(stmt, tirx.For):
            find(stmt.body, loops + [stmt])
        elif isinstance(stmt, SBlockRealize):
            if stmt.block.name_hint == block:
                found["loops"], found["iv"] = loops, list(stmt.iter_values)
            else:
                find(stmt.block.body, loops)

    find(func.body, [])
    if not found:
        raise ValueError(f"no block {block!r} in the scheduled kernel to guard")
    key = found["iv"][key_axis]
    used = tirx.analysis.undefined_vars(key)
    key_loops = [lp for lp in found["loops"] if any(lp.loop_var.same_as(v) for v in used)]
    if not key_loops:
        raise ValueError(f"block {block!r}: no loop walks its key axis")
    outer, inner = key_loops[0], key_loops[1:]
    dom = {lp.loop_var: IntervalSet(lp.min, lp.min + lp.extent - 1) for lp in inner}
    keys = Analyzer().int_set(key, dom)
    first, last = span_of(found["iv"])
    live = tirx.all(keys.max_value >= first, keys.min_value <= last)

    def guard(loop, body):
        return tirx.IfThenElse(live, body, None) if loop.same_as(outer) else body

    return func.with_body(_rebuild(func.body, loop_body=guard))


def skip_dead_keys(func, spec: KernelSpec):
    """A scheduled local kernel (default or replayed record) that skips band keys no row
    of the item sees: before position 0 or past the end, up to left/(left + block_q)
    of a band at the start of a sequence. The score product and P·V test once per
    iteration of their outer key loop. Exact: those scores are masked to -inf by a
    select (an unwritten score is never used) and their probabilities are 0."""
    q = next(p for p in func.params if p.name == "q")
    dil = next(p for p in func.params if p.name == "dilation")

    def span_of(iv):  # iter values: b, h, beta, ...
        return item_key_span(spec.left, spec.right, spec.block_q, q.shape[2], i64(dil[iv[1]]), iv[2])

    func = _guard_key_loop(func, "score_update", 3, span_of)  # b, h, beta, kj, qi, c
    return _guard_key_loop(func, "wacc_update", 5, span_of)  # b, h, beta, qi, cc, kr


def drop_init(func, products):
    """A scheduled matrix-engine kernel without the zero init of its tensorized products
    (``AMX_PRODUCTS`` of its kind; the blocks ``<product>_o`` that tensorize leaves): their
    intrinsic (schedules.amx) computes the whole product from zeroed tiles and writes
    every element, so the init is a pass of stores whose values are never read."""
    blocks = {p + "_o" for p in products}
    dropped = []

    def without_init(blk):
        if blk.name_hint in blocks and blk.init is not None:
            dropped.append(blk.name_hint)
            return None
        return blk.init

    func = func.with_body(_rebuild(func.body, init=without_init))
    if sorted(dropped) != sorted(blocks):
        raise ValueError(f"drop_init: the kernel's tensorized products with an init are {sorted(dropped)}, "
                         f"expected {sorted(blocks)}")
    return func


def _always_true(cond, loops: dict, analyzer) -> bool:
    """``cond`` is ``x // d < n`` where x is below n * d: a loop over [0, n * d), or
    ``y % (n * d)``. What fusing a loop of symbolic extent n (the batch, or the heads
    when the batch is fused above them too) with inner loops of product d leaves."""
    if not (isinstance(cond, tirx.LT) and isinstance(cond.a, tirx.FloorDiv)):
        return False
    x, bound = cond.a.a, cond.b * cond.a.b
    if isinstance(x, tirx.FloorMod):
        return analyzer.can_prove_equal(x.b, bound)
    loop = loops.get(x) if isinstance(x, tirx.Var) else None
    return loop is not None and analyzer.can_prove_equal(loop.min, 0) and analyzer.can_prove_equal(loop.extent, bound)


def drop_fused_bound_predicates(func):
    """A scheduled kernel (default or replayed record) without the block predicates
    ``fused // (H * blocks) < B`` (and ``fused % (H * rest) // rest < H``) that fusing
    the symbolic batch and head loops into the item and row loops leaves on every block
    computed there. The analyzer cannot prove them from the fused extent B * H * blocks,
    so they stay, evaluated in the inner loops: the causal W=512 forward ran 1.56x
    slower with them (19.5 against 12.5 ms at T=2048, H=8, AVX-512, 2026-12-05;
    tools/experiments/symbolic_shape_gap.py). True by the loop's extent, so dropping them changes
    no result. Conjuncts not of that form stay."""
    analyzer = Analyzer()

    def conjuncts(e):
        return conjuncts(e.a) + conjuncts(e.b) if isinstance(e, tirx.And) else [e]

    def predicate(realize, loops):
        kept = [c for c in conjuncts(realize.predicate) if not _always_true(c, loops, analyzer)]
        return tirx.all(*kept) if kept else tirx.const(True, "bool")

    return func.with_body(_rebuild(func.body, predicate=predicate))


def _rebuild(stmt, loops=None, loop_body=None, predicate=None, init=None):
    """A scheduled body rebuilt with ``loop_body(loop, new_body)`` as each loop's body,
    ``predicate(realize, loops)`` as each block's predicate (``loops``: the enclosing
    loops by loop var) and ``init(block)`` as each block's init."""
    loops = loops or {}

    def again(x, inner=loops):
        return _rebuild(x, inner, loop_body, predicate, init)

    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([again(x) for x in stmt.seq])
    if isinstance(stmt, tirx.For):
        body = again(stmt.body, {**loops, stmt.loop_var: stmt})
        body = loop_body(stmt, body) if loop_body else body
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.IfThenElse):
        other = stmt.else_case and again(stmt.else_case)
        return tirx.IfThenElse(stmt.condition, again(stmt.then_case), other)
    if isinstance(stmt, SBlockRealize):
        blk = stmt.block
        blk = SBlock(blk.iter_vars, blk.reads, blk.writes, blk.name_hint, again(blk.body),
                     init(blk) if init else blk.init, blk.alloc_buffers, blk.match_buffers, blk.annotations)
        return SBlockRealize(stmt.iter_values, predicate(stmt, loops) if predicate else stmt.predicate, blk)
    return stmt


SCHEDULES = {
    "local": schedule_local,
    "global": schedule_global,
    "cache": schedule_cache,
    "cache_dq": schedule_cache_dq,
    "cache_dkv": schedule_cache_dkv,
    "cache_dx": schedule_cache_dx,
    "local_dq": schedule_local_dq,
    "local_dkv": schedule_local_dkv,
    "local_dx": schedule_local_dx,
    "global_bwd": schedule_global_bwd,
}


def schedule(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 8, knobs=None,
             matrix: str | None = None) -> None:
    """Apply the schedule for ``spec`` to ``sch`` (working on spec.name): the default
    one, or with ``knobs=Sampled()`` one point of the MetaSchedule search space.
    ``matrix``: the PrimFunc is the matrix-engine form (``compute.prim_func(amx=True)``),
    its products on this engine of MATRIX_ENGINES."""
    if matrix is not None:
        AMX_SCHEDULES[spec.kind](sch, spec, vector_lanes, knobs, matrix)
    else:
        SCHEDULES[spec.kind](sch, spec, vector_lanes, knobs)
