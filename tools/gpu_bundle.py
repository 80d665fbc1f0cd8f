"""Build, on a machine without a GPU, everything the GPU check needs on one with a GPU.

The GPU machine has CUDA, torch and Triton but no TVM compiler, and what travels there is
limited (the repository's tree and the bundle together: 64 MiB), so the full apache-tvm
wheel cannot go. By default this writes to ``build/gpu/`` what the decision run
(tools/gpu_decide.sh) needs, and no more:

- ``lib/*.so`` (+ manifests): the check and bench libraries, compiled here with nvcc
  for one arch (no ``.so.cu`` sources: nothing there reads them);
- ``lib/variants/``: the fused forward under its tile configurations and the wgmma
  probes (sm_90a for Hopper, whose wgmma needs it), ``variants.json`` naming them;
- ``runtime/``: libtvm_runtime.so and libtvm_runtime_cuda.so from the installed TVM and a
  ``tvm_version`` file (what ``library.tvm_version`` reads without apache-tvm);
- ``wheels/``: the apache-tvm-ffi wheel for the GPU machine's Python (fetched by pip);
- ``COMMIT``: the checkout it was built from (its root and ``git describe``).

Only when asked: ``--gradients`` (the dq and dk/dv kernels' tile variants),
``--kv-cache`` (the KV-cache libraries, for the check's kv_cache and decode stages),
``--tune-trials N`` (``tune_batch/``: MetaSchedule candidates for the GPU to measure,
:mod:`swa_tvm.tuning.batch`, continuing from the records in ``tuning_logs/``). At the
end it prints the tree's and the bundle's sizes against the limit and fails if they
are over (``--max-mib``).

Then ``tools/gpu_decide.sh`` or ``tools/gpu_check.sh`` (run there, see
:mod:`tools.gpu_check`) loads and checks them. Usage: ``python -m tools.gpu_bundle
[--arch sm_90] [--out build/gpu]`` (``make gpu-bundle``), from the repository root.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

# This checkout's swa_tvm, not the one an editable install points at (main checks).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[:1] != [ROOT]:
    sys.path.insert(0, ROOT)

import tvm  # noqa: E402

from swa_tvm.compiler.build import UntunedKernelWarning, cuda_source, export_library  # noqa: E402
from swa_tvm.compiler.cuda_pack import (  # noqa: E402
    export_module,
    fatbin_cubin,
    library_blob,
    read_cuda_modules,
)
from swa_tvm.compiler.records import default_logs_root  # noqa: E402
from swa_tvm.compiler.targets import normalize_target  # noqa: E402
from swa_tvm.schedules import (  # noqa: E402
    cuda_flash,
    cuda_flash_bwd,
    cuda_flash_bwd_tc,
    cuda_flash_tc,
    cuda_wgmma,
)
from swa_tvm.spec import AttentionSpec  # noqa: E402
from swa_tvm.tuning.batch import build_batch  # noqa: E402
from tools import sass  # noqa: E402

# Correctness libraries: every pattern in every dtype, at a head dim and windows small
# enough for a dense float64 reference.
CHECK_SPECS = (
    "head_dim=64,window=31:0,dilation=2,backward",
    "head_dim=64,window=31:0,dilation=2,globals,sinks,backward",
    "head_dim=64,window=16:16,dilation=2,globals,backward",
)
CHECK_DTYPES = ("float16", "bfloat16", "float32")
# The timing shapes: bf16, D=128, causal W=4096, plain / dilation 2 / globals.
# The first with its gradient kernels, for the training timing (gpu_check.time_training).
BENCH_SPECS = (
    "head_dim=128,window=4095:0,dtype=bfloat16,backward",
    "head_dim=128,window=4095:0,dilation=2,dtype=bfloat16",
    "head_dim=128,window=4095:0,globals,dtype=bfloat16",
)
# The KV-cache kernels (kinds cache*, the TE schedule: no fused kernel serves them), of
# gpu_check.check_kv_cache's cases in every dtype: softcap without sinks, sinks without
# softcap (each serving dilation 1 and 2) and a full causal layer, with their gradients.
KV_CHECK_SPECS = (
    "head_dim=64,window=31:0,dilation=2,kvcache,softcap,backward",
    "head_dim=64,window=31:0,dilation=2,sinks,kvcache,backward",
    "head_dim=64,window=-1:0,kvcache,backward",
)
# gpu_check.bench_decode's: bf16 D=128, a sliding layer (W=4096) and a full one.
KV_BENCH_SPECS = (
    "head_dim=128,window=4095:0,kvcache,dtype=bfloat16",
    "head_dim=128,window=-1:0,kvcache,dtype=bfloat16",
)


# The blocks of rows those cases take (T_q x the GQA group: 2 and 4 rows; 32, 74 and 2048):
# the 8-row kernels would only add to what the device tool carries.
KV_BLOCKS = (4, 16)


def _cache_kernels(texts) -> list:
    return [k for s in texts for k in AttentionSpec.parse(s).kernels()
            if k.kind.startswith("cache") and k.block_q in KV_BLOCKS]


def build_libraries(out: str, arch: str, kv_cache: bool = False) -> list[str]:
    """The check libraries (CHECK_SPECS in every dtype) and the bench library
    (BENCH_SPECS); with ``kv_cache`` the KV-cache ones (KV_CHECK_SPECS, KV_BENCH_SPECS)."""
    target = normalize_target(f"cuda -arch={arch}")
    os.makedirs(os.path.join(out, "lib"), exist_ok=True)
    jobs = [(f"check_{dt}", [k for s in CHECK_SPECS for k in AttentionSpec.parse(f"{s},dtype={dt}").kernels()])
            for dt in CHECK_DTYPES]
    jobs.append(("bench_bf16", [k for s in BENCH_SPECS for k in AttentionSpec.parse(s).kernels()]))
    if kv_cache:
        jobs += [(f"kvcache_{dt}", _cache_kernels(f"{s},dtype={dt}" for s in KV_CHECK_SPECS)) for dt in CHECK_DTYPES]
        jobs.append(("kvcache_bench_bf16", _cache_kernels(KV_BENCH_SPECS)))
    paths = []
    for name, kernels in jobs:
        path = os.path.join(out, "lib", f"{name}_{arch}.so")
        t0 = time.time()
        kernels = list(dict.fromkeys(kernels))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntunedKernelWarning)  # no CUDA records yet: all default
            export_library(kernels, path, target)
        os.remove(path + ".cu")  # the generated source: nothing there reads it, and it counts against the 64 MiB
        print(f"{path}: {len(kernels)} kernels in {time.time() - t0:.0f}s", flush=True)
        paths.append(path)
    return paths


# Tile configurations of the fused kernels to time against each other on the GPU (the
# default is picked without one): tensor-core (warps, partners per chunk[, ldmatrix:
# False loads the B operands read along a tile's rows with 16-bit loads instead[,
# async_copy: the forward's K and V chunks by cp.async[, m_tiles: the forward's 16-row
# tiles per warp[, wgmma[, transpose_v[, min_blocks[, overlap[, stages]]]]]]]]; the gradients' (warps, chunk[, ldmatrix[,
# wgmma[, stages]]])), and the CUDA-core kernel; for the forward and for the two band gradient
# kernels. At the bf16 D=128 causal W=4096 shape.
# Those past 48 KiB of shared memory (forward 8 x 64 and every m_tiles=2, backward 4 x 32
# and 4 x 64) take dynamic shared memory. The wgmma ones (sm_90 only: the module is then
# built for sm_90a) have not run on a GPU before: V's tile both as it is (MN-major) and
# transposed (K-major, as K's), so that one wrong reading of the descriptor's layout
# cannot hide the other.
VARIANT_SPEC = "head_dim=128,window=4095:0,dtype=bfloat16,backward"
TC_VARIANTS = (
    (4, 64), (4, 64, False), (4, 32), (2, 64), (2, 32), (8, 64), (8, 32), (8, 16),
    (4, 64, True, True), (4, 32, True, True), (2, 64, True, True), (8, 64, True, True),
    (4, 32, True, False, 2), (4, 32, True, True, 2), (4, 64, True, True, 2),
    (4, 64, True, False, 1, True), (4, 64, True, True, 1, True), (4, 64, True, False, 1, True, True),
    (8, 64, True, False, 1, True), (8, 64, True, True, 1, True),
    (4, 128, True, False, 1, True), (8, 128, True, False, 1, True), (8, 128, True, True, 1, True),
    # __launch_bounds__' blocks per SM (TCConfig.min_blocks; the others take two): three
    # (168 registers; the default's 28 bytes of spill are in its masked chunks' path),
    # and ptxas's own choice (0) for the default tiles.
    (4, 64, True, False, 1, False, False, 3), (4, 32, True, True, 1, False, False, 3),
    (4, 64, True, True, 1, True, False, 3), (4, 64, True, False, 1, False, False, 0),
    # wgmma overlapped (TCConfig.overlap: chunk c's Q K^T issued with chunk c - 1's P V,
    # the softmax beside P V), V as it is and transposed, and with 8 warps.
    (4, 64, True, False, 1, True, False, None, True), (4, 64, True, False, 1, True, True, None, True),
    (8, 64, True, False, 1, True, False, None, True),
    # Two K/V stages by cp.async (TCConfig.stages: chunk c + 1's copies land during
    # chunk c's work): mma.sync 4 x 64 and 4 x 32 with two row tiles, wgmma 4 x 64, 8 x 64.
    (4, 64, True, True, 1, False, False, None, False, 2), (4, 32, True, True, 2, False, False, None, False, 2),
    (4, 64, True, True, 1, True, False, None, False, 2), (8, 64, True, True, 1, True, False, None, False, 2),
)
TC_BWD_VARIANTS = ((2, 32), (2, 32, False), (4, 32), (4, 64), (4, 16), (2, 16), (1, 32),
                   (4, 32, True, True), (4, 64, True, True), (8, 32, True, True),
                   # Two chunk stages by cp.async (TCBwdConfig.stages): mma.sync and wgmma
                   # (4 x 64: 99.3 KiB, past the 99 KiB of every sm_80+ GPU, within sm_90's 227).
                   (2, 32, True, False, 2), (4, 32, True, False, 2), (4, 32, True, True, 2), (8, 32, True, True, 2),
                   (4, 64, True, True, 2))
# One wgmma alone against a matrix product (``cuda_wgmma.probe``: operand, tile rows,
# tile columns, k-step, LBO and SBO exchanged), at the forward's geometry: K's tile (64
# keys x 128), V's as it is and with the other reading of its MN-major descriptor, V's
# transposed (128 x 64 keys). Where a wgmma variant disagrees, these say which reading.
WGMMA_PROBES = (("nk", 64, 128, 1, False), ("kn", 64, 128, 1, False), ("kn", 64, 128, 1, True),
                ("nk", 128, 64, 2, False))


def build_variants(out: str, arch: str, gradients: bool = False) -> str:
    """One CUDA module holding the local kernel of VARIANT_SPEC (with ``gradients`` also
    its dq and dk/dv kernels) under several tile configurations, each its own function
    (``<kernel>__tc_w4_c64``, ``<kernel>__cores``), and the wgmma probes for Hopper;
    ``variants.json`` names them (with the kernel kind each computes). It lives in
    ``lib/variants/``, away from the libraries the check registers: same kernels, so the
    registry could hold only one."""
    kernels = {k.kind: k for k in AttentionSpec.parse(VARIANT_SPEC).kernels()}
    funcs, entries = {}, []
    # wgmma needs the arch-specific sm_90a (whose code runs on sm_90 GPUs only).
    hopper = arch in ("sm_90", "sm_90a")
    arch = "sm_90a" if hopper else arch

    def add(spec, suffix, func, **entry):
        name = f"{spec.name}__{suffix}"
        funcs[name] = func.with_attr("global_symbol", name)
        entries.append({"function": name, "kind": spec.kind, **entry})

    for kind, tc, cores, tc_configs in (
        ("local", cuda_flash_tc, cuda_flash, TC_VARIANTS),
        ("local_dq", cuda_flash_bwd_tc, cuda_flash_bwd, TC_BWD_VARIANTS),
        ("local_dkv", cuda_flash_bwd_tc, cuda_flash_bwd, TC_BWD_VARIANTS),
    )[:3 if gradients else 1]:
        spec = kernels[kind]
        for variant in tc_configs:
            cfg = tc.TCConfig(*variant) if kind == "local" else tc.TCBwdConfig(*variant)
            if cfg.shared_bytes(spec.head_dim, spec.dtype) > cuda_flash_tc.shared_limit(cfg):
                continue
            # The forward's options.
            async_copy, m_tiles = getattr(cfg, "async_copy", False), getattr(cfg, "m_tiles", 1)
            wgmma, transpose_v = getattr(cfg, "wgmma", False), getattr(cfg, "transpose_v", False)
            min_blocks, overlap = getattr(cfg, "min_blocks", None), getattr(cfg, "overlap", False)
            stages = getattr(cfg, "stages", 1)
            if wgmma and not hopper:
                continue
            make = tc.flash_tc if kind == "local" else tc.flash_bwd_tc
            suffix = (f"tc_w{cfg.warps}_c{cfg.chunk}" + ("" if cfg.ldmatrix else "_lds16")
                      + ("_async" if async_copy else "") + (f"_m{m_tiles}" if m_tiles > 1 else "")
                      + ("_wgmma" if wgmma else "") + ("_vt" if transpose_v else "")
                      + (f"_mb{min_blocks}" if min_blocks is not None else "") + ("_ov" if overlap else "")
                      + (f"_s{stages}" if stages > 1 else ""))
            add(spec, suffix, make(spec, cfg), kernel=tc.__name__.rsplit(".", 1)[1], warps=cfg.warps, chunk=cfg.chunk,
                ldmatrix=cfg.ldmatrix, async_copy=async_copy, m_tiles=m_tiles, wgmma=wgmma, transpose_v=transpose_v,
                min_blocks=min_blocks, overlap=overlap, stages=stages,
                shared_bytes=cfg.shared_bytes(spec.head_dim, spec.dtype), default=cfg == tc.default_config(spec))
        make = cores.flash if kind == "local" else cores.flash_bwd
        add(spec, "cores", make(spec), kernel=cores.__name__.rsplit(".", 1)[1], config=str(cores.default_config(spec)))
    if hopper:
        for operand, rows, cols, ks, swap in WGMMA_PROBES:
            name = f"wgmma_probe_{operand}_r{rows}_c{cols}_k{ks}" + ("_swapped" if swap else "")
            funcs[name] = cuda_wgmma.probe(kernels["local"].dtype, operand, rows, cols, ks, swap).with_attr(
                "global_symbol", name)
            entries.append({"function": name, "kind": "wgmma_probe", "kernel": "cuda_wgmma", "wgmma": True,
                            "operand": operand, "rows": rows, "cols": cols, "ks": ks, "swap": swap})
    spec = kernels["local"]
    folder = os.path.join(out, "lib", "variants")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"variants_{arch}.so")
    t0 = time.time()
    target = normalize_target(f"cuda -arch={arch}")
    module = tvm.compile(tvm.IRModule(funcs), target=tvm.target.Target(target)).mod
    resources = export_module(module, path, target)
    for entry in entries:  # registers and spills: part of what a timing means
        entry["ptxas"] = resources.get(f"{entry['function']}_kernel")
    # And each one's hot loop, statically (tools.sass; skipped without nvdisasm).
    if sass.nvdisasm() is not None:
        # The library's own machine code (nvcc's second run for a cubin took as long as
        # its first, ~28 s for these kernels).
        fatbins = [data for fmt, data in read_cuda_modules(library_blob(path)) if fmt == "fatbin"]
        cubin = fatbin_cubin(fatbins[0]) if len(fatbins) == 1 else None
        machine = (sass.analyze_cubin(cubin, resources) if cubin is not None
                   else sass.analyze_source(cuda_source(module), arch))
        for entry in entries:
            found = machine.get(f"{entry['function']}_kernel", {})
            entry["sass"] = {key: found.get(key) for key in ("loop_instructions", "loop_mma", "loop_per_mma",
                                                              "shortest_pass", "shortest_pass_per_mma")}
    with open(os.path.join(folder, "variants.json"), "w") as f:
        json.dump({"spec": spec.to_dict(), "library": os.path.basename(path), "arch": arch, "variants": entries}, f,
                  indent=2)
    print(f"{path}: {len(entries)} variants in {time.time() - t0:.0f}s", flush=True)
    return path


# The tuning batch (only with --tune-trials): the kernel of the bars.
TUNE_SPEC = "head_dim=128,window=4095:0,dtype=bfloat16"
TUNE_TRIALS = 16
# What the device tool carries: the repository's tree and the bundle, together.
CARRY_LIMIT_MIB = 64


def build_tune_batch(out: str, arch: str, trials: int = TUNE_TRIALS) -> str:
    folder = os.path.join(out, "tune_batch")
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.time()
    specs = [k for k in AttentionSpec.parse(TUNE_SPEC).kernels() if k.kind == "local"]
    batch = build_batch(specs, normalize_target(f"cuda -arch={arch}"), trials, default_logs_root() or "tuning_logs",
                        folder)
    n = sum(len(t["candidates"]) for t in batch["tasks"])
    print(f"{folder}: {n} candidates + baselines in {time.time() - t0:.0f}s", flush=True)
    return folder


def copy_runtime(out: str) -> None:
    src = os.path.join(os.path.dirname(tvm.__file__), "lib")
    dst = os.path.join(out, "runtime")
    os.makedirs(dst, exist_ok=True)
    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        shutil.copy2(os.path.join(src, name), dst)
    with open(os.path.join(dst, "tvm_version"), "w") as f:
        f.write(importlib.metadata.version("apache-tvm") + "\n")


def fetch_ffi_wheel(out: str, python_version: str) -> None:
    """The tvm-ffi wheel matching this TVM, for the GPU machine's CPython."""
    version = importlib.metadata.version("apache-tvm-ffi")
    dst = os.path.join(out, "wheels")
    os.makedirs(dst, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--platform", "manylinux2014_x86_64",
         "--platform", "manylinux_2_28_x86_64", "-d", dst, f"apache-tvm-ffi=={version}"],
        check=True,
    )


