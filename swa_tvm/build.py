"""Compiling kernel specs into one TVM module, exporting it, and the JIT cache.

Data flows one way: KernelSpec -> TE (compute.py) -> PrimFunc -> schedule (schedules/,
or a tuning record later) -> tvm.compile -> module -> library (.so + manifest) -> op.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import tempfile
import threading
import warnings
from typing import Iterable

import filelock

from . import cuda_pack, library
from .compute import prim_func
from .library import MANIFEST_FORMAT, X86_FEATURES, Kernel, sha256_file
from .spec import KernelSpec

class UntunedKernelWarning(UserWarning):
    """An exported kernel had no tuning record for its target class."""


__all__ = ["host_target", "target_key", "compile_specs", "export_library", "get_or_build_kernel", "cache_dir", "find_records", "UntunedKernelWarning"]


def host_target(num_cores: int | None = None) -> dict:
    """The llvm target of this machine: detected -mcpu, all usable cores."""
    import tvm

    cores = num_cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": int(cores or 1)}


CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


def local_cuda_arch() -> str | None:
    """sm_XY of this machine's first CUDA device (via torch), or None without one."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - no usable CUDA runtime counts as no device
        pass
    return None


def _cuda_target(arch: str | None) -> dict:
    arch = arch or local_cuda_arch()
    if arch is None:
        raise ValueError(
            "target 'cuda': this machine has no CUDA device to take the architecture from; "
            f"name it, e.g. 'cuda -arch=sm_90' (one of {', '.join(CUDA_ARCHS)})"
        )
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"CUDA arch {arch!r}: expected sm_XY such as sm_80 or sm_90")
    return {"kind": "cuda", "arch": arch}


def normalize_target(target: str | dict | None) -> dict:
    """Accept None/"llvm" (host CPU), "cuda" (this machine's GPU), "cuda -arch=sm_90" or
    "cuda:sm_90", a JSON string, or a dict; return a plain dict."""
    if target is None or target in ("llvm", "cpu", "host"):
        return host_target()
    if isinstance(target, str):
        text = target.strip()
        m = re.fullmatch(r"cuda(?:\s+-arch=(\S+)|:(\S+))?", text)
        if m:
            return _cuda_target(m.group(1) or m.group(2))
        if text.startswith("{"):
            return normalize_target(json.loads(text))
        raise ValueError(
            f"target {target!r}: use 'llvm' for this CPU, 'cuda -arch=sm_90' for a GPU class, or a JSON dict "
            'such as {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}'
        )
    target = dict(target)
    if target.get("kind") == "cuda":
        return _cuda_target(target.get("arch"))
    if target.get("kind") != "llvm":
        raise ValueError(f"target kind {target.get('kind')!r}: swa_tvm builds for 'llvm' (CPUs) and 'cuda' only")
    if "mcpu" in target:
        _check_llvm_cpu(target)
    return target


def _check_llvm_cpu(target: dict) -> None:
    """LLVM takes an -mcpu it does not know as 'generic' with a log line and carries on,
    which would write a baseline-ISA library under the misspelled name's class."""
    from tvm.target import codegen

    triple = target.get("mtriple") or codegen.llvm_get_system_triple()
    cpu = target["mcpu"]
    if not isinstance(cpu, str) or not codegen.llvm_is_valid_cpu(cpu, triple):
        portable = " (portable x86 levels: x86-64-v2, x86-64-v3, x86-64-v4)" if triple.startswith("x86_64") else ""
        raise ValueError(
            f"target mcpu {cpu!r} is not a CPU that LLVM {codegen.llvm_version_major()} knows for {triple}; "
            f"this machine is {codegen.llvm_get_system_cpu()!r}{portable}"
        )


def target_key(target: dict) -> str:
    """The target class: tuning records and caches are never shared across classes."""
    if target.get("kind") == "llvm":
        return f"llvm-{target.get('mcpu', 'generic')}"
    return f"{target.get('kind')}-{target.get('arch', 'unknown')}"


def _vector_lanes(tvm_target) -> int:
    """fp32 lanes of the target's widest vector unit. (llvm_get_vector_width reports 512
    for znver3, which has 256-bit units, so this asks for the features instead.)"""
    import tvm

    feats = tvm.target.codegen.llvm_get_cpu_features(tvm_target)
    if "avx512f" in feats:
        return 16
    if "avx" in feats:
        return 8
    return 4


def _cpu_features(tvm_target) -> list[str]:
    import tvm

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    feats = tvm.target.codegen.llvm_get_cpu_features(tvm_target)
    return sorted(X86_FEATURES[f] for f in X86_FEATURES if f in feats)


