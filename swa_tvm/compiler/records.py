"""Tuning logs: where they live, reading them, choosing each kernel's best record and
replaying it on the symbolic-T kernel.

A record is measured on a *tuning workload*: the kernel's PrimFunc at a concrete shape
(``TUNE_SHAPES``) with the scale folded to a constant, because MetaSchedule's runner needs
concrete tensors. Its trace samples only loops whose extent the spec fixes, so it replays
unchanged on the symbolic-T kernel that is exported (``apply_record``).

``<logs>/<target-key>/`` (for instance ``swa_tvm/tuning_logs/llvm-znver3/``) holds
MetaSchedule's own JSON database files, ``database_workload.json`` and
``database_tuning_record.json``. Records of one target class are never applied to
another: export looks only in its own class's folder and also checks each record's target.

``TuningLog`` appends every line with a single ``write(2)`` on an O_APPEND descriptor and
fsyncs it, so killing a tune (Ctrl-C, SIGKILL) loses at most the candidates in flight and
never leaves a torn line; a torn last line from a power loss is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import tvm
from tvm import s_tir, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.database import (
    MemoryDatabase,
    PyDatabase,
    TuningRecord,
    Workload,
)

from swa_tvm.compiler.targets import _vector_lanes, target_key
from swa_tvm.compute import flops, prim_func
from swa_tvm.schedules import cpu as cpu_schedules
from swa_tvm.schedules.cuda import register_intrinsics

# Also importable from here, where it was before (tests and tools call it so).
from swa_tvm.schedules.intrinsics import preload_tensor_intrin as preload_tensor_intrin
from swa_tvm.spec import CPU_ONLY_KINDS, KernelSpec, accum_dtype

WORKLOAD_FILE = "database_workload.json"


RECORD_FILE = "database_tuning_record.json"


# The shape records are measured at. T=2048 keeps one measurement near 50-100 ms on two
# cores while giving every core hundreds of work items, as long sequences do.
TUNE_SHAPES = {
    "local": {"B": 1, "H": 8, "Hkv": 8, "T": 2048, "E": 16},
    "global": {"B": 1, "H": 8, "Hkv": 8, "T": 2048, "G": 16},
    # A decode step (or a few rows of a chunk) of a GQA layer against 4096 cached keys:
    # T_q and the block count follow the spec's block of rows (tune_shapes).
    "cache": {"B": 1, "H": 32, "Hkv": 8, "Tk": 4096, "NK": 4096, "E": 1},
}


def tune_shapes(spec: KernelSpec, shapes: dict | None = None) -> dict:
    """The tuning shape of ``spec``: TUNE_SHAPES, with T raised for windows that reach
    past T/2 (a multiple of 2048 at least twice the reach), so that most rows see their
    whole window, as at the lengths such windows serve (W=4096: T=8192)."""
    if spec.kind.startswith("cache"):
        base = dict(TUNE_SHAPES["cache"])
        base["Tq"] = max(1, spec.block_q * base["Hkv"] // base["H"])
        base["NB"], base["NRB"] = 1, 1
        if spec.left >= 0 and spec.right >= 0:  # the span a block of a bounded window scans
            reach = (spec.left + spec.right) * spec.max_dilation + base["Tq"]
            base["NK"] = min(base["NK"], -(-reach // 64) * 64)
        base.update(shapes or {})
        return base
    base = dict(TUNE_SHAPES["global" if spec.is_global else "local"])
    if not spec.is_global and spec.left >= 0 and spec.right >= 0:
        reach = (spec.left + spec.right) * spec.max_dilation + 1
        base["T"] = max(base["T"], -(-2 * reach // 2048) * 2048)
    base.update(shapes or {})
    return base


def tuning_workload(spec: KernelSpec, shapes: dict | None = None, target_kind: str = "llvm"):
    """The IRModule MetaSchedule tunes for ``spec``: concrete shapes, constant scale."""
    func = fold_scale(prim_func(spec, tune_shapes(spec, shapes), target_kind=target_kind), spec)
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


# The scalar arguments a tuning measurement fixes, beside the scale: Gemma 2's softcap and
# StreamingLLM's four sinks (the KV-cache kernels').
TUNE_SCALARS = {"softcap": (50.0, None), "num_sinks": (4, "int64")}  # (value, dtype; None: the scores')


def fold_scale(func, spec: KernelSpec):
    """``func`` (a kernel of ``spec``) with its ``scale`` parameter fixed to 1/sqrt(D), and
    its other scalars to TUNE_SCALARS, as a tuning measurement calls it."""
    fixed = {}
    for p in func.params:
        if p.name == "scale":
            fixed[p] = tirx.const(1.0 / spec.head_dim**0.5, accum_dtype(spec.dtype))
        elif p.name in TUNE_SCALARS:
            value, dtype = TUNE_SCALARS[p.name]
            fixed[p] = tirx.const(value, dtype or accum_dtype(spec.dtype))
    return func.specialize(fixed)


def tvm_target_of(target: dict):
    """The TVM Target tuning builds for. CUDA targets get the limits of an sm_80/sm_90
    class GPU that MetaSchedule's GPU checks read (1024 threads and 64K registers per
    block, 48 KiB of static shared memory); the code is the same as without them."""
    if target.get("kind") == "cuda":
        target = dict(target, **{"max_threads_per_block": 1024, "max_num_threads": 1024, "thread_warp_size": 32,
                                 "max_shared_memory_per_block": 48 * 1024, "registers_per_block": 65536})
    return tvm.target.Target(target)


def default_logs_root() -> str | None:
    """$SWA_TVM_TUNING_LOGS, else the tuning logs shipped in the package
    (``swa_tvm/tuning_logs/``, package data in a wheel too)."""
    env = os.environ.get("SWA_TVM_TUNING_LOGS")
    if env:
        return env
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning_logs")
    return shipped if os.path.isdir(shipped) else None


def log_dir(logs_root: str, target: dict) -> str:

    return os.path.join(logs_root, target_key(target))


# The first field of a line of either table: a workload's key, or a record's workload
# index. A lookup reads it alone to skip the lines it does not want undecoded.
_LEAD = re.compile(r'\[\s*"?([0-9A-Za-z_-]+)"?\s*,')


def _read_lines(path: str, wanted=None) -> list:
    """Parse a JSON-lines table, skipping (with a warning) a torn last line only.
    ``wanted(first field)``: whether to keep a line; the others are None, and are not
    decoded but for the last line (so a torn one is skipped as in a full read) and a
    line whose first field cannot be read (so damage there is still an error)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().split("\n") if ln.strip()]
    rows = []
    for n, ln in enumerate(lines):
        last = n == len(lines) - 1
        lead = _LEAD.match(ln) if wanted is not None else None
        unwanted = lead is not None and not wanted(lead.group(1))
        if unwanted and not last:
            rows.append(None)
            continue
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            if last:
                warnings.warn(f"{path}: skipping a torn last line (an interrupted write)", stacklevel=3)
                continue
            raise ValueError(f"{path}: line {n + 1} is not JSON; the tuning log is damaged") from None
        rows.append(None if unwanted else row)
    return rows


