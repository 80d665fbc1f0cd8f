"""The CUDA kernels' numerics on the CPU: every schedule (the TE kernels' CUDA
schedule and its search space, the fused kernels on CUDA cores and on tensor cores, the
gradients) with its thread loops run serially and the warp-collective steps (mma.sync,
wgmma, shuffles) emulated lane by lane, against the float64 reference; and the fragment
and descriptor layouts the emulation rests on, against TVM's and CUTLASS's."""

import re

import pytest
import torch
from conftest import rand, rel_err
from cuda_helpers import serial_on_cpu

from swa_tvm import eager
from swa_tvm.compiler import records
from swa_tvm.spec import KernelSpec

# Compiles each kernel serially for the CPU, many with mma emulated: `make test`, not `make check`.
pytestmark = pytest.mark.slow


def _assert_grid_divides_by_no_symbolic_extent(func) -> None:
    """Every block-index loop of a TE CUDA kernel: blockIdx.x's extent free of B and H
    (batch and heads are the grid's z and y axes), so no block index is divided by a
    product of symbolic extents (TVM's buffer compaction took 11-13 s per kernel on those
    divisions when one 1-D grid covered B x H x items)."""
    grid = re.findall(r'T\.thread_binding\((.*), thread="blockIdx\.([xyz])"\)', func.script())
    assert grid and {axis for _, axis in grid} >= {"x", "y"}
    for extent, axis in grid:
        names = set(re.findall(r"\b[A-Za-z_]\w*\b", extent)) - {"T", "int64", "int32"}
        if axis == "x":
            assert not names & {"B", "H"}, extent
        else:  # heads, batch, or (a band unbounded on the right) their product and the items
            assert extent.strip() in ("B", "H", "B * H") or not names & {"B", "H"}, extent


@pytest.mark.parametrize(
    "dtype,window,pattern",
    [
        ("bfloat16", (21, 0), "globals+sinks+per-head dilation"),
        ("float32", (8, 9), "symmetric, dilation 2"),
        # The band of a window unbounded on the right (T + 5 partners): a stage over it
        # whose loops were all fused failed to lower before 2026-12-03.
        ("float32", (5, -1), "unbounded right, dilation 2"),
    ],
)
def test_cuda_schedule_computes_the_reference(dtype, window, pattern):
    import tvm
    from tvm import s_tir

    from swa_tvm.compute import prim_func
    from swa_tvm.schedules import cuda

    extras = "globals" in pattern
    spec = KernelSpec("local", 16, dtype, *window, max_dilation=2, extras=extras)
    sch = s_tir.Schedule(tvm.IRModule({spec.name: prim_func(spec, target_kind="cuda")}))
    sch.work_on(spec.name)
    cuda.schedule(sch, spec)
    _assert_grid_divides_by_no_symbolic_extent(sch.mod[spec.name])
    kernel = serial_on_cpu(sch.mod)[spec.name]

    dilation = [1, 2, 1, 2] if extras else [2, 2, 2, 2]
    tol = 3e-3 if dtype == "bfloat16" else 1e-5  # bf16: the output's rounding
    _check_local_kernel(kernel, dtype, window, dilation, extras, tol, Hkv=4, D=16)


@pytest.mark.parametrize("causal", [True, False])
def test_cuda_global_schedule_computes_the_reference(causal):
    """The global rows' kernel under its CUDA schedule (serial on the CPU): two key
    chunks, the second partial; one row block, padded; GQA; learned sinks."""
    import tvm
    from tvm import s_tir

    from swa_tvm.compute.forward import GLOBAL_CHUNK
    from swa_tvm.compute import prim_func
    from swa_tvm.reference import sliding_window_attention_ref
    from swa_tvm.schedules import cuda

    spec = KernelSpec("global", 16, "float32", 0, 0 if causal else -1)
    sch = s_tir.Schedule(tvm.IRModule({spec.name: prim_func(spec, target_kind="cuda")}))
    sch.work_on(spec.name)
    cuda.schedule(sch, spec)
    kernel = serial_on_cpu(sch.mod)[spec.name]

    B, H, Hkv, T, D = 2, 4, 2, GLOBAL_CHUNK + 44, 16
    q, k, v = rand(B, H, T, D), rand(B, Hkv, T, D), rand(B, Hkv, T, D)
    gidx = torch.tensor([[3, 150, T - 1], [0, 77, GLOBAL_CHUNK + 5]], dtype=torch.int32)
    sink = rand(H)
    window = (3, 0) if causal else (3, 3)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, window_size=window, global_idx=gidx, sink_logits=sink)
    gi = gidx.long()
    qg = torch.gather(q, 2, gi[:, None, :, None].expand(B, H, 3, D)).contiguous()
    out, lse = torch.empty(B, H, 3, D), torch.empty(B, H, 3)
    kernel(qg, k, v, gidx, sink, D**-0.5, out, lse)
    want = torch.gather(ref_out, 2, gi[:, None, :, None].expand(B, H, 3, D))
    assert rel_err(out, want) < 1e-5
    assert (lse.double() - torch.gather(ref_lse, 2, gi[:, None, :].expand(B, H, 3))).abs().max() < 1e-5


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cuda_search_space_points_replay_and_compute_the_reference(seed):
    """A random point of the CUDA search space (schedules/cuda.py with Sampled knobs, what
    `swa-tvm tune --target cuda` measures), sampled on the concrete tuning workload and
    replayed on the symbolic-T kernel as export replays a record, computes the reference
    at another shape (run serially on the CPU)."""
    import tvm
    from tvm import s_tir

    from swa_tvm.schedules import cpu, cuda

    spec = KernelSpec("local", 16, "float16", 8, 9, max_dilation=2, extras=True)
    sch = s_tir.Schedule(records.tuning_workload(spec, target_kind="cuda"), seed=seed)
    cuda.schedule(sch, spec, cpu.Sampled())
    kinds = [i.kind.name for i in sch.trace.insts]
    assert "SamplePerfectTile" in kinds and "SampleCategorical" in kinds
    func = records.apply_record(spec, sch.trace, "cuda")
    _assert_grid_divides_by_no_symbolic_extent(func)
    kernel = serial_on_cpu(tvm.IRModule({spec.name: func}))[spec.name]
    _check_local_kernel(kernel, "float16", (8, 9), [1, 2, 1, 2], True, 3e-3, Hkv=4, D=16)