def schedule_spec(spec: KernelSpec, tvm_target, record=None, tiles=None):
    """The scheduled PrimFunc for ``spec``: a tuning record's trace replayed on the
    symbolic-T kernel when ``record`` is given, else the default schedule; a fused CUDA
    kernel's tile config ``tiles`` (swa_tvm.tiles: a measured record's) instead of its
    default."""
    import tvm
    from tvm import s_tir

    from swa_tvm.schedules import cpu as cpu_schedules
    from swa_tvm.schedules import cuda as cuda_schedules

    from .tuning import apply_record

    kind = tvm_target.kind.name
    if kind not in ("llvm", "cuda"):
        raise NotImplementedError(f"no schedule for target kind {kind!r}")
    if record is not None and record.trace is not None:
        return _postprocess(spec, kind, apply_record(spec, record.trace, kind))
    fused = default_schedule(spec, kind)
    if fused == "cuda_flash_tc":
        from swa_tvm.schedules import cuda_flash_tc

        return cuda_flash_tc.flash_tc(spec, tiles)
    if fused == "cuda_flash":
        from swa_tvm.schedules import cuda_flash

        return cuda_flash.flash(spec)
    if fused == "cuda_flash_bwd_tc":
        from swa_tvm.schedules import cuda_flash_bwd_tc

        return cuda_flash_bwd_tc.flash_bwd_tc(spec, tiles)
    if fused == "cuda_flash_bwd":
        from swa_tvm.schedules import cuda_flash_bwd

        return cuda_flash_bwd.flash_bwd(spec)
    sch = s_tir.Schedule(tvm.IRModule({spec.name: prim_func(spec, target_kind=kind)}))
    sch.work_on(spec.name)
    if kind == "cuda":
        cuda_schedules.schedule(sch, spec)
        return sch.mod[spec.name]
    # AVX2 machines get 8 fp32 lanes, AVX-512 ones 16.
    cpu_schedules.schedule(sch, spec, vector_lanes=_vector_lanes(tvm_target))
    return _postprocess(spec, kind, sch.mod[spec.name])


def default_schedule(spec: KernelSpec, kind: str) -> str:
    """Which kernel a spec gets without a tuning record: for CUDA forward kernels the
    fused kernel, on tensor cores for float16/bfloat16 ("cuda_flash_tc",
    schedules/cuda_flash_tc.py), else on CUDA cores ("cuda_flash",
    schedules/cuda_flash.py) where its tiles fit, local and global rows alike; for the
    CUDA gradients the fused backward, on tensor cores for float16/bfloat16
    ("cuda_flash_bwd_tc", schedules/cuda_flash_bwd_tc.py), else on CUDA cores
    ("cuda_flash_bwd", schedules/cuda_flash_bwd.py);
    otherwise "default", the TE compute under
    schedules/cpu.py or schedules/cuda.py."""
    if kind == "cuda" and spec.kind in ("local", "global"):
        from swa_tvm.schedules import cuda_flash, cuda_flash_tc

        if cuda_flash_tc.default_config(spec) is not None:
            return "cuda_flash_tc"
        if cuda_flash.default_config(spec) is not None:
            return "cuda_flash"
    if kind == "cuda":
        from swa_tvm.schedules import cuda_flash_bwd, cuda_flash_bwd_tc

        if cuda_flash_bwd_tc.default_config(spec) is not None:
            return "cuda_flash_bwd_tc"
        if cuda_flash_bwd.default_config(spec) is not None:
            return "cuda_flash_bwd"
    return "default"


def fused_tiles(spec: KernelSpec, schedule: str, config=None) -> dict | None:
    """The tile configuration a fused CUDA kernel (``schedule`` as default_schedule
    names it, the module under schedules/) is built with, for the manifest: ``config``
    (a measured record's, swa_tvm.tiles) or the default; a library should say which."""
    if schedule not in ("cuda_flash", "cuda_flash_tc", "cuda_flash_bwd", "cuda_flash_bwd_tc"):
        return None
    import dataclasses
    import importlib

    return dataclasses.asdict(config or importlib.import_module(f"swa_tvm.schedules.{schedule}").default_config(spec))


def _postprocess(spec: KernelSpec, kind: str, func):
    from swa_tvm.schedules import cpu as cpu_schedules

    if kind == "llvm":
        func = cpu_schedules.drop_fused_bound_predicates(func)
    if kind == "llvm" and spec.kind == "local":
        func = cpu_schedules.skip_dead_keys(func, spec)
    return func


# Default for `logs`: the committed/installed tuning logs (tuning.default_logs_root()).
DEFAULT_LOGS = "default"


