"""CUDA schedules for the forward TE computes in ``swa_tvm.compute``. Most kernels without
a tuning record get a fused kernel instead (``cuda_flash_tc`` for float16/bfloat16,
``cuda_flash`` for float32; see ``build.default_schedule``); this schedule serves the
rest (tiles too large for the fused kernels, such as float32 at head_dim 256) and is the
TE whose MetaSchedule records apply.

The compute is the one the CPU runs (blocked query x key-band items), so a GPU kernel
computes exactly what the CPU-tested TE says; only the loop structure differs. Plan:

- the two products (key-major scores = K_band Q_blk^T and acc = P^T V_band) are shared-memory tiled
  matmuls: one thread block per (item, column tile), 16 x 16 threads each owning a
  register tile, the reduction axis staged through shared memory in chunks. The per-item
  gathers (query rows, key band, value band; runtime dilation) are computed straight
  into those shared tiles, so the gathered copies never exist in global memory;
- every other stage (row max, probabilities, sums, the extras, the gather back to
  [B, H, T, D]) is elementwise or a short row reduction: one thread per output;
- scores and probabilities of an item are kept in global memory between the stages:
  O(B*H*T*(W+block_q)) floats, which fits an H200 at the issue's largest shapes; the
  fused kernels keep them on chip.

The same code is MetaSchedule's CUDA search space (``swa-tvm tune --target cuda``): like
``schedules/cpu.py`` it asks a knobs object for each tunable decision (``Defaults``: the
values below; ``Sampled``: MetaSchedule random variables). Only loops whose extent the
spec fixes are sampled (a product's rows, columns and reduction; the thread count of the
elementwise stages is a split factor, not a tiling of the symbolic loop), so a record
measured at the tuning shape replays on the symbolic-T kernel. MetaSchedule's own CUDA
rules cannot serve here: they tile every spatial loop of a block, the item loop
included, and ``sample_perfect_tile`` on a symbolic extent has no value to replay.

Blocks follow TE names; ``schedule`` dispatches on the kernel kind.
"""

from __future__ import annotations

from tvm import s_tir

from swa_tvm.schedules.cpu import Defaults, _has
from swa_tvm.spec import KernelSpec

# Threads of the one-thread-per-output stages (default, and the tuner's choices).
THREADS = 256
THREAD_CHOICES = (64, 128, 256, 512)
# Unroll limits the tuner may put on a product's reduction loop (0: none).
UNROLL_STEPS = (0, 16, 64, 512)
# Register tile of a product thread (rows x columns) and its 16 x 16 thread grid.
TILE_ROWS, TILE_COLS, GRID = 2, 4, 16


def _spatial_count(sch, block) -> int:
    return sum(1 for iv in sch.get(block).iter_vars if iv.iter_type == 0)


def _one_thread_per_output(sch, block, threads) -> None:
    """Fuse the spatial loops, one thread per output; reductions run serially inside."""
    loops = sch.get_loops(block)
    fused = sch.fuse(*loops[: _spatial_count(sch, block)])
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _largest_divisor(n: int, candidates) -> int:
    return next((c for c in candidates if n % c == 0), 1)


