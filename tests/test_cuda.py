"""CUDA without a GPU: compile and export for sm_80/sm_90, load, fail clearly on call,
and check the CUDA schedule's loop structure numerically on the CPU.

What needs a GPU (running the kernels, timing them) is tools.gpu_check, run by
tools/gpu_check.sh on a machine that has one."""

import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import rand, rel_err

from swa_tvm.compiler import targets
from swa_tvm.compiler import build
from swa_tvm.compiler import records
from swa_tvm import eager
import swa_tvm
from swa_tvm.runtime import library
from swa_tvm.compiler.build import UntunedKernelWarning
from swa_tvm.compiler.targets import normalize_target
from swa_tvm.spec import AttentionSpec, KernelSpec

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH")


def test_cuda_targets():
    assert normalize_target("cuda -arch=sm_90") == {"kind": "cuda", "arch": "sm_90"}
    assert normalize_target("cuda:sm_80") == {"kind": "cuda", "arch": "sm_80"}
    assert normalize_target({"kind": "cuda", "arch": "sm_86"}) == {"kind": "cuda", "arch": "sm_86"}
    assert targets.target_key(normalize_target("cuda -arch=sm_90")) == "cuda-sm_90"
    with pytest.raises(ValueError, match="sm_XY"):
        normalize_target("cuda -arch=ampere")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device.*name it"):
            normalize_target("cuda")


