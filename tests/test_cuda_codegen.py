"""The CUDA kernels' generated code, without a GPU: barriers and fences by
tools.cuda_races's model of the source, loop structure and launch bounds in the source,
the machine code of the hot loops (nvcc's cubin read by tools.sass), the schedules'
configuration checks and which kernel each spec gets."""

import collections
import dataclasses
import re

import pytest

from swa_tvm.compiler import build, records
from swa_tvm.spec import CPU_ONLY_KINDS, AttentionSpec, KernelSpec

# Compiles CUDA kernels and runs nvcc: `make test`, not `make check`.
pytestmark = pytest.mark.slow


def test_fused_cuda_kernels_have_the_barriers_they_need():
    """No shared-memory race in the generated source of every fused kernel (forward and
    gradients, tensor cores and CUDA cores, local rows with extra keys and global rows),
    of the forward with cp.async loads (one and two K/V stages) and of the gradient
    kernels with two chunk stages, by tools.cuda_races's model. The serial CPU runs
    cannot see a barrier: TVM places most of them (its planner), the async loads' waits
    and barriers are ours. Dropping any one of the async loops' waits or barriers is
    caught."""
    import tvm

    from tools.cuda_races import dynamic, generated_source, kernel_bodies, races
    from swa_tvm.schedules import cuda_flash_bwd_tc, cuda_flash_tc

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    funcs = {}
    for dtype in ("bfloat16", "float32"):
        for k in AttentionSpec.parse(f"head_dim=32,window=63:0,globals,backward,dtype={dtype}").kernels():
            if k.kind not in CPU_ONLY_KINDS:  # the five-product backward is a CPU kernel
                funcs[k.name] = build.schedule_spec(k, target)
    # The cp.async forwards, with one and with two 16-row tiles per warp (Q's own tile).
    local, glob = KernelSpec("local", 32, "bfloat16", 63, 0, extras=True), KernelSpec("global", 32, "float16", 0, -1)
    streamed = []
    for k, m_tiles in ((local, 1), (glob, 1), (local, 2)):
        name = f"{k.name}__m{m_tiles}"
        funcs[name] = cuda_flash_tc.flash_tc(k, cuda_flash_tc.TCConfig(2, 32, async_copy=True, m_tiles=m_tiles))
        funcs[name] = funcs[name].with_attr("global_symbol", name)
        streamed.append(name)
    ringed = []
    for k, m_tiles in ((local, 1), (glob, 1), (local, 2)):
        name = f"{k.name}__ring{m_tiles}"
        cfg = cuda_flash_tc.TCConfig(2, 32, async_copy=True, m_tiles=m_tiles, stages=2)
        funcs[name] = cuda_flash_tc.flash_tc(k, cfg).with_attr("global_symbol", name)
        ringed.append(name)
    # The gradient kernels' rings: the second stage's tiles (A1, B1) and, for dk/dv and
    # the extra keys', lse and delta tables (lse1) by cp.async.
    second = {}
    for kind in ("local_dq", "local_dkv", "local_dx", "global_bwd"):
        k = KernelSpec(kind, 32, "bfloat16", 63, 0, extras=kind in ("local_dq", "local_dx"))
        name = f"{k.name}__ring"
        cfg = cuda_flash_bwd_tc.TCBwdConfig(2, 32, stages=2)
        funcs[name] = cuda_flash_bwd_tc.flash_bwd_tc(k, cfg).with_attr("global_symbol", name)
        ringed.append(name)
        second[name] = ("A1_ptr", "B1_ptr") + (("lse1_ptr", "delta1_ptr") if kind in ("local_dkv", "local_dx") else ())
    bodies = kernel_bodies(generated_source(funcs))
    # Two kernels each: the global rows' gradients (three on tensor cores: the split-K
    # dq's pieces and sum, dk/dv; with and without the ring), and their split-K forward
    # on tensor cores (bf16 and the fp16 cp.async ones).
    assert len(bodies) == len(funcs) + 8
    for name, body in bodies.items():
        # Every kernel with tiles has barriers (the split-K sums have no tiles).
        assert ("__syncthreads" in body or "__shared__" not in body) and not dynamic(body), name
        assert races(body) == [], (name, races(body))
    # The streams' loops: one stage, a wait and a barrier before V's copies, again before
    # K's; two stages (two chunks a turn), before each stage's copies (the other stage's
    # chunk landed, every warp is done with this one's).
    for name, counter in [(n, "c") for n in streamed] + [(n, "i") for n in ringed]:
        body = bodies[f"{name}_kernel"]
        lines = body.splitlines()
        loop = next(i for i, line in enumerate(lines) if line.strip().startswith(f"for (int64_t {counter} "))
        steps = [i for i, line in enumerate(lines) if i > loop and "swa_cp_async_wait_all();" in line][:2]
        assert len(steps) == 2 and all(lines[i + 1].strip() == "__syncthreads();" for i in steps), name
        if name in ringed:
            between = "\n".join(lines[steps[0]:steps[1]])
            for tile in second.get(name, ("K1_ptr", "V1_ptr")):
                assert re.search(r"swa_cp_async_(16|4)\(\(&\(" + tile, between), (name, tile)
        for i in [j + d for j in steps for d in (0, 1)]:
            assert races("\n".join(lines[:i] + lines[i + 1 :])), (name, lines[i])


