"""CUDA schedules for the TE computes in ``swa_tvm.compute`` and ``compute_backward``. Most
kernels without a tuning record get a fused kernel instead (``cuda_flash_tc`` for
float16/bfloat16, ``cuda_flash`` for float32, ``cuda_flash_bwd`` for the gradients;
see ``build.default_schedule``); this schedule serves the rest (tiles too large for the
fused kernels, such as float32 at head_dim 256) and is the TE whose MetaSchedule records
apply.

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

For float16/bfloat16 the search space has a second design space in which the score
product (K_band Q_blk^T, the product whose operands are in the input dtype) runs on
tensor cores: ``_tensor_core_product`` tiles it into 16 x 16 x 16 steps, one warp per
row tile, operands staged through shared memory into wmma fragments, fp32
accumulators, each step tensorized with TVM's wmma intrinsics (bfloat16 ones registered
here: TVM ships float16 only). P·V stays on CUDA cores: its probabilities are fp32.

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

from tvm import s_tir, tirx
from tvm.s_tir import TensorIntrin

from swa_tvm.compute.forward import band_width
from swa_tvm.schedules.cpu import Defaults, _has
from swa_tvm.schedules.intrinsics import preload_tensor_intrin
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


def _batch_heads(sch, loops) -> int:
    """How many of a block's leading ``loops`` run over the batch and the heads (the TE's
    loops ``b`` and ``h``, extents B and H): 2, 1 (``h`` alone) or 0."""
    names = [sch.get(loop).loop_var.name for loop in loops[:2]]
    return 2 if names == ["b", "h"] else 1 if names[:1] == ["h"] else 0


def _bind_batch_heads(sch, loops) -> None:
    """Bind the batch and head loops to blockIdx.z and blockIdx.y. With them out of the
    fused index of blockIdx.x, no block index is divided by a symbolic extent; TVM's
    buffer compaction spent seconds per stage on the regions of such divisions when one
    1-D grid covered B x H x items. gridDim.y and .z bound H and B at 65535
    (``functional._check_te_cuda_grid`` refuses a call past that by name)."""
    for loop, axis in zip(reversed(loops), ("blockIdx.y", "blockIdx.z")):
        sch.bind(loop, axis)


def _one_thread_per_output(sch, block, threads) -> None:
    """One thread per output (reductions run serially inside): batch and heads on the
    grid's z and y, the other spatial loops fused and split over blockIdx.x and the threads.

    A stage over the band of a window unbounded on the right ([..., items, band, cols],
    band = T + left) fuses only band and columns into blockIdx.x, the items going to
    blockIdx.y and batch and heads (fused) to blockIdx.z: fused with the items, TVM's
    region analysis cannot lower the split of that symbolic extent. Such a stage is
    O(T^2) in work; its grid bounds items (T / block_q) and B x H at 65535."""
    spatial = sch.get_loops(block)[: _spatial_count(sch, block)]
    n = _batch_heads(sch, spatial)
    lead, rest = spatial[:n], spatial[n:]
    if len(rest) >= 3 and not isinstance(sch.get(rest[-2]).extent, (tirx.IntImm, tirx.Var)):
        bx, tx = sch.split(sch.fuse(*rest[-2:]), [None, threads])
        sch.bind(sch.fuse(*rest[:-2]), "blockIdx.y")
        if lead:
            sch.bind(sch.fuse(*lead), "blockIdx.z")
    else:
        if not rest:
            lead, rest = lead[:-1], lead[-1:]
        bx, tx = sch.split(sch.fuse(*rest), [None, threads])
        _bind_batch_heads(sch, lead)
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _largest_divisor(n: int, candidates) -> int:
    return next((c for c in candidates if n % c == 0), 1)


def _cooperative_fetch(sch, block, threads_y, threads_x) -> None:
    """Let all threads of the block copy a shared tile [..., rows, cols]: fuse its last
    two loops and spread them over the threads. (The loops before them have extent 1.
    Fusing them too would make the thread loops int64, from the symbolic kernel's int64
    batch and item dims, while the product binds the same threads to int32 loops; with a
    thread count of 1 the two then meet in one expression and lowering fails.)"""
    fused = sch.fuse(*sch.get_loops(block)[-2:])
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


def _shared_tile(sch, blk, operand: str):
    """The shared-memory tile through which block ``blk`` reads stage ``operand``: the
    stage itself when only ``blk`` reads it (a gather never lands in global memory),
    else a copy."""
    producer = sch.get_sblock(operand)
    if len(sch.get_consumers(producer)) == 1:
        sch.set_scope(producer, 0, "shared")
        return producer
    reads = [r.source.name for r in sch.get(blk).reads]
    return sch.cache_read(blk, reads.index(operand), "shared", consumer_blocks=[blk])


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
    n = _batch_heads(sch, batch)
    _bind_batch_heads(sch, batch[:n])
    sch.bind(sch.fuse(*batch[n:], io, jo), "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    local = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(local, tx, preserve_unit_loops=True)
    for operand in operands:
        tile = _shared_tile(sch, blk, operand)
        sch.compute_at(tile, ko, preserve_unit_loops=True)  # loop count independent of the samples
        _cooperative_fetch(sch, tile, ti, tj)


# The wmma intrinsics of the score product per input dtype: A and B loads from shared
# memory, the product (fp32 accumulators); fill and store are TVM's fp32 ones.
WMMA = {
    "float16": ("wmma_load_16x16x16_f16_a_shared", "wmma_load_16x16x16_f16_b_shared", "wmma_sync_16x16x16_f16f16f32"),
    "bfloat16": ("swa_wmma_load_16x16x16_bf16_a_shared", "swa_wmma_load_16x16x16_bf16_b_shared",
                 "swa_wmma_sync_16x16x16_bf16bf16f32"),
}
WMMA_FILL, WMMA_STORE = "wmma_fill_16x16x16_f32", "wmma_store_16x16x16_f32_global"


def register_intrinsics() -> None:
    """Register the bfloat16 wmma intrinsics (once per process; TVM's own module first,
    imported the fast way: ``intrinsics.preload_tensor_intrin``)."""
    preload_tensor_intrin()
    # Lazy, after the preload: imported plainly, tensor_intrin takes ~80 s.
    from tvm.s_tir.tensor_intrin import cuda as intrin

    load_a, load_b, sync = WMMA["bfloat16"]
    try:
        TensorIntrin.get(sync)
        return
    except Exception:  # noqa: BLE001 - not registered yet
        pass
    TensorIntrin.register(load_a, *intrin.get_wmma_load_intrin(16, 16, 16, "bfloat16", "shared", False, False))
    TensorIntrin.register(load_b, *intrin.get_wmma_load_intrin(16, 16, 16, "bfloat16", "shared", True, False))
    TensorIntrin.register(sync, *intrin.get_wmma_sync_intrin(16, 16, 16, "bfloat16", "float32", False))


def tensor_cores_apply(spec: KernelSpec) -> bool:
    """Whether the search space has a tensor-core design space for ``spec``: a half
    dtype, a bounded band, and every extent of the score product a multiple of 16."""
    if spec.kind != "local" or spec.dtype not in WMMA or spec.left < 0 or spec.right < 0:
        return False
    kw = band_width(spec.block_q, spec.left, spec.right)
    return kw % 16 == 0 and spec.block_q % 16 == 0 and spec.head_dim % 16 == 0


def _tensor_core_product(sch, name: str, rows: int, dtype: str, operands, knobs, tensorize: bool) -> None:
    """Block ``name`` [batch..., rows, cols] += A[rows, red] * B[red, cols] (A and B in
    ``dtype``, all extents multiples of 16) on tensor cores:
    a thread block per (item, group of row tiles), one warp per 16-row tile looping over
    the column tiles and the reduction in 16-wide steps; A and B tiles in shared memory
    (the gathers computed straight into them), then wmma fragments; fp32 accumulator
    fragments stored to the product's buffer. ``tensorize`` False leaves the 16 x 16
    steps as loops (how the tests run the loop nest on the CPU)."""
    load_a, load_b, sync = WMMA[dtype]
    blk = sch.get_sblock(name)
    *batch, i, j, k = sch.get_loops(blk)
    i_tiles, i16 = sch.split(i, [None, 16])
    j_tiles, j16 = sch.split(j, [None, 16])
    k_steps, k16 = sch.split(k, [None, 16])
    warps_default = _largest_divisor(rows // 16, (4, 3, 2, 1))
    factors = knobs.split(sch, i_tiles, [rows // 16 // warps_default, warps_default], max_inner=8)
    i_blk, warp = sch.split(i_tiles, factors)
    sch.reorder(i_blk, warp, k_steps, j_tiles, i16, j16, k16)
    # The row-tile groups keep their own grid axis (y): fused with the int64 item loop,
    # their int32 index would reach the wmma steps through a cast, which tensorize
    # cannot blockize. Heads go to z, the batch into x with the items (this stage's
    # one division by a symbolic extent, the item count).
    n = _batch_heads(sch, batch)
    rest = batch[n:]
    if n == 2:
        sch.reorder(batch[1], batch[0])
        rest = [batch[0]] + rest
    if n:
        sch.bind(batch[n - 1], "blockIdx.z")
    bx = sch.fuse(*rest) if len(rest) > 1 else rest[0]
    sch.bind(bx, "blockIdx.x")
    sch.bind(i_blk, "blockIdx.y")
    sch.bind(warp, "threadIdx.y")
    accumulator = sch.cache_write(blk, 0, "wmma.accumulator")
    sch.reverse_compute_at(accumulator, warp, preserve_unit_loops=True)
    for operand in operands:
        tile = _shared_tile(sch, blk, operand)
        sch.compute_at(tile, i_blk, preserve_unit_loops=True)
        _cooperative_fetch(sch, tile, factors[1], 32)  # every warp's 32 lanes copy
    frag_a = sch.cache_read(blk, 0, "wmma.matrix_a")
    frag_b = sch.cache_read(blk, 1, "wmma.matrix_b")
    sch.compute_at(frag_a, k_steps, preserve_unit_loops=True)
    sch.compute_at(frag_b, k_steps, preserve_unit_loops=True)
    init = sch.decompose_reduction(blk, k_steps)
    if not tensorize:
        return
    sch.tensorize(_tiles16(sch, frag_a), load_a)
    sch.tensorize(_tiles16(sch, frag_b), load_b)
    sch.tensorize(sch.get_loops(init)[-2], WMMA_FILL)
    sch.tensorize(i16, sync)
    sch.tensorize(_tiles16(sch, accumulator), WMMA_STORE)


def _tiles16(sch, block):
    """Split a copy block's last two loops into 16 x 16 tiles; the loop to tensorize."""
    a, b = sch.get_loops(block)[-2:]
    a0, a1 = sch.split(a, [None, 16])
    b0, b1 = sch.split(b, [None, 16])
    sch.reorder(a0, b0, a1, b1)
    return a1