@pytest.mark.parametrize("dtype,seed", [("float16", 1), ("bfloat16", 2)])
def test_cuda_tensor_core_space_computes_the_reference_and_issues_wmma(dtype, seed):
    """The search space's tensor-core design space (score product on wmma 16x16x16):
    a random point replayed on the symbolic kernel compiles for sm_90 with the dtype's
    wmma fragments and mma; the same point with the 16x16 steps left as loops (what the
    wmma intrinsics replace, matched by TVM's tensorize against their descriptions)
    computes the reference, run serially on the CPU."""
    import tvm
    from tvm import s_tir

    from swa_tvm.compiler.build import cuda_source
    from swa_tvm.schedules import cpu, cuda

    records.preload_tensor_intrin()
    spec = KernelSpec("local", 32, dtype, 15, 16, max_dilation=2, extras=True)  # band 64 keys
    assert cuda.tensor_cores_apply(spec)
    assert not cuda.tensor_cores_apply(KernelSpec("local", 40, dtype, 7, 0))  # head dim 40
    assert not cuda.tensor_cores_apply(KernelSpec("local", 32, dtype, -1, 0))  # no band
    assert not cuda.tensor_cores_apply(KernelSpec("local", 32, "float32", 15, 16))
    sch = s_tir.Schedule(records.tuning_workload(spec, target_kind="cuda"), seed=seed)
    cuda.schedule(sch, spec, cpu.Sampled(), tensor_cores=True)
    assert [i.kind.name for i in sch.trace.insts].count("Tensorize") == 5
    func = records.apply_record(spec, sch.trace, "cuda")
    target = {"kind": "cuda", "arch": "sm_90"}
    src = cuda_source(tvm.compile(tvm.IRModule({spec.name: func}), target=tvm.target.Target(target)).mod)
    half = {"float16": "half", "bfloat16": "nv_bfloat16"}[dtype]
    assert f"wmma::matrix_a, 16, 16, 16, {half}" in src and "wmma::mma_sync" in src

    loops = s_tir.Schedule(records.tuning_workload(spec, target_kind="cuda"), seed=seed)
    cuda.schedule(loops, spec, cpu.Sampled(), tensor_cores=True, tensorize=False)
    kernel = serial_on_cpu(tvm.IRModule({spec.name: records.apply_record(spec, loops.trace, "cuda")}))[spec.name]
    _check_local_kernel(kernel, dtype, (15, 16), [1, 2, 1, 2], True, 3e-3, Hkv=4, D=32)


