"""Hand-written default CPU (llvm) schedules for the computes in ``swa_tvm.compute``.

Used when no tuning record applies. The plan for the local kernel: one parallel loop over
work items (batch x head x query block); every stage of an item is computed at that loop
so its intermediates (the Bq x Kw score and probability tiles, the gathered key/value
bands) stay in L1/L2; the two products are register-tiled with the key or feature axis
vectorized. The final gathers back to [B,H,T,...] run as their own parallel loops.
"""

from __future__ import annotations

from tvm import s_tir

from swa_tvm.compute import LANES
from swa_tvm.spec import KernelSpec


def _has(sch: s_tir.Schedule, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def _inline_if_present(sch: s_tir.Schedule, name: str) -> None:
    """Inline an elementwise stage; the extras stages exist only in specs with extras."""
    if _has(sch, name):
        sch.compute_inline(sch.get_sblock(name))


def _split_vec(sch, loop, lanes):
    outer, inner = sch.split(loop, factors=[None, lanes])
    return outer, inner


def schedule_local(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 8) -> None:
    for name in ("masked", "xmasked", "rowmax", "denom"):
        _inline_if_present(sch, name)

    # Gathers back to [B,H,T,(D)], merged into one parallel loop over rows. `merge` puts
    # the merged loop where the last of its loops was and does not check dataflow, so
    # the gathers are merged first (landing after both item stages) and the item
    # stages second (landing before the gathers).
    out = sch.get_sblock("out")
    b, h, i, cc = sch.get_loops(out)
    row = sch.fuse(b, h, i)
    if spec.head_dim % vector_lanes == 0:
        sch.vectorize(_split_vec(sch, cc, vector_lanes)[1])
    b, h, i = sch.get_loops(sch.get_sblock("lse"))
    sch.parallel(sch.merge(row, sch.fuse(b, h, i)))

    # blk_out and blk_lse share every producer, so their item loops are merged into one
    # before the producers are computed at it.
    root = sch.get_sblock("blk_out")
    b, h, beta, qi, cc = sch.get_loops(root)
    item = sch.fuse(b, h, beta)
    lse_blk = sch.get_sblock("blk_lse")
    b2, h2, beta2, _ = sch.get_loops(lse_blk)
    item = sch.merge(item, sch.fuse(b2, h2, beta2))
    if spec.head_dim % vector_lanes == 0:
        sch.vectorize(_split_vec(sch, cc, vector_lanes)[1])

    # Producers of blk_out, innermost first so each compute_at finds its consumer placed.
    order = ["wacc", "xacc", "wsum", "xsum", "wprob", "xprob", "wmax", "xmax", "score", "xscore", "vblk", "kblk_t", "qblk"]
    for name in order:
        if not _has(sch, name):
            continue
        sch.compute_at(sch.get_sblock(name), item, preserve_unit_loops=True)
    sch.parallel(item)

    bounded = spec.left >= 0 and spec.right >= 0
    # Score tile: (qi, kj) with kj vectorized; the reduction over c sits outside the
    # register tile so the accumulators stay in registers.
    blk = sch.get_sblock("score")
    loops = sch.get_loops(blk)
    qi_l, kj_l, c_l = loops[-3:]
    qo, qi_in = sch.split(qi_l, factors=[None, 4] if spec.block_q % 4 == 0 else [None, 1])
    if bounded:
        # The key band is padded to a multiple of LANES (16), so this split is exact.
        ko, ki = sch.split(kj_l, factors=[None, LANES])
        sch.reorder(qo, ko, c_l, qi_in, ki)
        sch.unroll(qi_in)
        sch.vectorize(ki)
        sch.decompose_reduction(blk, c_l)
    # Probability tile: elementwise, vectorize along keys.
    for name in ("wprob",):
        blk = sch.get_sblock(name)
        if bounded:
            sch.vectorize(_split_vec(sch, sch.get_loops(blk)[-1], LANES)[1])
    # P @ V for the band and the extras: (qi, c) tile with c vectorized, the reduction
    # over keys outside the tile.
    for name in ("wacc", "xacc"):
        if not _has(sch, name):
            continue
        blk = sch.get_sblock(name)
        qi_l, c_l, kr = sch.get_loops(blk)[-3:]
        qo, qi_in = sch.split(qi_l, factors=[None, 2] if spec.block_q % 2 == 0 else [None, 1])
        width = 4 * vector_lanes
        if spec.head_dim % width == 0:
            co, ci = sch.split(c_l, factors=[None, width])
            sch.reorder(qo, co, kr, qi_in, ci)
        else:
            ci = c_l
            sch.reorder(qo, kr, qi_in, ci)
        sch.unroll(qi_in)
        sch.vectorize(ci)
        sch.decompose_reduction(blk, kr)


def schedule_global(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 8) -> None:
    for name in ("gmasked", "gmax", "gden"):
        _inline_if_present(sch, name)
    root = sch.get_sblock("out")
    b, h, g, cc = sch.get_loops(root)
    row = sch.fuse(b, h, g)
    b2, h2, g2 = sch.get_loops(sch.get_sblock("lse"))
    row = sch.merge(row, sch.fuse(b2, h2, g2))
    for name in ("gacc", "gsum", "gprob", "gmax0", "gscore"):
        sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True)
    sch.parallel(row)
    blk = sch.get_sblock("gacc")
    c_l, jr = sch.get_loops(blk)[-2:]
    sch.reorder(jr, c_l)
    if spec.head_dim % vector_lanes == 0:
        sch.vectorize(_split_vec(sch, c_l, vector_lanes)[1])
    sch.decompose_reduction(blk, jr)


def schedule(sch: s_tir.Schedule, spec: KernelSpec, vector_lanes: int = 8) -> None:
    """Apply the default schedule for ``spec`` to ``sch`` (working on spec.name)."""
    (schedule_local if spec.kind == "local" else schedule_global)(sch, spec, vector_lanes)