def schedule_local(sch: s_tir.Schedule, spec: KernelSpec, knobs=None, tensor_cores: bool = False,
                   tensorize: bool = True) -> None:
    knobs = knobs or Defaults()
    bounded = spec.left >= 0 and spec.right >= 0
    _inline(sch, "masked", "xmasked", "blk_out", "blk_lse")
    if bounded:
        kw = band_width(spec.block_q, spec.left, spec.right)
        if tensor_cores:
            _tensor_core_product(sch, "score", kw, spec.dtype, ("kband", "qblk_t"), knobs, tensorize)
        else:
            _tiled_product(sch, "score", kw, spec.block_q, spec.head_dim, ("kband", "qblk_t"), knobs)
        _tiled_product(sch, "wacc", spec.block_q, spec.head_dim, kw, ("wprob", "vband"), knobs)
    _rest_one_thread_per_output(sch, knobs)


def _unscheduled_blocks(sch):
    """Blocks of the function, in program order, that no thread binding covers yet."""
    out = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        if loops and sch.get(loops[0]).thread_binding is None:
            out.append(block)
    return out


def _inline(sch, *names) -> None:
    for name in names:
        if _has(sch, name):
            sch.compute_inline(sch.get_sblock(name))


def schedule_local_dq(sch: s_tir.Schedule, spec: KernelSpec, knobs=None) -> None:
    """dq of the local kernel (``compute_backward.local_dq``): scores and dP = dO V^T of an
    item as tiled products, dS (computed from them) straight into the shared tiles of
    dq = dS^T K_band; the extras and the gather back one thread per output."""
    knobs = knobs or Defaults()
    _inline(sch, "arg", "dq_blk")
    if spec.left >= 0 and spec.right >= 0:
        kw, bq, d = band_width(spec.block_q, spec.left, spec.right), spec.block_q, spec.head_dim
        _tiled_product(sch, "score", kw, bq, d, ("kband", "qblk_t"), knobs)
        _tiled_product(sch, "dp", kw, bq, d, ("vband", "dblk_t"), knobs)
        _tiled_product(sch, "dqw", bq, d, kw, ("ds", "kband_dq"), knobs)
    _rest_one_thread_per_output(sch, knobs)


