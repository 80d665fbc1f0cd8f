"""First-use compilation: a kernel no loaded library serves is compiled once, kept in a
disk cache ($SWA_TVM_CACHE, default ~/.cache/swa_tvm) and registered.

The cache heals: an entry that does not load (truncated or empty manifest, damaged
library, another kernel's files) is a cache miss, rebuilt in the same call with a
warning naming it. A cache that cannot be written (a read-only or shared install) still
serves its valid entries, loaded without the writers' lock; a kernel it lacks is
compiled into a private temporary folder, loaded from there and not cached, with a
warning naming the cache and why."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading

import filelock

from swa_tvm import compute, schedules
from swa_tvm import spec as spec_module
from swa_tvm.compiler import build, cuda_pack, kernels, targets
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
    schedule, the spec's parameters, the target's choice of form, this build and nvcc's
    packing."""
    files = [m.__file__ for m in (build, cuda_pack, kernels, targets, spec_module)]
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


def _cache_key(spec: KernelSpec, target: dict) -> str:
    """The entry's key: the full spec, its tuning record and tiles, the target, the TVM
    and swa_tvm versions and the kernel code's digest."""
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
    return hashlib.sha256(key_src.encode()).hexdigest()[:20]


# What loading a cache entry may raise: LibraryError (a manifest that does not vouch for
# its library), OSError (a file vanished or unreadable), ValueError (malformed JSON),
# RuntimeError (TVM's loader: "invalid ELF header"), AttributeError (the module lacks
# the function), KeyError/TypeError (a manifest missing or mistyping a field).
_LOAD_ERRORS = (library.LibraryError, OSError, ValueError, RuntimeError, AttributeError, KeyError, TypeError)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else '(no message)'}"


def _load(spec: KernelSpec, device: str, path: str) -> tuple[Kernel | None, str | None]:
    """Load the library at ``path`` for ``spec``: (its kernel, None), or (None, why not).

    A manifest that lists other kernels than exactly ``spec`` is refused before
    anything is loaded, so another kernel's files never register under a cache entry's
    name. A load that fails, or registers without serving ``spec`` exactly, leaves the
    registry as it was (a partial load could otherwise leave kernels of a damaged
    library behind)."""
    mpath = library.manifest_path(path)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        listed = [KernelSpec.from_dict(entry["spec"]) for entry in manifest["kernels"]]
    except _LOAD_ERRORS as e:
        return None, f"its manifest {mpath} cannot be read ({_describe(e)})"
    if listed != [spec]:
        return None, f"its manifest lists {', '.join(s.name for s in listed) or 'no kernel'}, not {spec.name}"
    if path in _FAILED_LOADS:
        return _load_copy(spec, device, path)
    saved = library.REGISTRY.snapshot()
    try:
        library.load_library(path, _jit_cache=True)
    except _LOAD_ERRORS as e:
        library.REGISTRY.restore(saved)
        _FAILED_LOADS.add(path)
        return None, f"it does not load ({_describe(e)})"
    hit = library.REGISTRY.find(spec, device)
    if hit is None or hit.spec != spec:
        library.REGISTRY.restore(saved)
        return None, f"loading it did not register {spec.name}"
    return hit, None


# Cache entries whose load failed in this process. The dynamic loader hands back a
# library it already holds under the same path, even after the file there was replaced,
# so a load that failed after the library was mapped would fail again on the rebuilt
# entry: such paths are loaded from a private copy instead.
_FAILED_LOADS: set[str] = set()


def _load_copy(spec: KernelSpec, device: str, path: str) -> tuple[Kernel | None, str | None]:
    """``_load`` of a private copy of the entry ``path`` (library and manifest)."""
    tmpd = tempfile.mkdtemp(prefix="swa_tvm-jit-")
    try:
        copy = os.path.join(tmpd, os.path.basename(path))
        try:
            shutil.copyfile(path, copy)
            shutil.copyfile(library.manifest_path(path), library.manifest_path(copy))
        except OSError as e:
            return None, f"it cannot be copied to load it ({_describe(e)})"
        return _load(spec, device, copy)
    finally:
        shutil.rmtree(tmpd, ignore_errors=True)  # loaded: the process keeps its mapping


def _compile_and_load(spec: KernelSpec, target: dict, device: str, tmp: str) -> Kernel:
    """Compile ``spec`` into ``tmp`` (a fresh, private path) and load it from there.

    Loading from the private path, before the library is published into the cache,
    means a build that does not serve ``spec`` is never cached, and the loader never
    sees a path it may have opened before (the dynamic loader reuses a library already
    loaded under the same name)."""
    export_library([spec], tmp, target, warn_untuned=False)
    kernel, why = _load(spec, device, tmp)
    if kernel is None:
        raise library.LibraryError(f"{tmp}: a fresh build of kernel {spec.name} cannot be used: {why}")
    return kernel