def find_records(specs: Iterable[KernelSpec], target: dict, logs: str | None = DEFAULT_LOGS) -> dict:
    """The best tuning record of each spec for ``target`` (None where there is none)."""
    from .tuning import apply_record, best_records, default_logs_root

    specs = list(specs)
    root = default_logs_root() if logs == DEFAULT_LOGS else logs
    found = best_records(specs, target, root)  # reads the log folder once
    for s in specs:
        rec = found[s.name]
        if rec is not None and rec.trace is not None:  # trace None: the default kernel won
            try:
                apply_record(s, rec.trace, target.get("kind", "llvm"))
            except Exception as e:  # noqa: BLE001 - a stale record must not break a build
                # The schedule code changed since the record was made: it no longer replays.
                warnings.warn(
                    f"kernel {s.name}: its tuning record no longer replays on this schedule "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:120]}); re-tune to refresh it",
                    UntunedKernelWarning,
                    stacklevel=2,
                )
                rec = None
        found[s.name] = rec
    return found


def find_tiles(specs: Iterable[KernelSpec], target: dict, logs: str | None = DEFAULT_LOGS) -> dict:
    """{spec name: tile config} of the specs whose fused CUDA kernel has a measured tile
    record for ``target``'s class under ``logs`` (``tiles.json``, swa_tvm.tiles)."""
    from . import tiles as tile_records
    from .tuning import default_logs_root

    root = default_logs_root() if logs == DEFAULT_LOGS else logs
    recs = tile_records.read(root, target)
    found = {}
    for s in specs if recs else ():
        cfg = tile_records.find(s, default_schedule(s, target["kind"]), recs, target.get("arch"))
        if cfg is not None:
            found[s.name] = cfg
    return found


def compile_specs(specs: Iterable[KernelSpec], target: str | dict | None = None, records: dict | None = None,
                  tiles: dict | None = None):
    """Compile every spec into one runtime module. Returns (module, target dict).

    ``records`` maps spec names to tuning records (``find_records``); specs without one
    get the default schedule. ``tiles`` maps spec names to fused kernels' tile configs
    (``find_tiles``). A CUDA module holds its generated source until exported
    (``cuda_pack.export_module`` compiles it with nvcc then)."""
    import tvm

    target = normalize_target(target)
    tvm_target = tvm.target.Target(target)
    specs = list(dict.fromkeys(specs))  # dedupe, keep order
    if not specs:
        raise ValueError("specs is empty: give at least one KernelSpec")
    records, tiles = records or {}, tiles or {}
    funcs = {spec.name: schedule_spec(spec, tvm_target, records.get(spec.name), tiles.get(spec.name)) for spec in specs}
    module = tvm.compile(tvm.IRModule(funcs), target=tvm_target)
    if target.get("kind") == "cuda":
        module = module.mod  # the host module, importing the CUDA one
    return module, target


def cuda_source(module) -> str:
    """The CUDA C source TVM generated for a compiled CUDA module (for inspection)."""
    return "\n".join(m.inspect_source() for m in module.imports if m.kind == "cuda")