def _pattern_inputs(dtype, window, dilation, extras, B=2, H=4, Hkv=2, T=150, D=32, ramp=0.0):
    """Fresh inputs of one pattern, the kernel's extra arguments, and the rows a local
    kernel owns (global rows belong to the global kernel). ``ramp``: key j scaled by
    1 + ramp * j / T, so that rows' score maxima keep growing along the keys."""
    from swa_tvm.eager import _extra_positions

    tdt = getattr(torch, dtype)
    q = rand(B, H, T, D).to(tdt)
    k, v = (rand(B, Hkv, T, D) for _ in range(2))
    k, v = (k * (1 + ramp * torch.arange(T) / T)[:, None]).to(tdt), v.to(tdt)
    kw = dict(window_size=window, dilation=torch.tensor(dilation, dtype=torch.int32))
    if extras:
        kw.update(global_idx=torch.tensor([[3, 77], [100, 5]], dtype=torch.int32), num_sinks=2, sink_logits=rand(H))
    sink = kw.get("sink_logits", torch.full((H,), float("-inf")))
    extra = _extra_positions(kw.get("global_idx"), kw.get("num_sinks", 0), B, "cpu")
    rows = torch.ones(B, 1, T, dtype=torch.bool)
    for b, gs in enumerate(kw.get("global_idx", torch.empty(B, 0)).tolist()):
        rows[b, 0, gs] = False
    return (q, k, v), kw, ([extra] if extras else []) + [sink], rows.expand(B, H, T)


def _check_local_kernel(kernel, dtype, window, dilation, extras, tol, **shape):
    """Call a local kernel on fresh inputs of one pattern (outputs NaN-filled first, so
    a row left unwritten fails) and compare the rows it owns with the float64
    reference: out within ``tol`` (relative), lse within 1e-5 (and fp32's rounding)."""
    from swa_tvm.reference import sliding_window_attention_ref

    (q, k, v), kw, extra_args, keep = _pattern_inputs(dtype, window, dilation, extras, **shape)
    B, H, T, D = q.shape
    out = torch.full((B, H, T, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, T), float("nan"))
    kernel(q, k, v, kw["dilation"], *extra_args, D**-0.5, out, lse)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    assert rel_err(out[keep], ref_out[keep]) < tol
    # lse: 1e-5, plus 4 fp32 rounding units of its magnitude (large with a ramp).
    assert ((lse.double() - ref_lse).abs() - 4 * 2.0**-23 * ref_lse.abs())[keep].max() < 1e-5


@pytest.mark.parametrize(
    "dtype,window,dilation,extras,config",
    [
        # Default tiles; globals, sinks and per-head dilation up to 3 (items past the end
        # for the heads with less); band chunks the causal edge skips.
        ("bfloat16", (21, 0), [1, 3, 2, 1], True, None),
        # Small tiles (more chunks, fewer threads than rows x columns); both sides.
        ("float32", (8, 9), [2, 2, 2, 2], False, (32, 16, 64)),
        # Unbounded left side (causal full attention): the band is the residue sequence.
        ("float16", (-1, 0), [1, 2, 1, 1], False, (32, 16, 64)),
        # Unbounded right side, plus extras that fall inside some rows' windows.
        ("float32", (5, -1), [1, 1, 2, 1], True, (16, 16, 64)),
        # A window long against the block: chunks every row sees whole skip the mask.
        ("float32", (100, 20), [1, 2, 1, 1], False, (16, 16, 64)),
    ],
)
def test_cuda_flash_kernel_computes_the_reference(dtype, window, dilation, extras, config):
    """The fused CUDA kernel (schedules/cuda_flash.py), its thread loops run serially on
    the CPU: every phase in the GPU's order, every row written, against the float64
    reference."""
    from swa_tvm.schedules import cuda_flash

    spec = KernelSpec("local", 32, dtype, *window, max_dilation=max(dilation), extras=extras)
    cfg = cuda_flash.FlashConfig(*config) if config else None
    kernel = serial_on_cpu(cuda_flash.flash(spec, cfg))[spec.name]
    tol = 1e-5 if dtype == "float32" else {"bfloat16": 3e-3, "float16": 5e-4}[dtype]  # the output's rounding
    _check_local_kernel(kernel, dtype, window, dilation, extras, tol)