def _remove_entry(path: str) -> None:
    """Delete a cache entry's files, the library first: a reader without the lock that
    sees the library also finds its manifest."""
    for name in (path, library.manifest_path(path)):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass
        except OSError:
            return  # not ours to remove (a shared cache): publishing the rebuild says so


def _writer_lock(folder: str, path: str) -> tuple[filelock.FileLock | None, str | None]:
    """The writers' lock of the entry ``path``, acquired: (lock, None); or (None, why the
    cache cannot be written) for a folder that cannot be created or written, or a lock
    file that cannot be opened."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return None, f"its folder cannot be created ({_describe(e)})"
    if not os.access(folder, os.W_OK):
        return None, "its folder is not writable"
    lock = filelock.FileLock(path + ".lock")
    try:
        lock.acquire()
    except OSError as e:
        return None, f"the lock {path}.lock cannot be opened ({_describe(e)})"
    return lock, None


# Cache folders already announced as unwritable: the first in-memory compile for each
# warns, later ones say so at INFO.
_READ_ONLY_WARNED: set[str] = set()


def _read_only(spec: KernelSpec, target: dict, device: str, folder: str, path: str, why: str) -> Kernel:
    """The kernel for ``spec`` from a cache that cannot be written: its valid entry,
    loaded without the lock, else compiled into a private temporary folder (outside the
    cache) and loaded from there, for this process only. Without the lock, a writer
    elsewhere (a shared cache another user can write) that is replacing a damaged entry
    at that moment may leave its manifest and library briefly disagreeing: the load
    then fails its checks, and the kernel is compiled in memory."""
    global _COMPILED_ONCE
    if os.path.exists(path):
        kernel, bad = _load(spec, device, path)
        if kernel is not None:
            return kernel
        missing = f"its entry {path} is unusable ({bad})"
    else:
        missing = f"it has no entry for {spec.name}"
    level = logging.INFO if folder in _READ_ONLY_WARNED else logging.WARNING
    _READ_ONLY_WARNED.add(folder)
    _COMPILED_ONCE = True  # this message stands for the first compile's warning
    logger.log(
        level,
        "kernel cache %s cannot be written (%s) and %s: compiling kernel %s in memory for this "
        "process only (seconds, again in every process; point $SWA_TVM_CACHE at a writable folder "
        "to keep it)",
        folder, why, missing, spec.name,
    )
    tmpd = tempfile.mkdtemp(prefix="swa_tvm-jit-")
    try:
        return _compile_and_load(spec, target, device, os.path.join(tmpd, os.path.basename(path)))
    finally:
        shutil.rmtree(tmpd, ignore_errors=True)  # loaded: the process keeps its mapping


def get_or_build_kernel(spec: KernelSpec, target: str | dict | None = None) -> Kernel:
    """A registered kernel for ``spec``: from memory, else from the disk cache, else
    compiled now and cached. The cache key is the full spec, the target and TVM version,
    so a changed CPU, TVM or spec never reuses a stale build.

    A cache entry that does not load is rebuilt in place (a warning names it); a cache
    that cannot be written serves its valid entries and compiles the rest in memory.
    Never returns None: a kernel that a fresh build still does not provide raises
    LibraryError."""
    target = normalize_target(target)
    device = library.device_of_target(target)
    with _JIT_LOCK:
        hit = library.REGISTRY.find(spec, device)
        if hit is not None and hit.spec == spec:
            return hit
        key = _cache_key(spec, target)
        folder = os.path.join(cache_dir(), target_key(target))
        path = os.path.join(folder, f"{spec.name}-{key}.so")
        # Across processes (torchrun's ranks, pytest's workers) one builds, the others
        # wait and load its entry: two writers' renames could pair one build's manifest
        # with the other's library, whose sha256 it would then refuse.
        lock, why = _writer_lock(folder, path)
        if lock is None:
            return _read_only(spec, target, device, folder, path, why)
        try:
            if os.path.exists(path):
                kernel, bad = _load(spec, device, path)
                if kernel is not None:
                    return kernel
                logger.warning("cached kernel %s is unusable (%s); rebuilding it", path, bad)
                _remove_entry(path)
            _say_compiling(spec, target_key(target), folder)
            with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmpd:
                tmp = os.path.join(tmpd, os.path.basename(path))
                kernel = _compile_and_load(spec, target, device, tmp)
                # The library's rename publishes the entry (readers test for it), so the
                # manifest goes first: a reader that sees the library finds its manifest.
                try:
                    os.replace(library.manifest_path(tmp), library.manifest_path(path))
                    os.replace(tmp, path)
                except OSError as e:  # e.g. another user's files in a shared folder
                    logger.warning("kernel %s could not be written to the cache as %s (%s); it serves "
                                   "this process only", spec.name, path, _describe(e))
            return kernel
        finally:
            lock.release()