def schedule_local_dkv(sch: s_tir.Schedule, spec: KernelSpec, knobs=None) -> None:
    """dk, dv of the local kernel's window (``compute_backward.local_dkv``), key-major:
    S^T and dP^T of a key block against its query band, dv = P^T dO and dk = dS^T Q as
    tiled products (dS computed straight into the last one's shared tile)."""
    knobs = knobs or Defaults()
    _inline(sch, "arg")
    if spec.left >= 0 and spec.right >= 0:
        qw, bk, d = band_width(spec.block_q, spec.right, spec.left), spec.block_q, spec.head_dim
        _tiled_product(sch, "score", qw, bk, d, ("qband", "kblk_t"), knobs)
        _tiled_product(sch, "dp", qw, bk, d, ("dband", "vblk_t"), knobs)
        _tiled_product(sch, "dv_blk", bk, d, qw, ("prob", "dband_dv"), knobs)
        _tiled_product(sch, "dk_blk", bk, d, qw, ("ds", "qband_dk"), knobs)
    _rest_one_thread_per_output(sch, knobs)


def schedule_rows(sch: s_tir.Schedule, spec: KernelSpec, knobs=None) -> None:
    """Kernels whose products run along the sequence (the extras' key gradients, the
    global rows' gradients; global rows forward): one thread per output, reductions
    serial inside. Their outputs are few (E or G rows, or a [T, G] tile) next to the
    local kernels'."""
    _inline(sch, "arg", "garg", "capped")
    _rest_one_thread_per_output(sch, knobs)