def test_wgmma_kernels_fence_and_barrier_what_the_tensor_cores_read():
    """The wgmma kernels (forward with synchronous and cp.async loads, V transposed,
    overlapped, two K/V stages; the gradient kernels with one and two chunk stages;
    local rows with extra keys, global rows) by
    tools.cuda_races: no shared-memory race, and every tile the tensor cores read
    (the async proxy) was fenced by its writers, then barriered, after its last write;
    deleting any one of those fences is caught."""
    from tools.cuda_races import deletions, dynamic, generated_source, kernel_bodies, races
    from swa_tvm.schedules import cuda_flash_bwd_tc, cuda_flash_tc

    local, glob = KernelSpec("local", 32, "bfloat16", 63, 0, extras=True), KernelSpec("global", 32, "bfloat16", 0, -1)
    funcs = {}
    for k, cfg in ((local, (4, 32, True, False, 1, True)), (local, (4, 32, True, True, 1, True)),
                   (local, (4, 32, True, False, 1, True, True)), (glob, (4, 32, True, True, 1, True)),
                   (local, (4, 32, True, False, 1, True, False, None, True)),
                   (glob, (4, 32, True, False, 1, True, True, None, True)),
                   (local, (4, 32, True, True, 1, True, False, None, False, 2)),
                   (glob, (4, 32, True, True, 1, True, False, None, False, 2))):
        name = f"{k.name}__{'_'.join(str(int(x)) if x is not None else 'n' for x in cfg)}"
        funcs[name] = cuda_flash_tc.flash_tc(k, cuda_flash_tc.TCConfig(*cfg)).with_attr("global_symbol", name)
    for kind in ("local_dq", "local_dkv", "local_dx", "global_bwd"):
        k = KernelSpec(kind, 32, "bfloat16", 63, 0, extras=kind == "local_dx")
        for stages in (1, 2) if kind in ("local_dq", "local_dkv") else (2,):
            cfg = cuda_flash_bwd_tc.TCBwdConfig(4, 32, wgmma=True, stages=stages)
            name = f"{k.name}__s{stages}"
            funcs[name] = cuda_flash_bwd_tc.flash_bwd_tc(k, cfg).with_attr("global_symbol", name)
    bodies = {n: b for n, b in kernel_bodies(generated_source(funcs, "sm_90a")).items() if "swa_wgmma" in b}
    # The split-K combines have no wgmma; the global rows' gradients have two kernels that do.
    assert len(bodies) == len(funcs) + 1
    for name, body in bodies.items():
        assert not dynamic(body) and races(body) == [], (name, races(body))
        fences, missed = deletions(body)["proxy fences"]
        assert fences >= 1 and missed == [], (name, fences, missed)


def test_tensor_core_chunk_loops_divide_nothing():
    """The band chunk loops of the tensor-core kernels (forward, dq, dk/dv), with a
    runtime dilation, divide by nothing and hardly use int64: the work item's fields,
    chunk range and interior span are computed once per block, key positions in int32.
    Left as index expressions of blockIdx they were re-evaluated per chunk and per
    score (int64 divisions by H*nitems, nitems and the dilation as often as the mma in
    the H200 profile of bench/gpu); this fails on that code."""
    import tvm

    from tools.cuda_races import braced, generated_source, kernel_bodies

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    spec = AttentionSpec.parse("head_dim=32,window=63:0,dilation=2,globals,sinks,backward,dtype=bfloat16")
    funcs = {k.name: build.schedule_spec(k, target) for k in spec.kernels() if k.kind in ("local", "local_dq", "local_dkv")}
    bodies = kernel_bodies(generated_source(funcs))
    assert len(bodies) == 3
    for name, body in bodies.items():
        loop = braced(body, body.index("for (int64_t c = "))
        assert "swa_mma_bf16(" in loop, name
        assert re.findall(r"[^/*]/[^/*]|%", loop) == [], name
        # The loads' 64-bit addresses, in two forms (clamped rows, and the chunks inside
        # the sequence unclamped): 80 in dk/dv; 2731 in the code the H200 profiled.
        assert loop.count("int64_t") < 120, (name, loop.count("int64_t"))


