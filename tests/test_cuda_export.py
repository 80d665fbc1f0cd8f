"""CUDA without a GPU: targets, compiling and exporting a CUDA library for sm_80/sm_90
(its manifest, ptxas's report, the device code packed compiled), loading it here, and
a call failing clearly for want of a device.

What needs a GPU (running the kernels, timing them) is tools.gpu_check, run by
tools/gpu_check.sh on a machine that has one; the CUDA kernels' numerics without one
are test_cuda_emulated.py's, their generated code test_cuda_codegen.py's."""

import json
import re
import subprocess
import sys
import warnings

import pytest
import torch
from cuda_helpers import needs_nvcc

import swa_tvm
from swa_tvm.compiler import targets
from swa_tvm.compiler.build import UntunedKernelWarning
from swa_tvm.compiler.targets import normalize_target
from swa_tvm.runtime import library
from swa_tvm.spec import CPU_ONLY_KINDS, AttentionSpec


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


@pytest.mark.slow  # nvcc and a subprocess
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
    kernels = [k for k in spec.kernels() if k.kind not in CPU_ONLY_KINDS]  # CUDA builds no CPU-only kernel
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


@pytest.mark.slow
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


@pytest.mark.slow  # nvcc, twice
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kv_cache_kernels_compile_for_cuda(tmp_path, arch, fresh_registry):
    """The KV-cache kernels (forward and gradients, sinks and softcap) compile for both
    archs on the TE schedule (no fused kernel serves them yet), with what ptxas reports
    in the manifest: no spill, registers within a thread's 255; and the library loads."""
    spec = AttentionSpec.parse("head_dim=32,window=15:0,sinks,kvcache,softcap,backward,dtype=bfloat16")
    kernels = [k for k in spec.kernels() if k.kind.startswith("cache") and k.block_q == 4]
    assert {k.kind for k in kernels} == {"cache", "cache_dq", "cache_dkv", "cache_dx"}
    path = tmp_path / f"kv_{arch}.so"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntunedKernelWarning)
        manifest = swa_tvm.export_library(kernels, path, target=f"cuda -arch={arch}")
    assert manifest["cuda_arch"] == arch
    assert {k["spec"]["kind"]: k["schedule"] for k in manifest["kernels"]} == {k.kind: "default" for k in kernels}
    for k in manifest["kernels"]:
        assert k["ptxas"], k["name"]
        for f, r in k["ptxas"].items():
            assert r["registers"] <= 255 and r["spill_stores"] == 0, (f, r)
    swa_tvm.load_library(path)
    assert {k.spec.name for k in library.REGISTRY.kernels("cuda")} == {k.name for k in kernels}


@pytest.mark.slow  # nvcc
@needs_nvcc
def test_sm_90a_library_is_refused_at_load_on_a_gpu_of_another_arch(tmp_path, monkeypatch, fresh_registry):
    """A library exported for sm_90a (Hopper's arch-specific target, which wgmma needs):
    its manifest says so, and where a CUDA GPU is present (here: the device query
    monkeypatched) loading it on another arch is refused by the file's name and both
    archs, nothing registered; on sm_90 it passes that check (on to the runtime)."""
    path = tmp_path / "lib_sm_90a.so"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntunedKernelWarning)
        manifest = swa_tvm.export_library([AttentionSpec.parse("head_dim=32,window=15:0,dtype=float16")], path,
                                          target="cuda -arch=sm_90a")
    assert manifest["cuda_arch"] == "sm_90a" and manifest["target"] == {"kind": "cuda", "arch": "sm_90a"}
    assert manifest["target_key"] == "cuda-sm_90a" and "sm_90a" in targets.CUDA_ARCHS
    monkeypatch.setattr(library, "cuda_unavailable_reason", lambda: None)  # a GPU is present
    for other in ("sm_80", "sm_89", "sm_100"):
        monkeypatch.setattr(library, "cuda_device_arch", lambda other=other: other)
        with pytest.raises(library.LibraryError,
                           match=rf"lib_sm_90a\.so: built for sm_90a, whose code runs on sm_90 GPUs alone, "
                                 rf"but this GPU is {other}"):
            library.load_library(path)
        assert library.REGISTRY.kernels("cuda") == [] and str(path) not in library.REGISTRY.libraries

    def past_the_check():
        raise RuntimeError("past the arch check")

    monkeypatch.setattr(library, "cuda_device_arch", lambda: "sm_90")
    monkeypatch.setattr(library, "_load_tvm_runtime", past_the_check)
    with pytest.raises(RuntimeError, match="past the arch check"):
        library.load_library(path)