@needs_nvcc
@pytest.mark.parametrize(
    "arch,spec_text",
    [
        # sm_90 gets every pattern (dilation, globals, sinks); sm_80 the window with
        # globals in bf16 with its gradient kernels (the global rows' split-K dq among them).
        ("sm_90", "head_dim=32,window=15:0,dilation=2,globals,sinks,dtype=float16"),
        ("sm_80", "head_dim=32,window=15:0,globals,dtype=bfloat16,backward"),
    ],
)
def test_export_cuda_library_and_load_without_gpu(tmp_path, arch, spec_text, fresh_registry):
    """Export for one arch; the manifest names the arch, the generated CUDA stages the
    products through shared memory, and the library loads here; a call says no CUDA
    device is present."""
    spec = AttentionSpec.parse(spec_text)
    kernels = spec.kernels()
    path = tmp_path / f"lib_{arch}.so"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = swa_tvm.export_library([spec], path, target=f"cuda -arch={arch}")
    untuned = [str(w.message) for w in caught if issubclass(w.category, UntunedKernelWarning)]
    assert len(untuned) == len(kernels) and all(f"cuda-{arch}" in m for m in untuned)
    assert manifest["cuda_arch"] == arch and manifest["target"] == {"kind": "cuda", "arch": arch}
    assert manifest["target_key"] == f"cuda-{arch}" and manifest["cpu_features"] == []
    assert [k["spec"]["dtype"] for k in manifest["kernels"]] == [spec.dtype] * len(kernels)
    assert json.load(open(f"{path}.json")) == manifest
    # Local and global rows both on the tensor-core kernel, the window's gradients on the
    # tensor-core backward; `swa-tvm info` says so.
    forward = [k for k in kernels if k.kind in ("local", "global")]
    schedules = {k["spec"]["kind"]: k["schedule"] for k in manifest["kernels"]}
    assert schedules == {k.kind: "cuda_flash_tc" if k in forward else "cuda_flash_bwd_tc" for k in kernels}
    from swa_tvm import cli

    info = subprocess.run([sys.executable, "-m", "swa_tvm.cli", "info", str(path)], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert info.stdout.count(cli.FUSED_TEXT["cuda_flash_tc"]) == len(forward), info.stdout
    assert info.stdout.count(cli.FUSED_TEXT["cuda_flash_bwd_tc"]) == len(kernels) - len(forward), info.stdout
    # Which tiles each fused kernel was built with (head_dim 32: every default's largest).
    tiles = {k["spec"]["kind"]: k["tiles"] for k in manifest["kernels"]}
    for kind, got in tiles.items():
        want = {"warps": 4, "chunk": 32, "ldmatrix": True, "wgmma": False, "stages": 1}
        if kind in ("local", "global"):
            want.update(chunk=64, async_copy=False, m_tiles=1, transpose_v=False, min_blocks=None, overlap=False)
        assert got == want, (kind, got)
    assert {k["tiles_from"] for k in manifest["kernels"]} == {"default"}  # no tile record for this arch and head dim
    assert ("tiles warps=4, chunk=64, ldmatrix=True, async_copy=False, m_tiles=1, wgmma=False, transpose_v=False, "
            "min_blocks=None, overlap=False, stages=1"
            in info.stdout), info.stdout
    # What ptxas reported for each kernel of the library (the global rows' gradients are
    # two kernels, their split-K forward too: the pieces, then the combine, which has no
    # tiles): registers within the 255 a thread may have, the tiles' static shared
    # memory, and no spill at head dim 32 (ptxas's own occupancy choice held the forward
    # with extra keys to 128 registers, spilling 12 bytes; TCConfig's two blocks per SM
    # leave it 133, no spill).
    # The global rows' gradients: the split-K dq's pieces and sum, then dk/dv.
    n_kernels = {"global": 2, "global_bwd": 3}
    for k in manifest["kernels"]:
        n = n_kernels.get(k["spec"]["kind"], 1)
        assert set(k["ptxas"]) == {f"{k['name']}_kernel"} | {f"{k['name']}_kernel_{i}" for i in range(1, n)}
        for f, r in k["ptxas"].items():
            if k["spec"]["kind"] in ("global", "global_bwd") and f.endswith("_kernel_1"):  # the sums: no tiles
                assert r["spill_stores"] == 0 and r["smem"] == 0, (f, r)
                continue
            assert 32 <= r["registers"] <= 255 and r["spill_stores"] == 0 and 1024 < r["smem"] <= 48 * 1024, (k["name"], r)
    # The split-K global rows take the caller's workspace, which the manifest names.
    workspaces = {"global": swa_tvm.runtime.library.GLOBAL_WORKSPACE, "global_bwd": swa_tvm.runtime.library.GLOBAL_BWD_WORKSPACE}
    assert {k["spec"]["kind"]: k.get("workspace") for k in manifest["kernels"]} == {
        k.kind: workspaces.get(k.kind) for k in kernels
    }
    # info says what ptxas said: "no spills", or how many bytes.
    spilled = sum(bool(r["spill_stores"]) for k in manifest["kernels"] for r in k["ptxas"].values())
    assert info.stdout.count(" registers, no spills, ") == sum(len(k["ptxas"]) for k in manifest["kernels"]) - spilled
    assert info.stdout.count(" B stored, ") == spilled, info.stdout
    for kind, workspace in workspaces.items():
        n = sum(k.kind == kind for k in kernels)
        assert info.stdout.count(f"the caller's workspace: {workspace}") == n, info.stdout

    # The generated CUDA source (written beside the library): half inputs, fp32
    # accumulation, shared-memory tiles.
    src = open(f"{path}.cu").read()
    half = {"float16": "half", "bfloat16": "nv_bfloat16"}[spec.dtype]
    assert "__global__" in src
    tiles = re.findall(rf"__shared__ (?:alignas\(\d+\) )?{half} \w+\[\d+\]", src)
    assert len(tiles) >= 2, f"products should stage {half} tiles in shared memory"
    # The local kernel's products on tensor cores, in the input dtype with fp32 accumulators.
    ptx = {"float16": "f16", "bfloat16": "bf16"}[spec.dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in src
    assert re.search(rf"swa_mma_{ptx}\(qfrag", src) and re.search(rf"swa_mma_{ptx}\(pfrag", src), (
        "Q K^T and P V should both issue mma (P from the score registers)"
    )
    # V's B operands by ldmatrix.trans from the shared tile, two output tiles per load.
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in src
    assert re.search(rf"swa_ldsm_t_{ptx}\(\(&\(Vt(_ptr)?\[", src), "P V's operands should come by ldmatrix"
    if spec.backward:
        # The fused gradient kernels: four 16-bit tiles each in shared memory (dq: Q, dO,
        # K, V; dk/dv: K, V, Q, dO); S and dP, then dq (from dS), or dv (from P) and dk
        # (from dS), as mma products whose A operands are the score registers.
        kinds = re.findall(r'extern "C" __global__ void[^\n]*? swa_local_(dq|dkv)_d32\w*\(', src)
        assert set(kinds) == {"dkv", "dq"}, "kernels for dq and dk/dv, in the library's CUDA source"
        for kind, operands in (("dq", ("afrag", "a2frag", "dsfrag")), ("dkv", ("afrag", "a2frag", "pfrag", "dsfrag"))):
            body = src.rsplit(f"swa_local_{kind}_d32", 1)[1].split('extern "C"')[0]  # the definition
            assert len(re.findall(rf"__shared__ (?:alignas\(\d+\) )?{half} \w+\[\d+\]", body)) == 4, kind
            for a in operands:
                assert re.search(rf"swa_mma_{ptx}\({a}(_ptr)?\[", body), f"{kind}: no mma with A operand {a}"
            assert f"swa_ldsm_t_{ptx}(" in body, f"{kind}: the chunk tile's B operands should come by ldmatrix"

    # The device code is in the library compiled (TVM alone would keep the source and
    # compile it at load, through a callback only the full apache-tvm registers): one
    # CUDA module, a fatbin holding the arch's machine code (an ELF) and its PTX.
    from swa_tvm.compiler import cuda_pack

    [(fmt, fatbin)] = cuda_pack.read_cuda_modules(cuda_pack.library_blob(str(path)))
    assert fmt == "fatbin" and fatbin[:4] == bytes.fromhex("50ed55ba"), (fmt, fatbin[:16])
    assert b"\x7fELF" in fatbin, "no machine code in the fatbin"
    assert b"__global__" not in fatbin and len(fatbin) < len(src)
    # The manifest says so, and a CUDA library whose manifest does not (exported before
    # the packing: source inside) is refused with a clear error, not at its first call.
    assert manifest["cuda_device_code"] == "fatbin"
    old = tmp_path / "old.so"
    old.write_bytes(path.read_bytes())
    (tmp_path / "old.so.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "cuda_device_code"}))
    with pytest.raises(library.LibraryError, match="CUDA device code is source.*export it again"):
        swa_tvm.load_library(old)

    specs = swa_tvm.load_library(path)
    assert {s.name for s in specs} == {k.name for k in kernels}
    registered = fresh_registry.kernels("cuda")
    assert len(registered) == len(kernels) and all(k.cuda_arch == arch for k in registered)
    assert fresh_registry.kernels("cpu") == []
    if library.cuda_unavailable_reason() is not None:
        with pytest.raises(library.NoDeviceError, match="no CUDA device is present"):
            registered[0].func()


@needs_nvcc
def test_fatbin_cubin_is_the_machine_code_nvcc_writes():
    """cuda_pack.fatbin_cubin (how the GPU bundle reads its library's machine code for
    tools.sass instead of compiling the source again): the ELF in a fatbin is byte for
    byte the cubin nvcc writes for the arch; a PTX-only or foreign blob has none."""
    from swa_tvm.compiler.cuda_pack import FATBIN_MAGIC, fatbin_cubin, nvcc_compile

    code = 'extern "C" __global__ void twice(float* a) { a[threadIdx.x] *= 2.0f; }'
    fatbin, _ = nvcc_compile(code, "sm_80", "fatbin")
    cubin, _ = nvcc_compile(code, "sm_80", "cubin")
    assert cubin.startswith(b"\x7fELF") and fatbin_cubin(fatbin) == cubin
    ptx_only = bytearray(fatbin)
    ptx_only[16:18] = (1).to_bytes(2, "little")  # the entry's kind: PTX
    assert fatbin_cubin(bytes(ptx_only)) is None
    assert fatbin_cubin(cubin) is None and fatbin_cubin(FATBIN_MAGIC + bytes(12)) is None


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


def test_machine_code_of_the_bf16_d128_kernels():
    """The machine code (tools.sass: nvcc's cubin, nvdisasm) of the issue's bf16 D=128
    kernels: no spill, the mma each chunk needs, every operand read from shared memory
    by ldmatrix in the forward, and the hot loop's instructions per mma well under the
    code the H200 profiled (14.2 forward, 14.4 dq, 9.9 dk/dv per mma, static count)."""
    import tvm

    from tools import sass

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    kernels = {k.kind: k for k in AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16,backward").kernels()}
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


def test_wgmma_probe_tells_the_layout_readings_apart():
    """The GPU check's wgmma probes (one instruction against a matrix product), emulated
    on the CPU with B read where the descriptor says (``canonical_address``): K's tile
    and V's tile and V's transposed agree with torch's product; V's tile under the other
    reading (LBO and SBO exchanged) does not, so on the GPU the probes name the reading
    the hardware has."""
    from tools import gpu_check
    from tools import gpu_bundle
    from swa_tvm.schedules import cuda_wgmma

    rows = []
    for operand, r, c, ks, swap in gpu_bundle.WGMMA_PROBES:
        entry = {"function": "probe", "kind": "wgmma_probe", "operand": operand, "rows": r, "cols": c, "ks": ks}
        func = cuda_wgmma.probe("bfloat16", operand, r, c, ks, swap, emulate=True).with_attr("global_symbol", "probe")
        rows.append(gpu_check.probe_row(_serial_on_cpu(func), entry, torch.device("cpu")))
    assert [row["agrees"] for row in rows] == [not swap for *_, swap in gpu_bundle.WGMMA_PROBES], rows
    assert gpu_check.best_variants(rows, torch.bfloat16) == {}  # probes are not timing rows


def test_sass_hot_loop_is_the_innermost_with_the_most_mma():
    """tools.sass's reading of nvdisasm's text: two loops of two HMMA each (the band's,
    then the extra keys'), and a branch back across both, as nvcc laid out the forward
    with extra keys: the hot loop is the first inner loop, not the range spanning both."""
    from tools import sass

    ops = []

    def emit(op, target=None):
        line = f"        /*{16 * len(ops):04x}*/                   {op}" + (f" `({target}) ;" if target else " R0, R1 ;")
        ops.append(line)

    text = ["//--------------------- .text.k_kernel --------------------------"]
    emit("IMAD")
    text += ops[-1:] + [".L_x_1:"]
    for op in ("LDSM", "HMMA", "HMMA", "FMUL"):
        emit(op)
        text.append(ops[-1])
    emit("BRA", ".L_x_1")
    text += [ops[-1], ".L_x_2:"]
    for op in ("HMMA", "HMMA", "IMAD", "IMAD", "IMAD"):
        emit(op)
        text.append(ops[-1])
    emit("BRA", ".L_x_2")
    text.append(ops[-1])
    emit("BRA", ".L_x_1")  # back across both
    text.append(ops[-1])
    kernels = sass.kernel_instructions("\n".join(text))
    insts, labels = kernels["k_kernel"]
    assert len(insts) == 13 and labels == {".L_x_1": 1, ".L_x_2": 6}
    r = sass.summarize(insts, labels)
    assert (r["loop_instructions"], r["loop_mma"], r["loop_per_mma"]) == (5, 2, 2.5), r


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


def test_sass_shortest_pass_takes_each_branch_the_shorter_way():
    """tools.sass.shortest_pass on a loop as nvcc lays out the forward's: a predicated
    branch over the unmasked path to the masked one (longer), which jumps back to the
    join; then a predicated skip of the rescale; then the back branch. The shortest pass
    is the unmasked path without the rescale; the mma on it are counted."""
    from tools import sass

    lines, labels = [], {}

    def emit(op, pred="", target=None):
        text = f"        /*{16 * len(lines):04x}*/               {pred}{op}" + (f" `({target}) ;" if target else " R0, R1 ;")
        lines.append(text)

    def label(name):
        labels[name] = len(lines)
        lines.append(f"{name}:")

    lines.append("//--------------------- .text.k_kernel --------------------------")
    label(".L_x_0")
    emit("HMMA")
    emit("BRA", "@P0 ", ".L_x_1")  # masked chunk: to the longer path
    emit("FMNMX")
    emit("BRA", "", ".L_x_2")  # unconditional: over the masked path
    label(".L_x_1")
    for op in ("ISETP", "FSEL", "FSEL", "FMNMX"):
        emit(op)
    label(".L_x_2")
    emit("BRA", "@!P1 ", ".L_x_3")  # no rescale: skip the multiplies
    for op in ("FMUL", "FMUL", "FMUL"):
        emit(op)
    label(".L_x_3")
    emit("HMMA")
    emit("BRA", "@P2 ", ".L_x_0")  # back
    insts, found = sass.kernel_instructions("\n".join(lines))["k_kernel"]
    start, end = sass.hot_loop(insts, found)
    assert (start, end) == (0, len(insts)) and len(insts) == 14
    # HMMA, BRA, FMNMX, BRA, BRA (the rescale's skip), HMMA, BRA back: 7, two mma.
    assert sass.shortest_pass(insts, found, start, end) == (7, 2)
    r = sass.summarize(insts, found)
    assert (r["loop_instructions"], r["shortest_pass"], r["shortest_pass_per_mma"]) == (14, 7, 3.5), r
    # A second chunk under a predicated branch (two K/V stages, odd chunk counts): the
    # pass skips what it can but not the products: + BRA, HMMA, FMUL.
    back = lines.pop()
    emit("BRA", "@!P3 ", ".L_x_4")
    emit("HMMA")
    emit("FMUL")
    label(".L_x_4")
    lines.append(back)
    insts, found = sass.kernel_instructions("\n".join(lines))["k_kernel"]
    start, end = sass.hot_loop(insts, found)
    assert sass.shortest_pass(insts, found, start, end) == (10, 3)


def _serial_on_cpu(func):
    """The CUDA-scheduled PrimFunc with its thread bindings made serial loops and its
    shared/local buffers global, compiled for the CPU. Every thread then does its part
    in turn: the same loop nest, tiles, regions and predicates the GPU runs, minus
    concurrency (barriers: test_fused_cuda_kernels_have_the_barriers_they_need; what
    the hardware does: the GPU check)."""
    import tvm

    text = func.script()
    text = text.replace("T.thread_binding(", "T.serial(")
    text = re.sub(r', thread="[a-zA-Z.]+"\)', ")", text)
    text = re.sub(r', scope="(shared|shared\.dyn|local|wmma\.[a-z_]+)"', "", text)
    text = text.replace("T.alloc_local(", "T.alloc_buffer(")
    assert "thread_binding" not in text and 'scope="shared' not in text
    mod = tvm.script.from_source(text)
    # Unoptimized: what is checked is the TIR's arithmetic, which LLVM's passes keep, and
    # the emulated mma kernels took ~7 s each at -O3 against ~2 s.
    return tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "opt-level": 0}))


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
    kernel = _serial_on_cpu(sch.mod)[spec.name]

    dilation = [1, 2, 1, 2] if extras else [2, 2, 2, 2]
    tol = 3e-3 if dtype == "bfloat16" else 1e-5  # bf16: the output's rounding
    _check_local_kernel(kernel, dtype, window, dilation, extras, tol, Hkv=4, D=16)


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
    kernel = _serial_on_cpu(tvm.IRModule({spec.name: func}))[spec.name]
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

    pass  # SPLITIMPORT
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
    kernel = _serial_on_cpu(tvm.IRModule({spec.name: records.apply_record(spec, loops.trace, "cuda")}))[spec.name]
    _check_local_kernel(kernel, dtype, (15, 16), [1, 2, 1, 2], True, 3e-3, Hkv=4, D=32)


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_cuda_search_space_points_with_one_thread_along_an_axis_compile(tensor_cores):
    """Points of the CUDA space where a sampled thread count is 1 (one warp per block;
    one thread along a product's rows or columns) compile on the symbolic kernel. (Such
    points once failed in lowering, int32 thread loops meeting int64 ones.)"""
    import tvm
    from tvm import s_tir

    pass  # SPLITIMPORT
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
    kernel = _serial_on_cpu(cuda_flash.flash(spec, cfg))[spec.name]
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
    kernel = _serial_on_cpu(func)[spec.name]
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
    kernel = _serial_on_cpu(func)[spec.name]
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


def test_gpu_check_harness_on_cpu(tmp_path, fresh_registry):
    """The GPU check's correctness stage, run on the CPU kernels: the harness itself
    (cases, reference, tolerances, results file) works before it costs GPU time."""
    from tools import gpu_check

    # A library that does not load (here: no manifest) is recorded and fails the run,
    # and the stages still run.
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "broken.so").write_bytes(b"not a library")
    # A spent time budget (0 s) skips every stage after correctness, and says so.
    rc = gpu_check.main(["--device", "cpu", "--libs", str(tmp_path / "libs"), "--out", str(tmp_path), "--skip-bench",
                         "--budget-s", "0"])
    results = json.load(open(tmp_path / "gpu_results.json"))
    assert rc == 1 and results["ok"] is False
    assert [results[s] for s in ("bench", "variants", "tuning")] == [gpu_check.OUT_OF_TIME] * 3
    [broken] = results["libraries"]
    assert broken["path"].endswith("broken.so") and "broken.so" in broken["error"], broken
    assert len(results["correctness"]) == 6 and all(r["ok"] and r["out_rel_err"] < 1e-5 for r in results["correctness"])
    # Gradients of every float input, the own projections' and sink logits' included.
    grads = {r["case"]: r["grad_rel_err"] for r in results["correctness"]}
    assert set(grads["globals with own projections, sink logits"]) == {"q", "k", "v", "q_global", "k_global",
                                                                       "v_global", "sink_logits"}
    assert all(e < 1e-4 for g in grads.values() for e in g.values()), grads
    assert results["stream_and_compile"] == {"compile_fullgraph_equal": True}


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

    pass  # SPLITIMPORT
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
            return Kernel(want, _serial_on_cpu(func)[want.name], device, "serial, mma emulated", None, workspace)
        if fused == "cores":
            cfg = cuda_flash_bwd.BwdConfig(*config) if config else None
            return Kernel(want, _serial_on_cpu(cuda_flash_bwd.flash_bwd(want, cfg))[want.name], device, "serial")
        sch = s_tir.Schedule(tvm.IRModule({want.name: prim_func(want, target_kind="cuda")}))
        sch.work_on(want.name)
        cuda.schedule(sch, want)
        return Kernel(want, _serial_on_cpu(sch.mod)[want.name], device, "serial CUDA schedule")

    monkeypatch.setattr(eager, "_kernel", serial_cuda_kernel)
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
    pass  # SPLITIMPORT
    from swa_tvm.runtime.library import GLOBAL_WORKSPACE, Kernel
    from swa_tvm.reference import sliding_window_attention_ref
    from swa_tvm.schedules import cuda_flash_tc

    def serial_tc_kernel(want, device):
        func = cuda_flash_tc.flash_tc(want, cuda_flash_tc.TCConfig(2, 16), emulate=True)
        workspace = GLOBAL_WORKSPACE if want.kind == "global" else None
        return Kernel(want, _serial_on_cpu(func)[want.name], device, "serial, mma emulated", None, workspace)

    monkeypatch.setattr(eager, "_kernel", serial_tc_kernel)
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