def tree_bytes(root: str, exclude: str | None = None) -> int:
    """Bytes of the files that travel with the working tree of the git checkout at
    ``root``: tracked, and untracked ones git does not ignore (those under ``exclude``
    left out: the bundle, counted on its own)."""
    listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    skip = os.path.abspath(exclude) + os.sep if exclude else None
    total = 0
    for rel in filter(None, dict.fromkeys(listed)):
        path = os.path.join(root, rel)
        if (skip and os.path.abspath(path).startswith(skip)) or not os.path.isfile(path) or os.path.islink(path):
            continue
        total += os.path.getsize(path)
    return total


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs
               if not os.path.islink(os.path.join(d, f)))


def check_size(root: str, out: str, limit_mib: float = CARRY_LIMIT_MIB) -> tuple[int, int]:
    """Print the tree's and the bundle's sizes against ``limit_mib``; SystemExit
    (status 1, saying by how much) when together they are over. Returns both sizes."""
    tree, bundle = tree_bytes(root, out), folder_bytes(out)
    total, limit = tree + bundle, limit_mib * 2**20
    print(f"carried: tree {tree / 2**20:.1f} MiB + {out} {bundle / 2**20:.1f} MiB = {total / 2**20:.1f} MiB "
          f"of {limit_mib:g} MiB", flush=True)
    if total > limit:
        raise SystemExit(f"gpu_bundle: the tree and {out} come to {total / 2**20:.1f} MiB, "
                         f"{(total - limit) / 2**20:.1f} MiB over the {limit_mib:g} MiB the device tool carries; "
                         "leave out what the run does not need (--kv-cache, --gradients, --tune-trials)")
    return tree, bundle