def test_tensor_core_forward_min_blocks_sets_the_launch_bounds():
    """TCConfig.min_blocks is __launch_bounds__' second argument, on the local and the
    global rows' kernels (0: none, ptxas's own choice; None: two blocks of up to 4
    warps, one of more); a negative one is refused."""
    from tools.cuda_races import generated_source
    from swa_tvm.schedules import cuda_flash_tc

    for kind, window in (("local", (31, 0)), ("global", (0, 0))):
        spec = KernelSpec(kind, 64, "bfloat16", *window)
        for warps, min_blocks, bounds in ((4, 0, "(128) "), (4, 3, "(128, 3) "), (4, None, "(128, 2) "),
                                          (8, None, "(256, 1) ")):
            func = cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(warps, 32, min_blocks=min_blocks))
            source = generated_source({spec.name: func})
            assert source.count("__launch_bounds__" + bounds + spec.name + "_kernel(") == 2, (kind, min_blocks)
    with pytest.raises(ValueError, match="min_blocks must be >= 0"):
        cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(4, 32, min_blocks=-1))


def test_machine_code_of_the_bf16_d128_kernels():
    """The machine code (tools.sass: nvcc's cubin, nvdisasm) of the issue's bf16 D=128
    kernels: no spill, the mma each chunk needs, every operand read from shared memory
    by ldmatrix in the forward, and the hot loop's instructions per mma well under the
    code the H200 profiled (14.2 forward, 14.4 dq, 9.9 dk/dv per mma, static count)."""
    import tvm

    from tools import sass

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    kernels = {k.kind: k for k in AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16,backward").kernels()
               if k.kind != "local_bwd"}  # the five-product backward is a CPU kernel
    result = sass.analyze({k.name: build.schedule_spec(k, target) for k in kernels.values()})
    # mma per warp and chunk: S (8 k-steps x 8 score tiles) + P V (4 x 16) in the forward;
    # S and dP (2 x 8 x 4) + dS K (2 x 16) for dq; + P^T dO and dS^T Q for dk/dv.
    for kind, mma, most in (("local", 128, 8.0), ("local_dq", 96, 7.5), ("local_dkv", 128, 7.0)):
        r = result[f"{kernels[kind].name}_kernel"]
        assert r["spill_stores"] == 0 and r["loop_mma"] == mma, (kind, r)
        assert r["loop_per_mma"] < most, (kind, r)
    forward = result[f"{kernels['local'].name}_kernel"]["loop_opcodes"]
    assert forward["LDSM"] == 64 and "LDS" not in forward, forward  # K's 32 and V's 32 ldmatrix.x4
    # An unmasked chunk without rescale: 602 instructions before the softmax's trees,
    # FFMA, lazy rescaling and unclamped rows in chunks inside the sequence (484 with
    # them, nvcc 13.0); two blocks of 128 threads per SM (TCConfig.min_blocks).
    local = result[f"{kernels['local'].name}_kernel"]
    assert local["shortest_pass"] < 500 and local["registers"] <= 255, local


