"""Export -> manifest -> load (in a fresh process) -> call, and the manifest's refusals."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import rel_err

from swa_tvm.compiler import jit
from swa_tvm.compute import forward as compute_forward
from swa_tvm import eager
import swa_tvm
from swa_tvm.runtime import library
from swa_tvm.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=32, window=(3, 0), max_dilation=4, globals=True, sinks=True)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = tmp_path_factory.mktemp("lib") / "swa.so"
    r = subprocess.run(
        [sys.executable, "-m", "swa_tvm.cli", "export", "--spec", "head_dim=32,window=3:0,dilation=4,globals,sinks",
         "-o", str(path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    return path


def test_manifest_contents(lib):
    m = library.read_manifest(lib)
    assert m["tvm_version"] == __import__("tvm").__version__ == library.tvm_version()
    assert m["target"]["kind"] == "llvm" and m["target"]["mcpu"]
    assert m["sha256"] == library.sha256_file(lib)
    names = {k["name"] for k in m["kernels"]}
    assert names == {k.name for k in SPEC.kernels()}
    assert all(k["tuned"] is False for k in m["kernels"])


ROUND_TRIP = r"""
import sys, torch, swa_tvm
from swa_tvm.runtime import library
from swa_tvm.reference import sliding_window_attention_ref as ref
specs = swa_tvm.load_library(sys.argv[1])
assert not library.REGISTRY.kernels() or all(k.origin == sys.argv[1] for k in library.REGISTRY.kernels())
B, H, Hkv, T, D, G = 2, 4, 2, 300, 32, 3
q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
gi = torch.stack([torch.randperm(T)[:G] for _ in range(B)]).int()
kw = dict(window_size=(3, 0), dilation=torch.tensor([1, 2, 4, 3], dtype=torch.int32), global_idx=gi,
          q_global=torch.randn(B, H, G, D), num_sinks=2, sink_logits=torch.randn(H))
out = torch.ops.swa_tvm.attention(q, k, v, kw["dilation"], gi, kw["q_global"], None, None, 2, kw["sink_logits"],
                                  D ** -0.5, 3, 0)[0]
r, _ = ref(q, k, v, **kw)
err = ((out.double() - r).norm() / r.norm()).item()
assert err < 1e-5, err
# a head dim the library lacks: a clear error naming the dims it has
try:
    swa_tvm.sliding_window_attention(torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16),
                                     window_size=(3, 0))
except ValueError as e:
    assert "head dim D=16" in str(e) and "[32]" in str(e), e
else:
    raise AssertionError("no error for a head dim the library lacks")
