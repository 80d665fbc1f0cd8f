"""Loading compiled libraries and the registry of kernels the torch op dispatches to.

This module needs only the TVM runtime: a library built elsewhere loads here without a
compiler. Building lives in :mod:`swa_tvm.build`.

Before a library is opened (``dlopen`` maps it and runs its initializers, so a damaged
file could crash the process), ``check_manifest`` checks its manifest's fields and their
types, the sha256, a keyed signature where $SWA_TVM_LIBRARY_KEY is set, the TVM version,
the CPU, and the ELF file itself: its headers, that every segment and section lies
within the file, that it defines each kernel's function, and that it holds CUDA device
code exactly when the manifest says CUDA. docs/libraries.md is the user's account.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import hmac
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any

from swa_tvm.spec import KernelSpec

# 2: a kernel entry may name extra arguments ("workspace"), which format 1 had none of.
# 3: kernels may use AMX tiles ("schedule": "amx"), which the loader must ask the OS for
# before their first call; an older loader, which would not, refuses format 3. Libraries
# without such kernels keep format 2.
# 4: kernels may be of kind "local_bwd" (the five-product CPU backward), which a loader
# from before it would reject by kind; it refuses format 4 instead, by number.
MANIFEST_FORMATS = (2, 3, 4)
AMX_FORMAT, FUSED_BACKWARD_FORMAT = 3, 4
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
    "amx-tile": "amx_tile",
    "amx-bf16": "amx_bf16",
}


class LibraryError(RuntimeError):
    """A library that cannot be used here: a malformed or inconsistent manifest or
    library file, a hash or signature mismatch, another TVM version or target. The
    message starts with the library's path."""


# The key that signs exported libraries (``export_library``) and, where it is set, that
# every library loaded must be signed with: any string of at least MIN_KEY_LENGTH
# characters, used as its UTF-8 bytes.
KEY_ENV = "SWA_TVM_LIBRARY_KEY"
MIN_KEY_LENGTH = 16
SIGNATURE_SCHEME = "hmac-sha256"


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