def test_machine_code_of_the_wgmma_forward():
    """The wgmma forward (sm_90a) of the issue's bf16 D=128 kernel, 4 and 8 warps, V as
    it is or transposed: no spill; in the chunk loop 8 HGMMA.64x64x16 (Q K^T, K-steps of
    the head dim) and 4 HGMMA.64x128x16 (P V), the work of 128 mma.sync per warp, and no
    HMMA or ldmatrix left (the tensor cores read K and V from shared memory); fewer
    instructions per product than the mma.sync default on the loop's shortest pass; the shared stores fenced
    for the async proxy; and ptxas did not serialize the wgmma."""
    from tools import cuda_races
    from tools import sass
    from swa_tvm.compiler.cuda_pack import nvcc_compile, ptxas_resources
    from tools.cuda_races import generated_source
    from swa_tvm.schedules import cuda_flash_tc

    spec = next(k for k in AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16").kernels() if k.kind == "local")
    configs = {"w4": (4, 64, True, False, 1, True), "w4_vt": (4, 64, True, False, 1, True, True),
               "w8": (8, 64, True, False, 1, True)}
    funcs = {f"{spec.name}_{n}": cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(*c)).with_attr(
        "global_symbol", f"{spec.name}_{n}") for n, c in configs.items()}
    source = generated_source(funcs, "sm_90a")
    # Per kernel: a fence before each of the two products, each committed and waited for
    # before its results are read; the synchronous loads' stores fenced for wgmma.
    for name in configs:
        body = cuda_races.kernel_body(source, f"{spec.name}_{name}_kernel")
        calls = re.findall(r"swa_wgmma_fence\(\)|swa_wgmma_\w+_n\d+_r\d+\(|swa_wgmma_commit_wait0\(\)|"
                           r"swa_fence_proxy_async\(\)", body)
        order = [c.split("(")[0].replace("swa_", "") for c in calls]
        products = ["wgmma_bf16_nk_n64_r64"] * 8
        pv = ["wgmma_bf16_nk_n128_r128" if name == "w4_vt" else "wgmma_bf16_kn_n128_r64"] * 4
        assert order == ["fence_proxy_async", "wgmma_fence", *products, "wgmma_commit_wait0", "wgmma_fence", *pv,
                         "wgmma_commit_wait0"], (name, order)
    cubin, report = nvcc_compile(source, "sm_90a", "cubin")
    # ptxas neither serialized the wgmma nor had to insert a warpgroup.arrive (C7519)
    # before one: it did for each P V product before the A operands were packed and
    # the registers pinned on their side of the fence (cuda_wgmma.a_packer).
    assert "serialized" not in report and "C7519" not in report, report[-2000:]
    resources = ptxas_resources(report)
    for kernel, (insts, labels) in sass.kernel_instructions(sass.disassemble(cubin)).items():
        start, end = sass.hot_loop(insts, labels)
        loop = [line for _, line in insts[start:end]]
        shapes = collections.Counter(m.group(0) for line in loop for m in [re.search(r"HGMMA\.64x\d+x16", line)] if m)
        assert shapes == {"HGMMA.64x64x16": 8, "HGMMA.64x128x16": 4}, (kernel, shapes)
        assert not any(re.search(r"\b(HMMA|LDSM)\b", line) for line in loop), kernel
        assert resources[kernel]["spill_stores"] == 0, (kernel, resources[kernel])
        # Fewer instructions a product on most chunks' pass than the mma.sync default's 3.78.
        assert sass.summarize(insts, labels)["shortest_pass_per_mma"] < 3.78, (kernel, len(loop))
        assert any("FENCE.VIEW.ASYNC.S" in line for _, line in insts), kernel