@pytest.mark.parametrize(
    "dtype,window,dilation,extras,config,ramp",
    [
        # Globals, sinks, per-head dilation up to 3; two warps, one 16-key score tile
        # pair; K and V chunks by cp.async (a copy per thread and 16 bytes, as the GPU's).
        ("bfloat16", (21, 0), [1, 3, 2, 1], True, (2, 16, True, True), 0.0),
        # Both sides, 32-key chunks (two k-steps of P V per chunk); V's operands by
        # 16-bit loads instead of ldmatrix.
        ("float16", (8, 9), [2, 2, 2, 2], False, (2, 32, False), 0.0),
        # A window long against the block: chunks every row sees whole skip the mask.
        ("float16", (100, 20), [1, 2, 1, 1], False, (2, 16), 0.0),
        # Two 16-row tiles per warp (Q's A fragments re-read from its shared tile), cp.async.
        ("float16", (8, 9), [2, 2, 2, 2], False, (2, 32, True, True, 2), 0.0),
        # Three per warp, extras, 16-bit loads.
        ("bfloat16", (21, 0), [1, 3, 2, 1], True, (1, 16, False, False, 3), 0.0),
        # wgmma (a warpgroup, K and V as core matrices, emulated): extras, then cp.async.
        ("bfloat16", (21, 0), [1, 3, 2, 1], True, (4, 16, True, False, 1, True), 0.0),
        ("float16", (8, 9), [2, 2, 2, 2], False, (4, 32, True, True, 1, True), 0.0),
        # wgmma with V's tile transposed (both operands K-major).
        ("bfloat16", (8, 9), [1, 2, 1, 3], False, (4, 16, True, False, 1, True, True), 0.0),
        # Scores growing along the keys (ramp: a row's max moves by about the lazy
        # rescaling's slack, 8 log2 units, from chunk to chunk: some moves taken, some
        # not), a sink; mma.sync, then wgmma.
        ("float16", (100, 20), [1, 2, 1, 1], True, (2, 16), 20.0),
        ("bfloat16", (100, 20), [1, 1, 2, 1], True, (4, 16, True, True, 1, True), 20.0),
        # wgmma overlapped (chunk c's Q K^T with chunk c - 1's P V, V a chunk behind K):
        # extras after the stream; V transposed with a ramp; a long window.
        ("bfloat16", (21, 0), [1, 3, 2, 1], True, (4, 16, True, False, 1, True, False, None, True), 0.0),
        ("float16", (8, 9), [2, 2, 2, 2], False, (4, 32, True, False, 1, True, True, None, True), 20.0),
        ("bfloat16", (100, 20), [1, 1, 2, 1], True, (4, 16, True, False, 1, True, False, None, True), 20.0),
        # Two K/V stages (chunks alternate between two tile pairs, copies a chunk ahead):
        # extras after the stream (in the ring's freed tiles); two row tiles a warp with a
        # ramp; wgmma on a long window.
        ("bfloat16", (21, 0), [1, 3, 2, 1], True, (2, 16, True, True, 1, False, False, None, False, 2), 0.0),
        ("float16", (8, 9), [2, 2, 2, 2], False, (2, 16, True, True, 2, False, False, None, False, 2), 20.0),
        ("bfloat16", (100, 20), [1, 1, 2, 1], True, (4, 16, True, True, 1, True, False, None, False, 2), 20.0),
    ],
)
def test_cuda_flash_tc_kernel_computes_the_reference(dtype, window, dilation, extras, config, ramp):
    """The tensor-core kernel (schedules/cuda_flash_tc.py) with its warp-collective steps
    (mma.sync, 4-lane reductions) emulated lane by lane and its thread loops run serially
    on the CPU: fragment addressing, masks, online softmax and the reuse of score
    fragments as P V operands, against the float64 reference."""
    from swa_tvm.schedules import cuda_flash_tc

    spec = KernelSpec("local", 32, dtype, *window, max_dilation=max(dilation), extras=extras)
    func = cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(*config), emulate=True)
    kernel = serial_on_cpu(func)[spec.name]
    # P enters the P V product in the input dtype, as in FlashAttention: bf16 rounds it.
    _check_local_kernel(kernel, dtype, window, dilation, extras, {"bfloat16": 4e-3, "float16": 5e-4}[dtype], ramp=ramp)