assert "tvm" not in sys.modules, "loading and calling a library must not import the TVM compiler"
print("OK", err)
"""


def test_round_trip_in_fresh_process(lib):
    r = subprocess.run([sys.executable, "-c", ROUND_TRIP, str(lib)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK")


THREADS = r"""
import sys, torch, swa_tvm, tvm_ffi
torch.set_num_threads(int(sys.argv[2]))
swa_tvm.load_library(sys.argv[1])
q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
swa_tvm.sliding_window_attention(q, k, v, window_size=(3, 0), dilation=torch.tensor([1, 4], dtype=torch.int32), num_sinks=1)
print(tvm_ffi.get_global_func("runtime.NumThreads")())
"""


@pytest.mark.slow  # a process per thread count
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_kernels_use_torchs_thread_count(lib, threads):
    # TVM alone would use hardware_concurrency / 2 threads on x86 (one of this machine's
    # two cores); a user's TVM_NUM_THREADS / OMP_NUM_THREADS still wins. TVM's pool never
    # exceeds the CPUs it may run on.
    cpus = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", THREADS, str(lib), str(threads)], capture_output=True, text=True,
                       timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(r.stdout.split()[-1]) == min(threads, cpus)


@pytest.mark.slow  # a process of its own
def test_tvm_num_threads_wins_over_torchs(lib):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["TVM_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", THREADS, str(lib), "3"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and int(r.stdout.split()[-1]) == 1, r.stdout + r.stderr


def _copy(lib, tmp_path, edit=None, tamper=False):
    dst = tmp_path / "copy.so"
    dst.write_bytes(lib.read_bytes() + (b"\0" if tamper else b""))
    m = library.read_manifest(lib)
    if edit:
        edit(m)
    (tmp_path / "copy.so.json").write_text(json.dumps(m))
    return dst


def test_refuses_modified_library(lib, tmp_path, fresh_registry):
    with pytest.raises(library.LibraryError, match="sha256"):
        swa_tvm.load_library(_copy(lib, tmp_path, tamper=True))


def test_refuses_other_tvm_version(lib, tmp_path, fresh_registry):
    with pytest.raises(library.LibraryError, match=r"built with TVM 0\.1\.0.*rebuild"):
        swa_tvm.load_library(_copy(lib, tmp_path, edit=lambda m: m.update(tvm_version="0.1.0")))


def test_refuses_cpu_lacking_features(lib, tmp_path, fresh_registry):
    def edit(m):
        m["target"]["mcpu"] = "imaginary"
        m["cpu_features"] = m["cpu_features"] + ["amx_tile_imaginary"]

    with pytest.raises(library.LibraryError, match=r"amx_tile_imaginary"):
        swa_tvm.load_library(_copy(lib, tmp_path, edit=edit))


def test_refuses_an_older_manifest_format_and_unknown_kernel_arguments(lib, tmp_path, fresh_registry):
    """Format 1 manifests could not name a kernel's extra arguments (the split-K global
    rows' workspace); a kernel taking arguments this version does not know is refused
    rather than called with too few."""
    with pytest.raises(library.LibraryError, match=r"manifest format 1, expected one of \(2, 3, 4\)"):
        swa_tvm.load_library(_copy(lib, tmp_path, edit=lambda m: m.update(format=1)))

    def edit(m):
        m["kernels"][0]["workspace"] = "future: scratch [B, H, X] float32"

    with pytest.raises(library.LibraryError, match=r"takes arguments this swa_tvm does not know"):
        swa_tvm.load_library(_copy(lib, tmp_path, edit=edit))
    assert fresh_registry.kernels() == []


def test_refuses_missing_manifest(lib, tmp_path, fresh_registry):
    dst = tmp_path / "bare.so"
    dst.write_bytes(lib.read_bytes())
    with pytest.raises(library.LibraryError, match="no manifest"):
        swa_tvm.load_library(dst)
    assert fresh_registry.kernels() == []


def test_loaded_library_missing_window_is_an_error(lib, fresh_registry):
    swa_tvm.load_library(lib)
    q = torch.randn(1, 2, 10, 32)
    with pytest.raises(ValueError, match=r"no kernel in the loaded libraries computes .*window \(5, 0\)"):
        swa_tvm.sliding_window_attention(q, q, q, window_size=(5, 0))


@pytest.mark.slow  # three CLI processes
def test_cli_info_and_errors(lib):
    r = subprocess.run([sys.executable, "-m", "swa_tvm.cli", "info", str(lib)], capture_output=True, text=True)
    assert r.returncode == 0 and "loadable     yes" in r.stdout and "swa_local_d32" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "swa_tvm.cli", "export", "--spec", "head_dim=32,window=3", "-o", "/tmp/x.so"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 1 and "window must look like LEFT:RIGHT" in r.stderr
    r = subprocess.run([sys.executable, "-m", "swa_tvm.cli", "bogus"], capture_output=True, text=True)
    assert r.returncode == 2


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 feature levels")
@pytest.mark.parametrize("level,needs", [("x86-64-v3", {"avx2", "fma"}), ("x86-64-v4", {"avx512f"})])
def test_x86_level_library_needs_only_its_level(level, needs, tmp_path, fresh_registry):
    """A library for one of x86-64's feature levels (to ship one file to a mixed fleet)
    records just that level's features: v3 (AVX2, FMA) loads on any AVX2 machine whatever
    LLVM calls its CPU, and computes the reference; where v4's AVX-512 is missing, the load
    is refused naming it."""
    from swa_tvm.reference import sliding_window_attention_ref

    path = tmp_path / f"{level}.so"
    specs = AttentionSpec.parse("head_dim=16,window=5:0,dilation=2").kernels()
    with pytest.warns(UserWarning, match=f"no tuning record for llvm-{level}"):
        manifest = swa_tvm.export_library(specs, path, target={"kind": "llvm", "mcpu": level})
    feats = set(manifest["cpu_features"])
    assert needs <= feats and manifest["target_key"] == f"llvm-{level}"
    if level == "x86-64-v3":
        assert not any(f.startswith("avx512") for f in feats), feats
    missing = sorted(feats - library.host_cpu_flags())
    if missing:
        with pytest.raises(library.LibraryError, match=rf"built for CPU '{level}', which needs {missing[0]}"):
            swa_tvm.load_library(path)
        return
    swa_tvm.load_library(path)
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    dil = torch.tensor([1, 2], dtype=torch.int32)
    out = swa_tvm.sliding_window_attention(q, k, v, window_size=(5, 0), dilation=dil)
    ref, _ = sliding_window_attention_ref(q.double(), k.double(), v.double(), window_size=(5, 0), dilation=dil)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.slow  # exports bf16 forward and gradient kernels
def test_half_precision_cpu_library(tmp_path, fresh_registry):
    """A bfloat16 CPU library (float32 accumulation): exported, loaded through its
    manifest, serving the forward and the gradients against the float64 reference."""
    from tools.gpu_check import GRAD_TOLERANCE, TOLERANCE
    from swa_tvm.reference import sliding_window_attention_ref

    specs = AttentionSpec.parse("head_dim=16,window=5:0,dtype=bfloat16,backward").kernels()
    path = tmp_path / "bf16.so"
    manifest = swa_tvm.export_library(specs, path, logs=None)
    assert {k["spec"]["dtype"] for k in manifest["kernels"]} == {"bfloat16"} and manifest["target"]["kind"] == "llvm"
    swa_tvm.load_library(path)
    q, k, v = (torch.randn(2, 3, 50, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = swa_tvm.sliding_window_attention(q, k, v, window_size=(5, 0))
    ref, _ = sliding_window_attention_ref(q, k, v, window_size=(5, 0))
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOLERANCE[torch.bfloat16][0]
    d_out = torch.randn_like(ref)
    got = torch.autograd.grad((out.double() * d_out).sum(), (q, k, v))
    want = torch.autograd.grad((ref * d_out).sum(), (q, k, v))
    assert all(rel_err(a, b) < GRAD_TOLERANCE[torch.bfloat16] for a, b in zip(got, want))
    # A sequence shorter than the window (which then reaches every row) is served by the
    # same kernels, forward and backward.
    qs, ks, vs = (x.detach()[:, :, :4].clone().requires_grad_(True) for x in (q, k, v))
    out = swa_tvm.sliding_window_attention(qs, ks, vs, window_size=(5, 0))
    ref, _ = sliding_window_attention_ref(qs, ks, vs, window_size=(5, 0))
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16][0]
    got = torch.autograd.grad((out.double() * d_out[:, :, :4]).sum(), (qs, ks, vs))
    want = torch.autograd.grad((ref * d_out[:, :, :4]).sum(), (qs, ks, vs))
    assert all(rel_err(a, b) < GRAD_TOLERANCE[torch.bfloat16] for a, b in zip(got, want))
    # The library's kernels served it: a float32 call finds none of its kind.
    with pytest.raises(ValueError, match="no kernel in the loaded libraries"):
        swa_tvm.sliding_window_attention(q.detach().float(), k.detach().float(), v.detach().float(), window_size=(5, 0))


@pytest.mark.slow  # two processes, each compiling or loading
def test_jit_disk_cache_is_reused(tmp_path):
    """A second process finds the kernel compiled by the first on disk."""
    env = dict(os.environ, SWA_TVM_CACHE=str(tmp_path))
    code = (
        "import sys, torch, swa_tvm, swa_tvm.compiler.jit as b\n"
        "if sys.argv[1] == 'forbid':\n"
        "    b.export_library = lambda *a, **k: (_ for _ in ()).throw(AssertionError('recompiled'))\n"
        "q = torch.randn(1, 1, 20, 16)\n"
        "swa_tvm.sliding_window_attention(q, q, q, window_size=(1, 1))\n"
    )
    first = subprocess.run([sys.executable, "-c", code, "allow"], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    files = sorted(p.name for p in tmp_path.rglob("*.so"))
    assert len(files) == 1 and files[0].startswith("swa_local_d16_f32_l1_r1_md1_x0")
    second = subprocess.run([sys.executable, "-c", code, "forbid"], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr  # served from disk, export_library never called
    assert sorted(p.name for p in tmp_path.rglob("*.so")) == files


@pytest.mark.slow  # two processes racing to compile
def test_jit_cache_builds_once_for_concurrent_processes(tmp_path):
    """Two processes asking for the same uncached kernel at once: one compiles, the
    other waits for it and loads its entry. Both meet after their imports, and each
    build logs a line and takes a second longer, so without the lock both would build."""
    env = dict(os.environ, SWA_TVM_CACHE=str(tmp_path / "cache"))
    code = (
        "import os, sys, time, torch, swa_tvm, swa_tvm.compiler.jit as b\n"
        "from swa_tvm.reference import sliding_window_attention_ref\n"
        "folder, me = sys.argv[1], sys.argv[2]\n"
        "export = b.export_library\n"
        "def logged(*a, **k):\n"
        "    open(os.path.join(folder, 'builds.txt'), 'a').write(me + '\\n')\n"
        "    time.sleep(1)\n"
        "    return export(*a, **k)\n"
        "b.export_library = logged\n"
        "open(os.path.join(folder, 'ready' + me), 'w').close()\n"
        "while not all(os.path.exists(os.path.join(folder, 'ready' + i)) for i in '01'):\n"
        "    time.sleep(0.01)\n"
        "q = torch.randn(1, 2, 24, 16)\n"
        "out = swa_tvm.sliding_window_attention(q, q, q, window_size=(2, 0))\n"
        "ref = sliding_window_attention_ref(q, q, q, window_size=(2, 0))[0]\n"
        "assert (out.double() - ref).abs().max() < 1e-5\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(i)], env=env, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()
    assert len((tmp_path / "builds.txt").read_text().splitlines()) == 1
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 1


def test_jit_cache_key_covers_every_schedule():
    """Every file of the schedules package (cuda_wgmma.py was missed once) and the TE
    are in the sources whose hash keys the JIT cache."""
    from swa_tvm import schedules

    files = {os.path.realpath(f) for f in jit.kernel_code_files()}
    folder = os.path.dirname(schedules.__file__)
    wanted = {os.path.realpath(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".py")}
    assert len(wanted) >= 8 and wanted <= files and os.path.realpath(compute_forward.__file__) in files


@pytest.mark.parametrize("kind", ["local", "local_dq", "local_dkv"])
def test_kernels_never_floor_divide_by_the_runtime_dilation(kind):
    # Floor division/modulo by a runtime value lowers to sign fix-ups (nested Let/Select);
    # nested in the gathers they made every kernel take ~7 s in TVM's code generation.
    # Indices and dilations are never negative, so the kernels divide with truncation
    # (compute_forward.div_nonneg). (With extras, the extra positions' residues keep floor
    # division on purpose: a padded position is -1.) The code of 2026-12-02 had 14-22
    # such divisions per kernel.
    import re

    from swa_tvm.compute import prim_func
    from swa_tvm.spec import KernelSpec

    script = prim_func(KernelSpec(kind, 16, left=3, right=2, max_dilation=2)).script()
    assert "dilation" in script and "T.truncmod" in script  # the dilation is there, divided by truncation
    floor_by_dilation = re.findall(r'(?://|%) \(?T\.Cast\("int64", dilation', script)
    assert floor_by_dilation == []


@pytest.mark.parametrize("built,device,refused", [("sm_90a", "sm_90", False), ("sm_90a", "sm_80", True),
                                                 ("sm_90a", "sm_100", True), ("sm_90", "sm_100", False),
                                                 ("sm_80", "sm_90", False), ("sm_90a", None, False), (None, "sm_90", False)])
def test_arch_specific_cuda_code_is_refused_on_another_arch(built, device, refused):
    """load_library's arch check: sm_XYa code (wgmma) runs on sm_XY alone, so on any
    other GPU it is refused, naming the file and both archs; sm_XY code is left to the
    launch's check (it runs on later GPUs too), an unknown device to the call."""
    if refused:
        with pytest.raises(library.LibraryError, match=rf"lib\.so: built for {built}, .* this GPU is {device}"):
            library.check_arch_specific("lib.so", built, device)
    else:
        assert library.check_arch_specific("lib.so", built, device) is None