def test_two_stage_forward_copies_a_chunk_ahead():
    """TCConfig.stages = 2, bf16 D=128, 4 warps x 64 keys, cp.async, on mma.sync and on
    wgmma (sm_90a): the chunk loop takes two chunks a turn (256 mma per warp), and in
    its machine code each turn's half is a cp.async wait, then the next stage's copies,
    then this stage's products (the copies land behind a whole chunk's work); no
    spill, registers for two blocks per SM, no more instructions per product than the
    one-stage kernel's loop (the ring costs shared memory, not instructions), and no
    block barrier but the waits'."""
    from tools import sass
    from swa_tvm.compiler.cuda_pack import nvcc_compile, ptxas_resources
    from tools.cuda_races import generated_source
    from swa_tvm.schedules import cuda_flash_tc

    spec = next(k for k in AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16").kernels() if k.kind == "local")
    funcs = {}
    for wgmma in (False, True):
        for stages in (1, 2):
            name = f"{spec.name}_{'wgmma' if wgmma else 'sync'}_s{stages}"
            cfg = cuda_flash_tc.TCConfig(4, 64, async_copy=True, wgmma=wgmma, stages=stages)
            funcs[name] = cuda_flash_tc.flash_tc(spec, cfg).with_attr("global_symbol", name)
    cubin, report = nvcc_compile(generated_source(funcs, "sm_90a"), "sm_90a", "cubin")
    resources = ptxas_resources(report)
    found = sass.kernel_instructions(sass.disassemble(cubin))
    for kind in ("sync", "wgmma"):
        _assert_two_stage_loop(found, resources, f"{spec.name}_{kind}_s2_kernel", f"{spec.name}_{kind}_s1_kernel", 256)


def _assert_two_stage_loop(found, resources, kernel, one_stage, mma):
    """The machine code of a two-stage loop (``found``: sass.kernel_instructions; its
    ptxas ``resources``): each half-turn a cp.async wait, the other stage's copies, this
    stage's products; two block barriers a turn, the waits'; ``mma`` products a turn;
    no spill; no more instructions per product than ``one_stage``'s loop. Returns the
    two loops' summaries."""
    from tools import sass

    tags = {"DEPBAR": "wait", "LDGSTS": "copy", "HMMA": "mma", "HGMMA": "mma"}
    insts, labels = found[kernel]
    start, end = sass.hot_loop(insts, labels)
    seq = []
    for op, _ in insts[start:end]:
        if op in tags and (not seq or seq[-1] != tags[op]):
            seq.append(tags[op])
    # (ptxas may leave the first chunk's last mma.sync after the second wait: the wait
    # is for this thread's copies, the products only read registers.)
    assert seq in (["wait", "copy", "mma"] * 2, ["wait", "copy", "mma", "wait", "mma", "copy", "mma"]), (kernel, seq)
    # None after the copies' issue from TVM's planner, which sees tiles merged into one
    # dynamic buffer as one.
    bars = [line for op, line in insts[start:end] if op == "BAR" and "BAR.SYNC" in line]
    assert len(bars) == 2, (kernel, bars)
    summary = sass.summarize(insts, labels)
    assert summary["loop_mma"] == mma and resources[kernel]["spill_stores"] == 0, (kernel, summary)
    assert resources[kernel]["registers"] <= 255, resources[kernel]
    one = sass.summarize(*found[one_stage])
    assert summary["loop_per_mma"] <= one["loop_per_mma"] + 0.05, (kernel, summary, one)
    return summary, one


def test_two_stage_gradients_copy_a_chunk_ahead():
    """TCBwdConfig.stages = 2, bf16 D=128, 4 warps x 32 keys, on mma.sync and on wgmma
    (sm_90a), the dq and dk/dv kernels: as the forward's ring, two chunks a turn (192
    and 256 mma per warp), each half a cp.async wait, the next stage's copies, then this
    stage's products; two block barriers a turn; no spill; no more instructions per
    product than the one-stage loop, and fewer on its shortest pass (the synchronous
    loads are out of the loop)."""
    from tools import sass
    from swa_tvm.compiler.cuda_pack import nvcc_compile, ptxas_resources
    from tools.cuda_races import generated_source
    from swa_tvm.schedules import cuda_flash_bwd_tc

    kernels = {k.kind: k for k in AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16,backward").kernels()}
    funcs = {}
    for kind in ("local_dq", "local_dkv"):
        for wgmma in (False, True):
            for stages in (1, 2):
                name = f"{kind}_{'wgmma' if wgmma else 'sync'}_s{stages}"
                cfg = cuda_flash_bwd_tc.TCBwdConfig(4, 32, wgmma=wgmma, stages=stages)
                funcs[name] = cuda_flash_bwd_tc.flash_bwd_tc(kernels[kind], cfg).with_attr("global_symbol", name)
    cubin, report = nvcc_compile(generated_source(funcs, "sm_90a"), "sm_90a", "cubin")
    resources = ptxas_resources(report)
    found = sass.kernel_instructions(sass.disassemble(cubin))
    for kind, mma in (("local_dq", 192), ("local_dkv", 256)):
        for loads in ("sync", "wgmma"):
            summary, one = _assert_two_stage_loop(found, resources, f"{kind}_{loads}_s2_kernel",
                                                  f"{kind}_{loads}_s1_kernel", mma)
            assert summary["shortest_pass_per_mma"] < one["shortest_pass_per_mma"] - 0.3, (kind, loads, summary, one)


def test_wgmma_overlap_forward_waits_for_q_k_before_p_v():
    """TCConfig.overlap (FlashAttention-3's intra-warpgroup pipelining), bf16 D=128, 4
    warps x 64 keys, sm_90a: in the chunk loop one warpgroup.arrive, Q K^T's 8
    HGMMA.64x64x16 then the previous chunk's P V as 4 HGMMA.64x128x16, a wait that
    leaves one group pending (the softmax runs beside P V), then a wait for all; no
    spill, and ptxas neither serialized a wgmma nor injected a wait or an arrive. The
    waits are the kernel's: deleting the one that leaves P V pending makes ptxas inject
    its own (the registers it guards), deleting the loop's full wait races on V's tile
    (cuda_races). The option needs wgmma and synchronous loads."""
    from tools import cuda_races
    from tools import sass
    from swa_tvm.compiler.cuda_pack import nvcc_compile, ptxas_resources
    from tools.cuda_races import generated_source
    from swa_tvm.schedules import cuda_flash_tc

    spec = next(k for k in AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16").kernels() if k.kind == "local")
    for bad in (cuda_flash_tc.TCConfig(4, 64, overlap=True), cuda_flash_tc.TCConfig(4, 64, async_copy=True, wgmma=True,
                                                                                     overlap=True)):
        with pytest.raises(ValueError, match="overlap takes wgmma and synchronous loads"):
            cuda_flash_tc.flash_tc(spec, bad)
    name = f"{spec.name}_overlap"
    func = cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(4, 64, wgmma=True, overlap=True))
    source = generated_source({name: func.with_attr("global_symbol", name)}, "sm_90a")
    cubin, report = nvcc_compile(source, "sm_90a", "cubin")
    assert "(C75" not in report, [line for line in report.splitlines() if "(C75" in line]
    assert ptxas_resources(report)[f"{name}_kernel"]["spill_stores"] == 0
    insts, labels = sass.kernel_instructions(sass.disassemble(cubin))[f"{name}_kernel"]
    start, end = sass.hot_loop(insts, labels)
    steps = [m.group(0) for _, line in insts[start:end]
             for m in [re.search(r"WARPGROUP\.ARRIVE|HGMMA\.64x\d+x16|WARPGROUP\.DEPBAR\.LE gsb0, 0x\d", line)] if m]
    assert steps == (["WARPGROUP.ARRIVE"] + ["HGMMA.64x64x16"] * 8 + ["HGMMA.64x128x16"] * 4
                     + ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]), steps
    # Without the wait for Q K^T alone, ptxas must guard the scores' registers itself.
    _, unguarded = nvcc_compile(source.replace("swa_wgmma_wait1();", ""), "sm_90a", "cubin")
    assert re.search(r"\(C751[78]\)", unguarded), unguarded[-2000:]
    body = cuda_races.kernel_body(source, f"{name}_kernel")
    assert cuda_races.races(body) == []
    waits, missed = cuda_races.deletions(body)["wgmma waits"]
    lines = body.splitlines()
    assert waits == 2 and [lines[i].strip() for i in missed] == ["swa_wgmma_wait1();"], missed


def test_machine_code_of_the_wgmma_gradients():
    """The dq and dk/dv kernels on wgmma (sm_90a, bf16 D=128, 4 warps x 32 keys): no
    spill; in the chunk loop S and dP as 16 HGMMA.64x32x16 with both operands from
    shared memory, dS K (dq) or P^T dO and dS^T Q (dk/dv) as HGMMA.64x128x16, the work
    of 96 / 128 mma.sync per warp, and no HMMA or ldmatrix left; fewer instructions per
    product than the mma.sync kernels (6.3, 5.7)."""
    from tools import sass
    from swa_tvm.compiler.cuda_pack import nvcc_compile, ptxas_resources
    from tools.cuda_races import generated_source
    from swa_tvm.schedules import cuda_flash_bwd_tc

    kernels = {k.kind: k for k in AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16,backward").kernels()}
    cfg = cuda_flash_bwd_tc.TCBwdConfig(4, 32, wgmma=True)
    funcs = {kernels[kind].name: cuda_flash_bwd_tc.flash_bwd_tc(kernels[kind], cfg) for kind in ("local_dq", "local_dkv")}
    cubin, report = nvcc_compile(generated_source(funcs, "sm_90a"), "sm_90a", "cubin")
    assert "serialized" not in report and "C7519" not in report, report[-2000:]
    listing = sass.kernel_instructions(sass.disassemble(cubin))
    for kind, pv, most in (("local_dq", 2, 6.3), ("local_dkv", 4, 5.7)):
        insts, labels = listing[f"{kernels[kind].name}_kernel"]
        start, end = sass.hot_loop(insts, labels)
        loop = [line for _, line in insts[start:end]]
        shapes = collections.Counter(m.group(0) for line in loop for m in [re.search(r"HGMMA\.64x\d+x16", line)] if m)
        assert shapes == {"HGMMA.64x32x16": 16, "HGMMA.64x128x16": pv}, (kind, shapes)
        assert not any(re.search(r"\b(HMMA|LDSM)\b", line) for line in loop), kind
        summary = sass.summarize(insts, labels)
        assert summary["loop_mma"] == (96 if kind == "local_dq" else 128) and summary["loop_per_mma"] < most, summary
    resources = ptxas_resources(report)
    assert all(r["spill_stores"] == 0 for r in resources.values()), resources
    # Two warpgroups (8 warps, 128 item rows): each group's A descriptor starts at its own
    # 64 rows, 8 cores (512 values) down the item's tile (the emulation, reading by row,
    # cannot see this address).
    dq = cuda_flash_bwd_tc.flash_bwd_tc(kernels["local_dq"], cuda_flash_bwd_tc.TCBwdConfig(8, 32, wgmma=True))
    calls = [line for line in generated_source({kernels["local_dq"].name: dq}, "sm_90a").splitlines()
             if "swa_wgmma_ss_" in line and "(&(" in line]
    assert len(calls) == 16 and all("((((int)threadIdx.x) >> 7) * 512)" in line.split(", ")[0] for line in calls)


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_cuda_search_space_points_with_one_thread_along_an_axis_compile(tensor_cores):
    """Points of the CUDA space where a sampled thread count is 1 (one warp per block;
    one thread along a product's rows or columns) compile on the symbolic kernel. (Such
    points once failed in lowering, int32 thread loops meeting int64 ones.)"""
    import tvm
    from tvm import s_tir

    from swa_tvm.compiler.build import cuda_source
    from swa_tvm.compiler.cuda_pack import nvcc_fatbin
    from swa_tvm.schedules import cpu, cuda

    class OneThread(cpu.DefaultPoint):
        def split(self, sch, loop, default, max_inner):
            if len(default) == 3:  # [blocks, threads, per thread]
                default = [default[0] * default[1], 1, default[2]]
            elif max_inner == 8:  # tensor cores: [row-tile groups, warps]
                default = [default[0] * default[1], 1]
            return super().split(sch, loop, default, max_inner)

    records.preload_tensor_intrin()
    spec = KernelSpec("local", 16, "float16", 7, 0)
    sch = s_tir.Schedule(records.tuning_workload(spec, target_kind="cuda"))
    cuda.schedule(sch, spec, OneThread(), tensor_cores=tensor_cores)
    func = records.apply_record(spec, sch.trace, "cuda")
    target = {"kind": "cuda", "arch": "sm_80"}
    fatbin, _ = nvcc_fatbin(cuda_source(tvm.compile(tvm.IRModule({spec.name: func}), target=tvm.target.Target(target)).mod), "sm_80")
    assert fatbin[:4] == bytes.fromhex("50ed55ba")  # the fatbin magic


def test_cuda_flash_config_checks():
    from swa_tvm.schedules import cuda_flash

    spec = KernelSpec("local", 128, "bfloat16", 4095, 0)
    cfg = cuda_flash.default_config(spec)
    assert cfg.shared_bytes(128, "bfloat16") <= cuda_flash.SHARED_BUDGET
    assert build.default_schedule(spec, "cuda") == "cuda_flash_tc"
    assert build.default_schedule(KernelSpec("local", 128, "float32", 7, 0), "cuda") == "cuda_flash"
    assert build.default_schedule(KernelSpec("local", 40, "float16", 7, 0), "cuda") == "cuda_flash"  # 40 % 16
    assert build.default_schedule(KernelSpec("global", 64, "float32", 7, 0), "cuda") == "cuda_flash"
    # No tile of fp32 x 256 fits: the TE kernel under schedules/cuda.py serves it.
    assert build.default_schedule(KernelSpec("local", 256, "float32", 7, 0), "cuda") == "default"
    assert build.default_schedule(spec, "llvm") == "default"
    with pytest.raises(ValueError, match="block_q=96 exceeds threads=64"):
        cuda_flash.flash(spec, cuda_flash.FlashConfig(96, 16, 64))
    with pytest.raises(ValueError, match="no flash tile"):
        cuda_flash.flash(KernelSpec("local", 256, "float32", 7, 0))
    from swa_tvm.schedules import cuda_flash_tc

    with pytest.raises(ValueError, match="chunk a positive multiple of 16"):
        cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(4, 24))
    with pytest.raises(ValueError, match="float16/bfloat16 forward kernels"):
        cuda_flash_tc.flash_tc(KernelSpec("local", 128, "float32", 7, 0))
    for stages, async_copy in ((2, False), (3, True), (0, True)):
        with pytest.raises(ValueError, match=r"stages must be 1 or 2, and 2 takes cp.async"):
            cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(4, 64, async_copy=async_copy, stages=stages))
    # A second stage's K and V tiles: 34 KiB more at 4 x 64, so dynamic shared memory.
    one, two = (cuda_flash_tc.TCConfig(4, 64, async_copy=True, stages=n).shared_bytes(128, "bfloat16") for n in (1, 2))
    assert two - one == 2 * 64 * 136 * 2 + 2 * 64 and one <= cuda_flash.SHARED_BUDGET < two
    # The gradients' second stage: the chunk's two tiles, lse and delta; cp.async is
    # what two stages mean there (a single stage has nothing to overlap).
    from swa_tvm.schedules import cuda_flash_bwd_tc

    grad = KernelSpec("local_dkv", 128, "bfloat16", 4095, 0)
    one, two = (cuda_flash_bwd_tc.TCBwdConfig(2, 32, stages=n) for n in (1, 2))
    assert (one.async_copy, two.async_copy) == (False, True)
    assert two.shared_bytes(128, "bfloat16") - one.shared_bytes(128, "bfloat16") == 2 * 32 * 136 * 2 + 2 * 32 * 4 + 4 * 64
    for stages in (0, 3):
        with pytest.raises(ValueError, match=r"stages must be 1 or 2"):
            cuda_flash_bwd_tc.flash_bwd_tc(grad, cuda_flash_bwd_tc.TCBwdConfig(2, 32, stages=stages))
    # Gradients: every kind on the tensor-core backward for float16/bfloat16 (head_dim %
    # 16 == 0), else on the CUDA-core one where a tile fits, else on TE.
    from swa_tvm.schedules import cuda_flash_bwd

    for kind in ("local_dq", "local_dkv"):
        grad = KernelSpec(kind, 128, "bfloat16", 4095, 0, extras=True)
        assert build.default_schedule(grad, "cuda") == "cuda_flash_bwd_tc"
        assert cuda_flash_bwd_tc.default_config(grad) == cuda_flash_bwd_tc.TCBwdConfig(2, 32)
        assert cuda_flash_bwd_tc.default_config(grad).shared_bytes(128, "bfloat16") <= cuda_flash.SHARED_BUDGET
        assert build.default_schedule(dataclasses.replace(grad, dtype="float32"), "cuda") == "cuda_flash_bwd"
        assert build.default_schedule(dataclasses.replace(grad, head_dim=40), "cuda") == "cuda_flash_bwd"
        assert cuda_flash_bwd.default_config(grad).shared_bytes(128, "bfloat16") <= cuda_flash.SHARED_BUDGET
        assert build.default_schedule(dataclasses.replace(grad, dtype="float32", head_dim=256), "cuda") == "default"
        assert build.default_schedule(grad, "llvm") == "default"
    assert build.default_schedule(KernelSpec("local_dx", 64, "float16", 7, 0, extras=True), "cuda") == "cuda_flash_bwd_tc"
    assert build.default_schedule(KernelSpec("global_bwd", 64, "float16", 0, 0), "cuda") == "cuda_flash_bwd_tc"
    assert cuda_flash_bwd_tc.default_config(KernelSpec("local_dq", 64, "float16", 7, 0)) == cuda_flash_bwd_tc.TCBwdConfig(4, 32)
    with pytest.raises(ValueError, match="chunk a positive multiple of 16"):
        cuda_flash_bwd_tc.flash_bwd_tc(grad, cuda_flash_bwd_tc.TCBwdConfig(2, 24))
    with pytest.raises(ValueError, match="float16/bfloat16 gradient kernels"):
        cuda_flash_bwd_tc.flash_bwd_tc(KernelSpec("local_dq", 128, "float32", 7, 0))
    with pytest.raises(ValueError, match="float16/bfloat16 gradient kernels"):
        cuda_flash_bwd_tc.flash_bwd_tc(KernelSpec("local", 128, "float16", 7, 0))
    with pytest.raises(ValueError, match="block=64 exceeds threads=32"):
        cuda_flash_bwd.flash_bwd(grad, cuda_flash_bwd.BwdConfig(64, 16, 32))
    with pytest.raises(ValueError, match="no backward tile of float32 x head_dim 256"):
        cuda_flash_bwd.flash_bwd(KernelSpec("local_dq", 256, "float32", 7, 0))
    with pytest.raises(ValueError, match="serves"):
        cuda_flash_bwd.flash_bwd(KernelSpec("local", 64, "float32", 7, 0, extras=True))