def _make_tuning_log_class():
    @derived_object
    class TuningLog(PyDatabase):
        """A MetaSchedule database over the two JSON files of one target-class folder.

        Queries go to an in-memory database; commits are appended to the files, one
        fsynced ``write(2)`` per line. ``readonly`` opens without ever writing.
        """

        def __init__(self, folder: str, readonly: bool = False, only: set | None = None):
            super().__init__()
            self.folder = folder
            self.readonly = readonly or only is not None
            self._mem = MemoryDatabase(module_equality="structural")
            # Workload structural hash -> line number; a lookup (``only``) holds the wanted
            # workloads' alone, and never writes.
            self._index: dict[str, int] = {}
            self._records = 0
            wl_path, rec_path = self.paths
            if os.path.basename(os.path.normpath(folder)).startswith("cuda"):
                # A tensor-core bf16 record names our wmma intrinsics, which decoding it
                # looks up: without them any bf16 CUDA export failed in a fresh process.
                register_intrinsics()
            # Decoding a record into TVM objects costs ~15 ms (its trace), so a lookup
            # (``only``: the workload keys wanted) decodes just those workloads' records;
            # the whole committed log took ~8 s to decode.
            workloads = []
            lookup = None if only is None else (lambda key: key in only)
            for row in _read_lines(wl_path, lookup):
                wanted = row is not None and (only is None or row[0] in only)
                if row is not None:
                    self._index[row[0]] = len(workloads)
                workloads.append(self._mem.commit_workload(Workload.from_json(row).mod) if wanted else None)
            # An index past the table is decoded, to fail as it always has.
            wanted_idx = None if only is None else (
                lambda idx: not idx.isdigit() or int(idx) >= len(workloads) or workloads[int(idx)] is not None)
            for row in _read_lines(rec_path, wanted_idx):
                if row is not None and workloads[row[0]] is not None:
                    self._mem.commit_tuning_record(TuningRecord.from_json(row[1], workloads[row[0]]))
                self._records += 1

        @property
        def paths(self) -> tuple[str, str]:
            return os.path.join(self.folder, WORKLOAD_FILE), os.path.join(self.folder, RECORD_FILE)

        def _append(self, path: str, row) -> None:
            if self.readonly:
                raise RuntimeError(f"{self.folder} was opened read-only")
            os.makedirs(self.folder, exist_ok=True)
            data = (json.dumps(row) + "\n").encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)
                if written != len(data):  # only on a full disk; never leave half a line
                    os.ftruncate(fd, os.fstat(fd).st_size - written)
                    raise OSError(f"{path}: short write ({written} of {len(data)} bytes)")
                os.fsync(fd)
            finally:
                os.close(fd)

        def _key(self, workload) -> str:
            return workload.as_json()[0]

        def has_workload(self, mod) -> bool:
            return self._mem.has_workload(mod)

        def commit_workload(self, mod):
            known = self._mem.has_workload(mod)
            wl = self._mem.commit_workload(mod)
            if not known:
                row = wl.as_json()
                if row[0] not in self._index:
                    self._append(self.paths[0], row)
                    self._index[row[0]] = len(self._index)
            return wl

        def commit_tuning_record(self, record) -> None:
            if self.readonly:
                raise RuntimeError(f"{self.folder} was opened read-only")
            idx = self._index[self._key(record.workload)]
            self._append(self.paths[1], [idx, record.as_json()])
            self._mem.commit_tuning_record(record)
            self._records += 1

        def get_top_k(self, workload, top_k: int):
            return self._mem.get_top_k(workload, top_k)

        def records_for(self, mod) -> list:
            """Every valid record of the workload ``mod``, fastest first (a lookup: the
            workload is committed to the in-memory table only)."""
            if not self._mem.has_workload(mod):
                return []
            return list(self._mem.get_top_k(self._mem.commit_workload(mod), 1 << 20))

        def get_all_tuning_records(self):
            return self._mem.get_all_tuning_records()

        def __len__(self) -> int:
            return self._records

    return TuningLog