def cuda_device_arch(index: int | None = None) -> str | None:
    """sm_XY of CUDA device ``index`` (default: the current one), via torch, or None
    where torch sees none."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index)
            return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - no usable CUDA runtime counts as no device
        pass
    return None


def check_arch_specific(lib_path: str, built: str | None, device: str | None) -> None:
    """LibraryError unless code ``built`` for an arch-specific target (sm_XYa, such as
    sm_90a for Hopper's wgmma) can run on a ``device`` of arch sm_XY: that code runs on
    its own arch alone. Other targets (sm_XY: that arch and later ones) pass, as does an
    unknown device."""
    if not built or not built.endswith("a") or device is None or built[:-1] == device:
        return
    raise LibraryError(
        f"{lib_path}: built for {built}, whose code runs on {built[:-1]} GPUs alone, but this GPU is {device}; "
        f"export a library for it with --target 'cuda -arch={device}'"
    )


class NoDeviceError(RuntimeError):
    """A kernel was called on a machine that lacks the device it was built for."""


def _no_device_kernel(spec: KernelSpec, path: str, reason: str):
    def call(*args, **kwargs):
        raise NoDeviceError(f"kernel {spec.name} of {path} is CUDA code, and {reason}; run it on a machine with an NVIDIA GPU")

    return call


# Linux grants a process the AMX tile state only on request; without it the first tile
# instruction kills the process (SIGILL). arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
_amx_granted = False


def request_amx(lib_path: str) -> None:
    """Ask the OS for AMX tile state for this process, once, before a kernel of
    ``lib_path`` that uses the matrix engine can run; LibraryError if it is refused."""
    global _amx_granted
    if _amx_granted:
        return
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise LibraryError(f"{lib_path}: its kernels use AMX tiles, which swa_tvm enables on x86-64 Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        raise LibraryError(
            f"{lib_path}: its kernels use AMX tiles, and the OS refused this process the tile state "
            f"(arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(err)}); export the library for a target without AMX"
        )
    _amx_granted = True


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1]
    except OSError:
        pass
    return None


def host_cpu_flags() -> set[str]:
    return set((_cpuinfo_field("flags") or "").split())


def host_cpu_name() -> str:
    """The CPU's model name, for results and records (platform's guess elsewhere)."""
    name = _cpuinfo_field("model name")
    return name.strip() if name is not None else platform.processor()


# The manifest schedules of the matrix-engine form (AMX tiles, AVX-512 BF16 dot products):
# their "local_bwd" kernels round dq, dk and dv to bfloat16 themselves.
MATRIX_SCHEDULES = ("amx", "bf16_dot")


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
    # schedules/cuda.py, or a record replayed on it), "amx" (the matrix-engine form,
    # schedules/cpu.py; for "local_bwd" schedules/cpu_flash_bwd_matrix.py, whose dq, dk and
    # dv come in bfloat16), "bf16_dot" (the same form on AVX-512 BF16 dot products) or a
    # fused kernel's module name.
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
        wanted one serves (the smallest is taken: the least wasted grid), and a
        nonfinite variant serves a plain want (the plain one is taken when both exist)."""
        exact = self._kernels.get(want.name)
        if exact is not None and exact.device == device:
            return exact
        best = None
        for k in self._kernels.values():
            s = k.spec
            if k.device != device or s.kind != want.kind or s.max_dilation < want.max_dilation:
                continue
            if s.nonfinite < want.nonfinite:  # the nonfinite variant serves any call, the plain one only finite ones
                continue
            if (s.head_dim, s.dtype, s.left, s.right, s.extras, s.softcap) != (
                want.head_dim,
                want.dtype,
                want.left,
                want.right,
                want.extras,
                want.softcap,
            ):
                continue
            if s.kind.startswith("cache") and s.block_q != want.block_q:
                continue  # the caller lays out the key ranges per block of rows
            if best is None or (s.nonfinite, s.max_dilation) < (best.spec.nonfinite, best.spec.max_dilation):
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


# ---------------------------------------------------------------------------------------
# The manifest's fields


