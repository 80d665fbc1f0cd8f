"""Loading compiled libraries and the registry of kernels the torch op dispatches to.

This module needs only the TVM runtime: a library built elsewhere loads here without a
compiler. Building lives in :mod:`swa_tvm.build`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import threading
from dataclasses import dataclass
from typing import Any

from swa_tvm.spec import KernelSpec

# 2: a kernel entry may name extra arguments ("workspace"), which format 1 had none of.
MANIFEST_FORMAT = 2
# Such sets of arguments: the split-K global rows' pieces (schedules/cuda_flash_tc, and
# the gradients' dq in schedules/cuda_flash_bwd_tc), an fp32 workspace the caller
# allocates for any number S >= 1 of pieces of the keys (functional.global_pieces
# chooses S). Here, not in schedules/: the GPU machine runs
# without TVM's compiler.
GLOBAL_WORKSPACE = "split_k: ws_o [B, H, S, G, D] float32, ws_lse [B, H, S, G] float32"
# The global rows' gradients on tensor cores: dq in S pieces of the keys, summed.
GLOBAL_BWD_WORKSPACE = "split_k: ws_dq [B, H, S, G, D] float32"
WORKSPACES = (GLOBAL_WORKSPACE, GLOBAL_BWD_WORKSPACE)

# x86 features a compiled CPU kernel may depend on, as LLVM names them, with the name
# /proc/cpuinfo uses. Only these are recorded and checked when a library loads.
X86_FEATURES = {
    "sse4.2": "sse4_2",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
}


class LibraryError(RuntimeError):
    """A library that cannot be used here (hash, TVM version or target mismatch)."""


def manifest_path(lib_path: str | os.PathLike) -> str:
    return str(lib_path) + ".json"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tvm_version() -> str:
    """The installed TVM's version, read without importing TVM (and its compiler). A
    runtime-only install ($SWA_TVM_RUNTIME_DIR, see ``_load_tvm_runtime``) names its
    version in a ``tvm_version`` file there."""
    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        folder = os.environ.get("SWA_TVM_RUNTIME_DIR")
        if folder and os.path.exists(os.path.join(folder, "tvm_version")):
            with open(os.path.join(folder, "tvm_version")) as f:
                return f.read().strip()
        import tvm

        return tvm.__version__


def _runtime_dir() -> str:
    folder = os.environ.get("SWA_TVM_RUNTIME_DIR")
    if folder:
        return folder
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise LibraryError("the TVM runtime was not found: install apache-tvm or set SWA_TVM_RUNTIME_DIR")
    return os.path.join(list(spec.submodule_search_locations)[0], "lib")


def _load_tvm_runtime() -> None:
    """Make the TVM runtime's symbols available to libraries loaded by tvm_ffi.

    An exported kernel library calls into libtvm_runtime (thread pool, workspaces). With
    the full ``tvm`` package imported they are already there; otherwise only
    libtvm_runtime.so is loaded (3 MB), from $SWA_TVM_RUNTIME_DIR or the installed
    package, never the 250 MB compiler.
    """
    global _RUNTIME
    if _RUNTIME is not None or "tvm" in sys.modules:
        return
    _RUNTIME = ctypes.CDLL(os.path.join(_runtime_dir(), "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)


_RUNTIME = None


def cpu_threads() -> int:
    """Threads the CPU kernels run on: $TVM_NUM_THREADS (or $OMP_NUM_THREADS, which TVM
    also reads) when set, else torch's intra-op thread count, else the usable cores."""
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").strip().isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    if "torch" in sys.modules:
        return sys.modules["torch"].get_num_threads()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tvm_pool_threads() -> int:
    """Threads of the TVM CPU thread pool of the calling thread (created if need be)."""
    import tvm_ffi

    return int(tvm_ffi.get_global_func("runtime.NumThreads")())


def configure_cpu_threads() -> None:
    """Size TVM's CPU thread pool like torch's. Left alone, TVM runs parallel loops on
    hardware_concurrency / 2 threads on x86 (it assumes every core has two SMT threads):
    on a 2-vCPU machine, one thread, half the machine. The pool reads $TVM_NUM_THREADS
    when a thread first runs a parallel kernel, so this sets it (never overriding a
    user's choice) before any kernel is called; a pool created earlier keeps its size."""
    default_tvm_threads(cpu_threads())


def default_tvm_threads(n: int) -> None:
    """Set $TVM_NUM_THREADS to ``n`` unless the user chose a count (it or $OMP_NUM_THREADS)."""
    if not os.environ.get("TVM_NUM_THREADS") and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["TVM_NUM_THREADS"] = str(n)


_CUDA_RUNTIME: dict = {}


