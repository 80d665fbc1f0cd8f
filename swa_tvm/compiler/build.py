"""Compiling kernel specs into one TVM module and exporting it as a library + manifest.

Data flows one way: KernelSpec -> TE (swa_tvm.compute) -> PrimFunc -> schedule
(swa_tvm.schedules, or a tuning record) -> tvm.compile -> module -> library -> op.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import warnings
from typing import Iterable

import tvm
from tvm import s_tir

from swa_tvm.compiler import cuda_pack, kernels
from swa_tvm.compiler import tiles as tile_records
from swa_tvm.compiler.records import (
    apply_record,
    best_records,
    default_logs_root,
    log_dir,
)
from swa_tvm.compiler.targets import (
    AMX_FEATURES,
    _cpu_features,
    _vector_lanes,
    matrix_engine,
    matrix_form,
    normalize_target,
    target_key,
    uses_amx,
)
from swa_tvm.compute import prim_func
from swa_tvm.compute.forward import fused_backward_runs
from swa_tvm.runtime import library
from swa_tvm.runtime.library import AMX_FORMAT, FUSED_BACKWARD_FORMAT, MANIFEST_FORMATS, sha256_file
from swa_tvm.schedules import cpu as cpu_schedules
from swa_tvm.schedules import cpu_flash_bwd, cpu_flash_bwd_matrix
from swa_tvm.schedules import cuda as cuda_schedules
from swa_tvm.spec import CPU_ONLY_KINDS, KernelSpec

# The manifest format of a library without matrix-engine or five-product backward
# kernels: loaders from before format 3 still read it.
LEGACY_FORMAT = MANIFEST_FORMATS[0]


class UntunedKernelWarning(UserWarning):
    """An exported kernel had no tuning record for its target class."""


__all__ = ["compile_specs", "export_library", "find_records", "find_tiles", "UntunedKernelWarning"]


def schedule_spec(spec: KernelSpec, tvm_target, record=None, tiles=None):
    """The scheduled PrimFunc for ``spec``: a tuning record's trace replayed on the
    symbolic-T kernel when ``record`` is given, else the default schedule; a fused CUDA
    kernel's tile config ``tiles`` (swa_tvm.compiler.tiles: a measured record's) instead
    of its default."""
    kind = tvm_target.kind.name
    if kind not in ("llvm", "cuda"):
        raise NotImplementedError(f"no schedule for target kind {kind!r}")
    engine = matrix_form(spec, tvm_target)
    if spec.kind in CPU_ONLY_KINDS:
        if kind != "llvm":
            raise ValueError(f"{spec.name}: kind {spec.kind!r} is a CPU kernel; {kind} targets have none")
        return (cpu_flash_bwd_matrix.fused_backward_matrix(spec, engine) if engine is not None
                else cpu_flash_bwd.fused_backward(spec))
    if engine is not None:
        sch = s_tir.Schedule(tvm.IRModule({spec.name: prim_func(spec, amx=True)}))
        sch.work_on(spec.name)
        cpu_schedules.schedule(sch, spec, vector_lanes=_vector_lanes(tvm_target), matrix=engine)
        func = cpu_schedules.drop_fused_bound_predicates(sch.mod[spec.name])
        return cpu_schedules.drop_init(func, cpu_schedules.AMX_PRODUCTS[spec.kind])
    if record is not None and record.trace is not None:
        return _postprocess(spec, kind, apply_record(spec, record.trace, kind))
    fused = kernels.fused_kernel(default_schedule(spec, kind))
    if fused is not None:
        return fused.build(spec, tiles)
    sch = s_tir.Schedule(tvm.IRModule({spec.name: prim_func(spec, target_kind=kind)}))
    sch.work_on(spec.name)
    if kind == "cuda":
        cuda_schedules.schedule(sch, spec)
        return sch.mod[spec.name]
    # AVX2 machines get 8 fp32 lanes, AVX-512 ones 16.
    cpu_schedules.schedule(sch, spec, vector_lanes=_vector_lanes(tvm_target))
    return _postprocess(spec, kind, sch.mod[spec.name])


def default_schedule(spec: KernelSpec, kind: str) -> str:
    """Which kernel a spec gets without a tuning record: on CUDA the first fused kernel
    of ``kernels.FUSED_KERNELS`` that serves it (tensor cores for float16/bfloat16, else
    CUDA cores, forward and gradients alike), named as there; "cpu_flash_bwd" for the
    five-product CPU backward (schedules/cpu_flash_bwd.py); otherwise "default", the TE
    compute under schedules/cpu.py or schedules/cuda.py."""
    if spec.kind in CPU_ONLY_KINDS:
        return "cpu_flash_bwd"
    fused = kernels.choose(spec) if kind == "cuda" else None
    return fused.name if fused is not None else "default"


def fused_tiles(spec: KernelSpec, schedule: str, config=None) -> dict | None:
    """The tile configuration a fused CUDA kernel (``schedule`` as default_schedule
    names it) is built with, for the manifest: ``config`` (a measured record's,
    swa_tvm.compiler.tiles) or the default; a library should say which."""
    fused = kernels.fused_kernel(schedule)
    return fused.tiles(spec, config) if fused is not None else None


def _postprocess(spec: KernelSpec, kind: str, func):
    if kind == "llvm":
        func = cpu_schedules.drop_fused_bound_predicates(func)
    if kind == "llvm" and spec.kind == "local":
        func = cpu_schedules.skip_dead_keys(func, spec)
    return func


# Default for `logs`: the committed/installed tuning logs (tuning.default_logs_root()).
DEFAULT_LOGS = "default"


def find_records(specs: Iterable[KernelSpec], target: dict, logs: str | None = DEFAULT_LOGS) -> dict:
    """The best tuning record of each spec for ``target`` (None where there is none)."""
    specs = list(specs)
    root = default_logs_root() if logs == DEFAULT_LOGS else logs
    # Records are searched over the float32-product form; the matrix-engine form is
    # built with its own schedule, so its specs are not looked up.
    searched = [s for s in specs if matrix_form(s, target) is None]
    found = {s.name: None for s in specs}
    if searched:
        found.update(best_records(searched, target, root))  # reads the log folder once
    for s in searched:
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
    record for ``target``'s class under ``logs`` (``tiles.json``, swa_tvm.compiler.tiles)."""
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

    Each kernel uses the applied record (``records.best_records``: on a CPU the one
    validation kept, else the default's own) for this target class under ``logs`` (default: the
    committed ``tuning_logs/``; None: no records), else the default schedule, with a
    warning naming the kernel when ``warn_untuned``. The manifest records the format,
    TVM version, target (and its class key), the CPU features the code needs, the
    kernel specs and whether each is tuned, and the sha256 of the library; with
    $SWA_TVM_LIBRARY_KEY set, a keyed signature of the library and the manifest
    (``library.sign_manifest``). Returns it.
    """
    specs = list(dict.fromkeys(specs))
    target = normalize_target(target)
    # The five-product CPU backward is left out where the TE gradient kernels run instead:
    # on CUDA (fused kernels of their own), and on a CPU with a bfloat16 engine where
    # ``fused_backward_runs`` says so.
    specs = [s for s in specs if s.kind not in CPU_ONLY_KINDS
             or (target.get("kind") == "llvm" and fused_backward_runs(s, matrix_engine(target)))]
    # The KV-cache forward's blocks of CACHE_MATRIX_BLOCK rows serve the matrix engine
    # alone: elsewhere calls take the smaller blocks (swa_tvm.eager), so it is left out.
    specs = [s for s in specs if not s.engine_only or matrix_form(s, target) is not None]
    records = find_records(specs, target, logs) if logs is not None else {}
    if warn_untuned and logs is not None:  # logs=None asks for default schedules: nothing to warn
        root = default_logs_root() if logs == DEFAULT_LOGS else logs
        where = log_dir(root, target) if root else "(no tuning logs configured)"
        for s in specs:
            # The matrix-engine form has no search yet; the hand-written CPU backward has none at all.
            if records.get(s.name) is None and matrix_form(s, target) is None and s.kind not in CPU_ONLY_KINDS:
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
        engine = matrix_form(s, target)
        if engine is not None:
            # The matrix-engine form: "amx" (the loader asks the OS for tile state) or "bf16_dot".
            entry["schedule"] = engine
        used = fused_tiles(s, entry["schedule"], tiles.get(s.name))
        if used is not None:
            entry["tiles"] = used
            entry["tiles_from"] = "measured" if s.name in tiles else "default"  # tiles.json's record, or not
        fused = kernels.fused_kernel(entry["schedule"])
        if fused is not None and s.kind in fused.workspaces:
            entry["workspace"] = fused.workspaces[s.kind]  # split-K: the caller passes it (swa_tvm.eager)
        # ptxas's count for each CUDA kernel of the spec (registers, spills, shared memory).
        ptxas = {f: r for f, r in resources.items() if re.fullmatch(rf"{s.name}_kernel(_\d+)?", f)}
        if ptxas:
            entry["ptxas"] = ptxas
        if rec is not None:
            entry["tuning"] = {
                "run_ms": round(rec.run_ms, 4),
                "gflops": round(rec.gflops, 2),
                "records": rec.records,
                # No searched record was validated (CUDA: beat the fused kernel by DEFAULT_MARGIN).
                "default_point": rec.default_point,
            }
            if target.get("kind") == "llvm":
                # "kept": a searched record validated faster at every shape; "default":
                # validated, none was; "none": no verdict, so no searched record applies.
                v = rec.validation
                entry["tuning"]["validation"] = "none" if not v else "kept" if v.get("kept") else "default"
                if v:
                    entry["tuning"]["validated"] = v["date"]
                    if v.get("kept"):
                        entry["tuning"]["worst_ratio"] = v["worst_ratio"][v["kept"]]
        return entry

    amx = any(uses_amx(s, target) for s in specs)
    manifest = {
        "format": (FUSED_BACKWARD_FORMAT if any(s.kind in CPU_ONLY_KINDS for s in specs)
                   else AMX_FORMAT if amx else LEGACY_FORMAT),
        "tvm_version": library.tvm_version(),
        "target": target,
        "target_key": target_key(target),
        "machine": platform.machine(),
        # The target's features, AMX only where a kernel uses it: a library without
        # matrix-engine kernels also loads where the OS does not expose AMX.
        "cpu_features": [f for f in _cpu_features(tvm.target.Target(target)) if amx or f not in AMX_FEATURES]
        if target.get("kind") == "llvm" else [],
        "cuda_arch": target.get("arch") if target.get("kind") == "cuda" else None,
        # How the device code is packed (cuda_pack): compiled, loadable by the runtime alone.
        **({"cuda_device_code": "fatbin"} if target.get("kind") == "cuda" else {}),
        "kernels": [kernel_entry(s) for s in specs],
        "sha256": sha256_file(tmp),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    # With $SWA_TVM_LIBRARY_KEY set, an HMAC of the library and the manifest: where the
    # key is set, load_library refuses libraries without it (docs/libraries.md).
    library.sign_manifest(tmp, manifest)
    os.replace(tmp, path)
    with open(library.manifest_path(path) + ".tmp", "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(library.manifest_path(path) + ".tmp", library.manifest_path(path))
    return manifest