_TUNING_LOG_CLS = None


def open_log(folder: str, readonly: bool = False, only: set | None = None):
    """The ``TuningLog`` database of one target-class folder. ``only``: the workload
    keys (``workload_key``) to load, read-only; None loads every workload."""
    global _TUNING_LOG_CLS
    if _TUNING_LOG_CLS is None:
        _TUNING_LOG_CLS = _make_tuning_log_class()
    return _TUNING_LOG_CLS(folder, readonly, only)


def workload_key(mod) -> str:
    """The key a log's workload table stores for ``mod`` (its structural hash)."""
    return Workload(mod).as_json()[0]


@dataclass
class BestRecord:
    trace: object
    run_ms: float
    gflops: float
    records: int  # how many records this workload has
    default_point: bool = False  # the default schedule's own record (nothing beat it)
    validation: dict | None = None  # the kernel's verdict (VALIDATION_FILE's entry), if any


# A fused CUDA kernel is replaced by a searched record only if the record measured at
# least this much faster than the fused kernel on the GPU. Smaller wins are within a shared
# machine's noise: the CPU dk/dv record of 2026-12-03 measured 2% ahead of the default at
# the tuning shape and ran ~20% behind it in use (CPU records now pass VALIDATION_FILE).
DEFAULT_MARGIN = 0.05