def source_checkout() -> tuple[str, str]:
    """(root, ``git describe``) of the checkout this swa_tvm is imported from, which must
    be this module's (not another one an editable install points at)."""
    import swa_tvm

    where = os.path.abspath(swa_tvm.__file__)
    if not where.startswith(ROOT + os.sep):
        raise SystemExit(f"gpu_bundle: swa_tvm is imported from {where}, not from this checkout {ROOT}; "
                         f"run it with PYTHONPATH={ROOT}")
    head = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return ROOT, head.stdout.strip() or "unknown (not a git checkout)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_bundle", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", help="CUDA arch of the GPU machine (default sm_90: H100/H200)")
    p.add_argument("--out", default=os.path.join("build", "gpu"), help="output folder (default build/gpu)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    p.add_argument("--skip-libraries", action="store_true", help="only the runtime and the wheel")
    p.add_argument("--gradients", action="store_true", help="also the dq and dk/dv kernels' tile variants")
    p.add_argument("--kv-cache", action="store_true", help="also the KV-cache libraries (stages kv_cache, decode)")
    p.add_argument("--tune-trials", type=int, default=0,
                   help=f"candidates in a MetaSchedule tuning batch (default 0: none; e.g. {TUNE_TRIALS})")
    p.add_argument("--max-mib", type=float, default=CARRY_LIMIT_MIB,
                   help=f"what the tree and the bundle may come to (default {CARRY_LIMIT_MIB})")
    args = p.parse_args(argv)
    root, describe = source_checkout()
    # What a previous build left and this one would not write (kv-cache libraries, a
    # batch, gradient variants) must not travel: start from an empty folder.
    if os.path.isdir(args.out) and os.listdir(args.out) and not os.path.exists(os.path.join(args.out, "COMMIT")):
        raise SystemExit(f"gpu_bundle: {args.out} holds files and no COMMIT (not a bundle): refusing to clear it")
    shutil.rmtree(args.out, ignore_errors=True)
    copy_runtime(args.out)
    fetch_ffi_wheel(args.out, args.python_version)
    if not args.skip_libraries:
        build_libraries(args.out, args.arch, kv_cache=args.kv_cache)
        build_variants(args.out, args.arch, gradients=args.gradients)
        if args.tune_trials > 0:
            build_tune_batch(args.out, args.arch, args.tune_trials)
    # Which code the bundle was built from (the GPU run's results quote it).
    with open(os.path.join(args.out, "COMMIT"), "w") as f:
        f.write(f"{describe}\n{root}\n")
    check_size(root, args.out, args.max_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