def export_library(
    specs: Iterable[KernelSpec],
    path: str | os.PathLike,
    target: str | dict | None = None,
    logs: str | None = DEFAULT_LOGS,
    warn_untuned: bool = True,
) -> dict:
    """Compile ``specs`` and write ``path`` (a shared library) and ``path + '.json'``
    (and, for CUDA, the generated source as ``path + '.cu'``).

    Each kernel uses the best record for this target class under ``logs`` (default: the
    committed ``tuning_logs/``; None: no records), else the default schedule, with a
    warning naming the kernel when ``warn_untuned``. The manifest records the format,
    TVM version, target (and its class key), the CPU features the code needs, the
    kernel specs and whether each is tuned, and the sha256 of the library. Returns it.
    """
    import tvm

    from .tuning import default_logs_root, log_dir

    specs = list(dict.fromkeys(specs))
    target = normalize_target(target)
    records = find_records(specs, target, logs) if logs is not None else {}
    if warn_untuned and logs is not None:  # logs=None asks for default schedules: nothing to warn
        root = default_logs_root() if logs == DEFAULT_LOGS else logs
        where = log_dir(root, target) if root else "(no tuning logs configured)"
        for s in specs:
            if records.get(s.name) is None:
                warnings.warn(
                    f"kernel {s.name}: no tuning record for {target_key(target)} in {where}; "
                    "using the default schedule",
                    UntunedKernelWarning,
                    stacklevel=2,
                )
    tiles = find_tiles(specs, target, logs) if logs is not None and target.get("kind") == "cuda" else {}
    module, target = compile_specs(specs, target, records, tiles)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Write to a temporary name and rename, so a crash never leaves a half library
    # beside a manifest that vouches for it. CUDA device code goes in compiled.
    tmp = f"{path}.tmp{os.getpid()}.so"
    resources = cuda_pack.export_module(module, tmp, target)
    if target.get("kind") == "cuda":
        # The generated CUDA C beside the library, for reading what the schedule made.
        with open(f"{path}.cu", "w") as f:
            f.write(cuda_source(module))

    def kernel_entry(s):
        rec = records.get(s.name)
        entry = {
            "name": s.name,
            "spec": s.to_dict(),
            "tuned": rec is not None,
            "schedule": "tuned" if rec is not None and rec.trace is not None else default_schedule(s, target["kind"]),
        }
        used = fused_tiles(s, entry["schedule"], tiles.get(s.name))
        if used is not None:
            entry["tiles"] = used
            entry["tiles_from"] = "measured" if s.name in tiles else "default"  # tiles.json's record, or not
        if s.kind == "global" and entry["schedule"] == "cuda_flash_tc":
            entry["workspace"] = library.GLOBAL_WORKSPACE  # split-K: the caller passes it (functional)
        if s.kind == "global_bwd" and entry["schedule"] == "cuda_flash_bwd_tc":
            entry["workspace"] = library.GLOBAL_BWD_WORKSPACE
        # ptxas's count for each CUDA kernel of the spec (registers, spills, shared memory).
        ptxas = {f: r for f, r in resources.items() if re.fullmatch(rf"{s.name}_kernel(_\d+)?", f)}
        if ptxas:
            entry["ptxas"] = ptxas
        if rec is not None:
            entry["tuning"] = {
                "run_ms": round(rec.run_ms, 4),
                "gflops": round(rec.gflops, 2),
                "records": rec.records,
                # No searched record beat the default (CUDA: the fused kernel) by DEFAULT_MARGIN.
                "default_point": rec.default_point,
            }
        return entry

    manifest = {
        "format": MANIFEST_FORMAT,
        "tvm_version": library.tvm_version(),
        "target": target,
        "target_key": target_key(target),
        "machine": platform.machine(),
        "cpu_features": _cpu_features(tvm.target.Target(target)) if target.get("kind") == "llvm" else [],
        "cuda_arch": target.get("arch") if target.get("kind") == "cuda" else None,
        # How the device code is packed (cuda_pack): compiled, loadable by the runtime alone.
        **({"cuda_device_code": "fatbin"} if target.get("kind") == "cuda" else {}),
        "kernels": [kernel_entry(s) for s in specs],
        "sha256": sha256_file(tmp),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.replace(tmp, path)
    with open(library.manifest_path(path) + ".tmp", "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(library.manifest_path(path) + ".tmp", library.manifest_path(path))
    return manifest


def cache_dir() -> str:
    """Disk cache of JIT-compiled kernels: $SWA_TVM_CACHE or ~/.cache/swa_tvm."""
    return os.environ.get("SWA_TVM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "swa_tvm")


_JIT_LOCK = threading.Lock()


def kernel_code_files() -> list[str]:
    """The sources that decide what a kernel computes and how it is built: the TE, every
    schedule, the spec's parameters, this build and nvcc's packing."""
    from swa_tvm import compute, compute_backward, cuda_pack, schedules, spec

    folder = os.path.dirname(schedules.__file__)
    files = [m.__file__ for m in (compute, compute_backward, cuda_pack, spec)] + [__file__]
    return files + sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".py"))


def _kernel_code_digest() -> str:
    """Hash of ``kernel_code_files``, so an edited checkout never reuses a cached build
    of older code."""
    import hashlib

    h = hashlib.sha256()
    for name in kernel_code_files():
        with open(name, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def get_or_build_kernel(spec: KernelSpec, target: str | dict | None = None) -> Kernel:
    """A registered kernel for ``spec``: from memory, else from the disk cache, else
    compiled now and cached. The cache key is the full spec, the target and TVM version,
    so a changed CPU, TVM or spec never reuses a stale build."""
    import hashlib

    from . import __version__

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
            with tempfile.TemporaryDirectory(dir=folder) as tmpd:
                tmp = os.path.join(tmpd, os.path.basename(path))
                export_library([spec], tmp, target, warn_untuned=False)
                os.replace(library.manifest_path(tmp), library.manifest_path(path))
                os.replace(tmp, path)
            library.load_library(path, _jit_cache=True)
        return library.REGISTRY.find(spec, device)