def _rest_one_thread_per_output(sch, knobs) -> None:
    threads = (knobs or Defaults()).choice(sch, THREAD_CHOICES, THREADS)
    for block in _unscheduled_blocks(sch):
        _one_thread_per_output(sch, block, threads)


SCHEDULES = {
    "local": schedule_local,
    "global": schedule_rows,
    "cache": schedule_rows,
    "cache_dq": schedule_rows,
    "cache_dkv": schedule_rows,
    "cache_dx": schedule_rows,
    "local_dq": schedule_local_dq,
    "local_dkv": schedule_local_dkv,
    "local_dx": schedule_rows,
    "global_bwd": schedule_rows,
}


def schedule(sch: s_tir.Schedule, spec: KernelSpec, knobs=None, tensor_cores: bool = False,
             tensorize: bool = True) -> None:
    """Apply the CUDA schedule of ``spec`` to the PrimFunc ``sch`` works on: the default
    (``knobs`` None), or a point of the search space (``cpu.Sampled()``); with
    ``tensor_cores`` (where ``tensor_cores_apply``) the score product on tensor cores."""
    if tensor_cores:
        if not tensor_cores_apply(spec):
            raise ValueError(f"kernel {spec.name}: no tensor-core schedule (half dtype, bounded band, extents % 16)")
        register_intrinsics()
        schedule_local(sch, spec, knobs, tensor_cores=True, tensorize=tensorize)
        return
    SCHEDULES[spec.kind](sch, spec, knobs)