@pytest.mark.parametrize(
    "kernel_kind,dtype,causal",
    [("tc", "bfloat16", True), ("tc", "float16", False), ("tc_wgmma", "bfloat16", True),
     ("tc_wgmma_overlap", "float16", True), ("tc_ring", "bfloat16", True), ("tc_ring", "float16", False),
     ("cores", "float32", True), ("cores", "float32", False)],
)
def test_cuda_flash_global_rows_compute_the_reference(kernel_kind, dtype, causal):
    """Global rows on the fused kernels (serial on the CPU; the tensor-core one emulated):
    a block of 32 rows (on tensor cores two warps, or one warp of two 16-row tiles) and a
    padded one, unsorted positions; GQA; learned sinks; keys in chunks up to the block's
    last position. On tensor cores split-K: the keys in 3 or 4 pieces (the caller's
    workspace), a block each (causal: pieces past a block's last position left empty),
    then combined with the sink; and on wgmma (a warpgroup: a block of 64 rows, padded),
    also overlapped (TCConfig.overlap; the empty pieces take its no-chunk path); with two
    K/V stages (TCConfig.stages; odd and even chunk counts, empty pieces)."""
    from swa_tvm.reference import sliding_window_attention_ref
    from swa_tvm.schedules import cuda_flash, cuda_flash_tc

    spec = KernelSpec("global", 32, dtype, 0, 0 if causal else -1)
    if kernel_kind.startswith("tc"):  # causal: K and V chunks by cp.async; else one warp of two 16-row tiles
        cfg = cuda_flash_tc.TCConfig(2, 16, async_copy=True) if causal else cuda_flash_tc.TCConfig(1, 16, m_tiles=2)
        if kernel_kind == "tc_wgmma":
            cfg = cuda_flash_tc.TCConfig(4, 16, async_copy=True, wgmma=True)
        if kernel_kind == "tc_wgmma_overlap":
            cfg = cuda_flash_tc.TCConfig(4, 16, wgmma=True, overlap=True)
        if kernel_kind == "tc_ring":
            cfg = cuda_flash_tc.TCConfig(2, 16, async_copy=True, m_tiles=1 if causal else 2, stages=2)
        func = cuda_flash_tc.flash_tc(spec, cfg, emulate=True)
    else:
        func = cuda_flash.flash(spec, cuda_flash.FlashConfig(32, 16, 64))
    kernel = serial_on_cpu(func)[spec.name]
    B, H, Hkv, T, D = 2, 4, 2, 150, 32
    tdt = getattr(torch, dtype)
    q, k, v = rand(B, H, T, D).to(tdt), rand(B, Hkv, T, D).to(tdt), rand(B, Hkv, T, D).to(tdt)
    # 35 global rows: one full block of 32 and a padded one.
    gidx = torch.stack([torch.randperm(T)[:35] for _ in range(B)]).to(torch.int32)
    sink = rand(H)
    window = (3, 0) if causal else (3, 3)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, window_size=window, global_idx=gidx, sink_logits=sink)
    gi = gidx.long()
    G = gi.shape[1]
    qg = torch.gather(q, 2, gi[:, None, :, None].expand(B, H, G, D)).contiguous()
    out, lse = torch.full((B, H, G, D), float("nan"), dtype=tdt), torch.full((B, H, G), float("nan"))
    if kernel_kind.startswith("tc"):  # garbage in the workspace: every piece must write its share
        S = 4 if causal else 3
        workspace = (torch.full((B, H, S, G, D), float("nan")), torch.full((B, H, S, G), float("nan")))
        kernel(qg, k, v, gidx, sink, D**-0.5, out, lse, *workspace)
    else:
        kernel(qg, k, v, gidx, sink, D**-0.5, out, lse)
    want = torch.gather(ref_out, 2, gi[:, None, :, None].expand(B, H, G, D))
    assert rel_err(out, want) < {"bfloat16": 4e-3, "float16": 5e-4, "float32": 1e-5}[dtype]
    assert (lse.double() - torch.gather(ref_lse, 2, gi[:, None, :].expand(B, H, G))).abs().max() < 1e-5