def _same_target_class(record_target, target: dict) -> bool:

    if record_target is None:
        return True  # the folder already names the class
    attrs = dict(record_target.export())
    rec = {"kind": attrs.get("kind"), "mcpu": attrs.get("mcpu"), "arch": attrs.get("arch")}
    return target_key({k: v for k, v in rec.items() if v is not None}) == target_key(target)


BASELINE_FILE = "baselines.json"

# A searched CPU record is applied only where ``swa_tvm.tuning.validate`` timed it against
# the default schedule, both exported as the symbolic-T kernel, back to back in one
# process, at the tuning shape, a long T and B > 1, and it won at every shape. This file
# beside the records holds those verdicts: workload key -> entry ("kept": the winning
# record's trace_digest, or None; "default": the default trace's digest it was weighed
# against; "shapes": each shape's timings).
VALIDATION_FILE = "validation.json"
VALIDATION_FORMAT = 1


def trace_digest(trace) -> str:
    """A short, stable name of a record's trace (its text's SHA-256)."""
    return hashlib.sha256(str(trace).encode()).hexdigest()[:16]


def read_validation(folder: str) -> dict:
    """The verdicts of VALIDATION_FILE in a CPU log folder ({} without one). A damaged
    file is warned about and read as no verdicts: every kernel keeps its default."""
    path = os.path.join(folder, VALIDATION_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != VALIDATION_FORMAT or not isinstance(data.get("verdicts"), dict):
            raise ValueError(f"not a format-{VALIDATION_FORMAT} verdict table")
    except (OSError, ValueError, AttributeError) as e:
        warnings.warn(f"{path}: unreadable ({e}); its records are applied as unvalidated (not at all)", stacklevel=2)
        return {}
    good = {key: v for key, v in data["verdicts"].items() if _sound_verdict(v)}
    if len(good) < len(data["verdicts"]):
        warnings.warn(f"{path}: {len(data['verdicts']) - len(good)} damaged verdict(s) ignored; those kernels "
                      "keep their default schedule", stacklevel=2)
    return good


def _sound_verdict(v) -> bool:
    """A verdict with what export reads of it: the default it was weighed against, its
    date, and for a kept record that record's worst ratio."""
    if not isinstance(v, dict) or not isinstance(v.get("default"), str) or not isinstance(v.get("date"), str):
        return False
    kept = v.get("kept")
    return kept is None or (isinstance(kept, str) and isinstance(v.get("worst_ratio"), dict)
                            and isinstance(v["worst_ratio"].get(kept), (int, float)))


def read_baselines(folder: str) -> dict:
    """The fused kernels' measured times in a CUDA log folder: workload key -> entry
    with ``run_secs`` (the fastest measurement), ``spec``, ``schedule``, ``device``."""
    path = os.path.join(folder, BASELINE_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def default_trace(spec: KernelSpec, target: dict):
    """The trace of the default schedule's point of ``spec``'s search space for ``target``."""
    return default_point(spec, _vector_lanes(tvm.target.Target(target))).trace


def _secs(run_secs) -> float:
    return float(np.mean([float(s) for s in run_secs]))


def _best_in(db, spec: KernelSpec, target: dict, baselines: dict | None = None, mod=None,
             validation: dict | None = None) -> BestRecord | None:
    kind = target.get("kind")
    mod = mod if mod is not None else tuning_workload(spec, target_kind=kind)
    recs = db.records_for(mod)
    mine = [r for r in recs if _same_target_class(r.target, target)]
    if not mine:
        return None
    best, is_default, verdict = mine[0], False, None
    if kind == "llvm":
        # The default schedule's own record, unless validation kept a searched one. A
        # verdict weighed against another default schedule (the code changed) is void.
        trace = str(default_trace(spec, target))
        default = next((r for r in mine if str(r.trace) == trace), None)
        verdict = (validation or {}).get(workload_key(mod))
        if verdict and verdict.get("default") != trace_digest(trace):
            verdict = None
        kept = verdict.get("kept") if verdict else None
        best = next((r for r in mine if kept and trace_digest(r.trace) == kept), None)
        if best is None:
            if default is None:
                return None
            best, is_default = default, True
            if kept:  # the kept record is not in this log: what runs is the default
                verdict = dict(verdict, kept=None)
    elif kind == "cuda":
        # The default is the fused kernel: a record replaces it only when measured faster
        # on the GPU; without a measurement of the fused kernel, the fused kernel stays.
        base = (baselines or {}).get(workload_key(mod))
        if base is None:
            return None
        if _secs(best.run_secs) > (1 - DEFAULT_MARGIN) * _secs(base["run_secs"]):
            t = _secs(base["run_secs"])
            return BestRecord(None, t * 1e3, workload_flops(spec) / t / 1e9, len(recs), True)
    t = _secs(best.run_secs)
    return BestRecord(best.trace, t * 1e3, workload_flops(spec) / t / 1e9, len(recs), is_default, verdict)


def best_records(specs: Iterable[KernelSpec], target: dict, logs_root: str | None) -> dict:
    """The record each spec is built with from ``logs_root``'s folder for ``target``
    (None where there is none), reading that folder once. On a CPU: the searched record
    that validation kept (VALIDATION_FILE), else the default schedule's own record. On
    CUDA: the fastest record, or one whose ``trace`` is None, standing for the fused
    kernel, measured faster than every record."""
    specs = list(specs)
    folder = log_dir(logs_root, target) if logs_root else None
    if folder is None or not os.path.exists(os.path.join(folder, RECORD_FILE)):
        return {s.name: None for s in specs}
    kind = target.get("kind")
    searched = [s for s in specs if s.kind not in CPU_ONLY_KINDS]  # the others have no search space
    if not searched:
        return {s.name: None for s in specs}
    mods = {s.name: tuning_workload(s, target_kind=kind) for s in searched}
    db = open_log(folder, only={workload_key(m) for m in mods.values()})
    baselines, validation = read_baselines(folder), read_validation(folder)
    found = {s.name: None for s in specs}
    found.update({s.name: _best_in(db, s, target, baselines, mods[s.name], validation) for s in searched})
    return found


def best_record(spec: KernelSpec, target: dict, logs_root: str | None) -> BestRecord | None:
    """``best_records`` of one spec."""
    return best_records([spec], target, logs_root)[spec.name]


def apply_record(spec: KernelSpec, trace, target_kind: str = "llvm"):
    """Replay a tuned trace on the symbolic-T kernel; returns the scheduled PrimFunc."""
    if target_kind == "cuda":
        register_intrinsics()  # a tensor-core record names the bfloat16 wmma intrinsics
    sch = s_tir.Schedule(tvm.IRModule({"main": prim_func(spec, target_kind=target_kind)}))
    trace.apply_to_schedule(sch, remove_postproc=True)
    return sch.mod["main"].with_attr("global_symbol", spec.name)


def workload_flops(spec: KernelSpec, shapes: dict | None = None) -> float:
    s = tune_shapes(spec, shapes)
    if spec.is_global:
        return flops(spec, s["B"], s["H"], s["T"], G=s["G"])
    if spec.kind.startswith("cache"):
        # The tuning shape's query rows, each against its scanned keys (the window's, or
        # every key of an unbounded one), the sinks' chunk beside them.
        w = min(s["NK"], spec.left + spec.right + 1) if spec.left >= 0 and spec.right >= 0 else s["NK"]
        return flops(spec, s["B"], s["H"], s["Tq"], window_entries=w + (s["E"] if spec.extras else 0))
    if spec.kind == "local_dx":
        return flops(spec, s["B"], s["H"], s["T"], window_entries=s["E"])
    # Bounded windows: the full band per row (edges ignored); unbounded: half or all of T.
    if spec.left >= 0 and spec.right >= 0:
        w = spec.left + spec.right + 1
    else:
        w = s["T"] // 2 if (spec.left < 0) != (spec.right < 0) else s["T"]
    return flops(spec, s["B"], s["H"], s["T"], window_entries=w + (s["E"] if spec.extras else 0))


def default_point(spec: KernelSpec, lanes: int):
    """The schedule of the default knobs, as a point of the search space (its trace has
    the space's sampling instructions with the defaults as decisions)."""
    sch = s_tir.Schedule(tuning_workload(spec))
    cpu_schedules.schedule(sch, spec, lanes, cpu_schedules.DefaultPoint())
    return sch