def _malformed(lib_path: str, what: str) -> LibraryError:
    return LibraryError(f"{lib_path}: malformed manifest {manifest_path(lib_path)}: {what}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_type(lib_path: str, where: str, value, want: type | tuple, text: str) -> None:
    ok = _is_int(value) if want is int else isinstance(value, want)
    if not ok:
        raise _malformed(lib_path, f"{where} is {type(value).__name__} {_short(value)}, expected {text}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# The types of KernelSpec's fields, from its annotations (strings: the module uses
# ``from __future__ import annotations``).
_SPEC_FIELD_TYPES = {"str": (str, "a string"), "int": (int, "an integer"), "bool": (bool, "true or false")}
SPEC_FIELDS = {f.name: _SPEC_FIELD_TYPES.get(str(f.type), (object, "a value")) for f in dataclasses.fields(KernelSpec)}
CUDA_ARCH = re.compile(r"sm_\d{2,3}a?")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
SIGNATURE = re.compile(rf"{SIGNATURE_SCHEME}:[0-9a-f]{{64}}")


def manifest_target_key(target: dict) -> str:
    """The target class a manifest's target belongs to, as
    ``swa_tvm.compiler.targets.target_key`` names it (which the runtime may not import:
    it is the compiler's; a test holds the two to the same answers)."""
    if target.get("kind") == "llvm":
        return f"llvm-{target.get('mcpu', 'generic')}"
    return f"{target.get('kind')}-{target.get('arch', 'unknown')}"


def _check_kernel_entry(lib_path: str, i: int, entry) -> KernelSpec:
    where = f"kernels[{i}]"
    _check_type(lib_path, where, entry, dict, "an object")
    if entry.get("workspace") not in (None, *WORKSPACES):
        raise LibraryError(
            f"{lib_path}: kernel {entry.get('name')} takes arguments this swa_tvm does not know ({entry['workspace']!r})"
        )
    for key in ("name", "spec", "tuned"):
        if key not in entry:
            raise _malformed(lib_path, f"{where} has no {key!r}")
    _check_type(lib_path, f"{where}.name", entry["name"], str, "a string")
    _check_type(lib_path, f"{where}.tuned", entry["tuned"], bool, "true or false")
    for key, want, text in (("schedule", str, "a string"), ("tiles", dict, "an object"), ("tiles_from", str, "a string"),
                            ("ptxas", dict, "an object"), ("tuning", dict, "an object")):  # fmt: skip
        if entry.get(key) is not None:
            _check_type(lib_path, f"{where}.{key}", entry[key], want, text)
    spec = entry["spec"]
    _check_type(lib_path, f"{where}.spec", spec, dict, "an object")
    unknown = sorted(set(spec) - set(SPEC_FIELDS))
    if unknown:
        raise _malformed(lib_path, f"{where}.spec has fields a KernelSpec does not: {', '.join(map(repr, unknown))}")
    for key, value in spec.items():
        want, text = SPEC_FIELDS[key]
        _check_type(lib_path, f"{where}.spec.{key}", value, want, text)
    try:
        kspec = KernelSpec.from_dict(spec)
    except (TypeError, ValueError) as e:
        raise _malformed(lib_path, f"{where}.spec is not a valid kernel spec: {e}") from None
    if kspec.name != entry["name"]:
        raise LibraryError(
            f"{lib_path}: inconsistent manifest: kernel {entry['name']!r} has the spec of {kspec.name!r}; "
            "the manifest was edited"
        )
    return kspec


def manifest_kernels(lib_path: str, manifest) -> list[tuple[KernelSpec, dict]]:
    """Check the fields of ``manifest`` and their types; return (spec, entry) of each
    kernel. LibraryError, naming ``lib_path`` and the field, for anything malformed or
    inconsistent, before anything else reads the manifest."""
    if not isinstance(manifest, dict):
        raise _malformed(lib_path, f"a JSON {type(manifest).__name__}, not an object")
    fmt = manifest.get("format")
    if not _is_int(fmt) or fmt not in MANIFEST_FORMATS:
        raise LibraryError(f"{lib_path}: manifest format {fmt!r}, expected one of {MANIFEST_FORMATS}")
    for key in ("tvm_version", "target", "target_key", "machine", "cpu_features", "kernels", "sha256"):
        if key not in manifest:
            raise _malformed(lib_path, f"no {key!r}")
    for key, want, text in (("tvm_version", str, "a string"), ("target", dict, "an object"),
                            ("target_key", str, "a string"), ("machine", str, "a string"),
                            ("cpu_features", list, "a list"), ("kernels", list, "a list"), ("sha256", str, "a string")):  # fmt: skip
        _check_type(lib_path, key, manifest[key], want, text)
    for i, feature in enumerate(manifest["cpu_features"]):
        _check_type(lib_path, f"cpu_features[{i}]", feature, str, "a string")
    for key in ("created", "signature", "cuda_device_code"):
        if manifest.get(key) is not None:
            _check_type(lib_path, key, manifest[key], str, "a string")
    if not SHA256_HEX.fullmatch(manifest["sha256"]):
        raise _malformed(lib_path, f"sha256 {_short(manifest['sha256'])} is not 64 lowercase hex digits")
    if manifest.get("signature") is not None and not SIGNATURE.fullmatch(manifest["signature"]):
        raise _malformed(lib_path, f"signature {_short(manifest['signature'])} is not {SIGNATURE_SCHEME}:<64 hex digits>")
    target = manifest["target"]
    kind = target.get("kind")
    if kind not in ("llvm", "cuda"):
        raise LibraryError(f"{lib_path}: target kind {_short(kind)}: swa_tvm loads 'llvm' and 'cuda' libraries only")
    for key in ("mcpu", "mtriple", "arch"):
        if key in target:
            _check_type(lib_path, f"target.{key}", target[key], str, "a string")
    if "num-cores" in target:
        _check_type(lib_path, "target.num-cores", target["num-cores"], int, "an integer")
    if kind == "cuda":
        if not CUDA_ARCH.fullmatch(str(target.get("arch"))):
            raise _malformed(lib_path, f"CUDA target arch {_short(target.get('arch'))}, expected sm_XY")
        if manifest.get("cuda_arch") != target["arch"]:
            raise LibraryError(
                f"{lib_path}: inconsistent manifest: cuda_arch {_short(manifest.get('cuda_arch'))} but target arch "
                f"{target['arch']!r}; the manifest was edited"
            )
    elif manifest.get("cuda_arch") is not None or manifest.get("cuda_device_code") is not None:
        raise LibraryError(f"{lib_path}: inconsistent manifest: a CPU (llvm) target with CUDA fields; the manifest was edited")
    if not manifest["kernels"]:
        raise _malformed(lib_path, "it lists no kernels")
    found = [(_check_kernel_entry(lib_path, i, e), e) for i, e in enumerate(manifest["kernels"])]
    names = [s.name for s, _ in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LibraryError(f"{lib_path}: inconsistent manifest: kernel {twice[0]} is listed twice")
    return found


# ---------------------------------------------------------------------------------------
# The keyed signature


def library_key() -> bytes | None:
    """The signing key, $SWA_TVM_LIBRARY_KEY as UTF-8 bytes; None where it is unset or
    empty. A key shorter than MIN_KEY_LENGTH characters is refused (LibraryError)."""
    key = os.environ.get(KEY_ENV)
    if not key:
        return None
    if len(key) < MIN_KEY_LENGTH:
        raise LibraryError(
            f"${KEY_ENV} has {len(key)} characters; use a random key of at least {MIN_KEY_LENGTH}, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return key.encode("utf-8", "surrogateescape")


def _canonical(manifest: dict) -> bytes:
    """The manifest but its signature, as the signature covers it: as read back from
    the written JSON (tuples become lists, keys strings), with sorted keys, no spaces."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != "signature"}))
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def library_signature(data: bytes, manifest: dict, key: bytes) -> str:
    """``hmac-sha256:<hex>`` of the library's bytes ``data`` and the manifest's other
    fields (canonical JSON) under ``key``."""
    canon = _canonical(manifest)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(b"swa_tvm library\0" + struct.pack("<Q", len(canon)) + canon)
    mac.update(data)
    return f"{SIGNATURE_SCHEME}:{mac.hexdigest()}"


def sign_manifest(lib_path: str | os.PathLike, manifest: dict, key: bytes | None = None) -> dict:
    """Add the signature of the library at ``lib_path`` to ``manifest`` (in place; also
    returned) under ``key``, by default $SWA_TVM_LIBRARY_KEY's; without a key, leave the
    manifest unsigned. ``export_library`` calls this."""
    key = library_key() if key is None else key
    manifest.pop("signature", None)
    if key:
        with open(lib_path, "rb") as f:
            manifest["signature"] = library_signature(f.read(), manifest, key)
    return manifest


def _check_signature(lib_path: str, data: bytes, manifest: dict) -> None:
    key = library_key()
    if key is None:
        return
    have = manifest.get("signature")
    if have is None:
        raise LibraryError(
            f"{lib_path}: the library is not signed, and ${KEY_ENV} is set: only libraries signed with that key "
            f"load here; export it again with ${KEY_ENV} set"
        )
    if not hmac.compare_digest(have, library_signature(data, manifest, key)):
        raise LibraryError(
            f"{lib_path}: its signature does not match ${KEY_ENV}: the library or its manifest changed after "
            "it was signed, or it was signed with another key"
        )


# ---------------------------------------------------------------------------------------
# The ELF file, read before dlopen maps it

ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
HOST_ELF_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}.get(platform.machine().lower())
BLOB_SYMBOL = "__tvm_ffi__library_bin"  # TVM's packed imported modules (compiler/cuda_pack.py)
FUNCTION_PREFIX = "__tvm_ffi_"  # the symbol of each function a library exports
_PT_LOAD, _PT_DYNAMIC = 1, 2
_SHT_NOBITS, _SHT_DYNSYM = 8, 11


class _Elf:
    """A 64-bit ELF shared object in ``data``, its headers checked against the file's
    size; LibraryError naming ``path`` for anything out of place."""

    def __init__(self, path: str, data: bytes) -> None:
        self.path, self.data = path, data
        size = len(data)
        if size < 64 or data[:4] != b"\x7fELF":
            raise self.error("it is not an ELF shared library (no ELF header)")
        if data[4] != 2:
            raise self.error(f"it is not a 64-bit ELF file (class {data[4]})")
        host = 1 if sys.byteorder == "little" else 2
        if data[5] != host:
            raise self.error(f"its byte order (ELF data {data[5]}) is not this machine's ({sys.byteorder} endian)")
        self.order = "<" if data[5] == 1 else ">"
        (e_type, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, shstrndx) = self.unpack(
            "HHIQQQIHHHHHH", 16
        )
        if e_type != 3:
            raise self.error(f"it is not a shared library (ELF type {e_type})")
        if HOST_ELF_MACHINE is not None and machine != HOST_ELF_MACHINE:
            raise self.error(
                f"it holds code for {ELF_MACHINES.get(machine, f'ELF machine {machine}')}, "
                f"this machine is {platform.machine()}"
            )
        if shoff == 0 or shentsize != 64:
            raise self.error(f"it has no valid section header table (offset {shoff}, entry size {shentsize})")
        self.within(shoff, 64, "the section header table")
        if shnum == 0:  # more than 0xff00 sections: the count is in section 0's size
            shnum = self.unpack("Q", shoff + 32)[0]
        self.within(shoff, shnum * 64, "the section header table")
        self.sections = [self.unpack("IIQQQQIIQQ", shoff + 64 * i) for i in range(shnum)]
        if phnum == 0xFFFF:  # PN_XNUM: the count is in section 0's sh_info
            phnum = self.sections[0][7]
        if phnum == 0 or phentsize != 56:
            raise self.error(f"it has no valid program header table ({phnum} entries of {phentsize} bytes)")
        self.within(phoff, phnum * 56, "the program header table")
        types = set()
        for i in range(phnum):
            p_type, _, offset, _, _, filesz, memsz, _ = self.unpack("IIQQQQQQ", phoff + 56 * i)
            self.within(offset, filesz, f"segment {i} (type {p_type:#x})")
            if p_type == _PT_LOAD and filesz > memsz:
                raise self.error(f"segment {i} holds {filesz} bytes of the file in {memsz} bytes of memory")
            types.add(p_type)
        if not {_PT_LOAD, _PT_DYNAMIC} <= types:
            raise self.error("it has no loadable segment or no dynamic section")
        for i, (_, sh_type, _, _, offset, sh_size, *_rest) in enumerate(self.sections):
            if sh_type != _SHT_NOBITS and i > 0:
                self.within(offset, sh_size, f"section {i}")
        if shstrndx == 0xFFFF:  # SHN_XINDEX
            shstrndx = self.sections[0][6]
        if shstrndx >= shnum:
            raise self.error(f"its section names are in section {shstrndx}, of {shnum}")

    def error(self, what: str) -> LibraryError:
        return LibraryError(f"{self.path}: {what}; the file is damaged or not a library swa_tvm exported")

    def unpack(self, fmt: str, offset: int) -> tuple:
        self.within(offset, struct.calcsize("<" + fmt), "a header")
        return struct.unpack_from(self.order + fmt, self.data, offset)

    def within(self, offset: int, length: int, what: str) -> None:
        if offset < 0 or length < 0 or offset + length > len(self.data):
            raise self.error(
                f"{what} ({length} bytes at offset {offset}) reaches past the end of the file "
                f"({len(self.data)} bytes): it is truncated"
            )

    def dynamic_symbols(self) -> dict[str, tuple[int, int, int]]:
        """{name: (section index, value, size)} of the symbols the library defines."""
        found = {}
        for _, sh_type, _, _, offset, size, link, _, _, entsize in self.sections:
            if sh_type != _SHT_DYNSYM:
                continue
            if entsize != 24 or link >= len(self.sections):
                raise self.error("its dynamic symbol table is malformed")
            str_off, str_size = self.sections[link][4], self.sections[link][5]
            for at in range(offset, offset + size - size % 24, 24):
                name_at, _, _, shndx, value, sym_size = self.unpack("IBBHQQ", at)
                if shndx == 0 or name_at >= str_size:  # undefined, or a name outside the table
                    continue
                end = self.data.find(b"\0", str_off + name_at, str_off + str_size)
                if end < 0:
                    raise self.error("its dynamic symbol names are malformed")
                found[self.data[str_off + name_at : end].decode("utf-8", "replace")] = (shndx, value, sym_size)
        return found

    def symbol_bytes(self, symbol: tuple[int, int, int], name: str) -> bytes:
        """The bytes of a defined data symbol, from its section in the file."""
        shndx, value, size = symbol
        if shndx >= len(self.sections):
            raise self.error(f"symbol {name} is in section {shndx}, of {len(self.sections)}")
        _, sh_type, _, addr, offset, sh_size, *_rest = self.sections[shndx]
        if sh_type == _SHT_NOBITS or not (addr <= value and value + size <= addr + sh_size):
            raise self.error(f"symbol {name} lies outside the data of its section")
        return self.data[offset + value - addr : offset + value - addr + size]


def packed_modules(blob: bytes) -> list[tuple[str, str | None]]:
    """(kind, format) of each module TVM packed into a library's import blob (the layout
    ``compiler/cuda_pack.py`` describes); format is a CUDA module's ("fatbin" compiled,
    "cuda" source), None for other kinds. ValueError where the blob is malformed."""
    pos = 0

    def u64() -> int:
        nonlocal pos
        if pos + 8 > len(blob):
            raise ValueError("it ends inside a length")
        (v,) = struct.unpack_from("<Q", blob, pos)
        pos += 8
        return v

    def raw() -> bytes:
        nonlocal pos
        n = u64()
        if n > len(blob) - pos:
            raise ValueError("a field reaches past its end")
        pos += n
        return blob[pos - n : pos]

    if u64() != len(blob) - 8:
        raise ValueError("its size field does not match its size")
    for _ in range(2):  # the import tree: row pointers, child indices
        n = u64()
        if n > (len(blob) - pos) // 8:
            raise ValueError("the import tree reaches past its end")
        pos += 8 * n
    found = []
    while pos < len(blob):
        kind = raw().decode("ascii", "replace")
        if kind == "_lib":  # the library's own host code
            found.append((kind, None))
            continue
        payload = raw()
        fmt = None
        if kind == "cuda":
            if len(payload) < 8 or struct.unpack_from("<Q", payload)[0] > len(payload) - 8:
                raise ValueError("a CUDA module's format reaches past its end")
            n = struct.unpack_from("<Q", payload)[0]
            fmt = payload[8 : 8 + n].decode("ascii", "replace")
        found.append((kind, fmt))
    return found


def check_elf(lib_path: str, data: bytes, manifest: dict, specs: list[KernelSpec]) -> None:
    """Raise LibraryError unless the library file ``data`` is a sound 64-bit ELF shared
    object for this machine (headers, segments and sections within the file) that
    defines each kernel of ``specs`` and holds CUDA device code, compiled, exactly when
    ``manifest`` says CUDA. Pure reading: nothing is mapped or run."""
    elf = _Elf(lib_path, data)
    symbols = elf.dynamic_symbols()
    missing = [s.name for s in specs if FUNCTION_PREFIX + s.name not in symbols]
    if missing:
        raise LibraryError(
            f"{lib_path}: the library does not define kernel {', '.join(missing)}, which its manifest lists: "
            "it is not the library the manifest describes"
        )
    modules = []
    if BLOB_SYMBOL in symbols:
        try:
            modules = packed_modules(elf.symbol_bytes(symbols[BLOB_SYMBOL], BLOB_SYMBOL))
        except ValueError as e:
            raise elf.error(f"its packed device code is malformed ({e})") from None
    other = sorted({k for k, _ in modules} - {"_lib", "cuda"})
    if other:
        raise LibraryError(f"{lib_path}: the library holds device code of kind {', '.join(other)}, which swa_tvm never builds")
    cuda = [fmt for kind, fmt in modules if kind == "cuda"]
    kind = manifest["target"]["kind"]
    if kind == "llvm" and cuda:
        raise LibraryError(
            f"{lib_path}: the library holds CUDA device code, but its manifest says it is a CPU (llvm) library; "
            "the manifest belongs to another build"
        )
    if kind == "cuda" and not cuda:
        raise LibraryError(
            f"{lib_path}: its manifest says CUDA ({manifest['target'].get('arch')}), but the library holds no "
            "CUDA device code; the manifest belongs to another build"
        )
    if kind == "cuda" and any(fmt != manifest.get("cuda_device_code") for fmt in cuda):
        raise LibraryError(
            f"{lib_path}: its CUDA device code is {'source' if 'cuda' in cuda else ', '.join(map(str, cuda))}, "
            f"not {manifest.get('cuda_device_code')} as its manifest says; export it again with `swa-tvm export`"
        )


# ---------------------------------------------------------------------------------------
# Checking and loading


def _read_library(lib_path: str) -> bytes:
    if not os.path.isfile(lib_path):
        raise LibraryError(f"{lib_path}: not a regular file")
    with open(lib_path, "rb") as f:
        return f.read()


def _verify(lib_path: str, manifest, data: bytes | None = None) -> list[tuple[KernelSpec, dict]]:
    """Every check of ``check_manifest``; the (spec, entry) of each kernel."""
    kernels = manifest_kernels(lib_path, manifest)
    data = _read_library(lib_path) if data is None else data
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest["sha256"]:
        raise LibraryError(
            f"{lib_path}: sha256 {digest[:16]}... does not match the manifest's "
            f"{manifest['sha256'][:16]}...; the library was modified or the manifest belongs to another build"
        )
    _check_signature(lib_path, data, manifest)
    have = tvm_version()
    if manifest["tvm_version"] != have:
        raise LibraryError(
            f"{lib_path}: built with TVM {manifest['tvm_version']}, but this process runs TVM {have}; "
            "rebuild it with `swa-tvm export`"
        )
    target = manifest["target"]
    if target["kind"] == "cuda" and manifest.get("cuda_device_code") != "fatbin":
        # Exported before device code was packed compiled (cuda_pack): the library holds
        # CUDA source that TVM's runtime would compile at the first call, through a
        # compiler callback only the full apache-tvm registers.
        raise LibraryError(
            f"{lib_path}: its CUDA device code is source, not compiled (exported by an older swa_tvm); "
            "export it again with `swa-tvm export`"
        )
    if target["kind"] == "llvm":
        arch = manifest["machine"]
        if arch and arch != platform.machine():
            raise LibraryError(f"{lib_path}: built for {arch} CPUs, this machine is {platform.machine()}")
        # The CPU features decide, not the CPU's name: code for a lesser CPU runs on a
        # better one. target.mcpu and target_key are informational (but must agree).
        missing = sorted(set(manifest["cpu_features"]) - host_cpu_flags())
        if missing:
            raise LibraryError(
                f"{lib_path}: built for CPU {target.get('mcpu')!r}, which needs {', '.join(missing)}; "
                "this CPU lacks them. Rebuild it here with `swa-tvm export`"
            )
    if manifest["target_key"] != manifest_target_key(target):
        raise LibraryError(
            f"{lib_path}: inconsistent manifest: target_key {manifest['target_key']!r}, but its target "
            f"{json.dumps(target, sort_keys=True)} is of class {manifest_target_key(target)!r}; the manifest was edited"
        )
    check_elf(lib_path, data, manifest, [s for s, _ in kernels])
    return kernels


def check_manifest(lib_path: str, manifest: dict) -> None:
    """Raise LibraryError unless the library at lib_path can run here: the manifest's
    fields and their types, the sha256, the signature where $SWA_TVM_LIBRARY_KEY is set,
    the TVM version, the CPU, and the ELF file (``check_elf``). Nothing is loaded."""
    _verify(os.fspath(lib_path), manifest)


def load_library(path: str | os.PathLike, *, _jit_cache: bool = False) -> list[KernelSpec]:
    """Load a library written by ``export_library`` and register its kernels.

    The manifest beside it (``<path>.json``) must be well formed and match the file's
    sha256 (and its signature, where $SWA_TVM_LIBRARY_KEY is set), this process's TVM
    version and this machine's CPU, and the file must be a sound ELF library holding the
    kernels and device code the manifest lists (``check_manifest``); otherwise
    LibraryError names the file and what is wrong, and nothing is registered. A missing
    library is a FileNotFoundError. Where a CUDA GPU is present, a library built for an
    arch-specific target (sm_90a) on a GPU of another arch is a LibraryError naming the
    file and both archs (``check_arch_specific``). Only the TVM runtime is needed
    (tvm_ffi and libtvm_runtime), not the compiler. Returns the specs it registered.
    """
    import tvm_ffi

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"library {path!r} does not exist")
    mpath = manifest_path(path)
    if not os.path.exists(mpath):
        raise LibraryError(f"{path}: no manifest at {mpath}; export libraries with swa_tvm.export_library")
    manifest = _read_manifest(path)
    kernels = _verify(path, manifest, _read_library(path))
    device = device_of_target(manifest["target"])
    # A CUDA library still loads without a GPU (its manifest checked, its kernels
    # registered); calling one then raises NoDeviceError saying why.
    no_device = cuda_unavailable_reason() if device == "cuda" else None
    module = None
    if no_device is None:
        if device == "cuda":  # sm_XYa code on a GPU of another arch: refused here, by the file's name
            check_arch_specific(path, manifest.get("cuda_arch"), cuda_device_arch())
        _load_tvm_runtime()
        if device == "cpu":
            configure_cpu_threads()
            if any(entry.get("schedule") == "amx" for _, entry in kernels):
                request_amx(path)
        try:
            module = tvm_ffi.load_module(path)
        except Exception as e:  # noqa: BLE001 - whatever the runtime says, by the file's name
            raise LibraryError(f"{path}: the TVM runtime cannot load it: {e}") from e
        missing = [s.name for s, _ in kernels if not module.implements_function(s.name)]
        if missing:
            raise LibraryError(
                f"{path}: the library has no function {', '.join(missing)}, which its manifest lists: "
                "it is not the library the manifest describes"
            )
    # Everything is checked: register all the kernels, or (above) none.
    arch = manifest.get("cuda_arch")
    origin = "jit" if _jit_cache else path
    found = [
        Kernel(spec, module[spec.name] if module is not None else _no_device_kernel(spec, path, no_device), device,
               origin, arch, entry.get("workspace"), entry.get("schedule"))
        for spec, entry in kernels
    ]  # fmt: skip
    for kernel in found:
        REGISTRY.add(kernel, module)
    if not _jit_cache:  # JIT cache entries do not count as user libraries
        REGISTRY.add_library(path)
    return [k.spec for k in found]


def _read_manifest(lib_path: str) -> Any:
    mpath = manifest_path(lib_path)
    if not os.path.isfile(mpath):
        raise LibraryError(f"{lib_path}: its manifest {mpath} is not a regular file")
    try:
        with open(mpath, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _malformed(lib_path, f"not JSON ({e})") from None


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the library at ``path``, as its JSON says (unchecked: see
    ``check_manifest``). FileNotFoundError without one; LibraryError naming the library
    if it is not JSON."""
    path = os.fspath(path)
    if not os.path.exists(manifest_path(path)):
        raise FileNotFoundError(f"no manifest at {manifest_path(path)}")
    return _read_manifest(path)
