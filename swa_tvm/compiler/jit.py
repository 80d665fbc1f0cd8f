"""First-use compilation: a kernel no loaded library serves is compiled once, kept in a
disk cache ($SWA_TVM_CACHE, default ~/.cache/swa_tvm) and registered."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading

import filelock

from swa_tvm import compute, schedules
from swa_tvm import spec as spec_module
from swa_tvm.compiler import build, cuda_pack, kernels
from swa_tvm.compiler.build import export_library, find_records, find_tiles
from swa_tvm.compiler.targets import normalize_target, target_key
from swa_tvm.runtime import library
from swa_tvm.runtime.library import Kernel
from swa_tvm.spec import KernelSpec
from swa_tvm.version import __version__


def cache_dir() -> str:
    """Disk cache of JIT-compiled kernels: $SWA_TVM_CACHE or ~/.cache/swa_tvm."""
    return os.environ.get("SWA_TVM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "swa_tvm")


_JIT_LOCK = threading.Lock()


def kernel_code_files() -> list[str]:
    """The sources that decide what a kernel computes and how it is built: the TE, every
    schedule, the spec's parameters, this build and nvcc's packing."""
    files = [m.__file__ for m in (build, cuda_pack, kernels, spec_module)]
    for package in (compute, schedules):
        folder = os.path.dirname(package.__file__)
        files += sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".py"))
    return files


def _kernel_code_digest() -> str:
    """Hash of ``kernel_code_files``, so an edited checkout never reuses a cached build
    of older code."""
    h = hashlib.sha256()
    for name in kernel_code_files():
        with open(name, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


logger = logging.getLogger("swa_tvm")
_COMPILED_ONCE = False


def _say_compiling(spec: KernelSpec, key: str, folder: str) -> None:
    """Name the kernel a first-use compile builds and where it is cached: the first
    compile of a process as a warning (it takes seconds, and a user should know why),
    later ones as info."""
    global _COMPILED_ONCE
    level = logging.INFO if _COMPILED_ONCE else logging.WARNING
    _COMPILED_ONCE = True
    logger.log(
        level,
        "compiling kernel %s for %s on first use (seconds; cached in %s, $SWA_TVM_CACHE moves it; "
        "swa_tvm.export_library builds ahead of time)",
        spec.name, key, folder,
    )


def get_or_build_kernel(spec: KernelSpec, target: str | dict | None = None) -> Kernel:
    """A registered kernel for ``spec``: from memory, else from the disk cache, else
    compiled now and cached. The cache key is the full spec, the target and TVM version,
    so a changed CPU, TVM or spec never reuses a stale build."""
    target = normalize_target(target)
    device = library.device_of_target(target)
    with _JIT_LOCK:
        hit = library.REGISTRY.find(spec, device)
        if hit is not None and hit.spec == spec:
            return hit
        record = find_records([spec], target)[spec.name]
        tiles = find_tiles([spec], target).get(spec.name)  # a measured tile record (CUDA), which export applies
        key_src = json.dumps(
            {
                "spec": spec.to_dict(),
                "record": str(record.trace) if record is not None else None,
                "tiles": str(tiles) if tiles is not None else None,
                "target": target,
                "tvm": library.tvm_version(),
                "swa_tvm": __version__,
                "code": _kernel_code_digest(),
            },
            sort_keys=True,
        )
        key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
        folder = os.path.join(cache_dir(), target_key(target))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{spec.name}-{key}.so")
        # Across processes (torchrun's ranks, pytest's workers) one builds, the others
        # wait and load its entry: two writers' renames could pair one build's manifest
        # with the other's library, whose sha256 it would then refuse.
        with filelock.FileLock(path + ".lock"):
            if os.path.exists(path):
                try:
                    library.load_library(path, _jit_cache=True)
                    return library.REGISTRY.find(spec, device)
                except library.LibraryError:
                    pass  # corrupt or foreign entry: rebuild below
            _say_compiling(spec, target_key(target), folder)
            with tempfile.TemporaryDirectory(dir=folder) as tmpd:
                tmp = os.path.join(tmpd, os.path.basename(path))
                export_library([spec], tmp, target, warn_untuned=False)
                os.replace(library.manifest_path(tmp), library.manifest_path(path))
                os.replace(tmp, path)
            library.load_library(path, _jit_cache=True)
        return library.REGISTRY.find(spec, device)