def _cooperative_fetch(sch, block, outer: int, threads_y, threads_x) -> None:
    """Let all threads of the block copy a shared tile: fuse its own loops (those under
    the ``outer`` enclosing ones) and spread them over the threads."""
    fused = sch.fuse(*sch.get_loops(block)[outer:])
    _, ty, tx = sch.split(fused, [None, threads_y, threads_x])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def _product_tiles(rows: int, cols: int, red: int):
    """Default factors of a product's loops, each list multiplying to the extent:
    rows [blocks, threads, per thread], cols likewise, reduction [chunks, chunk]. At most
    GRID x GRID threads holding a TILE_ROWS x TILE_COLS register tile; leftover extent
    goes to more thread blocks."""
    ri = _largest_divisor(rows, (TILE_ROWS, 1))
    ti = _largest_divisor(rows // ri, range(GRID, 0, -1))
    rj = _largest_divisor(cols, (TILE_COLS, 2, 1))
    tj = _largest_divisor(cols // rj, range(GRID, 0, -1))
    kc = _largest_divisor(red, (32, 16, 8, 4, 2, 1))
    return [rows // (ti * ri), ti, ri], [cols // (tj * rj), tj, rj], [red // kc, kc]


def _tiled_product(sch, name: str, rows: int, cols: int, red: int, operands=(), knobs=None) -> None:
    """Schedule block ``name`` [batch..., rows, cols] += A[rows, red] * B[red, cols] as a
    tiled matmul. The ``operands`` (names of computed stages it reads) reach it through
    shared-memory tiles: a stage only this block reads is computed straight into them
    (a gather never lands in global memory); one that others read too is copied in."""
    knobs = knobs or Defaults()
    blk = sch.get_sblock(name)
    *batch, i, j, k = sch.get_loops(blk)
    di, dj, dk = _product_tiles(rows, cols, red)
    fi = knobs.split(sch, i, di, max_inner=8)
    fj = knobs.split(sch, j, dj, max_inner=8)
    fk = knobs.split(sch, k, dk, max_inner=64)
    io, ty, ii = sch.split(i, fi)
    jo, tx, jj = sch.split(j, fj)
    ko, ki = sch.split(k, fk)
    sch.reorder(io, jo, ty, tx, ko, ki, ii, jj)
    ti, tj = fi[1], fj[1]
    unroll = knobs.choice(sch, UNROLL_STEPS, 0)
    if not isinstance(unroll, int) or unroll:
        sch.annotate(ko, "pragma_auto_unroll_max_step", unroll)
        sch.annotate(ko, "pragma_unroll_explicit", 1)
    sch.bind(sch.fuse(*batch), "blockIdx.x")
    sch.bind(sch.fuse(io, jo), "blockIdx.y")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    local = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(local, tx, preserve_unit_loops=True)
    for operand in operands:
        producer = sch.get_sblock(operand)
        if len(sch.get_consumers(producer)) == 1:
            sch.set_scope(producer, 0, "shared")
            tile = producer
        else:
            reads = [r.source.name for r in sch.get(blk).reads]
            tile = sch.cache_read(blk, reads.index(operand), "shared", consumer_blocks=[blk])
        sch.compute_at(tile, ko, preserve_unit_loops=True)  # loop count independent of the samples
        _cooperative_fetch(sch, tile, 5, ti, tj)  # under blockIdx.x/y, threadIdx.y/x, ko


def schedule_local(sch: s_tir.Schedule, spec: KernelSpec, knobs=None) -> None:
    from swa_tvm.compute import band_width

    knobs = knobs or Defaults()
    bounded = spec.left >= 0 and spec.right >= 0
    for name in ("masked", "xmasked", "blk_out", "blk_lse"):
        if _has(sch, name):
            sch.compute_inline(sch.get_sblock(name))
    if bounded:
        kw = band_width(spec.block_q, spec.left, spec.right)
        _tiled_product(sch, "score", kw, spec.block_q, spec.head_dim, ("kband", "qblk_t"), knobs)
        _tiled_product(sch, "wacc", spec.block_q, spec.head_dim, kw, ("wprob", "vband"), knobs)
    threads = knobs.choice(sch, THREAD_CHOICES, THREADS)
    for block in _unscheduled_blocks(sch):
        _one_thread_per_output(sch, block, threads)


def _unscheduled_blocks(sch):
    """Blocks of the function, in program order, that no thread binding covers yet."""
    out = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        if loops and sch.get(loops[0]).thread_binding is None:
            out.append(block)
    return out


def schedule_global(sch: s_tir.Schedule, spec: KernelSpec, knobs=None) -> None:
    threads = (knobs or Defaults()).choice(sch, THREAD_CHOICES, THREADS)
    for block in _unscheduled_blocks(sch):
        _one_thread_per_output(sch, block, threads)


SCHEDULES = {"local": schedule_local, "global": schedule_global}


def schedule(sch: s_tir.Schedule, spec: KernelSpec, knobs=None) -> None:
    """Apply the CUDA schedule of ``spec`` to the PrimFunc ``sch`` works on: the default
    (``knobs`` None), or a point of the search space (``cpu.Sampled()``)."""
    if spec.kind not in SCHEDULES:
        raise NotImplementedError(
            f"kernel {spec.name}: no CUDA schedule for kind {spec.kind!r} yet (CUDA serves the forward kernels)"
        )
    SCHEDULES[spec.kind](sch, spec, knobs)
