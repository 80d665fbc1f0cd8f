"""Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a) for the tensor-core forward and
gradients (``cuda_flash_tc`` with ``TCConfig(wgmma=True)``, ``cuda_flash_bwd_tc`` with
``TCBwdConfig(wgmma=True)``).

mma.sync (sm_80's instruction, what the other tensor-core kernels issue) reaches about
two thirds of an H100's bf16 rate; wgmma, one instruction per warpgroup (4 warps, 64
rows) reading its B operand straight from shared memory, is how FlashAttention-3 and
FlexAttention reach the rest. Its fit to our kernel is exact where it matters:

- the accumulator of ``m64nNk16`` in warp w of the group is the C fragments of
  ``mma.m16n8k16`` for rows 16w..16w+15, N/8 of them side by side (PTX ISA, "Register
  Fragments" of wgmma): value i of a thread is value i % 4 of C tile i // 4. So the
  score and output arrays (``sfrag``, ``ofrag``) and everything the kernel does to them
  (masks, online softmax) are unchanged;
- A from registers (the ``rs`` form) takes the A fragment of ``mma.m16n8k16`` per warp:
  Q's fragments and the probabilities' (``pfrag``) as they are;
- B comes from shared memory through a 64-bit matrix descriptor, in the canonical
  no-swizzle layout: 8x8 "core matrices" of 16-bit values, 128 contiguous bytes each
  (``core_offset``). K's tile (keys x head dim) is B of Q K^T "K-major" (the head dim,
  the product's K, contiguous) and V's, laid out the same, is B of P V "MN-major"
  (transposed: the head dim is the product's N); ``descriptor_fields`` gives both.
  The gradients' S and dP take A from shared memory too (the ``ss`` form: the item's
  tile, K-major like K's).

Ordering rules (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): a
``wgmma.fence`` before the first wgmma and after any other instruction touched its
accumulators or A registers; ``commit_group`` then ``wait_group`` before the results are
read; shared memory written by ordinary stores (or cp.async) reaches the async proxy
wgmma reads through only after a ``fence.proxy.async`` by the writers, then a barrier.
The compiler does not know the first two: it moved the accumulators' zeroing and the A
operands' packing past the fence, and ptxas then injected a ``warpgroup.arrive`` before
each such wgmma (its C7519 notes). So A operands are packed into 32-bit registers
before the group (``a_packer``), and every register the products touch is pinned on
its side of the fence and of the wait by an empty asm that "modifies" it
(``swa_reg_fence_*``, CUTLASS's ``warpgroup_fence_operand``).

``emulate=True``: the product lane by lane (the CPU runs it, as ``cuda_flash_tc``'s
emulation), each shared operand read where ``canonical_address`` says the hardware
reads it under the descriptor (CUTLASS's documented canonical layouts): so the emulated
kernels check the loaders' layout against the descriptors end to end. That the
hardware reads as CUTLASS documents is ``probe``'s question for a GPU.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from swa_tvm.schedules.ptx import (
    COMMON_SOURCE,
    CORE,
    PTX_TYPE,
    a_lane,
    a_pos,
    c_lane,
    c_pos,
    core_offset,
)


def descriptor_fields(operand: str, rows: int, ks: int, el_bytes: int = 2) -> tuple[int, int, int]:
    """(start byte offset in the tile, leading byte offset, stride byte offset) of the
    descriptor of k-step ``ks`` (16 values of the product's K) of a ``core_offset`` tile
    of ``rows`` rows, as B operand:

    - "nk": B[k][n] = tile[n][16*ks + k] (K's tile in Q K^T: the tile's rows are N, its
      columns K; K-major). LBO = the step between cores along K (the tile's columns),
      SBO = along N (its rows).
    - "kn": B[k][n] = tile[16*ks + k][n] (V's tile in P V: rows K, columns N; MN-major,
      ``imm-trans-b`` 1). LBO along K (the rows), SBO along N (the columns).
    """
    along_rows, along_cols = CORE * CORE * el_bytes, rows * CORE * el_bytes  # bytes between neighbouring cores
    if operand == "nk":
        return 2 * ks * along_cols, along_cols, along_rows
    if operand == "kn":
        return 2 * ks * along_rows, along_rows, along_cols
    raise ValueError(f"operand {operand!r}: expected 'nk' or 'kn'")


def canonical_address(start: int, lbo: int, sbo: int, major: str, mn: int, k: int, el_bytes: int = 2) -> int:
    """Byte address at which wgmma reads element (mn, k) of a no-swizzle operand whose
    descriptor holds ``start``, ``lbo`` and ``sbo``: CUTLASS's canonical GMMA layouts
    (cute/atom/mma_traits_sm90_gmma.hpp, LayoutType::INTERLEAVE), in units of T = 8
    values: K-major ((8, m), (T, 2)) : ((1T, SBO), (1, LBO)); MN-major ((T, 1, m), (8, k))
    : ((1, T, SBO), (1T, LBO)). Independent of ``core_offset``: the tests hold one to the
    other."""
    if major == "K":
        return start + (mn // 8) * sbo + (k // 8) * lbo + ((mn % 8) * 8 + k % 8) * el_bytes
    if major == "MN":
        return start + (mn // 8) * sbo + (k // 8) * lbo + ((k % 8) * 8 + mn % 8) * el_bytes
    raise ValueError(f"major {major!r}: expected 'K' or 'MN'")


def wgmma_source(name: str, n: int, dtype: str, trans_b: int, lbo: int, sbo: int) -> str:
    """A C macro ``name(a0..a3, ptr, d0..d{n/2-1})``: D[64 x n] += A[64 x 16] B[16 x n],
    A from registers (the mma A fragment's eight 16-bit values packed in four 32-bit
    registers, ``a_packer``), B the shared tile at ``ptr`` with LBO/SBO (bytes), D the
    thread's n/2 fp32 accumulators. scale-d is 1 (always accumulate: the caller zeroes D)."""
    half = n // 2
    d = ",".join(f"%{i}" for i in range(half))
    a = ",".join(f"%{half + i}" for i in range(4))
    params = ", ".join([f"a{i}" for i in range(4)] + ["ptr"] + [f"d{i}" for i in range(half)])
    outs = ", ".join(f'"+f"(d{i})' for i in range(half))
    ptx = PTX_TYPE[dtype]
    return (
        COMMON_SOURCE
        + f"#define {name}({params}) \\\n"
        + f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{half + 5}, 0;\\n" \\\n'
        + f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} '
        + f'{{{d}}}, {{{a}}}, %{half + 4}, p, 1, 1, {trans_b};\\n}}\\n" \\\n'
        + f"    : {outs} \\\n"
        + '    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), \\\n'
        + f'      "l"(swa_gmma_desc(ptr, {lbo}u, {sbo}u)), "n"(1))\n'
    )


def wgmma_ss_source(name: str, n: int, dtype: str, a_fields: tuple[int, int], b_fields: tuple[int, int]) -> str:
    """A C macro ``name(aptr, bptr, d0..d{n/2-1})``: D[64 x n] += A[64 x 16] B[16 x n], both
    from shared memory, K-major (``imm-trans-a``/``-b`` 0), at ``aptr``/``bptr`` with
    (LBO, SBO) ``a_fields``/``b_fields`` (bytes); scale-d 1, as ``wgmma_source``."""
    half, ptx = n // 2, PTX_TYPE[dtype]
    d = ",".join(f"%{i}" for i in range(half))
    params = ", ".join(["aptr", "bptr"] + [f"d{i}" for i in range(half)])
    outs = ", ".join(f'"+f"(d{i})' for i in range(half))
    return (
        COMMON_SOURCE
        + f"#define {name}({params}) \\\n"
        + f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{half + 2}, 0;\\n" \\\n'
        + f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} '
        + f'{{{d}}}, %{half}, %{half + 1}, p, 1, 1, 0, 0;\\n}}\\n" \\\n'
        + f"    : {outs} \\\n"
        + f'    : "l"(swa_gmma_desc(aptr, {a_fields[0]}u, {a_fields[1]}u)), '
        + f'"l"(swa_gmma_desc(bptr, {b_fields[0]}u, {b_fields[1]}u)), "n"(1))\n'
    )