def cuda_unavailable_reason() -> str | None:
    """None when CUDA kernels can run here; else why not (for error messages).

    CUDA device code loads through libtvm_runtime_cuda.so, which needs the NVIDIA driver
    (libcuda.so.1); a machine without a GPU usually has neither driver nor device."""
    if "reason" in _CUDA_RUNTIME:
        return _CUDA_RUNTIME["reason"]
    reason = None
    try:
        import torch

        if not torch.cuda.is_available():
            reason = "no CUDA device is present (torch.cuda.is_available() is False)"
    except ImportError:
        pass
    if reason is None:
        try:
            _load_tvm_runtime()
            ctypes.CDLL(os.path.join(_runtime_dir(), "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)
        except (OSError, LibraryError) as e:
            reason = f"no CUDA device is present: the TVM CUDA runtime cannot load ({e})"
    _CUDA_RUNTIME["reason"] = reason
    return reason


class NoDeviceError(RuntimeError):
    """A kernel was called on a machine that lacks the device it was built for."""


def _no_device_kernel(spec: KernelSpec, path: str, reason: str):
    def call(*args, **kwargs):
        raise NoDeviceError(f"kernel {spec.name} of {path} is CUDA code, and {reason}; run it on a machine with an NVIDIA GPU")

    return call


def host_cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@dataclass
class Kernel:
    spec: KernelSpec
    func: Any  # tvm_ffi Function
    device: str  # torch device type it serves: "cpu" | "cuda"
    origin: str  # library path, or "jit"
    cuda_arch: str | None = None  # sm_XY the CUDA code was built for
    # Extra trailing arguments the caller allocates (the manifest's "workspace", one of
    # WORKSPACES), None for none.
    workspace: str | None = None
    # The manifest's "schedule": "default"/"tuned" (the TE compute, schedules/cpu.py or
    # schedules/cuda.py, or a record replayed on it) or a fused kernel's module name.
    schedule: str | None = None


class Registry:
    """Kernels available to the torch op, keyed by spec name."""

    def __init__(self) -> None:
        self._kernels: dict[str, Kernel] = {}
        self._libraries: list[str] = []
        self._lock = threading.Lock()
        # Keep loaded modules alive: their functions point into them.
        self._modules: list[Any] = []

    @property
    def libraries(self) -> list[str]:
        return list(self._libraries)

    def add(self, kernel: Kernel, module: Any = None) -> None:
        with self._lock:
            self._kernels[kernel.spec.name] = kernel
            if module is not None:
                self._modules.append(module)

    def kernels(self, device: str | None = None) -> list[Kernel]:
        return [k for k in self._kernels.values() if device is None or k.device == device]

    def find(self, want: KernelSpec, device: str) -> Kernel | None:
        """The kernel computing ``want``; for local kernels any max_dilation >= the
        wanted one serves (the smallest is taken: the least wasted grid)."""
        exact = self._kernels.get(want.name)
        if exact is not None and exact.device == device:
            return exact
        best = None
        for k in self._kernels.values():
            s = k.spec
            if k.device != device or s.kind != want.kind or s.max_dilation < want.max_dilation:
                continue
            if (s.head_dim, s.dtype, s.left, s.right, s.extras) != (
                want.head_dim,
                want.dtype,
                want.left,
                want.right,
                want.extras,
            ):
                continue
            if best is None or s.max_dilation < best.spec.max_dilation:
                best = k
        return best

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()
            self._libraries.clear()
            self._modules.clear()

    def add_library(self, path: str) -> None:
        """Count ``path`` among the loaded libraries (``libraries``; once), as
        ``load_library`` does after registering its kernels. With a library loaded, a
        call no loaded kernel serves is an error instead of a JIT compilation."""
        with self._lock:
            if path not in self._libraries:
                self._libraries.append(path)

    @dataclass(frozen=True)
    class Snapshot:
        """What ``Registry.snapshot`` saw: the kernels by name, the loaded libraries, and
        the modules kept alive for them. Opaque; pass it to ``Registry.restore``."""

        kernels: tuple
        libraries: tuple
        modules: tuple

    def snapshot(self) -> Registry.Snapshot:
        """The registry's contents now, to put back later with ``restore``.

        For tests (a library a test loads leaves with it) and for code that loads
        libraries temporarily: ``saved = REGISTRY.snapshot(); load_library(...); ...;
        REGISTRY.restore(saved)``. Kernels registered in between are dropped on restore;
        the snapshot keeps the modules of its own kernels alive."""
        with self._lock:
            return Registry.Snapshot(tuple(self._kernels.items()), tuple(self._libraries), tuple(self._modules))

    def restore(self, snapshot: Registry.Snapshot) -> None:
        """Make the registry hold exactly what ``snapshot`` (from ``snapshot()``) saw."""
        if not isinstance(snapshot, Registry.Snapshot):
            raise TypeError(f"restore takes a Registry.snapshot(), not {type(snapshot).__name__}")
        with self._lock:
            self._kernels.clear()
            self._kernels.update(snapshot.kernels)
            self._libraries[:] = snapshot.libraries
            self._modules[:] = snapshot.modules


REGISTRY = Registry()


def device_of_target(target: dict) -> str:
    return "cuda" if target.get("kind") == "cuda" else "cpu"


def check_manifest(lib_path: str, manifest: dict) -> None:
    """Raise LibraryError unless the library at lib_path can run here."""
    if manifest.get("format") != MANIFEST_FORMAT:
        raise LibraryError(f"{lib_path}: manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}")
    for entry in manifest.get("kernels", []):
        if entry.get("workspace") not in (None, *WORKSPACES):
            raise LibraryError(
                f"{lib_path}: kernel {entry.get('name')} takes arguments this swa_tvm does not know ({entry['workspace']!r})"
            )
    digest = sha256_file(lib_path)
    if digest != manifest.get("sha256"):
        raise LibraryError(
            f"{lib_path}: sha256 {digest[:16]}... does not match the manifest's "
            f"{str(manifest.get('sha256'))[:16]}...; the library was modified or the manifest belongs to another build"
        )
    have = tvm_version()
    if manifest.get("tvm_version") != have:
        raise LibraryError(
            f"{lib_path}: built with TVM {manifest.get('tvm_version')}, but this process runs TVM {have}; "
            "rebuild it with `swa-tvm export`"
        )
    target = manifest.get("target", {})
    if target.get("kind") == "cuda" and manifest.get("cuda_device_code") != "fatbin":
        # Exported before device code was packed compiled (cuda_pack): the library holds
        # CUDA source that TVM's runtime would compile at the first call, through a
        # compiler callback only the full apache-tvm registers.
        raise LibraryError(
            f"{lib_path}: its CUDA device code is source, not compiled (exported by an older swa_tvm); "
            "export it again with `swa-tvm export`"
        )
    if target.get("kind") == "llvm":
        arch = manifest.get("machine")
        if arch and arch != platform.machine():
            raise LibraryError(f"{lib_path}: built for {arch} CPUs, this machine is {platform.machine()}")
        missing = sorted(set(manifest.get("cpu_features", [])) - host_cpu_flags())
        if missing:
            raise LibraryError(
                f"{lib_path}: built for CPU {target.get('mcpu')!r}, which needs {', '.join(missing)}; "
                "this CPU lacks them. Rebuild it here with `swa-tvm export`"
            )


def load_library(path: str | os.PathLike, *, _jit_cache: bool = False) -> list[KernelSpec]:
    """Load a library written by ``export_library`` and register its kernels.

    The manifest beside it (``<path>.json``) must match the file's sha256, this
    process's TVM version and this machine's CPU; otherwise LibraryError says which.
    Only the TVM runtime is needed (tvm_ffi and libtvm_runtime), not the compiler.
    Returns the specs it registered.
    """
    import tvm_ffi

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"library {path!r} does not exist")
    mpath = manifest_path(path)
    if not os.path.exists(mpath):
        raise LibraryError(f"{path}: no manifest at {mpath}; export libraries with swa_tvm.export_library")
    with open(mpath) as f:
        manifest = json.load(f)
    check_manifest(path, manifest)
    device = device_of_target(manifest["target"])
    # A CUDA library still loads without a GPU (its manifest checked, its kernels
    # registered); calling one then raises NoDeviceError saying why.
    no_device = cuda_unavailable_reason() if device == "cuda" else None
    module = None
    if no_device is None:
        _load_tvm_runtime()
        if device == "cpu":
            configure_cpu_threads()
        module = tvm_ffi.load_module(path)
    specs = []
    arch = manifest.get("cuda_arch")
    for entry in manifest["kernels"]:
        spec = KernelSpec.from_dict(entry["spec"])
        func = module[spec.name] if module is not None else _no_device_kernel(spec, path, no_device)
        origin = "jit" if _jit_cache else path
        REGISTRY.add(Kernel(spec, func, device, origin, arch, entry.get("workspace"), entry.get("schedule")), module)
        specs.append(spec)
    if not _jit_cache:  # JIT cache entries do not count as user libraries
        REGISTRY.add_library(path)
    return specs


def read_manifest(path: str | os.PathLike) -> dict:
    with open(manifest_path(path)) as f:
        return json.load(f)