@pytest.mark.parametrize("arch,device_cc,refused", [("sm_80", (9, 0), False), ("sm_90", (8, 6), True),
                                                    ("sm_90a", (9, 0), False), ("sm_90a", (10, 0), True)])
def test_cuda_kernels_refuse_a_device_their_code_does_not_run_on(monkeypatch, arch, device_cc, refused):
    """The launch's arch check (before any CUDA call): sm_XY code runs on sm_XY and later
    GPUs, sm_XYa code (wgmma) on sm_XY alone; a refusal names both."""
    import torch

    from swa_tvm.spec import KernelSpec

    calls = []
    kern = library.Kernel(KernelSpec("local", 16, "float16", 7, 0), lambda *a: calls.append(a), "cuda", "lib.so", arch,
                          schedule="cuda_flash_tc")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: device_cc)
    if refused:
        with pytest.raises(RuntimeError, match=f"built for {arch}, but cuda:0 is sm_{device_cc[0]}{device_cc[1]}"):
            eager._launch(kern, torch.device("cuda", 0))
        return
    # Accepted: on to the launch, which needs the CUDA runtime this machine lacks.
    with pytest.raises(Exception) as e:
        eager._launch(kern, torch.device("cuda", 0))
    assert "built for" not in str(e.value)


def test_registry_snapshot_and_restore():
    """Registry.snapshot / restore (what the tests' fixtures isolate themselves with, and
    code that loads libraries for a while can use): restore puts back exactly the
    kernels, libraries and kept modules of the snapshot, whatever came or went since."""
    from swa_tvm.spec import KernelSpec

    reg = library.Registry()
    before = library.Kernel(KernelSpec("local", 16, "float32", 3, 0), print, "cpu", "a.so")
    after = library.Kernel(KernelSpec("local", 16, "float32", 5, 0), print, "cpu", "b.so")
    reg.add(before, module="module a")
    reg.add_library("a.so")
    reg.add_library("a.so")  # once
    saved = reg.snapshot()
    reg.add(after, module="module b")
    reg.add_library("b.so")
    assert reg.libraries == ["a.so", "b.so"] and len(reg.kernels()) == 2
    reg.restore(saved)
    assert reg.libraries == ["a.so"] and reg.kernels() == [before] and reg.find(after.spec, "cpu") is None
    assert reg.snapshot() == saved and list(saved.modules) == ["module a"]
    reg.clear()
    reg.restore(saved)  # a snapshot stays valid after the registry changes
    assert reg.kernels() == [before]
    with pytest.raises(TypeError, match="snapshot"):
        reg.restore((dict(), [], []))