def emulated_product(warps: int, n: int):
    """A T.macro ``product(cfrag, a_of, b_of)``, the emulation of one m64nNk16 per
    warpgroup, lane by lane: in every warp w, C[16w + row][j] += A[row][k] B[k][j] over
    the k-step's 16 values, A[row][k] = ``a_of(w, row, k)``, B[k][j] = ``b_of(k, j)``, C
    in ``cfrag`` as mma's C tiles of 8 columns side by side (the accumulator layout)."""
    @T.macro
    def product(cfrag, a_of, b_of):
        for w, row, j in T.grid(warps, 16, n):
            for k in T.serial(16):
                cfrag[w * 32 + c_lane(row, j % 8)[0], (j // 8) * 4 + c_lane(row, j % 8)[1]] = cfrag[
                    w * 32 + c_lane(row, j % 8)[0], (j // 8) * 4 + c_lane(row, j % 8)[1]
                ] + T.Cast("float32", a_of(w, row, k)) * T.Cast("float32", b_of(k, j))

    return product


def wgmma_ss_macro(warps: int, dtype: str, n: int, a_rows: int, emulate: bool):
    """A T.macro ``wgmma(atile, btile, ks, cfrag)``: in each warpgroup g, C[64 x n] +=
    A B over k-step ``ks``, A = rows 64g..64g+63 of ``atile`` (``core_offset`` layout,
    ``a_rows`` rows: A[m][k] = atile[64g + m][16*ks + k]), B = ``btile``'s k-step read as
    "nk" (B[k][j] = btile[j][16*ks + k], its n rows), both K-major from shared memory; C
    as ``wgmma_macro``'s. Emulated, both read where ``canonical_address`` says."""
    nt = 32 * warps
    name = f"swa_wgmma_ss_{PTX_TYPE[dtype]}_n{n}_a{a_rows}"
    _, a_lbo, a_sbo = descriptor_fields("nk", a_rows, 0)
    _, b_lbo, b_sbo = descriptor_fields("nk", n, 0)
    source = wgmma_ss_source(name, n, dtype, (a_lbo, a_sbo), (b_lbo, b_sbo))
    product = emulated_product(warps, n)

    def a_value(atile, ks, m, k):
        return atile[canonical_address(descriptor_fields("nk", a_rows, ks)[0], a_lbo, a_sbo, "K", m, k) // 2]

    def b_value(btile, ks, k, j):
        return btile[canonical_address(descriptor_fields("nk", n, ks)[0], b_lbo, b_sbo, "K", j, k) // 2]

    def call(atile, btile, ks, cfrag, tx):
        # Warpgroup g's 64 rows: 8 cores (1024 bytes) down the rows of the A tile.
        a_start = descriptor_fields("nk", a_rows, ks)[0] // 2 + (tx // 128) * 512
        b_start = descriptor_fields("nk", n, ks)[0] // 2
        ptrs = [atile.access_ptr("r", offset=a_start), btile.access_ptr("r", offset=b_start)]
        return T.cuda.func_call(name, *ptrs, *[cfrag[tx, i] for i in range(n // 2)], source_code=source)

    @T.macro
    def wgmma(atile, btile, ks, cfrag):
        if emulate:
            product(cfrag, lambda w, row, k: a_value(atile, ks, w * 16 + row, k), lambda k, j: b_value(btile, ks, k, j))
        else:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                T.evaluate(call(atile, btile, ks, cfrag, tx))

    return wgmma


def wgmma_macro(warps: int, dtype: str, operand: str, n: int, rows: int, emulate: bool, swap: bool = False):
    """A T.macro ``wgmma(apk, p0, tile, ks, cfrag)``: in each warpgroup of the block's
    ``warps`` warps (a multiple of 4; group g owns rows 64g..64g+63), C[rows x n] +=
    A B over k-step ``ks``: A the threads' fragments (mma's A layout per warp) as
    ``a_packer`` packed them, at apk[tx, p0 .. p0 + 3], B k-step ``ks`` of ``tile`` (``core_offset`` layout, ``rows``
    rows) read as ``operand`` ("nk": B[k][j] = tile[j][16*ks + k], n = the tile's rows
    used; "kn": B[k][j] = tile[16*ks + k][j], n = its columns), C the threads'
    accumulators cfrag[tx, 0 .. n/2 - 1] (mma's C tiles of 8 columns side by side).
    Emulated, B is read where ``canonical_address`` says the hardware reads it under
    the descriptor: what the tile's loaders wrote only if the two layouts agree.
    ``swap``: LBO and SBO exchanged (``probe``'s other reading of the layout)."""
    nt = 32 * warps
    name = f"swa_wgmma_{PTX_TYPE[dtype]}_{operand}_n{n}_r{rows}" + ("_swapped" if swap else "")
    _, lbo, sbo = descriptor_fields(operand, rows, 0)
    lbo, sbo = (sbo, lbo) if swap else (lbo, sbo)
    source = wgmma_source(name, n, dtype, 1 if operand == "kn" else 0, lbo, sbo)
    major = "K" if operand == "nk" else "MN"
    product = emulated_product(warps, n)

    def b_value(tile, ks, k, j):
        start = descriptor_fields(operand, rows, ks)[0]
        return tile[canonical_address(start, lbo, sbo, major, j, k) // 2]

    def call(apk, p0, tile, ks, cfrag, tx):
        start = descriptor_fields(operand, rows, ks)[0] // 2  # bytes -> 16-bit values
        values = [apk[tx, p0 + i] for i in range(4)] + [tile.access_ptr("r", offset=start)]
        return T.cuda.func_call(name, *values, *[cfrag[tx, i] for i in range(n // 2)], source_code=source)

    @T.macro
    def wgmma(apk, p0, tile, ks, cfrag):
        if emulate:  # the packed values as a_packer's emulation keeps them, two per slot
            product(
                cfrag, lambda w, row, k: apk[w * 32 + a_lane(row, k)[0], 2 * p0 + a_lane(row, k)[1]],
                lambda k, j: b_value(tile, ks, k, j),
            )
        else:
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                T.evaluate(call(apk, p0, tile, ks, cfrag, tx))

    return wgmma


def packed_a(threads: int, steps: int, dtype: str, emulate: bool) -> tuple[tuple[int, int], str]:
    """(shape, dtype) of a buffer of ``steps`` k-steps of A operands as ``a_packer``
    packs them: four 32-bit registers a k-step per thread (emulated: the eight 16-bit
    values themselves)."""
    return ((threads, 8 * steps), dtype) if emulate else ((threads, 4 * steps), "uint32")


def a_packer(threads: int, dtype: str, emulate: bool):
    """A T.macro ``pack(afrag, a0, apk, p0, steps)``: ``steps`` k-steps of A fragments
    (afrag[tx, a0 .. a0 + 8*steps - 1], mma's A layout) into 32-bit operand registers
    apk[tx, p0 .. p0 + 4*steps - 1] (``packed_a``), each then pinned before any later
    wgmma.fence (the compiler otherwise packs next to each wgmma, after the fence).
    Emulated: a copy (apk holds 16-bit values, 2*p0 onwards)."""
    name = f"swa_pack_{PTX_TYPE[dtype]}"

    @T.macro
    def pack(afrag, a0, apk, p0, steps):
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for i in T.unroll(steps * 4):
                if emulate:
                    for h in T.unroll(2):
                        apk[tx, 2 * (p0 + i) + h] = afrag[tx, a0 + 2 * i + h]
                else:
                    apk[tx, p0 + i] = T.cuda.func_call(name, afrag[tx, a0 + 2 * i], afrag[tx, a0 + 2 * i + 1],
                                                       source_code=COMMON_SOURCE, return_type="uint32")
                    T.evaluate(T.cuda.func_call("swa_reg_fence_r", apk[tx, p0 + i], source_code=COMMON_SOURCE))

    return pack


def per_thread(threads: int, emulate: bool, name: str):
    """A T.macro ``run()``: every thread calls ``COMMON_SOURCE``'s ``name()`` (nothing
    when emulated)."""

    @T.macro
    def run():
        if not emulate:
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                T.evaluate(T.cuda.func_call(name, source_code=COMMON_SOURCE))

    return run


def sync_macros(threads: int, emulate: bool):
    """T.macros ``fence()``, ``commit_wait()`` (commit the group, wait for all of it),
    ``proxy_fence()`` (make this thread's shared-memory stores visible to wgmma, before
    the barrier that follows them), nothing when emulated; and ``group(steps, issue,
    acc, n, acc2=None)``: accumulators acc[tx, 0 .. n - 1] (and acc2's) pinned, a
    fence, ``issue(ks)`` (wgmma products) for each k-step, then commit, wait, and the
    accumulators pinned again (``reg_fence``), the order every product of the kernels
    keeps."""

    fence = per_thread(threads, emulate, "swa_wgmma_fence")
    commit_wait = per_thread(threads, emulate, "swa_wgmma_commit_wait0")
    pin = reg_fence(threads, emulate)

    @T.macro
    def group(steps, issue, acc, n, acc2=None):
        pin(acc, n)
        if acc2 is not None:
            pin(acc2, n)
        fence()
        for ks in T.unroll(steps):
            issue(ks)
        commit_wait()
        pin(acc, n)
        if acc2 is not None:
            pin(acc2, n)

    return fence, commit_wait, per_thread(threads, emulate, "swa_fence_proxy_async"), group


def deferred_macros(threads: int, emulate: bool):
    """T.macros for groups waited for later (``TCConfig.overlap``): ``commit()`` closes
    the thread's group, ``wait0()`` / ``wait1()`` wait until none / at most the newest
    group is pending, and ``reg_fence``'s ``pin``; nothing when emulated (the CPU's
    products are done when issued)."""

    return (per_thread(threads, emulate, "swa_wgmma_commit"), per_thread(threads, emulate, "swa_wgmma_wait0"),
            per_thread(threads, emulate, "swa_wgmma_wait1"), reg_fence(threads, emulate))


def reg_fence(threads: int, emulate: bool):
    """A T.macro ``pin(acc, n)``: an empty asm "modifying" each of the fp32 registers
    acc[tx, 0 .. n - 1], so that ordinary code writing them stays before it and code
    reading them after (nothing when emulated)."""

    @T.macro
    def pin(acc, n):
        if not emulate:
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                for i in T.unroll(n):
                    T.evaluate(T.cuda.func_call("swa_reg_fence_f", acc[tx, i], source_code=COMMON_SOURCE))

    return pin


def probe(dtype: str, operand: str, rows: int, cols: int, ks: int, swap: bool = False, emulate: bool = False):
    """A one-warpgroup PrimFunc ``probe(a, m, d)`` that isolates the instruction: d[64 x n]
    = a[64 x 16] B, B k-step ``ks`` of m[rows x cols] read as ``operand`` (``wgmma_macro``:
    n = rows for "nk", cols for "kn"), m stored in shared memory as the kernel stores its
    tiles, one wgmma. Against a plain matrix product on the GPU it says whether the
    descriptor's reading of the tiles is the hardware's, apart from everything else the
    forward does; ``swap`` builds the other reading (LBO and SBO exchanged)."""
    n = rows if operand == "nk" else cols
    steps = -(-rows * cols // 128)
    wgmma = wgmma_macro(4, dtype, operand, n, rows, emulate, swap)
    pack = a_packer(128, dtype, emulate)
    apk_shape, apk_dtype = packed_a(128, 1, dtype, emulate)
    fence, commit_wait, proxy_fence, _ = sync_macros(128, emulate)
    acc = "float32"
    zero = tirx.const(0.0, acc)

    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((64, 16), dtype), m: T.Buffer((rows, cols), dtype), d: T.Buffer((64, n), acc)):
        for blk in T.thread_binding(1, thread="blockIdx.x"):
            with T.sblock("wgmma_probe"):
                T.reads()
                T.writes()
                tile = T.alloc_buffer((rows * cols,), dtype, scope="shared")
                afrag = T.alloc_buffer((128, 8), dtype, scope="local")
                apk = T.alloc_buffer(apk_shape, apk_dtype, scope="local")
                cfrag = T.alloc_buffer((128, n // 2), acc, scope="local")
                for tx in T.thread_binding(128, thread="threadIdx.x"):
                    for x in T.serial(steps):
                        if x * 128 + tx < rows * cols:
                            tile[core_offset((x * 128 + tx) // cols, (x * 128 + tx) % cols, rows)] = m[
                                (x * 128 + tx) // cols, (x * 128 + tx) % cols
                            ]
                    for l in T.unroll(8):
                        afrag[tx, l] = a[(tx // 32) * 16 + a_pos(tx % 32, l)[0], a_pos(tx % 32, l)[1]]
                    for i in T.unroll(n // 2):
                        cfrag[tx, i] = zero
                pack(afrag, 0, apk, 0, 1)
                proxy_fence()
                fence()
                wgmma(apk, 0, tile, ks, cfrag)
                commit_wait()
                for tx in T.thread_binding(128, thread="threadIdx.x"):
                    for i in T.unroll(n // 2):
                        row, col = T.meta_var(c_pos(tx % 32, i % 4))
                        d[(tx // 32) * 16 + row, (i // 4) * 8 + col] = cfrag[tx, i]

    return func