def test_mma_fragment_maps_are_the_hardware_layout():
    """The tensor-core kernel's fragment maps (and so its emulation) against TVM's own
    m16n8k16 maps, whose ldmatrix/mma/store intrinsics run on GPUs: A fragments whole,
    C fragments whole (the first 16x8 tile of TVM's 16x16 accumulator), B fragments'
    lanes (TVM's trans_b B is stored n x k, as the kernel's K tile). Then the identity
    the kernel's P·V rests on: score C values l of tiles 2s and 2s+1 are, at A index
    4*(tile % 2) + l, the A fragment of the probabilities' k-step s."""
    from swa_tvm.compiler.records import preload_tensor_intrin

    preload_tensor_intrin()  # the intrinsics' module parses hundreds of TVMScript functions on import
    from tvm.s_tir.tensor_intrin.cuda import (
        ldmatrix_32x8_to_shared_16x16_layout,
        shared_16x16_to_ldmatrix_32x8_layout,
    )

    from swa_tvm.schedules.cuda_flash_tc import a_lane, a_pos, b_lane, b_pos, c_lane, c_pos

    for lane in range(32):
        for l in range(8):
            assert a_pos(lane, l) == ldmatrix_32x8_to_shared_16x16_layout(lane, l)
            assert a_lane(*a_pos(lane, l)) == (lane, l)
        for l in range(4):
            row, col = c_pos(lane, l)
            assert shared_16x16_to_ldmatrix_32x8_layout(row, col) == (lane, l) and c_lane(row, col) == (lane, l)
            k, n = b_pos(lane, l)
            assert shared_16x16_to_ldmatrix_32x8_layout(n, k)[0] == lane and b_lane(k, n) == (lane, l)
            for half in (0, 1):
                assert a_pos(lane, 4 * half + l) == (row, 8 * half + col)
    # ldmatrix.x4.trans of a row-major [k][n] tile (V; the chunk tiles of the gradients'
    # dq/dk/dv products): lane t gives the address of row t % 16, column 8 * (t // 16)
    # (TVM's own offset for its B-operand ldmatrix.trans, get_ldmatrix_intrin), and,
    # under the PTX ISA's .trans map, every value it gets back is where the B fragment of
    # the output tile (first or second 8 columns) wants it.
    from swa_tvm.schedules.cuda_flash_tc import ldsm_row, ldsm_value

    for ks, ndp in ((0, 0), (1, 2)):
        for lane in range(32):
            assert ldsm_row(lane, ks, ndp) == (16 * ks + lane % 16, 16 * ndp + 8 * (lane // 16))
            for slot in range(8):
                src, col = ldsm_value(lane, slot)
                row, col0 = ldsm_row(src, ks, ndp)
                k, n = b_pos(lane, slot % 4)
                assert (row, col0 + col) == (16 * ks + k, 8 * (2 * ndp + slot // 4) + n), (lane, slot)
    # ldmatrix.x4 (no transpose) of a row-major 16 x 16 tile (Q's A operand with two
    # 16-row tiles per warp): lane t gives row t % 16, column 8 * (t // 16) (TVM's
    # A-operand ldmatrix offset), and every value lands where the A fragment wants it.
    from swa_tvm.schedules.cuda_flash_tc import ldsm_a_row, ldsm_a_value

    for lane in range(32):
        assert ldsm_a_row(lane) == (lane % 16, 8 * (lane // 16))
        for slot in range(8):
            src, col = ldsm_a_value(lane, slot)
            row, col0 = ldsm_a_row(src)
            assert (row, col0 + col) == a_pos(lane, slot), (lane, slot)
    # ldmatrix.x4 (no transpose) of K's rows (n) for the B operands of Q K^T: every
    # value lands where the B fragment of its score tile (first or second of the pair)
    # wants it.
    from swa_tvm.schedules.cuda_flash_tc import ldsm_nk_row

    for ntp, ks in ((0, 0), (3, 5)):
        for lane in range(32):
            for slot in range(8):
                src, col = ldsm_a_value(lane, slot)
                row, col0 = ldsm_nk_row(src, ntp, ks)
                k, n = b_pos(lane, slot % 4)
                assert (row, col0 + col) == (8 * (2 * ntp + slot // 4) + n, 16 * ks + k), (lane, slot)
    # Every position of each operand is held exactly once.
    assert len({a_pos(t, l) for t in range(32) for l in range(8)}) == 256
    assert len({b_pos(t, l) for t in range(32) for l in range(4)}) == 128
    assert len({c_pos(t, l) for t in range(32) for l in range(4)}) == 128


def test_wgmma_descriptors_name_the_tiles_layout():
    """Every element wgmma reads through a descriptor of ``descriptor_fields`` (per
    CUTLASS's canonical no-swizzle layouts, ``canonical_address``) is the element of the
    product the kernel means, where ``core_offset`` (its tiles' layout, which its loaders
    write) keeps it: K's tile as K-major B of Q K^T, V's as MN-major B of P V; all
    within the 14-bit fields, in 16-byte units."""
    from swa_tvm.schedules.cuda_wgmma import canonical_address, core_offset, descriptor_fields

    for rows, cols in ((64, 128), (16, 32), (128, 64)):
        for ks in range(cols // 16):  # K tile: B[k][n] = tile[n][16 ks + k], n < rows
            start, lbo, sbo = descriptor_fields("nk", rows, ks)
            assert start % 16 == lbo % 16 == sbo % 16 == 0 and max(start, lbo, sbo) < 2**18
            for n in range(rows):
                for k in range(16):
                    assert canonical_address(start, lbo, sbo, "K", n, k) == 2 * core_offset(n, 16 * ks + k, rows)
        for ks in range(rows // 16):  # V tile: B[k][n] = tile[16 ks + k][n], n < cols
            start, lbo, sbo = descriptor_fields("kn", rows, ks)
            for n in range(cols):
                for k in range(16):
                    assert canonical_address(start, lbo, sbo, "MN", n, k) == 2 * core_offset(16 * ks + k, n, rows)
        # The layout is one-to-one onto the tile.
        assert sorted(core_offset(r, c, rows) for r in range(rows) for c in range(cols)) == list(range(rows * cols))


# Backward cases: (dtype, window, per-head dilation, globals with separate projections,
# sinks and learned sink logits, GQA; the tolerance is the gradients' rounding; the fused
# kernels' tiles (block, chunk, threads), None for the default: small ones make several
# items and chunks of T=45, and fewer threads than a tile's rows x columns).
BACKWARD_CASES = {
    "bf16_causal_everything": ("bfloat16", (8, 0), [1, 2, 1, 2], True, 1e-2, (16, 16, 64)),
    "fp32_both_sides_dilation_2": ("float32", (5, 7), [2, 2, 2, 2], False, 1e-5, (16, 8, 32)),
    "fp16_unbounded_left": ("float16", (-1, 0), [1, 1, 2, 1], False, 2e-3, None),
    "fp32_long_window": ("float32", (30, 3), [1, 2, 1, 1], True, 1e-5, (16, 16, 64)),
    "bf16_unbounded_right": ("bfloat16", (4, -1), [2, 1, 1, 1], True, 1e-2, (16, 16, 64)),
}


# The tensor-core backward's tiles (warps, chunk[, ldmatrix]) and head dim for the
# half-precision cases: one warp (16 rows) makes several items of T=45; 32-key chunks make two k-steps
# of the dS/P products, head dim 32 two of S and dP.
TC_BACKWARD_CONFIGS = {
    "bf16_causal_everything": ((1, 16), 32),
    "fp16_unbounded_left": ((2, 32, False), 16),  # 16-bit loads instead of ldmatrix
    "bf16_unbounded_right": ((1, 32), 32),
}
# And on wgmma (a warpgroup of 4 warps: 64 rows an item; two warpgroups: 128), emulated.
TC_WGMMA_BACKWARD_CONFIGS = {
    "bf16_causal_everything": ((4, 16, True, True), 32),
    "fp16_unbounded_left": ((4, 32, True, True), 16),
    "bf16_unbounded_right": ((8, 16, True, True), 32),
}
# And with two chunk stages by cp.async (TCBwdConfig.stages; copies emulated as plain
# stores): every ring loop (band dq and dk/dv, extra keys' dk/dv, split-K global dq) on
# wgmma with extra keys and globals, one warp on mma.sync over a long band, 16-bit loads.
TC_RING_BACKWARD_CONFIGS = {
    "bf16_causal_everything": ((4, 16, True, True, 2), 32),
    "fp16_unbounded_left": ((1, 16, True, False, 2), 16),
    "bf16_unbounded_right": ((2, 32, False, False, 2), 32),
}


# Each case on each build of the gradient kernels; the tensor-core ones take
# float16/bfloat16, the cases their tables list.
BACKWARD_BUILDS = {"cores": BACKWARD_CASES, "tc": TC_BACKWARD_CONFIGS, "tc_wgmma": TC_WGMMA_BACKWARD_CONFIGS,
                   "tc_ring": TC_RING_BACKWARD_CONFIGS, "te": BACKWARD_CASES}


@pytest.mark.parametrize("case,fused", [(c, f) for c in BACKWARD_CASES for f, cases in BACKWARD_BUILDS.items() if c in cases])
def test_cuda_backward_kernels_compute_the_reference_gradients(case, fused, monkeypatch):
    """The whole backward (``eager.attention_backward``: delta, sink gradient, the
    global rows' split, GQA sums) with every gradient kernel as the CUDA build makes it
    ("cores": all on the fused kernels of schedules/cuda_flash_bwd.py; "tc": on the
    tensor-core ones of schedules/cuda_flash_bwd_tc.py, mma emulated lane by lane;
    "tc_wgmma": the same on wgmma, emulated; "tc_ring": with two chunk stages; "te": on
    the TE kernels' CUDA schedule),
    run serially on the CPU, against autograd through the float64 dense reference. On
    tensor cores the global rows' dq is split-K: 3 pieces of the keys (empty ones among
    them), summed."""
    import tvm
    from tvm import s_tir

    from swa_tvm.compute import prim_func
    from tools.gpu_check import sink_grad_err
    from swa_tvm.runtime.library import GLOBAL_BWD_WORKSPACE, Kernel
    from swa_tvm.reference import sliding_window_attention_ref
    from swa_tvm.schedules import cuda, cuda_flash_bwd, cuda_flash_bwd_tc
    from swa_tvm.spec import BACKWARD_KINDS

    tc_configs = BACKWARD_BUILDS[fused]
    config = BACKWARD_CASES[case][5]
    built = []

    def serial_cuda_kernel(want, device):
        assert want.kind in BACKWARD_KINDS, "the forward comes from the reference here"
        built.append(want.kind)
        if fused.startswith("tc"):
            cfg = cuda_flash_bwd_tc.TCBwdConfig(*tc_configs[case][0])
            func = cuda_flash_bwd_tc.flash_bwd_tc(want, cfg, emulate=True)
            # The global rows' dq split-K: functional allocates the pieces' workspace.
            workspace = GLOBAL_BWD_WORKSPACE if want.kind == "global_bwd" else None
            return Kernel(want, serial_on_cpu(func)[want.name], device, "serial, mma emulated", None, workspace)
        if fused == "cores":
            cfg = cuda_flash_bwd.BwdConfig(*config) if config else None
            return Kernel(want, serial_on_cpu(cuda_flash_bwd.flash_bwd(want, cfg))[want.name], device, "serial")
        sch = s_tir.Schedule(tvm.IRModule({want.name: prim_func(want, target_kind="cuda")}))
        sch.work_on(want.name)
        cuda.schedule(sch, want)
        return Kernel(want, serial_on_cpu(sch.mod)[want.name], device, "serial CUDA schedule")

    monkeypatch.setattr(eager, "_kernel", serial_cuda_kernel)
    monkeypatch.setattr(eager, "_fused_backward_kernel", lambda *a: None)  # a CPU kernel; CUDA's are emulated here
    monkeypatch.setattr(eager, "global_pieces", lambda B, H, G, T, device: 3)  # T=45: empty pieces too
    dtype, window, dilation, extras, tol, _ = BACKWARD_CASES[case]
    B, H, Hkv, T, G = 2, 4, 2, 45, 2
    D = tc_configs[case][1] if fused.startswith("tc") else 16
    tdt = getattr(torch, dtype)
    leaf = lambda *shape: rand(*shape).to(tdt).double().requires_grad_()  # noqa: E731 - values exact in dtype
    q, k, v = leaf(B, H, T, D), leaf(B, Hkv, T, D), leaf(B, Hkv, T, D)
    kw = dict(window_size=window, dilation=torch.tensor(dilation, dtype=torch.int32))
    if extras:
        kw.update(global_idx=torch.tensor([[3, 30], [44, 5]], dtype=torch.int32), num_sinks=2,
                  q_global=leaf(B, H, G, D), k_global=leaf(B, Hkv, T, D), v_global=leaf(B, Hkv, T, D),
                  sink_logits=leaf(H))
    leaves = [q, k, v] + [kw[n] for n in ("q_global", "k_global", "v_global", "sink_logits") if n in kw]
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    d_out, d_lse = torch.randn_like(ref_out).to(tdt).double(), torch.randn_like(ref_lse)
    want = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), leaves)

    low = lambda x: x.detach().to(tdt) if x is not None else None  # noqa: E731
    sink = kw.get("sink_logits")
    got = eager.attention_backward(
        low(d_out), d_lse.float(), low(q), low(k), low(v), kw["dilation"], kw.get("global_idx"),
        low(kw.get("q_global")), low(kw.get("k_global")), low(kw.get("v_global")), kw.get("num_sinks", 0),
        sink.detach().float() if sink is not None else None, D**-0.5, *window, low(ref_out), ref_lse.float(),
    )
    assert sorted(built) == sorted(["local_dq", "local_dkv"] + (["local_dx", "global_bwd"] if extras else []))
    names = ["dq", "dk", "dv", "dq_global", "dk_global", "dv_global", "dsink_logits"]
    given = [True, True, True] + [n in kw for n in ("q_global", "k_global", "v_global", "sink_logits")]
    for name, a, b in zip([n for n, g in zip(names, given) if g], [a for a, g in zip(got, given) if g], want):
        assert a.dtype == (torch.float32 if name == "dsink_logits" else tdt), name
        if name == "dsink_logits":  # relative to its terms, which cancel (see sink_grad_err)
            e = sink_grad_err(a, b, sink, ref_out, ref_lse, d_out, d_lse)
        else:
            e = rel_err(a, b)
        assert e < tol, f"{name} relative error {e:.2e} >= {tol}"


@pytest.mark.parametrize("pieces", [1, 3])
def test_tensor_core_forward_through_functional(pieces, monkeypatch):
    """The forward as functional runs it on a GPU, with the tensor-core kernels (serial,
    mma emulated): the window with extra keys, then the split-K global rows, whose
    workspace functional allocates (``pieces`` of the keys, in place of
    global_pieces's choice for the GPU) and passes after lse, as the manifest says."""
    from swa_tvm.runtime.library import GLOBAL_WORKSPACE, Kernel
    from swa_tvm.reference import sliding_window_attention_ref
    from swa_tvm.schedules import cuda_flash_tc

    def serial_tc_kernel(want, device):
        func = cuda_flash_tc.flash_tc(want, cuda_flash_tc.TCConfig(2, 16), emulate=True)
        workspace = GLOBAL_WORKSPACE if want.kind == "global" else None
        return Kernel(want, serial_on_cpu(func)[want.name], device, "serial, mma emulated", None, workspace)

    monkeypatch.setattr(eager, "_kernel", serial_tc_kernel)
    monkeypatch.setattr(eager, "_fused_backward_kernel", lambda *a: None)  # a CPU kernel; CUDA's are emulated here
    monkeypatch.setattr(eager, "global_pieces", lambda B, H, G, T, device: pieces)
    B, H, Hkv, T, D = 2, 4, 2, 90, 32
    q, k, v = rand(B, H, T, D).bfloat16(), rand(B, Hkv, T, D).bfloat16(), rand(B, Hkv, T, D).bfloat16()
    gidx = torch.tensor([[3, 50, 88], [70, 1, 20]], dtype=torch.int32)
    sink = rand(H)
    kw = dict(window_size=(9, 0), global_idx=gidx, num_sinks=1, sink_logits=sink)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    out, lse = eager.attention_forward(
        q, k, v, torch.ones(H, dtype=torch.int32), gidx, None, None, None, 1, sink, D**-0.5, 9, 0
    )
    assert rel_err(out, ref_out) < 4e-3
    assert (lse.double() - ref_lse).abs().max() < 1e-5