def test_gpu_check_training_timing_on_cpu():
    """The GPU check's training stage (GPU-only there), run on the CPU kernels at a tiny
    shape: it times ours and the banded-mask SDPA, and their gradients agree."""
    from tools import gpu_check

    results = {}
    gpu_check.time_training(results, torch.device("cpu"), None, 64, 8, shape=(1, 4, 2, 16), dtype=torch.float32)
    row = results["training"]
    assert not [k for k in row if k.endswith("_error")], row
    assert row["ours_fwd_bwd_ms"] > 0 and row["speedup_vs_sdpa_banded_mask"] > 0
    assert row["sdpa_banded_mask_grads_vs_ours_rel_err"] < 1e-4


@pytest.mark.parametrize("left,right", [(5, 0), (5, 3), (16, 0), (7, 9), (-1, 0), (3, -1), (-1, -1), (40, 0)])
@pytest.mark.parametrize("warps,m_tiles,chunk", [(1, 1, 16), (2, 2, 32), (4, 1, 16)])
def test_staged_bytes_counts_the_chunks_a_dense_mask_touches(left, right, warps, m_tiles, chunk):
    """The GPU check's traffic model of a tensor-core variant: per block of rows, the
    band chunks (aligned to the block's band index 0: partner m0 - left, or 0 with no
    left bound) holding a partner some row of the block sees in the dense mask; for the
    forward and dq the rows are queries and a chunk K's and V's rows, for dk/dv the rows
    are keys, the mask transposed, and a chunk Q's and dO's rows with lse and delta."""
    from tools import gpu_check
    from swa_tvm.reference import window_mask

    B, H, T, D = 2, 3, 50, 8
    spec = {"head_dim": D, "left": left, "right": right, "dtype": "bfloat16"}
    for kind, m in (("local", m_tiles), ("local_dq", 1), ("local_dkv", 1)):
        mask, origin_of = window_mask(T, left, right, 1), lambda m0: m0 - left if left >= 0 else 0
        if kind == "local_dkv":
            mask, origin_of = mask.T, lambda m0: m0 - right if right >= 0 else 0
        rows, blocks_chunks = 16 * warps * m, 0
        for m0 in range(0, T, rows):
            partners = mask[m0:m0 + rows].any(0).nonzero().flatten().tolist()
            blocks_chunks += len({(p - origin_of(m0)) // chunk for p in partners})
        column = D * 2 * 2 + (8 if kind == "local_dkv" else 0)
        entry = {"kind": kind, "warps": warps, "m_tiles": m, "chunk": chunk}
        assert gpu_check.staged_bytes(entry, spec, (B, H, 1, T)) == B * H * blocks_chunks * chunk * column, kind
        assert gpu_check.staged_bytes({"kind": kind, "config": "cores"}, spec, (B, H, 1, T)) is None


def test_gpu_check_variant_rows_on_cpu(monkeypatch, tmp_path):
    """The GPU check's variant stage (GPU-only there) on CPU kernels: each variant's
    arguments (forward; dq; dk/dv per query head) and its comparison with the default
    kernels' output and autograd's gradients; a failing variant gets an error row and
    the rest are still measured; the same from a child process."""
    import tvm

    from tools import gpu_check
    from swa_tvm.compiler.targets import host_target
    from swa_tvm.compiler.build import schedule_spec

    kernels = {k.kind: k for k in AttentionSpec.parse("head_dim=16,window=7:0,backward").kernels()}
    target = tvm.target.Target(host_target())
    funcs, entries = {}, []
    for kind in ("local", "local_dq", "local_dkv"):
        name = f"{kernels[kind].name}__te"
        funcs[name] = schedule_spec(kernels[kind], target).with_attr("global_symbol", name)
        entries.append({"function": name, "kind": kind})
    entries.insert(1, {"function": "absent__x", "kind": "local_dq"})
    # Written as the bundle writes lib/variants, and read back by the GPU check's loader.
    folder = tmp_path / "variants"
    folder.mkdir()
    tvm.compile(tvm.IRModule(funcs), target=target).mod.export_library(str(folder / "variants_cpu.so"))
    (folder / "variants.json").write_text(json.dumps(
        {"spec": kernels["local"].to_dict(), "library": "variants_cpu.so", "variants": entries}))
    meta, module = gpu_check.load_variants(str(tmp_path))
    assert meta["variants"] == entries
    rows = gpu_check.variant_rows(module, meta, torch.device("cpu"), shape=(1, 4, 2, 50))
    assert [r["kind"] for r in rows] == ["local", "local_dq", "local_dq", "local_dkv"]
    assert "error" in rows[1] and "ms" not in rows[1]
    for r in rows[:1] + rows[2:]:
        assert r["rel_err_vs_default"] < 1e-5 and r["ms"] > 0 and r["tflops"] > 0, r
    # The summary the defaults are set from: per kind the fastest variant that agreed,
    # never one that failed or disagreed.
    rows += [dict(rows[0], function="fast_but_wrong", ms=rows[0]["ms"] / 10, rel_err_vs_default=0.5),
             dict(rows[0], function="faster", ms=rows[0]["ms"] / 2, default=False)]
    rows[0]["default"] = True
    best = gpu_check.best_variants(rows, torch.float32)
    assert set(best) == {"local", "local_dq", "local_dkv"}
    assert best["local"]["function"] == "faster" and best["local"]["speedup_vs_default"] == pytest.approx(2.0)
    assert best["local_dq"]["function"] == rows[2]["function"] and best["local_dq"]["default_ms"] is None
    # A variant in a process of its own (the wgmma ones, whose failure could poison the
    # CUDA context): its row as in process; a child that fails is the row's error.
    child = gpu_check.isolated_variant_row(entries[0], str(tmp_path), "cpu", (1, 4, 2, 50))
    assert child["function"] == entries[0]["function"] and child["rel_err_vs_default"] < 1e-5 and child["ms"] > 0
    lost = gpu_check.isolated_variant_row({"function": "unlisted__y", "kind": "local"}, str(tmp_path), "cpu", (1, 4, 2, 50))
    assert "ms" not in lost and "child process rc 1" in lost["error"] and "unlisted__y: not in" in lost["error"], lost
    # Against the bars: each forward variant's speed against the bench stage's
    # FlexAttention (its causal row) and the matmul rate.
    bars = {"timing": [{"config": "dilation 2", "flex_attention_ms": 1.0},
                       {"config": "causal", "flex_attention_ms": rows[0]["ms"] * 3}],
            "matmul_tflops": rows[0]["tflops"] * 4, "variants": [dict(r) for r in rows],
            "variant_best": {"local": dict(best["local"])}}
    gpu_check.against_the_bars(bars)
    first = bars["variants"][0]
    assert first["speedup_vs_flex_attention"] == pytest.approx(3.0) and first["fraction_of_matmul"] == pytest.approx(0.25)
    assert "speedup_vs_flex_attention" not in bars["variants"][1]  # a failed row
    assert bars["variant_best"]["local"]["speedup_vs_flex_attention"] == pytest.approx(6.0)  # "faster": half the time
    # Past the run's time budget no variant is called: each says it was skipped.
    monkeypatch.setattr(gpu_check, "_deadline", 0.0)
    late = gpu_check.variant_rows(module, meta, torch.device("cpu"), shape=(1, 4, 2, 50))
    assert [r["error"] for r in late] == [gpu_check.OUT_OF_TIME] * 4 and not any("ms" in r for r in late)


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
    kernel = _serial_on_cpu(sch.mod)[spec.name]

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


@needs_nvcc
def test_gpu_bundle_builds_tile_variants(tmp_path, monkeypatch):
    """The GPU check's tile-configuration sweep: one module, one function per variant
    (tensor-core configurations and the CUDA-core kernel of the forward, dq and dk/dv
    kernels), listed in variants.json with the kind each computes; for sm_90 built as
    sm_90a, with the wgmma forward (V transposed, overlapped); two K/V stages."""
    from tools import gpu_bundle

    # 16-bit loads and cp.async; two 16-row tiles per warp.
    monkeypatch.setattr(gpu_bundle, "TC_VARIANTS", ((4, 64), (2, 16, False, True), (1, 16, True, False, 2),
                                                    (4, 16, True, False, 1, True, True, None, True),
                                                    (2, 16, True, True, 1, False, False, None, False, 2)))
    # 4 x 32: dynamic shared memory; 2 x 16 with two chunk stages.
    monkeypatch.setattr(gpu_bundle, "TC_BWD_VARIANTS", ((2, 32), (4, 32), (2, 16, True, False, 2)))
    monkeypatch.setattr(gpu_bundle, "WGMMA_PROBES", (("kn", 64, 128, 1, True),))
    path = gpu_bundle.build_variants(str(tmp_path), "sm_90")
    meta = json.load(open(tmp_path / "lib" / "variants" / "variants.json"))
    assert os.path.exists(path) and meta["library"] == os.path.basename(path) and meta["arch"] == "sm_90a"
    assert meta["spec"]["kind"] == "local"
    got = [(v["kind"], v["function"].rsplit("__", 1)[-1], v["kernel"], v.get("default")) for v in meta["variants"]]
    assert got == [
        ("local", "tc_w4_c64", "cuda_flash_tc", True),  # bf16 D=128's default
        ("local", "tc_w2_c16_lds16_async", "cuda_flash_tc", False),
        ("local", "tc_w1_c16_m2", "cuda_flash_tc", False),
        ("local", "tc_w4_c16_wgmma_vt_ov", "cuda_flash_tc", False),
        ("local", "tc_w2_c16_async_s2", "cuda_flash_tc", False),
        ("local", "cores", "cuda_flash", None),
        ("local_dq", "tc_w2_c32", "cuda_flash_bwd_tc", True),
        ("local_dq", "tc_w4_c32", "cuda_flash_bwd_tc", False),
        ("local_dq", "tc_w2_c16_async_s2", "cuda_flash_bwd_tc", False),
        ("local_dq", "cores", "cuda_flash_bwd", None),
        ("local_dkv", "tc_w2_c32", "cuda_flash_bwd_tc", True),
        ("local_dkv", "tc_w4_c32", "cuda_flash_bwd_tc", False),
        ("local_dkv", "tc_w2_c16_async_s2", "cuda_flash_bwd_tc", False),
        ("local_dkv", "cores", "cuda_flash_bwd", None),
        ("wgmma_probe", "wgmma_probe_kn_r64_c128_k1_swapped", "cuda_wgmma", None),
    ]
    dq_rows = [v for v in meta["variants"] if v["kind"] == "local_dq"]
    assert [v.get("shared_bytes", 0) > 48 * 1024 for v in dq_rows] == [False, True, False, False]
    assert [v.get("stages") for v in dq_rows] == [1, 1, 2, None]
    # ptxas's report per variant; the dynamic tiles count no static shared memory.
    assert all(v["ptxas"]["registers"] <= 255 for v in meta["variants"]), meta["variants"]
    assert [v["ptxas"]["smem"] > 1024 for v in dq_rows] == [True, False, True, True]
    # And each one's hot loop from its machine code (tools.sass): the tensor-core
    # forward's mma per warp and chunk: (8 k-steps x chunk/8 score tiles + chunk/16 x 16
    # output tiles) x row tiles: 128 at the default 4 x 64, 32 at 2 x 16, 64 with two
    # row tiles at 1 x 16, 32 in wgmma's units (a warp's share of each HGMMA) at 4 x 16;
    # the gradients' dq 96 and dk/dv 128 at 32 keys (two chunks a turn with two
    # stages: 64 at 2 x 16 in the forward, 2 x 48 and 2 x 64 at 16 keys in dq and dk/dv).
    assert [v["sass"]["loop_mma"] for v in meta["variants"] if v["kernel"] != "cuda_flash_bwd"][:5] == [128, 32, 64, 32, 64]
    assert [v["sass"]["loop_mma"] for v in meta["variants"] if v["kernel"] == "cuda_flash_bwd_tc"] == [96, 96, 96, 128,
                                                                                                       128, 128]
    # The 4 x 32 gradient kernels (52 KiB, compiled by nvcc above) take dynamic shared
    # memory; tiles within 48 KiB static.
    from swa_tvm.schedules import cuda_flash_bwd_tc, cuda_flash_tc

    grad = KernelSpec("local_dq", 128, "bfloat16", 4095, 0)
    assert 'scope="shared.dyn"' in cuda_flash_bwd_tc.flash_bwd_tc(grad, cuda_flash_bwd_tc.TCBwdConfig(4, 32)).script()
    small = cuda_flash_bwd_tc.flash_bwd_tc(grad, cuda_flash_bwd_tc.TCBwdConfig(2, 32)).script()
    assert "shared.dyn" not in small and "T.alloc_shared(" in small
    with pytest.raises(ValueError, match=r"exceed the 99 KiB of a block"):
        cuda_flash_tc.flash_tc(dataclasses.replace(grad, kind="local", head_dim=256), cuda_flash_tc.TCConfig(8, 128))
    # wgmma kernels run on sm_90 alone, whose blocks may take 227 KiB: 4 x 64 gradients
    # with two chunk stages (99.3 KiB) are one, on mma.sync they are refused.
    two_stage = cuda_flash_bwd_tc.TCBwdConfig(4, 64, True, True, 2)
    assert 99 * 1024 < two_stage.shared_bytes(128, "bfloat16") and cuda_flash_tc.tile_scope(grad, two_stage) == "shared.dyn"
    with pytest.raises(ValueError, match=r"exceed the 99 KiB of a block"):
        cuda_flash_tc.tile_scope(grad, dataclasses.replace(two_stage, wgmma=False))
    with pytest.raises(ValueError, match=r"exceed the 227 KiB of a block"):
        cuda_flash_tc.tile_scope(dataclasses.replace(grad, head_dim=256), cuda_flash_bwd_tc.TCBwdConfig(8, 128, True, True, 2))
